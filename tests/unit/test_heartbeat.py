"""Lease bookkeeping and the heartbeat round, with an injected clock and a recording backend."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest

from celery_guard import Fenced, StoreUnavailable, signals
from celery_guard.lease.heartbeat import Heartbeat, Lease
from celery_guard.worker_state import StateTracker, WorkerState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Backend:
    """Renews what it is told to keep; records every call; can be made to fail."""

    def __init__(self) -> None:
        self.keep: set[str] = set()
        self.calls: list[list[tuple[str, int]]] = []
        self.down = False

    def renew_leases(
        self, leases: Iterable[tuple[str, int]], ttl: float, statuses: object = None
    ) -> set[str]:
        pairs = list(leases)
        self.calls.append(pairs)
        if self.down:
            raise StoreUnavailable("store down")
        return {key for key, _ in pairs if key in self.keep}


def lease(clock: Clock, key: str = "k", **options: float | None) -> Lease:
    values: dict[str, float | None] = {"hard_deadline": None, "progress_timeout": None}
    values.update(options)
    return Lease(key, 7, ttl=10.0, clock=clock, **values)  # type: ignore[arg-type]


def test_one_round_renews_every_held_lease_in_one_call() -> None:
    clock, backend = Clock(), Backend()
    heartbeat = Heartbeat(backend, interval=3, clock=clock)
    first, second = lease(clock, "a"), lease(clock, "b")
    backend.keep = {"a", "b"}
    heartbeat._leases = {1: first, 2: second}  # held without starting the thread
    clock.now += 3
    heartbeat.beat()
    assert backend.calls == [[("a", 7), ("b", 7)]]
    assert first.valid_until == second.valid_until == 113.0


def test_a_lease_the_backend_did_not_renew_is_fenced() -> None:
    clock, backend = Clock(), Backend()
    heartbeat = Heartbeat(backend, interval=3, clock=clock)
    taken = lease(clock)
    heartbeat._leases = {1: taken}
    heartbeat.beat()
    assert taken.fenced_reason is not None and "taken over" in taken.fenced_reason
    with pytest.raises(Fenced):
        taken.check()


def test_an_unreachable_store_fences_only_once_the_lease_has_run_out() -> None:
    clock, backend = Clock(), Backend()
    backend.down = True
    heartbeat = Heartbeat(backend, interval=3, clock=clock)
    held = lease(clock)
    heartbeat._leases = {1: held}
    clock.now += 5
    heartbeat.beat()
    held.check()  # still within the TTL: not fenced
    clock.now += 6
    heartbeat.beat()
    with pytest.raises(Fenced):
        held.check()


def test_renewal_stops_at_the_hard_deadline_and_the_lease_then_runs_out() -> None:
    clock, backend = Clock(), Backend()
    backend.keep = {"k"}
    heartbeat = Heartbeat(backend, interval=3, clock=clock)
    hung = lease(clock, hard_deadline=5.0)
    heartbeat._leases = {1: hung}
    clock.now += 3
    heartbeat.beat()
    assert len(backend.calls) == 1
    clock.now += 3  # past the deadline
    heartbeat.beat()
    assert len(backend.calls) == 1, "no renewal past the hard deadline"
    clock.now += 10
    with pytest.raises(Fenced):
        hung.check()


def test_progress_mode_renews_only_while_the_body_reports_progress() -> None:
    clock, backend = Clock(), Backend()
    backend.keep = {"k"}
    heartbeat = Heartbeat(backend, interval=3, clock=clock)
    busy = lease(clock, progress_timeout=4.0)
    heartbeat._leases = {1: busy}
    for _ in range(3):
        clock.now += 3
        busy.progress({"rows": 10})
        heartbeat.beat()
    assert len(backend.calls) == 3
    clock.now += 5  # alive, but silent past the progress timeout
    heartbeat.beat()
    assert len(backend.calls) == 3
    assert busy.progress_info == {"rows": 10}


def test_renewal_uses_the_backend_handle_not_the_fencing_token() -> None:
    clock, backend = Clock(), Backend()
    backend.keep = {"k"}
    heartbeat = Heartbeat(backend, interval=3, clock=clock)
    redis_lease = Lease("k", 7, handle=42, ttl=10.0, hard_deadline=None, progress_timeout=None)
    heartbeat._leases = {1: redis_lease}
    heartbeat.beat()
    assert backend.calls == [[("k", 42)]]


def test_a_lease_dropped_during_a_round_is_not_fenced() -> None:
    """The body completed while the renewal was in flight: its key no longer needs renewing."""
    clock = Clock()
    finished = lease(clock)

    class DropsDuringRound(Backend):
        def renew_leases(
            self, leases: Iterable[tuple[str, int]], ttl: float, statuses: object = None
        ) -> set[str]:
            list(leases)
            heartbeat.drop(finished)  # the body completed meanwhile; its row is COMPLETED
            return set()

    heartbeat = Heartbeat(DropsDuringRound(), interval=3, clock=clock)
    heartbeat._leases = {id(finished): finished}
    heartbeat.beat()
    assert finished.fenced_reason is None


def test_a_fenced_execution_that_ends_leaves_the_process_ready() -> None:
    states = StateTracker()
    states.execution_started("k", 1)
    states.execution_fenced("k", 1)
    assert states.state is WorkerState.FENCED
    states.execution_ended("k", 1, fenced=False)
    assert states.state is WorkerState.READY


def test_the_fenced_count_is_told_only_when_it_changes_the_running_count_every_time() -> None:
    states = StateTracker()
    changed: list[tuple[int, int]] = []
    told: list[int] = []

    def on_changed(running: int = 0, fenced: int = 0, **_: object) -> None:
        changed.append((running, fenced))

    def on_fenced(fenced: int = 0, **_: object) -> None:
        told.append(fenced)

    signals.executions_changed.connect(on_changed, weak=False)
    signals.executions_fenced.connect(on_fenced, weak=False)
    try:
        for token in (1, 2):  # two deliveries, nothing fenced: no fenced signal at all
            states.execution_started("k", token)
            states.execution_ended("k", token, fenced=False)
        states.execution_started("k", 3)
        states.execution_fenced("k", 3)
        states.execution_ended("k", 3, fenced=True)
    finally:
        signals.executions_changed.disconnect(on_changed)
        signals.executions_fenced.disconnect(on_fenced)
    assert changed == [(1, 0), (0, 0), (1, 0), (0, 0), (1, 0), (1, 1), (0, 0)]
    assert told == [1, 0]


def test_per_task_state_changes_log_at_debug_the_rare_ones_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    states = StateTracker()
    with caplog.at_level(logging.DEBUG, logger="celery_guard.worker"):
        states.execution_started("k", 1)
        states.execution_ended("k", 1, fenced=False)
        states.execution_started("k", 2)
        states.execution_fenced("k", 2)
        states.execution_ended("k", 2, fenced=True)
        states.set_lifecycle(WorkerState.DRAINING, "warm shutdown")
    logged = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert logged == [
        ("DEBUG", "celery_guard worker state READY -> PROCESSING key=k token=1"),
        ("DEBUG", "celery_guard worker state PROCESSING -> READY key=k token=1"),
        ("DEBUG", "celery_guard worker state READY -> PROCESSING key=k token=2"),
        ("INFO", "celery_guard worker state PROCESSING -> FENCED key=k token=2"),
        ("INFO", "celery_guard worker state FENCED -> READY key=k token=2"),
        ("INFO", "celery_guard worker state READY -> DRAINING reason=warm shutdown"),
    ]


def test_a_lifecycle_state_or_a_fenced_execution_outranks_the_routine_changes() -> None:
    """The per-delivery READY <-> PROCESSING shortcut holds only while nothing else decides:
    after a fenced execution ends the routine changes resume; a lifecycle state stays."""
    states = StateTracker()
    states.execution_started("k", 1)
    states.execution_started("other", 1)  # two at once (a threaded pool)
    states.execution_fenced("k", 1)
    assert states.state is WorkerState.FENCED
    states.execution_ended("other", 1, fenced=False)
    assert states.state is WorkerState.FENCED  # k is still fenced
    states.execution_ended("k", 1, fenced=True)
    assert states.state is WorkerState.READY
    states.execution_started("k", 2)
    assert (states.state, states.counts()) == (WorkerState.PROCESSING, (1, 0))
    states.set_lifecycle(WorkerState.DRAINING, "warm shutdown")
    states.execution_ended("k", 2, fenced=False)
    states.execution_started("k", 3)
    assert (states.state, states.counts()) == (WorkerState.DRAINING, (1, 0))
    states.set_lifecycle_ready()
    assert states.state is WorkerState.PROCESSING
    states.execution_ended("k", 3, fenced=False)
    assert states.state is WorkerState.READY
