"""Periodic tasks whose idempotency key never changes: each run inside the key's retention is
skipped as a duplicate of the last one.

A ``beat_schedule`` entry sends the same arguments at every run, so a key option over them
(a format string or :data:`~celery_guard.BY_ARGUMENTS`), or a constant per-call key in its
``options``, names the same key each time. Once a run completed, the key deduplicates for its
retention (``idempotency_ttl``, else ``guard_result_ttl``): a schedule shorter than that runs
once, then reports ``duplicate_prevented`` for every run until the key expires. Nothing fails,
so nothing else would tell. :func:`warn_constant_keys` logs one WARNING per such entry when a
worker (or ``celery beat``) starts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from celery.schedules import crontab, maybe_schedule, schedule

from celery_guard.keys import BY_ARGUMENTS
from celery_guard.task import GuardedTask

logger = logging.getLogger("celery_guard.schedules")

#: Consecutive crontab runs looked at for its shortest gap: over a week of minutes, hours or
#: days, and years of a monthly schedule.
_CRONTAB_RUNS = 64


@dataclass(frozen=True)
class ConstantKeyEntry:
    """A ``beat_schedule`` entry that runs at most once per key retention."""

    entry: str
    task: str
    key: str
    #: Seconds between two runs (a crontab's shortest gap).
    period: float
    #: Seconds a completed key deduplicates (``None``: until pruned).
    retention: float | None
    #: Where the retention comes from: ``idempotency_ttl`` or ``guard_result_ttl``.
    retention_source: str

    def message(self) -> str:
        """The warning, with what to do."""
        kept = (
            "until it is pruned"
            if self.retention is None
            else f"for {_seconds(self.retention)} after it completes"
        )
        return (
            f"celery_guard: beat entry {self.entry!r} sends {self.task} every "
            f"{_seconds(self.period)}, under the same idempotency key {self.key!r} each time, and "
            f"a completed key deduplicates {kept} ({self.retention_source}): every run after a "
            "completed one is skipped as a duplicate until the key expires. Make the key change "
            "at each run (a key callable with a time bucket, e.g. "
            "idempotency_key=lambda *a, **kw: f'report:{int(time.time() // PERIOD)}', or no key "
            "option: the task id is new at every run), or set the task's idempotency_ttl below "
            f"{_seconds(self.period)}."
        )


def schedule_period(value: Any, app: Celery | None = None) -> float | None:
    """Seconds between two runs of a ``beat_schedule`` entry's ``schedule``, or ``None``.

    A number, a ``timedelta`` or a :class:`celery.schedules.schedule` has its period; a
    :class:`celery.schedules.crontab` has the shortest gap between its next runs (a weekday
    9:00 schedule: one day). Other schedules (``solar``, custom ones) are not estimated.
    """
    try:
        normalized = maybe_schedule(value, app=app)
    except Exception:  # not a schedule at all: beat itself will say so
        return None
    if isinstance(normalized, schedule) and not isinstance(normalized, crontab):
        seconds = normalized.run_every.total_seconds()
        return seconds if seconds > 0 else None
    if isinstance(normalized, crontab):
        return _shortest_crontab_gap(normalized)
    return None


def _shortest_crontab_gap(cron: crontab) -> float | None:
    at = _next_run(cron, datetime.now(UTC))
    shortest = math.inf
    for _ in range(_CRONTAB_RUNS):
        following = _next_run(cron, at)
        shortest = min(shortest, (following - at).total_seconds())
        at = following
    return shortest if math.isfinite(shortest) and shortest > 0 else None


def _next_run(cron: crontab, after: datetime) -> datetime:
    # Celery's own arithmetic: the run after ``after``, as if it had last run then.
    start, delta, _now = cron.remaining_delta(after)
    following: datetime = start + delta
    return following


def constant_key_entries(app: Celery, result_ttl: float | None) -> list[ConstantKeyEntry]:
    """The ``beat_schedule`` entries of guarded tasks whose key outlives their period.

    ``result_ttl`` is ``guard_result_ttl``. An entry is listed when its key is the same at
    every run (a constant per-call key, or a format string or ``BY_ARGUMENTS`` over its fixed
    arguments) and the key's retention is at least the period: a run takes some time, so a
    retention equal to the period already reaches into the next run. Entries with a task-id
    key, a key callable (it may read the clock), a task this process does not know, or a
    schedule whose period cannot be estimated are left out.
    """
    found = []
    schedule_conf: Mapping[str, Any] = app.conf.beat_schedule or {}
    for name, entry in schedule_conf.items():
        if not isinstance(entry, Mapping):
            continue
        task = app.tasks.get(entry.get("task"))
        if not isinstance(task, GuardedTask):
            continue
        key = _constant_key(task, entry)
        if key is None:
            continue
        period = schedule_period(entry.get("schedule"), app)
        if period is None:
            continue
        ttl = task.idempotency_ttl
        if ttl is None or isinstance(ttl, (int, float)):
            retention, source = ttl, f"{task.name}'s idempotency_ttl"
        else:
            retention, source = result_ttl, "guard_result_ttl"
        if retention is not None and (retention <= 0 or retention < period):
            continue
        found.append(
            ConstantKeyEntry(
                entry=str(name),
                task=task.name,
                key=key,
                period=period,
                retention=None if retention is None else float(retention),
                retention_source=source,
            )
        )
    return found


def _constant_key(task: GuardedTask, entry: Mapping[str, Any]) -> str | None:
    options = entry.get("options") or {}
    per_call = options.get("idempotency_key") if isinstance(options, Mapping) else None
    if per_call is not None:
        return str(per_call)
    option = task.idempotency_key
    if not (option is BY_ARGUMENTS or isinstance(option, str)):
        return None
    try:
        return task._key_from_option(
            tuple(entry.get("args") or ()), dict(entry.get("kwargs") or {})
        )
    except Exception:
        # apply_async refuses these arguments at every run, with its own error.
        return None


def warn_constant_keys(app: Celery, result_ttl: float | None) -> list[ConstantKeyEntry]:
    """Log one WARNING per entry :func:`constant_key_entries` finds; return them."""
    try:
        entries = constant_key_entries(app, result_ttl)
    except Exception:
        # A check must never stop a worker or beat from starting.
        logger.debug("celery_guard could not check beat_schedule", exc_info=True)
        return []
    for entry in entries:
        logger.warning("%s", entry.message())
    return entries


def _seconds(value: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if value >= size and value % size == 0:
            return f"{value / size:g} {unit} ({value:g} s)"
    return f"{value:g} s"
