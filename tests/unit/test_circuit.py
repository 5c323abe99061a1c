"""Backpressure's pure parts: the breaker's and the governor's decisions on a fake clock, the
shared block across a real fork, timeout classification, and the hold before a claim."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import psycopg.errors
import pytest
from celery.exceptions import Reject
from sqlalchemy import exc as sa_exc

from celery_guard import GuardConfig, StoreUnavailable, signals
from celery_guard.circuit import Circuit
from celery_guard.circuit.breaker import (
    Breaker,
    CircuitState,
    ConcurrencyGovernor,
    RollingWindow,
    Totals,
)
from celery_guard.circuit.shared import SharedBlock
from celery_guard.circuit.timeouts import is_timeout, timed_out
from celery_guard.metrics import WorkerSnapshot, build_registry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Feed:
    """Cumulative totals fed to a window, as the monitor samples the shared block."""

    def __init__(self, clock: Clock, window: RollingWindow) -> None:
        self.clock = clock
        self.window = window
        self.totals = Totals()
        window.add(clock(), self.totals)

    def calls(self, ok: int = 0, failed: int = 0, timed_out: int = 0, latency: float = 0.0) -> None:
        """Count calls during the next sampling tick (timed-out calls are failures too)."""
        self.clock.advance(0.25)
        calls = ok + failed + timed_out
        self.totals = Totals(
            calls=self.totals.calls + calls,
            failures=self.totals.failures + failed + timed_out,
            timeouts=self.totals.timeouts + timed_out,
            latency=self.totals.latency + latency * calls,
        )
        self.window.add(self.clock(), self.totals)

    def idle(self, seconds: float, step: float = 0.25) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.advance(step)
            self.window.add(self.clock(), self.totals)


def make_breaker(clock: Clock) -> tuple[Breaker, Feed]:
    breaker = Breaker(failure_ratio=0.5, min_calls=5, window=10.0, probe_interval=1.0, clock=clock)
    return breaker, Feed(clock, RollingWindow(10.5))


# -- the window ----------------------------------------------------------------------------


def test_the_window_counts_only_calls_after_its_start() -> None:
    clock = Clock()
    feed = Feed(clock, RollingWindow(10.0))
    feed.calls(failed=4)
    feed.idle(6)
    feed.calls(ok=3)
    assert feed.window.since(clock() - 10) == Totals(calls=7, failures=4)
    feed.idle(5)
    # The failures are 11 s old now: out of a 10 s window.
    assert feed.window.since(clock() - 10).failures == 0
    assert feed.window.since(clock() - 10).calls == 3


def test_ratios_never_exceed_one_when_a_failure_is_seen_before_its_call() -> None:
    totals = Totals(calls=1, failures=2, timeouts=2)
    assert totals.failure_ratio == 1.0
    assert totals.timeout_ratio == 1.0
    assert Totals().failure_ratio == 0.0


# -- the breaker ---------------------------------------------------------------------------


def test_few_calls_never_open_the_circuit_however_many_fail() -> None:
    clock = Clock()
    breaker, feed = make_breaker(clock)
    feed.calls(failed=4)
    assert breaker.evaluate(feed.window) is None
    assert breaker.state is CircuitState.CLOSED


def test_failures_at_the_ratio_over_min_calls_open_the_circuit() -> None:
    clock = Clock()
    breaker, feed = make_breaker(clock)
    feed.calls(ok=3, failed=2)
    assert breaker.evaluate(feed.window) is None  # 2 of 5: under 0.5
    feed.calls(failed=1, timed_out=1)  # 4 of 7
    transition = breaker.evaluate(feed.window)
    assert transition is not None
    assert (transition.old, transition.new) == (CircuitState.CLOSED, CircuitState.OPEN)
    assert "4 of 7 store calls failed (1 timed out" in transition.cause
    assert breaker.state is CircuitState.OPEN
    assert breaker.opened == 1
    assert int(CircuitState.OPEN) == 1 and int(CircuitState.HALF_OPEN) == 2


def test_failures_older_than_the_window_do_not_count() -> None:
    clock = Clock()
    breaker, feed = make_breaker(clock)
    feed.calls(failed=3)
    feed.idle(11)
    feed.calls(ok=2, failed=1)  # 1 of 3 in the window
    feed.calls(failed=1)  # 2 of 4: still under min_calls
    assert breaker.evaluate(feed.window) is None


def test_open_probes_on_its_interval_then_half_opens_then_closes() -> None:
    clock = Clock()
    breaker, feed = make_breaker(clock)
    feed.calls(failed=5)
    assert breaker.evaluate(feed.window) is not None
    assert not breaker.probe_due()  # the first probe one interval after opening
    clock.advance(1.0)
    assert breaker.probe_due()
    assert breaker.probe_result(False, "connection refused") is None
    assert breaker.state is CircuitState.OPEN
    assert not breaker.probe_due()
    clock.advance(1.0)
    half = breaker.probe_result(True)
    assert half is not None and half.new is CircuitState.HALF_OPEN
    assert breaker.probe_due() is False
    clock.advance(1.0)
    closed = breaker.probe_result(True)
    assert closed is not None
    assert (closed.old, closed.new) == (CircuitState.HALF_OPEN, CircuitState.CLOSED)
    assert "2 probes in a row" in closed.cause
    assert not breaker.probe_due()  # no probes while closed
    # The outage's failures are still in the window but no longer count.
    feed.calls(ok=1)
    assert breaker.evaluate(feed.window) is None
    assert breaker.opened == 1


def test_a_failed_probe_while_half_open_opens_again() -> None:
    clock = Clock()
    breaker, feed = make_breaker(clock)
    feed.calls(failed=5)
    breaker.evaluate(feed.window)
    clock.advance(1.0)
    breaker.probe_result(True)
    clock.advance(1.0)
    again = breaker.probe_result(False, "server closed the connection")
    assert again is not None
    assert (again.old, again.new) == (CircuitState.HALF_OPEN, CircuitState.OPEN)
    assert "server closed the connection" in again.cause
    assert breaker.opened == 2
    # A success after a failure starts the count of successes over.
    clock.advance(1.0)
    assert breaker.probe_result(True).new is CircuitState.HALF_OPEN  # type: ignore[union-attr]


def test_failing_trial_deliveries_while_half_open_open_again() -> None:
    clock = Clock()
    breaker, feed = make_breaker(clock)
    feed.calls(failed=5)
    breaker.evaluate(feed.window)
    clock.advance(1.0)
    breaker.probe_result(True)
    feed.calls(ok=1)
    assert breaker.evaluate(feed.window) is None  # only the calls since half-open count
    feed.calls(failed=4)
    reopened = breaker.evaluate(feed.window)
    assert reopened is not None and reopened.new is CircuitState.OPEN
    assert "trial deliveries" in reopened.cause


# -- the governor --------------------------------------------------------------------------


def make_governor(clock: Clock, latency: float | None = None) -> tuple[ConcurrencyGovernor, Feed]:
    governor = ConcurrencyGovernor(
        original=3, timeout_ratio=0.2, latency=latency, min_calls=5, window=10.0, clock=clock
    )
    return governor, Feed(clock, RollingWindow(10.5))


def test_timeouts_shrink_the_pool_once_per_window_down_to_one() -> None:
    clock = Clock()
    governor, feed = make_governor(clock)
    feed.calls(ok=8, timed_out=2)
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None  # no full window yet
    feed.idle(10)
    feed.calls(ok=8, timed_out=2)
    resize = governor.evaluate(feed.window, CircuitState.CLOSED)
    assert resize is not None and (resize.delta, resize.target) == (-1, 2)
    assert "2 timed out" in resize.cause
    feed.calls(ok=8, timed_out=2)
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None  # once per window
    feed.idle(10)
    feed.calls(ok=8, timed_out=2)
    assert governor.evaluate(feed.window, CircuitState.CLOSED).target == 1  # type: ignore[union-attr]
    feed.idle(10)
    feed.calls(timed_out=10)
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None  # the floor
    assert governor.target == 1


def test_healthy_windows_grow_the_pool_back_one_at_a_time() -> None:
    clock = Clock()
    governor, feed = make_governor(clock)
    governor.target = 1
    feed.idle(10)
    feed.calls(ok=50, timed_out=8)  # 0.14: under the threshold but not under half of it
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None
    feed.idle(11)
    feed.calls(ok=50)
    grow = governor.evaluate(feed.window, CircuitState.CLOSED)
    assert grow is not None and (grow.delta, grow.target) == (1, 2)
    feed.idle(5)
    feed.calls(ok=5)
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None  # once per window
    feed.idle(10)
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None  # no calls: no evidence
    feed.calls(ok=1)
    assert governor.evaluate(feed.window, CircuitState.CLOSED).target == 3  # type: ignore[union-attr]
    feed.idle(10)
    feed.calls(ok=50)
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None  # the original size


def test_nothing_is_resized_unless_the_circuit_is_closed() -> None:
    clock = Clock()
    governor, feed = make_governor(clock)
    feed.idle(10)
    feed.calls(timed_out=10)
    assert governor.evaluate(feed.window, CircuitState.OPEN) is None
    assert governor.evaluate(feed.window, CircuitState.HALF_OPEN) is None
    governor.rebase()  # the circuit closed: a full window from now
    assert governor.evaluate(feed.window, CircuitState.CLOSED) is None


def test_a_slow_mean_latency_shrinks_the_pool_when_configured() -> None:
    clock = Clock()
    governor, feed = make_governor(clock, latency=0.5)
    feed.idle(10)
    feed.calls(ok=10, latency=0.6)
    resize = governor.evaluate(feed.window, CircuitState.CLOSED)
    assert resize is not None and resize.delta == -1
    assert "mean latency 600 ms" in resize.cause


# -- the shared block ----------------------------------------------------------------------


def test_children_forked_after_the_block_count_into_it_without_a_lock() -> None:
    block = SharedBlock(slots=8)
    block.state = CircuitState.OPEN
    pids = []
    for index in (1, 2):
        pid = os.fork()
        if pid == 0:  # the child: sees the published state, counts in its own slot
            code = 0 if block.state is CircuitState.OPEN else 3
            for _ in range(100):
                block.add(block.slot_for(index), failed=True, timed_out=index == 2, seconds=0.01)
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    # A child SIGKILLed while it counts holds nothing anyone waits for.
    pid = os.fork()
    if pid == 0:
        while True:
            block.add(3, failed=False, timed_out=False, seconds=0.0)
    time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    block.add(0, failed=False, timed_out=False, seconds=0.5)
    totals = block.totals()
    assert totals.failures == 200
    assert totals.timeouts == 100
    assert totals.calls > 201
    assert totals.latency == pytest.approx(2.5, abs=0.01)


def test_process_indexes_past_the_last_slot_share_slots() -> None:
    block = SharedBlock(slots=4)
    assert [block.slot_for(i) for i in range(7)] == [0, 1, 2, 3, 1, 2, 3]


# -- timeouts ------------------------------------------------------------------------------


def wrapped(driver_error: Exception) -> StoreUnavailable:
    """A driver error as SqlStore raises it: StoreUnavailable from SQLAlchemy's wrapper."""
    try:
        try:
            raise sa_exc.OperationalError("SELECT 1", {}, driver_error)
        except sa_exc.OperationalError as exc:
            raise StoreUnavailable("store unavailable") from exc
    except StoreUnavailable as error:
        return error


def test_statement_lock_and_pool_timeouts_are_timeouts() -> None:
    assert is_timeout(wrapped(psycopg.errors.QueryCanceled("statement timeout")))
    assert is_timeout(wrapped(psycopg.errors.LockNotAvailable("lock timeout")))
    try:
        raise StoreUnavailable("no connection free") from sa_exc.TimeoutError()
    except StoreUnavailable as error:
        assert is_timeout(error)


def test_a_refused_connection_is_a_failure_but_not_a_timeout() -> None:
    refused = wrapped(psycopg.OperationalError("connection refused"))
    assert not is_timeout(refused)
    assert not timed_out(refused, 0.01, store_timeout=1.0)
    # ...unless it took the whole store timeout to fail.
    assert timed_out(refused, 0.95, store_timeout=1.0)
    assert not timed_out(None, 5.0, store_timeout=1.0)


# -- the hold before a claim ---------------------------------------------------------------


def a_circuit(hold: float) -> Circuit:
    circuit = Circuit(GuardConfig(circuit_hold=hold))
    circuit.on_worker_init()
    return circuit


class FakeTask:
    """What before_claim reads of a task (and the signal's sender)."""

    request = SimpleNamespace(is_eager=False)


def a_task() -> Any:
    return FakeTask()


def test_a_closed_or_half_open_circuit_lets_the_claim_go_on_at_once() -> None:
    circuit = a_circuit(hold=30)
    circuit.before_claim(a_task(), "k")
    assert circuit.block is not None
    circuit.block.state = CircuitState.HALF_OPEN
    started = time.monotonic()
    circuit.before_claim(a_task(), "k")
    assert time.monotonic() - started < 1


def test_a_circuit_that_stays_open_gives_the_message_back_unacknowledged() -> None:
    circuit = a_circuit(hold=0.3)
    assert circuit.block is not None
    circuit.block.state = CircuitState.OPEN
    events: list[dict[str, Any]] = []

    def receive(sender: Any = None, **event: Any) -> None:
        events.append(event)

    signals.outcome.connect(receive, weak=False)
    try:
        started = time.monotonic()
        with pytest.raises(Reject) as raised:
            circuit.before_claim(a_task(), "order:1")
        assert time.monotonic() - started >= 0.3
    finally:
        signals.outcome.disconnect(receive)
    assert raised.value.requeue is True
    assert [e["outcome"] for e in events] == [signals.CIRCUIT_OPEN_DEFERRED]
    assert events[0]["key"] == "order:1"


def test_a_circuit_that_closes_during_the_hold_lets_the_claim_go_on() -> None:
    circuit = a_circuit(hold=10)
    block = circuit.block
    assert block is not None
    block.state = CircuitState.OPEN
    timer = threading.Timer(0.2, lambda: setattr(block, "state", CircuitState.HALF_OPEN))
    timer.start()
    started = time.monotonic()
    circuit.before_claim(a_task(), "k")
    assert 0.15 < time.monotonic() - started < 5
    timer.join()


def test_calls_count_only_where_deliveries_run() -> None:
    circuit = a_circuit(hold=1)
    assert circuit.block is not None
    circuit.observe(0.01, None)  # the main process of a prefork worker: its reaper's calls
    assert circuit.block.totals().calls == 0
    circuit.record_in_this_process()  # solo/threads pool: deliveries run here
    circuit.observe(0.01, None)
    circuit.observe(0.02, wrapped(psycopg.errors.QueryCanceled("statement timeout")))
    with circuit.unrecorded():  # the monitor's probes
        circuit.observe(0.01, None)
    assert circuit.block.totals() == Totals(calls=2, failures=1, timeouts=1, latency=0.03)


def test_store_calls_reach_the_metrics_in_batches_per_result_and_none_is_lost() -> None:
    circuit = Circuit(GuardConfig(store_timeout=1.0))
    circuit.on_worker_init()
    circuit.record_in_this_process()
    assert circuit.block is not None
    told: list[tuple[bool, bool, int]] = []

    def receiver(ok: bool = True, timed_out: bool = False, calls: int = 1, **_: Any) -> None:
        told.append((ok, timed_out, calls))

    signals.store_call.connect(receiver, weak=False, dispatch_uid="test-batches")
    try:
        circuit.record(True, False, 0.001)  # the first call is told at once (nothing told yet)
        assert told == [(True, False, 1)]
        for _ in range(5):
            circuit.record(True, False, 0.001)
        circuit.record(False, True, 1.0)
        circuit.record(False, False, 0.01)
        assert told == [(True, False, 1)]  # held: within a second of the last telling
        circuit.tell()  # the end of a delivery
        assert sorted(told[1:]) == [(False, False, 1), (False, True, 1), (True, False, 5)]
        circuit.tell()
        assert len(told) == 4  # nothing new, nothing sent
        assert circuit.block.totals().calls == 8  # the breaker counts every call at once
    finally:
        signals.store_call.disconnect(receiver, dispatch_uid="test-batches")


def test_held_store_calls_are_told_once_a_second_has_passed(monkeypatch: Any) -> None:
    circuit = Circuit(GuardConfig())
    circuit.record_in_this_process()
    told: list[int] = []

    def receiver(calls: int = 1, **_: Any) -> None:
        told.append(calls)

    signals.store_call.connect(receiver, weak=False, dispatch_uid="test-held")
    now = [5000.0]
    monkeypatch.setattr("celery_guard.circuit.time.monotonic", lambda: now[0])
    try:
        circuit.record(True, False, 0.0)
        circuit.record(True, False, 0.0)
        circuit.record(True, False, 0.0)
        assert told == [1]
        now[0] += 1.0  # a long body's renewals: no delivery ends to tell them
        circuit.record(True, False, 0.0)
        assert told == [1, 3]
    finally:
        signals.store_call.disconnect(receiver, dispatch_uid="test-held")


def test_store_call_totals_split_by_result_with_the_circuit_off_and_no_receiver() -> None:
    circuit = Circuit(GuardConfig(circuit_enabled=False, adaptive_concurrency=False))
    assert not circuit.enabled
    assert circuit.store_call_totals() is None  # outside a worker: nothing counted
    circuit.on_worker_init()  # the block exists without the circuit: the metrics read it
    circuit.record_in_this_process()
    assert not signals.store_call.receivers
    for _ in range(3):
        circuit.observe(0.001, None)
    circuit.observe(0.01, wrapped(psycopg.OperationalError("connection refused")))
    circuit.observe(0.02, wrapped(psycopg.errors.QueryCanceled("statement timeout")))
    circuit.tell()  # the end of a delivery, with nobody to tell
    assert circuit.store_call_totals() == (3, 1, 1)


def test_the_scrape_exports_the_store_calls_of_the_shared_block() -> None:
    circuit = a_circuit(hold=1)
    circuit.record_in_this_process()
    circuit.observe(0.001, None)
    circuit.observe(0.01, wrapped(psycopg.OperationalError("connection refused")))
    registry = build_registry(
        lambda: WorkerSnapshot(state="READY", leader=False, store_calls=circuit.store_call_totals())
    )
    exported = {
        (sample.name, sample.labels.get("result")): sample.value
        for family in registry.collect()
        if family.name == "celery_guard_store_calls"
        for sample in family.samples
    }
    assert exported == {
        ("celery_guard_store_calls_total", "ok"): 1.0,
        ("celery_guard_store_calls_total", "error"): 1.0,
        ("celery_guard_store_calls_total", "timeout"): 0.0,
    }
