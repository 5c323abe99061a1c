"""``guard status``, ``guard key show`` and ``guard prune``: the keys table, read and pruned."""

from __future__ import annotations

import json
from typing import Any

import click

from celery_guard.cli.common import (
    MAX_PRUNE_BATCHES,
    PAGE,
    STATES,
    GuardCommand,
    _cut,
    _emit_json,
    _fields,
    _human_secs,
    _iso,
    _lease_remaining,
    _parse_json,
    _reaper_info,
    _reaper_line,
    _running_pages,
    _runtime,
    _secs,
    guard,
    json_option,
)
from celery_guard.lease.backends import RedisLeases
from celery_guard.store.base import KeyRecord
from celery_guard.store.schema import KeyState

# -- status -----------------------------------------------------------------------------------


@guard.command(cls=GuardCommand, name="status")
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Keys per state, the oldest RUNNING key, expired leases, the reaper, dead letters and
    workers (by their heartbeats in the store: a killed worker shows as down within one TTL)."""
    runtime = _runtime(ctx)
    store = runtime.store
    now = store.now()
    counts = store.keys.count_keys_by_state()
    states = {state: counts.get(state, 0) for state in STATES}
    states.update({state: n for state, n in counts.items() if state not in states})
    redis_leases = isinstance(runtime.leases, RedisLeases)
    if redis_leases:
        without_lease = 0
        for page in _running_pages(runtime, expired_only=False):
            held = runtime.leases.held([record.key for record in page])
            without_lease += sum(1 for record in page if record.key not in held)
    else:
        without_lease = store.keys.count_expired_leases()
    oldest = store.keys.oldest_running()
    oldest_info: dict[str, Any] | None = None
    if oldest is not None:
        remaining = _lease_remaining(runtime, oldest, now)
        oldest_info = {
            "key": oldest.key,
            "task": oldest.task_name,
            "owner": oldest.owner,
            "fencing_token": oldest.fencing_token,
            "claimed_at": _iso(oldest.updated_at),
            "age_seconds": _secs(now - oldest.updated_at),
            "lease_remaining_seconds": _secs(remaining),
        }
    total, pending = store.dead_letters.count_dead_letters()
    unclaimed: dict[str, Any] | None = None
    if runtime.config.track_publishes:
        count, oldest_age = store.publishes.unclaimed_publishes()
        unclaimed = {"count": count, "oldest_age_seconds": _secs(oldest_age)}
    report: dict[str, Any] = {
        "store": runtime.config.safe_store_url(),
        "lease_backend": "redis" if redis_leases else "sql",
        "now": _iso(now),
        "keys": states,
        "oldest_running": oldest_info,
        "running_without_live_lease": without_lease,
        "reaper": _reaper_info(runtime, now),
        "dead_letters": {"total": total, "not_replayed": pending},
        # Publish tracking: published, never claimed yet (None when tracking is off).
        "unclaimed_publishes": unclaimed,
        # Redis leases only: what runs now, read from Redis beside the leases (for people;
        # never used to decide anything). Bodies shorter than one renewal interval don't show.
        "live": _live_info(runtime, now) if redis_leases else None,
        "workers": [
            {
                "hostname": worker.hostname,
                "pid": worker.pid,
                "alive": worker.alive,
                "state": worker.state if worker.alive else "DOWN",
                "running": worker.running,
                "fenced": worker.fenced,
                "last_seen": _iso(worker.seen_at),
                "seconds_since_seen": _secs(now - worker.seen_at),
                "up_since": _iso(worker.started_at),
            }
            for worker in store.workers.list_workers()
        ],
    }
    if as_json:
        _emit_json(report)
        return
    if oldest_info is None:
        oldest_line = "none"
    else:
        remaining = oldest_info["lease_remaining_seconds"]
        lease = (
            "no lease"
            if remaining is None
            else f"lease {_human_secs(remaining)}" + (" (expired)" if remaining <= 0 else " left")
        )
        oldest_line = (
            f"{oldest_info['key']} ({oldest_info['task']}) owner {oldest_info['owner']}, "
            f"age {_human_secs(oldest_info['age_seconds'])}, {lease}"
        )
    lease_kind = "no Redis lease" if redis_leases else "lease expired"
    click.echo(
        _fields(
            [
                ("store", report["store"]),
                ("leases", "Redis" if redis_leases else "store rows"),
                ("now", report["now"]),
                ("keys", "  ".join(f"{state} {n}" for state, n in states.items())),
                ("oldest RUNNING", oldest_line),
                ("RUNNING, no live lease", f"{without_lease} ({lease_kind})"),
                ("reaper", _reaper_line(report["reaper"])),
                ("dead letters", f"{total} total, {pending} not replayed"),
                ("unclaimed publishes", _unclaimed_line(unclaimed)),
                ("workers", _workers_line(report["workers"])),
                *(
                    [("running now (Redis)", _live_line(report["live"]))]
                    if report["live"] is not None
                    else []
                ),
            ]
        )
    )


def _unclaimed_line(unclaimed: dict[str, Any] | None) -> str:
    if unclaimed is None:
        return "not tracked (guard_track_publishes is off)"
    if not unclaimed["count"]:
        return "none (every tracked publish was claimed)"
    return (
        f"{unclaimed['count']} published and not claimed yet, oldest "
        f"{_human_secs(unclaimed['oldest_age_seconds'])} ago"
    )


def _live_info(runtime: Any, now: float) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = runtime.leases.live_statuses(limit=1000)
    for entry in entries:
        for field in ("started_at", "progress_at", "renewed_at"):
            if isinstance(entry.get(field), (int, float)):
                entry[field.replace("_at", "_seconds_ago")] = _secs(now - entry[field])
                entry[field] = _iso(entry[field])
    return entries


def _live_line(entries: list[dict[str, Any]], shown: int = 10) -> str:
    if not entries:
        return "nothing (bodies show after their first lease renewal)"
    lines = [
        f"{entry.get('key')} ({entry.get('task')}) on {entry.get('owner')}, "
        f"running {_human_secs(entry.get('started_seconds_ago'))}, last progress "
        f"{_human_secs(entry.get('progress_seconds_ago'))} ago"
        + (
            f": {_cut(json.dumps(entry['progress'], default=str), 60)}"
            if entry.get("progress") is not None
            else ""
        )
        for entry in entries[:shown]
    ]
    if len(entries) > shown:
        lines.append(f"... and {len(entries) - shown} more (--json lists them all)")
    return "\n".join(lines)


def _workers_line(workers: list[dict[str, Any]]) -> str:
    if not workers:
        return "none has a heartbeat in the store (no worker running, or none seen in an hour)"
    lines = []
    for worker in workers:
        if worker["alive"]:
            work = f"{worker['running']} running" + (
                f", {worker['fenced']} fenced" if worker["fenced"] else ""
            )
            lines.append(f"{worker['hostname']} {worker['state']} ({work})")
        else:
            seen = _human_secs(worker["seconds_since_seen"])
            lines.append(f"{worker['hostname']} DOWN (last heartbeat {seen} ago)")
    return "\n".join(lines)


# -- key show -----------------------------------------------------------------------------------


@guard.group(name="key")
def key_group() -> None:
    """Inspect idempotency keys."""


def _message_summary(message: Any) -> str | None:
    if message is None:
        return None
    if not isinstance(message, dict):
        return _cut(message, 200)
    args = json.dumps(message.get("args"), default=str)
    kwargs = json.dumps(message.get("kwargs"), default=str)
    route = message.get("routing_key") or "-"
    if message.get("exchange"):
        route = f"{message['exchange']}/{route}"
    return (
        f"{message.get('task')}[{message.get('id')}] args={_cut(args, 120)} "
        f"kwargs={_cut(kwargs, 120)} route={route}"
    )


def _retention(record: KeyRecord, now: float) -> tuple[float | None, str]:
    """(retention seconds, a sentence) for a key's stored result."""
    if record.state != KeyState.COMPLETED.value:
        return None, "-"
    if record.expires_at is None:
        return None, "kept until pruned by hand (no retention)"
    retention = record.expires_at - (record.completed_at or record.expires_at)
    if record.expires_at <= now:
        return retention, f"expired at {_iso(record.expires_at)} (pruned at the next pass)"
    return retention, f"{_human_secs(retention)}, until {_iso(record.expires_at)}"


@key_group.command(cls=GuardCommand, name="revive")
@click.argument("key")
@json_option
@click.pass_context
def key_revive(ctx: click.Context, key: str, as_json: bool) -> None:
    """Make a DEAD key claimable again, with fresh attempts, without publishing anything.

    For a key whose dead letter was purged; `dlq replay` does this and re-publishes the task.
    """
    runtime = _runtime(ctx)
    if not runtime.store.dead_letters.revive_key(key):
        raise click.ClickException(f"key {key!r} is not DEAD (or does not exist); nothing done")
    if as_json:
        _emit_json({"key": key, "state": "RELEASED"})
    else:
        click.echo(f"key {key} revived: RELEASED, attempts reset; its next delivery runs it")


@key_group.command(cls=GuardCommand, name="show")
@click.argument("key")
@json_option
@click.pass_context
def key_show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one idempotency key's row: state, owner, lease, token, times and stored message."""
    runtime = _runtime(ctx)
    record = runtime.store.keys.get(key)
    if record is None:
        raise click.ClickException(f"no idempotency key {key!r} in the store")
    now = runtime.store.now()
    remaining = _lease_remaining(runtime, record, now)
    retention, retention_text = _retention(record, now)
    message = _parse_json(record.message)
    data = {
        "key": record.key,
        "state": record.state,
        "task": record.task_name,
        "attempts": record.attempts,
        "fencing_token": record.fencing_token,
        "owner": record.owner,
        "owner_lock": record.owner_lock,
        "lease_expires_at": _iso(record.lease_expires_at),
        "lease_remaining_seconds": _secs(remaining),
        "claim_reason": record.claim_reason,
        "last_error": record.last_error,
        "duplicates": record.duplicates,
        "fingerprint": record.fingerprint,
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
        "completed_at": _iso(record.completed_at),
        "expires_at": _iso(record.expires_at),
        "retention_seconds": _secs(retention),
        "republished_at": _iso(record.republished_at),
        "result": _parse_json(record.result),
        "message": message,
    }
    if as_json:
        _emit_json(data)
        return
    if remaining is None:
        lease = "-"
    elif remaining <= 0:
        lease = f"expired {_human_secs(-remaining)} ago"
    else:
        lease = f"{_human_secs(remaining)} left"
    click.echo(
        _fields(
            [
                ("key", record.key),
                ("state", record.state),
                ("task", record.task_name),
                ("attempts", record.attempts),
                ("fencing token", record.fencing_token),
                ("owner", record.owner),
                ("lease", lease),
                ("claim reason", record.claim_reason),
                ("last error", record.last_error),
                ("duplicates", record.duplicates),
                ("created", _iso(record.created_at)),
                ("updated", _iso(record.updated_at)),
                ("completed", _iso(record.completed_at)),
                ("retention", retention_text),
                ("re-published", _iso(record.republished_at)),
                ("result", _cut(record.result, 200) if record.result is not None else None),
                ("message", _message_summary(message)),
            ]
        )
    )


# -- prune ----------------------------------------------------------------------------------------


@guard.command(cls=GuardCommand, name="prune")
@json_option
@click.pass_context
def prune(ctx: click.Context, as_json: bool) -> None:
    """Delete COMPLETED keys whose retention has ended (the reaper also does it every pass)."""
    runtime = _runtime(ctx)
    pruned = 0
    complete = False
    for _ in range(MAX_PRUNE_BATCHES):
        batch = runtime.store.recovery.prune_completed(limit=PAGE)
        pruned += batch
        if batch < PAGE:
            complete = True
            break
    if as_json:
        _emit_json({"pruned": pruned, "complete": complete})
        return
    click.echo(f"pruned {pruned} COMPLETED key(s) past their retention")
    if not complete:
        click.echo(f"stopped after {MAX_PRUNE_BATCHES} batches of {PAGE}; run it again")
