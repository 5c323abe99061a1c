"""The decisions of backpressure, as pure logic over counts and an injected clock.

:class:`Breaker` is the store circuit breaker (CLOSED -> OPEN -> HALF_OPEN -> CLOSED) and
:class:`ConcurrencyGovernor` decides when the pool shrinks or grows. Both read a
:class:`RollingWindow` of the store calls' cumulative totals; neither touches a store, a broker
or a pool, so they are tested with a fake clock. :mod:`celery_guard.circuit.monitor` feeds them
and carries their decisions out.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]

#: Probes in a row that must succeed (the first one moves OPEN to HALF_OPEN) before CLOSED.
CLOSE_AFTER_PROBES = 2


class CircuitState(enum.IntEnum):
    """The breaker's state; the value is what the ``celery_guard_circuit_state`` gauge shows."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True)
class Totals:
    """Store calls counted since some moment (cumulative, or a difference of two samples)."""

    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    #: Seconds, summed over the calls.
    latency: float = 0.0

    def __sub__(self, other: Totals) -> Totals:
        return Totals(
            calls=max(0, self.calls - other.calls),
            failures=max(0, self.failures - other.failures),
            timeouts=max(0, self.timeouts - other.timeouts),
            latency=max(0.0, self.latency - other.latency),
        )

    @property
    def failure_ratio(self) -> float:
        # A reader may see a failure before its call (the counters are not read atomically as a
        # group): never more than 1.
        return min(1.0, self.failures / self.calls) if self.calls else 0.0

    @property
    def timeout_ratio(self) -> float:
        return min(1.0, self.timeouts / self.calls) if self.calls else 0.0

    @property
    def mean_latency(self) -> float:
        return self.latency / self.calls if self.calls else 0.0

    def describe(self) -> str:
        return (
            f"{min(self.failures, self.calls)} of {self.calls} store calls failed "
            f"({min(self.timeouts, self.calls)} timed out, mean latency "
            f"{self.mean_latency * 1000:.0f} ms)"
        )


class RollingWindow:
    """Samples of cumulative totals; answers "how many calls since ``start``?".

    Keeps samples back to ``span`` seconds (plus the one at or before the boundary).
    """

    def __init__(self, span: float) -> None:
        self.span = span
        self._samples: deque[tuple[float, Totals]] = deque()

    def add(self, now: float, totals: Totals) -> None:
        self._samples.append((now, totals))
        boundary = now - self.span
        while len(self._samples) > 1 and self._samples[1][0] <= boundary:
            self._samples.popleft()

    def since(self, start: float) -> Totals:
        """Calls between ``start`` (rounded down to a sample) and the latest sample."""
        if not self._samples:
            return Totals()
        base = self._samples[0][1]
        for at, totals in self._samples:
            if at > start:
                break
            base = totals
        return self._samples[-1][1] - base


@dataclass(frozen=True)
class Transition:
    """A change of the breaker's state and what caused it (for the log)."""

    old: CircuitState
    new: CircuitState
    cause: str


class Breaker:
    """The store circuit breaker of one worker.

    * CLOSED: when, over the last ``window`` seconds, at least ``min_calls`` store calls were
      made and at least ``failure_ratio`` of them failed, it OPENS.
    * OPEN: the store is probed every ``probe_interval`` seconds; the first probe that succeeds
      moves it to HALF_OPEN.
    * HALF_OPEN: deliveries held by an open circuit proceed (trial traffic). A failed probe, or
      trial calls that meet the opening rule, open it again; :data:`CLOSE_AFTER_PROBES` probes
      in a row that succeed close it, and the window starts afresh (the outage's failures no
      longer count).
    """

    def __init__(
        self,
        *,
        failure_ratio: float,
        min_calls: int,
        window: float,
        probe_interval: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self.failure_ratio = failure_ratio
        self.min_calls = min_calls
        self.window = window
        self.probe_interval = probe_interval
        self.clock = clock
        self.state = CircuitState.CLOSED
        #: Times the circuit opened (HALF_OPEN back to OPEN included).
        self.opened = 0
        self._counting_since = clock()
        self._next_probe = 0.0
        self._probe_successes = 0

    def _trips(self, totals: Totals) -> bool:
        return (
            totals.calls >= self.min_calls and totals.failures >= self.failure_ratio * totals.calls
        )

    def evaluate(self, window: RollingWindow) -> Transition | None:
        """Look at the recent store calls; open the circuit when they say so."""
        now = self.clock()
        if self.state is CircuitState.CLOSED:
            totals = window.since(max(now - self.window, self._counting_since))
            if self._trips(totals):
                return self._open(
                    now,
                    f"{totals.describe()} in the last {self.window:g}s (opens at a failure "
                    f"ratio of {self.failure_ratio:g} over {self.min_calls}+ calls)",
                )
        elif self.state is CircuitState.HALF_OPEN:
            totals = window.since(self._counting_since)
            if self._trips(totals):
                return self._open(now, f"trial deliveries while half-open: {totals.describe()}")
        return None

    def probe_due(self) -> bool:
        return self.state is not CircuitState.CLOSED and self.clock() >= self._next_probe

    def probe_result(self, ok: bool, detail: str = "") -> Transition | None:
        """Apply the outcome of one probe of the store."""
        now = self.clock()
        self._next_probe = now + self.probe_interval
        if not ok:
            self._probe_successes = 0
            if self.state is CircuitState.HALF_OPEN:
                return self._open(now, f"probe failed while half-open: {detail}")
            return None
        if self.state is CircuitState.OPEN:
            self.state = CircuitState.HALF_OPEN
            self._counting_since = now
            self._probe_successes = 1
            return Transition(CircuitState.OPEN, CircuitState.HALF_OPEN, "a probe succeeded")
        if self.state is CircuitState.HALF_OPEN:
            self._probe_successes += 1
            if self._probe_successes >= CLOSE_AFTER_PROBES:
                self.state = CircuitState.CLOSED
                self._counting_since = now
                return Transition(
                    CircuitState.HALF_OPEN,
                    CircuitState.CLOSED,
                    f"{self._probe_successes} probes in a row succeeded",
                )
        return None

    def _open(self, now: float, cause: str) -> Transition:
        old = self.state
        self.state = CircuitState.OPEN
        self.opened += 1
        self._probe_successes = 0
        self._next_probe = now + self.probe_interval
        return Transition(old, CircuitState.OPEN, cause)


@dataclass(frozen=True)
class Resize:
    """A decision to change the pool by one process."""

    delta: int
    #: The pool size wanted after the change.
    target: int
    cause: str


class ConcurrencyGovernor:
    """Adaptive concurrency (docs/backpressure.md): fewer processes while store calls time out.

    At most once per ``window`` seconds, and only while the circuit is CLOSED (an open circuit
    already stopped the work): when at least ``min_calls`` calls were made in the window and
    at least ``timeout_ratio`` of them timed out (or their mean latency reached ``latency``),
    the pool shrinks by one, never below ``floor``. A healthy window (some calls, with
    timeouts under half the ratio and a mean latency under half its threshold) grows it back by
    one, never above ``original``.
    """

    def __init__(
        self,
        *,
        original: int,
        timeout_ratio: float,
        latency: float | None,
        min_calls: int,
        window: float,
        floor: int = 1,
        clock: Clock = time.monotonic,
    ) -> None:
        self.original = original
        self.floor = min(floor, original)
        self.timeout_ratio = timeout_ratio
        self.latency = latency
        self.min_calls = min_calls
        self.window = window
        self.clock = clock
        #: The pool size this governor wants.
        self.target = original
        self._last_change = clock()

    def rebase(self) -> None:
        """Start a new window now (the circuit changed state: older calls say nothing)."""
        self._last_change = self.clock()

    def _slow(self, totals: Totals) -> bool:
        if totals.calls < self.min_calls:
            return False
        if totals.timeouts >= self.timeout_ratio * totals.calls:
            return True
        return self.latency is not None and totals.mean_latency >= self.latency

    def _healthy(self, totals: Totals) -> bool:
        if not totals.calls:
            # No evidence: deliveries deferred by the slow store may all be waiting out their
            # countdown, and growing now would only shrink again.
            return False
        if totals.timeout_ratio >= self.timeout_ratio / 2:
            return False
        return self.latency is None or totals.mean_latency < self.latency / 2

    def evaluate(self, window: RollingWindow, circuit: CircuitState) -> Resize | None:
        now = self.clock()
        if circuit is not CircuitState.CLOSED or now - self._last_change < self.window:
            return None
        totals = window.since(now - self.window)
        if self._slow(totals):
            if self.target <= self.floor:
                return None
            self.target -= 1
            self._last_change = now
            return Resize(-1, self.target, f"{totals.describe()} in the last {self.window:g}s")
        if self.target < self.original and self._healthy(totals):
            self.target += 1
            self._last_change = now
            return Resize(
                +1, self.target, f"a healthy window: {totals.describe()} in {self.window:g}s"
            )
        return None
