"""Backpressure (docs/backpressure.md): a store circuit breaker per worker, adaptive concurrency.

``runtime.circuit`` (a :class:`Circuit`) is the seam the rest of celery_guard uses:

* every process counts its store calls through :meth:`Circuit.record` (the store and the lease
  backend call :meth:`Circuit.observe`), into a :class:`~celery_guard.circuit.shared.SharedBlock`
  the main process created before the pool forked;
* the main process's :class:`~celery_guard.circuit.monitor.CircuitMonitor` reads the counts,
  runs the :class:`~celery_guard.circuit.breaker.Breaker` (stop consuming while the store
  fails, probe, resume) and the :class:`~celery_guard.circuit.breaker.ConcurrencyGovernor`
  (shrink the prefork pool while store calls time out, grow it back), and publishes the state;
* a delivery checks :meth:`Circuit.before_claim` before it claims: while the circuit is open it
  waits (``guard_circuit_hold``), then gives its message back to the broker unacknowledged.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from celery.exceptions import Reject
from celery.utils.log import current_process_index

from celery_guard import signals
from celery_guard.circuit.breaker import CircuitState
from celery_guard.circuit.shared import SharedBlock
from celery_guard.circuit.timeouts import timed_out
from celery_guard.config import GuardConfig
from celery_guard.errors import StoreError
from celery_guard.lease.backends import LeaseBackend
from celery_guard.store.sql import SqlStore, StoreObserver

__all__ = ["Circuit", "CircuitState"]

#: The lease backend's calls that reach Redis.
_LEASE_CALLS = ("acquire", "renew_leases", "release", "held")

logger = logging.getLogger("celery_guard.circuit")

#: Seconds between two looks at the shared state while a delivery waits for the circuit.
HOLD_POLL = 0.05
#: Seconds at most between two ``store_call`` signals while store calls are made.
TELL_EVERY = 1.0
#: (ok, timed_out) of the three results, in the order :meth:`Circuit.record` counts them.
_RESULTS = ((True, False), (False, False), (False, True))


class Monitor(Protocol):
    """What the circuit reads of its main-process monitor (:mod:`celery_guard.circuit.monitor`,
    which imports this module)."""

    @property
    def concurrency(self) -> int | None:
        """Pool processes now (``None``: not governed)."""
        ...


class _Quiet(threading.local):
    """Per thread: whether its store calls go uncounted (:meth:`Circuit.unrecorded`). A class
    default, so that the check after every store call is an attribute read, not a getattr."""

    quiet = False


class Circuit:
    """Backpressure for one app, in every process of a worker (``runtime.circuit``).

    For metrics: :attr:`state` (a :class:`CircuitState`: 0 closed, 1 open, 2 half-open),
    :attr:`opened` (times it opened), :attr:`concurrency` (pool processes now) and
    :meth:`record`, called once per store call made for a delivery, in the process that made it.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        #: Whether the worker runs the monitor at all.
        self.enabled = config.circuit_enabled or config.adaptive_concurrency
        #: The shared counts and state; created by :meth:`on_worker_init` in a worker only.
        self.block: SharedBlock | None = None
        #: The main process's monitor, once the worker has started.
        self.monitor: Monitor | None = None
        self._recording = False
        self._slot = 0
        #: Store calls counted but not yet told to the metrics: ok, error, timeout.
        self._untold = [0, 0, 0]
        self._told_at = 0.0
        # Private to this process: guards this process's slot against its own threads (the
        # body's thread and the heartbeat). Never shared with another process.
        self._lock = threading.Lock()
        self._local = _Quiet()

    # -- the worker's lifecycle -----------------------------------------------------------------

    def watch(self, store: SqlStore, leases: LeaseBackend) -> None:
        """Count the calls of the store and, when leases live in Redis, of the lease backend."""
        store.observer = self.observe
        if not leases.in_store:
            # The Redis backend's calls, wrapped on this instance (the handler and the heartbeat
            # share it): each raises StoreUnavailable when Redis does not answer.
            for name in _LEASE_CALLS:
                setattr(leases, name, _observed(getattr(leases, name), self.observe))

    def on_worker_init(self) -> None:
        """Main process, ``worker_init``: create the shared block before the pool forks.

        Created with the circuit off too: the block is also where the worker's store-call
        counts live, which the metrics read at scrape time (:meth:`store_call_totals`).
        """
        if self.block is None:
            self.block = SharedBlock()
        # A worker started again in this process starts afresh (its store-call counts go on:
        # a counter only grows).
        self.block.state = CircuitState.CLOSED
        self.block.opened = 0

    def on_child_start(self) -> None:
        """Prefork child, ``worker_process_init``: count this child's calls in its own slot."""
        self._lock = threading.Lock()  # whatever the parent's was doing when it forked
        self._untold = [0, 0, 0]  # the parent's, not this child's
        self._recording = True  # the metrics count store calls even with the circuit off
        if self.block is not None:
            self._slot = self.block.slot_for(current_process_index(base=1) or 0)

    def record_in_this_process(self) -> None:
        """In-process pools (solo, threads): deliveries run in the main process, slot 0."""
        self._slot = 0
        self._recording = True

    # -- counting store calls -------------------------------------------------------------------

    def observe(self, seconds: float, error: StoreError | None) -> None:
        """What the store and the lease backend call after each of their calls."""
        if error is not None:
            self.record(False, timed_out(error, seconds, self.config.store_timeout), seconds)
            return
        # The answered call, inline rather than through record(): this runs after every store
        # call of every delivery (four for a task that writes through transaction()), and the
        # extra call, its keyword arguments and the failure branches were most of its cost.
        if not self._recording or self._local.quiet:
            return
        block = self.block
        signal = signals.store_call
        # Else nobody reads the untold counts (two attribute reads: per store call, no property).
        told = bool(signal.recorders or signal.receivers)
        with self._lock:
            if block is not None:
                block.add_answered(self._slot, seconds)
            if told:
                self._untold[0] += 1
                told = time.monotonic() - self._told_at >= TELL_EVERY
        if told:
            self.tell()

    def record(self, ok: bool, timed_out: bool, seconds: float) -> None:
        """Count one store call made for a delivery: ``ok`` (the store answered), whether it
        ran into a timeout (a timeout is a failure too), and how long it took.

        Called in the process that made the call: a prefork child, or the main process of an
        in-process pool (solo, threads), where the reaper's calls share the process and count
        too. A prefork worker's main process counts nothing; the probes never count.
        """
        if ok and not timed_out:
            self.observe(seconds, None)
            return
        if not self._recording or self._local.quiet:
            return
        block = self.block
        signal = signals.store_call
        told = bool(signal.recorders or signal.receivers)
        with self._lock:
            if block is not None:
                block.add(self._slot, failed=not ok, timed_out=timed_out, seconds=seconds)
            if told:
                self._untold[0 if ok else 2 if timed_out else 1] += 1
                told = time.monotonic() - self._told_at >= TELL_EVERY
        if told:
            self.tell()

    def tell(self) -> None:
        """Send the store calls counted since the last time as ``store_call`` signals.

        One signal per result with the number of calls (``calls``), not one per call: the
        handler's delivery tells at its end (:class:`celery_guard.task.GuardedTask`), and
        :meth:`record` tells when :data:`TELL_EVERY` seconds have passed (a long body's
        renewals, an in-process pool's reaper), so a receiver lags by a second at most.
        celery_guard's metrics are not a receiver (they read :meth:`store_call_totals`), so
        with no receiver of the user's nothing is sent.
        """
        untold = self._untold
        if not (signals.store_call.recorders or signals.store_call.receivers):
            # Nobody to tell: forget what was counted before the last receiver went (record()
            # counts nothing meanwhile).
            if untold[0] or untold[1] or untold[2]:
                self._untold = [0, 0, 0]
            return
        if not (untold[0] or untold[1] or untold[2]):
            return  # read without the lock: a call counted meanwhile is told next time
        with self._lock:
            counts, self._untold = self._untold, [0, 0, 0]
            self._told_at = time.monotonic()
        for (ok, timeout), calls in zip(_RESULTS, counts, strict=True):
            if calls:
                signals.store_call.send(None, ok=ok, timed_out=timeout, calls=calls)

    def store_call_totals(self) -> tuple[int, int, int] | None:
        """Store calls counted since the worker started, summed over its processes: ok, error
        (the store did not answer) and timeout, as :meth:`record` tells them apart.

        Read from the shared block in the main process (``None`` before ``worker_init``): the
        counts a SIGKILLed child made stay in its slot, which its replacement keeps counting in,
        so the totals never go backwards while the worker runs.
        """
        block = self.block
        if block is None:
            return None
        totals = block.totals()
        # A timeout is a failure too (record), and a call that did not fail never times out.
        timeouts = min(totals.timeouts, totals.failures)
        return max(0, totals.calls - totals.failures), totals.failures - timeouts, timeouts

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Store calls this thread makes inside the block are not counted (the probes)."""
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = False

    # -- what the state is ----------------------------------------------------------------------

    @property
    def state(self) -> CircuitState:
        """CLOSED, OPEN or HALF_OPEN, as the main process published it (any process)."""
        return self.block.state if self.block is not None else CircuitState.CLOSED

    @property
    def opened(self) -> int:
        """Times the circuit opened since the worker started."""
        return self.block.opened if self.block is not None else 0

    @property
    def concurrency(self) -> int | None:
        """Pool processes now (``None`` outside a worker, or before it started)."""
        if self.monitor is not None:
            return self.monitor.concurrency
        return self.block.concurrency if self.block is not None else None

    # -- a delivery, before its claim -----------------------------------------------------------

    def before_claim(self, task: Any, key: str) -> None:
        """Hold a delivery while the circuit is OPEN; give its message back if it stays open.

        Returns at once when the circuit is closed or half-open (trial traffic), or as soon as
        it stops being open within ``guard_circuit_hold`` seconds. Otherwise sends the
        ``circuit_open_deferred`` outcome and raises ``Reject(requeue=True)``: the message goes
        back to the broker unacknowledged, nothing is re-published, and this worker, which has
        stopped consuming, does not take it again until the circuit closes.
        """
        block = self.block
        if (
            block is None
            or not self.config.circuit_enabled
            or not block.is_open
            or getattr(task.request, "is_eager", False)
        ):
            return
        hold = self.config.circuit_hold
        deadline = time.monotonic() + hold
        while (remaining := deadline - time.monotonic()) > 0:
            time.sleep(min(HOLD_POLL, remaining))
            if block.state is not CircuitState.OPEN:
                logger.debug("celery_guard circuit no longer open: key=%s proceeds", key)
                return
        signals.outcome.send(
            sender=task,
            key=key,
            outcome=signals.CIRCUIT_OPEN_DEFERRED,
            fencing_token=None,
            attempts=None,
        )
        logger.info(
            "celery_guard circuit open for %gs: key=%s given back to the broker unacknowledged",
            hold,
            key,
        )
        raise Reject(f"celery_guard: store circuit open for {hold:g}s", requeue=True)


def _observed(call: Callable[..., Any], observer: StoreObserver) -> Callable[..., Any]:
    """``call``, telling ``observer`` its latency and the StoreError it ended with, if any."""

    @functools.wraps(call)
    def observed(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            value = call(*args, **kwargs)
        except StoreError as exc:
            _tell(observer, time.monotonic() - started, exc)
            raise
        _tell(observer, time.monotonic() - started, None)
        return value

    return observed


def _tell(observer: StoreObserver, seconds: float, error: StoreError | None) -> None:
    try:
        observer(seconds, error)
    except Exception:  # counting a call must never change its outcome
        logger.exception("celery_guard: the store call observer failed")
