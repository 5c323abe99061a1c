"""The beat_schedule check: periodic runs under a key that never changes, kept past the period."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule
from celery.signals import beat_init

import celery_guard
from celery_guard import BY_ARGUMENTS, GuardedTask
from celery_guard.schedules import constant_key_entries, schedule_period, warn_constant_keys

DAY = 86400.0


class BeatService:
    """What ``beat_init`` is sent with: celery.beat.Service, which has the app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


class Sunrise(BaseSchedule):  # type: ignore[misc]  # celery ships no types
    """A custom schedule (as celery's solar, which needs ephem): no period to estimate."""


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30, 30.0),
        (2.5, 2.5),
        (timedelta(hours=1), 3600.0),
        (schedule(timedelta(minutes=5)), 300.0),
        (crontab(minute="*/15"), 900.0),
        (crontab(minute=0), 3600.0),
        (crontab(minute=0, hour="*/6"), 6 * 3600.0),
        (crontab(minute=30, hour=9), DAY),
        (crontab(minute=0, hour=9, day_of_week="1-5"), DAY),
        (crontab(minute=0, hour=9, day_of_week="mon"), 7 * DAY),
        (crontab(minute=0, hour=0, day_of_month=1), 28 * DAY),
    ],
)
def test_the_period_of_each_kind_of_schedule(value: object, seconds: float) -> None:
    assert schedule_period(value) == seconds


@pytest.mark.parametrize("value", [None, "hourly", Sunrise()])
def test_schedules_it_cannot_estimate_have_no_period(value: object) -> None:
    assert schedule_period(value) is None


@pytest.fixture
def app(sqlite_url: str) -> Iterator[Celery]:
    celery_app = Celery("beat-check", broker="memory://", set_as_current=False)
    celery_app.conf.update(guard_store_url=sqlite_url, guard_result_ttl=DAY)
    runtime = celery_guard.install(celery_app)

    @celery_app.task(
        base=GuardedTask, shared=False, name="reports.by_args", idempotency_key=BY_ARGUMENTS
    )
    def by_args(region: str) -> None: ...

    @celery_app.task(
        base=GuardedTask, shared=False, name="reports.formatted", idempotency_key="report:{region}"
    )
    def formatted(region: str) -> None: ...

    @celery_app.task(
        base=GuardedTask, shared=False, name="reports.short", idempotency_key="short:{region}"
    )
    def short(region: str) -> None: ...

    short.idempotency_ttl = 60

    @celery_app.task(
        base=GuardedTask, shared=False, name="reports.forever", idempotency_key="forever"
    )
    def forever() -> None: ...

    forever.idempotency_ttl = None

    @celery_app.task(base=GuardedTask, shared=False, name="reports.by_id")
    def by_id(region: str) -> None: ...

    @celery_app.task(
        base=GuardedTask, shared=False, name="reports.clock", idempotency_key=lambda region: region
    )
    def clock(region: str) -> None: ...

    @celery_app.task(name="reports.plain", base=celery_app.Task, shared=False)
    def plain(region: str) -> None: ...

    try:
        yield celery_app
    finally:
        runtime.store.dispose()


def entry(task: str, every: Any, *args: Any, **options: Any) -> dict[str, Any]:
    return {"task": task, "schedule": every, "args": args, "options": options}


def test_constant_keys_kept_longer_than_the_period_are_found(app: Celery) -> None:
    app.conf.beat_schedule = {
        "hourly-by-args": entry("reports.by_args", 3600, "eu"),
        "daily-formatted": entry("reports.formatted", crontab(minute=0, hour=6), "eu"),
        "per-call-key": entry("reports.by_id", 600, "eu", idempotency_key="nightly"),
        "kept-forever": entry("reports.forever", DAY * 365),
        # Left out: the key changes (task id, a callable), it expires before the next run,
        # the task is not guarded or unknown, or the period cannot be told.
        "weekly-formatted": entry("reports.formatted", 7 * DAY, "us"),
        "short-ttl": entry("reports.short", 600, "eu"),
        "by-id": entry("reports.by_id", 60, "eu"),
        "callable": entry("reports.clock", 60, "eu"),
        "plain": entry("reports.plain", 60, "eu"),
        "unknown": entry("reports.elsewhere", 60, "eu"),
        "solar": entry("reports.formatted", Sunrise(), "eu"),
        "bad-args": entry("reports.formatted", 60),
    }
    found = {e.entry: e for e in constant_key_entries(app, DAY)}
    assert sorted(found) == ["daily-formatted", "hourly-by-args", "kept-forever", "per-call-key"]
    hourly = found["hourly-by-args"]
    assert hourly.task == "reports.by_args" and hourly.key.startswith("reports.by_args:")
    assert (hourly.period, hourly.retention, hourly.retention_source) == (
        3600.0,
        DAY,
        "guard_result_ttl",
    )
    assert (found["daily-formatted"].key, found["daily-formatted"].period) == ("report:eu", DAY)
    assert found["per-call-key"].key == "nightly"
    forever = found["kept-forever"]
    assert forever.retention is None and "idempotency_ttl" in forever.retention_source


def test_the_warning_names_the_task_the_key_and_the_period_and_what_to_do(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.beat_schedule = {"hourly": entry("reports.formatted", 3600, "eu")}
    with caplog.at_level(logging.WARNING, logger="celery_guard.schedules"):
        (found,) = warn_constant_keys(app, DAY)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    for part in ("'hourly'", "reports.formatted", "'report:eu'", "every 1 h (3600 s)"):
        assert part in text
    assert "for 1 d (86400 s) after it completes (guard_result_ttl)" in text
    assert "time bucket" in text and "idempotency_ttl below 1 h" in text
    assert text == found.message()


def test_nothing_is_logged_for_a_schedule_without_constant_keys(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.beat_schedule = {"by-id": entry("reports.by_id", 60, "eu")}
    with caplog.at_level(logging.DEBUG, logger="celery_guard.schedules"):
        assert warn_constant_keys(app, DAY) == []
    assert caplog.records == []


def test_a_shorter_retention_or_none_kept_is_not_a_problem(app: Celery) -> None:
    app.conf.beat_schedule = {"hourly": entry("reports.formatted", 3600, "eu")}
    assert constant_key_entries(app, 1800) == []
    assert constant_key_entries(app, 0) == [], "0: a key deduplicates only while in flight"
    assert len(constant_key_entries(app, 3600)) == 1, "a run takes time: equal reaches the next"
    assert len(constant_key_entries(app, None)) == 1, "None: kept until pruned"


def test_celery_beat_start_runs_the_check(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    app.conf.beat_schedule = {"hourly": entry("reports.formatted", 3600, "eu")}
    with caplog.at_level(logging.WARNING, logger="celery_guard.schedules"):
        beat_init.send(sender=BeatService(app))
        beat_init.send(sender=BeatService(Celery("no-guard", set_as_current=False)))
    assert [r.getMessage().split(" sends ")[0] for r in caplog.records] == [
        "celery_guard: beat entry 'hourly'"
    ]
