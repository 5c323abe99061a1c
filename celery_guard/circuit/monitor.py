"""The main process's side of backpressure: the monitor thread and what it asks of Celery.

:class:`CircuitMonitor` (a thread) samples the shared counts, runs the breaker and the governor
and probes the store while the circuit is open. It never touches Celery's consumer or pool
itself: those belong to the worker's event loop, where Celery's own remote-control commands
(``cancel_consumer``/``add_consumer``, ``pool_shrink``/``pool_grow``) run. On the Redis
transport, cancelling a consumer from another thread would race the loop's ``BRPOP`` handling
(kombu defers a cancel made during a read to after it, which only works on the loop's thread),
and billiard's pool is not thread-safe either. So the monitor only records what it wants in
:class:`ConsumerControl`, and :meth:`ConsumerControl.reconcile` makes it so on the event loop: a
hub timer (:meth:`CircuitStep.register_with_event_loop`) or, for a worker without an event loop,
``consumer.call_soon`` (run by Celery's blocking loop between two reads).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from celery_guard.circuit import Circuit
from celery_guard.circuit.breaker import (
    Breaker,
    CircuitState,
    ConcurrencyGovernor,
    RollingWindow,
    Transition,
)
from celery_guard.errors import StoreError
from celery_guard.lease.backends import LeaseBackend, RedisLeases
from celery_guard.store.base import StoreClock

logger = logging.getLogger("celery_guard.circuit")

#: Seconds between two reconciliations on the worker's event loop.
RECONCILE_INTERVAL = 0.2


class ConsumerControl:
    """What the monitor wants of the consumer and the pool, carried out on the event loop."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._lock = threading.Lock()  # between the monitor thread and the event loop only
        self._want_paused = False
        self._pause_cause = ""
        #: Queues cancelled while paused (``None``: consuming).
        self._paused_queues: list[str] | None = None
        self._want_processes: int | None = None
        self._resize_cause = ""
        self._poke_pending = False
        #: The worker's event loop, once registered (``None``: Celery's blocking loop).
        self.hub: Any = None
        self._retry_scheduled = False

    # -- the monitor thread ---------------------------------------------------------------------

    def pause(self, cause: str) -> None:
        with self._lock:
            self._want_paused, self._pause_cause = True, cause

    def resume(self, cause: str) -> None:
        with self._lock:
            self._want_paused, self._pause_cause = False, cause

    def resize(self, processes: int, cause: str) -> None:
        with self._lock:
            self._want_processes, self._resize_cause = processes, cause

    @property
    def paused(self) -> bool:
        """True once the consumers are actually cancelled."""
        return self._paused_queues is not None

    def settled(self) -> bool:
        with self._lock:
            want_paused, want_processes = self._want_paused, self._want_processes
        if want_paused != self.paused:
            return False
        return want_processes is None or want_processes == self._processes()

    def poke(self) -> None:
        """Without an event loop: ask Celery's loop to reconcile (once until it has)."""
        if self.hub is not None or self.settled():
            return
        with self._lock:
            if self._poke_pending:
                return
            self._poke_pending = True
        self.worker.consumer.call_soon(self.reconcile)

    # -- the event loop -------------------------------------------------------------------------

    def attach(self, hub: Any) -> None:
        """The consumer (re)started its event loop (a reset loop dropped our queued retry)."""
        self.hub = hub
        self._retry_scheduled = False

    def reconcile(self) -> None:
        """Make the consumers and the pool what the monitor wants (event loop thread only)."""
        with self._lock:
            self._poke_pending = False
            want_paused, pause_cause = self._want_paused, self._pause_cause
            want_processes, resize_cause = self._want_processes, self._resize_cause
        consumer = self.worker.consumer
        try:
            if want_paused != self.paused:
                self._pause_or_resume(consumer, want_paused, pause_cause)
            if want_processes is not None:
                self._resize(consumer, want_processes, resize_cause)
        except Exception:  # never let the event loop die for backpressure
            logger.exception("celery_guard circuit: could not apply the circuit's decision")

    def _retry_resize(self) -> None:
        self._retry_scheduled = False
        with self._lock:
            want_processes, resize_cause = self._want_processes, self._resize_cause
        if want_processes is None:
            return
        try:
            self._resize(self.worker.consumer, want_processes, resize_cause)
        except Exception:
            logger.exception("celery_guard circuit: could not resize the pool")

    def _pause_or_resume(self, consumer: Any, pause: bool, cause: str) -> None:
        task_consumer = getattr(consumer, "task_consumer", None)
        if task_consumer is None:
            return  # not connected yet (or reconnecting): next time
        if pause:
            # What Celery's cancel_consumer control command does, for each consumed queue.
            names = [queue.name for queue in task_consumer.queues]
            for name in names:
                consumer.cancel_task_queue(name)
            self._paused_queues = names
            logger.warning(
                "celery_guard circuit open: stopped consuming from %s (%s)",
                ", ".join(names) or "no queue",
                cause,
            )
        else:
            # add_consumer: select the queue again and consume from it. A consumer restarted
            # (broker reconnect) while paused consumed nothing: the queues were deselected.
            names = self._paused_queues or []
            for name in names:
                consumer.add_task_queue(name)
            self._paused_queues = None
            logger.info(
                "celery_guard circuit closed: consuming from %s again (%s)",
                ", ".join(names) or "no queue",
                cause,
            )

    def _processes(self) -> int:
        return int(self.worker.consumer.pool.num_processes)

    def _resize(self, consumer: Any, target: int, cause: str) -> None:
        pool = consumer.pool
        current = int(pool.num_processes)
        if target < current:
            try:
                pool.shrink(1)
            except ValueError:
                # billiard shrinks idle processes only, and while work keeps coming a process is
                # idle only between reading its result and being given the next job: the loop
                # does that in one round (events, then its on_tick writes). A callback queued
                # with call_soon runs at the start of the next round, in between; it re-queues
                # itself each round (no busy loop: each round still waits in poll) until the
                # shrink is done or no longer wanted.
                if self.hub is not None and not self._retry_scheduled:
                    self._retry_scheduled = True
                    self.hub.call_soon(self._retry_resize)
                return
            # What Celery's pool_shrink control command does after the shrink.
            consumer._update_prefetch_count(-1)
            logger.info(
                "celery_guard adaptive concurrency: pool shrunk to %d process(es) (%s)",
                current - 1,
                cause,
            )
        elif target > current:
            pool.grow(1)
            consumer._update_prefetch_count(1)
            logger.info(
                "celery_guard adaptive concurrency: pool grown to %d process(es) (%s)",
                current + 1,
                cause,
            )


class CircuitMonitor:
    """The main process's thread: samples the counts, decides, probes, publishes the state."""

    def __init__(
        self,
        circuit: Circuit,
        store: StoreClock,
        leases: LeaseBackend,
        control: ConsumerControl | None,
        *,
        adaptive_from: int | None,
        clock: Any = time.monotonic,
    ) -> None:
        config = circuit.config
        assert circuit.block is not None
        self.circuit = circuit
        self.block = circuit.block
        self.store = store
        self.leases = leases
        self.control = control
        self.clock = clock
        self.tick_interval = min(0.25, config.circuit_window / 20)
        self.window = RollingWindow(config.circuit_window + 2 * self.tick_interval)
        self.breaker = (
            Breaker(
                failure_ratio=config.circuit_failure_ratio,
                min_calls=config.circuit_min_calls,
                window=config.circuit_window,
                probe_interval=config.circuit_probe_interval,
                clock=clock,
            )
            if config.circuit_enabled
            else None
        )
        self.governor = (
            ConcurrencyGovernor(
                original=adaptive_from,
                timeout_ratio=config.adaptive_timeout_ratio,
                latency=config.adaptive_latency,
                min_calls=config.circuit_min_calls,
                window=config.circuit_window,
                clock=clock,
            )
            if adaptive_from is not None
            else None
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> CircuitState:
        return self.breaker.state if self.breaker is not None else CircuitState.CLOSED

    @property
    def concurrency(self) -> int | None:
        if self.control is None:
            return None
        try:
            return self.control._processes()
        except AttributeError:  # the pool is not started, or already gone
            return None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery_guard-circuit", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.tick_interval):
            try:
                self.tick()
            except Exception:
                logger.exception("celery_guard circuit monitor: tick failed")

    def tick(self) -> None:
        """One round: sample, evaluate, probe when due, resize when due."""
        self.window.add(self.clock(), self.block.totals())
        breaker = self.breaker
        if breaker is not None:
            transition = breaker.evaluate(self.window)
            if transition is None and breaker.probe_due():
                ok, detail = self.probe()
                transition = breaker.probe_result(ok, detail)
                if not ok and transition is None:
                    logger.debug("celery_guard circuit probe failed: %s", detail)
            if transition is not None:
                self._publish(transition)
        if self.governor is not None and self.control is not None:
            resize = self.governor.evaluate(self.window, self.state)
            if resize is not None:
                self.control.resize(resize.target, resize.cause)
        concurrency = self.concurrency
        if concurrency is not None:
            self.block.concurrency = concurrency
        if self.control is not None:
            self.control.poke()

    def probe(self) -> tuple[bool, str]:
        """A cheap question to the store (its clock), and a PING to Redis holding the leases."""
        try:
            with self.circuit.unrecorded():
                self.store.now()
                if isinstance(self.leases, RedisLeases):
                    self.leases.client.ping()
        except StoreError as exc:
            return False, str(exc)
        except redis.RedisError as exc:
            return False, f"lease store: {exc}"
        return True, ""

    def _publish(self, transition: Transition) -> None:
        assert self.breaker is not None
        self.block.state = transition.new
        self.block.opened = self.breaker.opened
        if transition.new is CircuitState.OPEN:
            logger.warning(
                "celery_guard circuit %s -> OPEN: %s; consumption paused, probing the store "
                "every %gs",
                transition.old.name,
                transition.cause,
                self.breaker.probe_interval,
            )
            if self.control is not None:
                self.control.pause(transition.cause)
        else:
            logger.info(
                "celery_guard circuit %s -> %s: %s%s",
                transition.old.name,
                transition.new.name,
                transition.cause,
                "; consumption resumed" if transition.new is CircuitState.CLOSED else "",
            )
            if transition.new is CircuitState.CLOSED and self.control is not None:
                self.control.resume(transition.cause)
        if self.governor is not None:
            self.governor.rebase()
