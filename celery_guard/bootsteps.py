"""Every worker bootstep celery_guard adds, and what they run in the worker's main process.

:class:`GuardStep` runs the reaper (which also carries this worker's heartbeat row and the
sampling) and the metrics endpoint, and drains on warm shutdown; :class:`CircuitStep` runs the
store circuit breaker's monitor (:mod:`celery_guard.circuit.monitor`). Both find their app's
runtime with :func:`celery_guard.runtime.get_runtime`; ``install()`` adds them to the app.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.signals import beat_init
from celery.worker import state as celery_worker_state
from sqlalchemy.engine import make_url

from celery_guard import metrics
from celery_guard.circuit import Circuit
from celery_guard.circuit.breaker import CircuitState
from celery_guard.circuit.monitor import RECONCILE_INTERVAL, CircuitMonitor, ConsumerControl
from celery_guard.config import DEFAULT_STORE_URL, GuardConfig, normalize_store_url
from celery_guard.errors import ConfigurationError, StoreError
from celery_guard.metrics import MetricsServer, WorkerSnapshot, build_registry
from celery_guard.outbox import UnclaimedRepublisher
from celery_guard.reaper import Reaper, ReaperReport
from celery_guard.runtime import get_runtime
from celery_guard.sampling import Sample, Sampler
from celery_guard.schedules import warn_constant_keys
from celery_guard.worker_state import WorkerState, combine_state

logger = logging.getLogger("celery_guard.worker")
circuit_logger = logging.getLogger("celery_guard.circuit")


def _stop_relay(runtime: Any) -> None:
    relay = runtime.relay
    if relay is not None:
        relay.stop()


class GuardStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no types
    """Started after the pool (so no thread of ours is ever forked into a child)."""

    label = "celery_guard"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        # The settings are read when first needed; a worker needs them now. A bad one raises
        # out of the worker's setup (an error from the worker_init signal would only be
        # logged), so the worker exits before it consumes anything.
        get_runtime(parent.app).load()
        super().__init__(parent, **kwargs)
        self.reaper: Reaper | None = None
        self.monitor: WorkerMonitor | None = None
        self.metrics_server: MetricsServer | None = None

    def create(self, parent: Any) -> None:
        # No service object: Celery would call its stop()/terminate() without the parent.
        return None

    def start(self, parent: Any) -> None:
        runtime = get_runtime(parent.app)
        runtime.states.set_lifecycle_ready()
        config = runtime.config
        warn_if_embedded_store(config)
        warn_constant_keys(parent.app, config.result_ttl)
        monitor = WorkerMonitor(runtime, parent, live_fenced=metrics.live_fenced_count)
        metrics.declare_series()
        self.monitor = monitor
        # The reaper's loop also carries this worker's heartbeat, so it runs even when the
        # worker does not compete for the reaper's lease.
        self.reaper = Reaper(
            parent.app,
            runtime.store.recovery,
            runtime.leases,
            interval=config.reaper_interval,
            lease_ttl=config.lease_ttl,
            holder=parent.hostname,
            lead=config.reaper_enabled,
            on_pass=monitor.beat,
            on_leader_pass=monitor.sample,
            on_report=monitor.record_report,
            outbox=(
                UnclaimedRepublisher(
                    parent.app, runtime.store.publishes, after=config.unclaimed_republish_after
                )
                if config.track_publishes
                else None
            ),
        )
        self.reaper.start()
        runtime.reaper = self.reaper
        if runtime.relay is not None:
            runtime.relay.start()  # the pool processes' renewals (celery_guard/lease/relay.py)
        if config.metrics_port is not None:
            self.metrics_server = MetricsServer(
                build_registry(monitor.snapshot), config.metrics_address, config.metrics_port
            )
            self.metrics_server.start()

    def stop(self, parent: Any) -> None:
        """Warm shutdown: drain, then hand back what did not finish in time."""
        runtime = get_runtime(parent.app)
        runtime.states.set_lifecycle(WorkerState.DRAINING, reason="warm shutdown")
        self._stop_reaper()
        drain(runtime, parent.hostname)  # the relay still renews what the pool still runs
        self._stop_monitoring()
        _stop_relay(runtime)

    def terminate(self, parent: Any) -> None:
        """Cold shutdown: no drain; running keys' leases expire and the reaper recovers them."""
        runtime = get_runtime(parent.app)
        runtime.states.set_lifecycle(WorkerState.DRAINING, reason="cold shutdown")
        self._stop_reaper()
        self._stop_monitoring()
        _stop_relay(runtime)

    def _stop_reaper(self) -> None:
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None

    def _stop_monitoring(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        if self.monitor is not None:
            self.monitor.leave()
            self.monitor = None

    def shutdown(self, parent: Any) -> None:
        get_runtime(parent.app).states.set_lifecycle(WorkerState.STOPPED, reason="shutdown")
        self._stop_monitoring()


def warn_if_embedded_store(config: GuardConfig) -> None:
    """Say so once per worker start when the store is the embedded SQLite default.

    A worker without ``guard_store_url`` (or whose setting went unread) works, alone, on a
    file in its working directory; every other host, and a worker started from another
    directory, has a file of its own, and so runs the same key again. A SQLite URL set on
    purpose is a choice (one host, one file) and is not warned about.
    """
    if config.store_url != normalize_store_url(DEFAULT_STORE_URL):
        return
    database = make_url(config.store_url).database or ""
    logger.warning(
        "celery_guard store is the embedded SQLite default, %s: deduplication holds only among "
        "processes sharing that file (this worker's, and others started in the same "
        "directory on this host). Set guard_store_url (CELERY_GUARD_STORE_URL under a "
        "namespace) to a postgresql:// URL shared by all workers and producers.",
        os.path.abspath(database),
    )


def check_beat_schedule(sender: Any = None, **_: Any) -> None:
    """``beat_init`` receiver: ``celery beat`` warns about constant keys as a worker does."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        runtime = get_runtime(app)
    except ConfigurationError:
        return  # an app without celery_guard
    warn_constant_keys(app, runtime.config.result_ttl)


beat_init.connect(check_beat_schedule, weak=False, dispatch_uid="celery_guard.beat_schedule")


def drain(runtime: Any, hostname: str) -> list[str]:
    """Wait up to ``guard_drain_timeout`` for this worker's running bodies, then revoke the rest.

    Celery has stopped consuming and waits for the pool; the bodies commit to the store as they
    finish, so the store is what is watched (the main process's event loop no longer runs).
    Keys still running at the deadline are revoked: their token moves on and their lease ends,
    so the reaper re-publishes them to a live worker now, and the late commits here are
    refused. Returns the revoked keys.
    """
    owner_prefix = f"{hostname}/"
    deadline = time.monotonic() + runtime.config.drain_timeout
    try:
        while (
            runtime.store.recovery.count_running_owned(owner_prefix) and time.monotonic() < deadline
        ):
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        if not runtime.store.recovery.count_running_owned(owner_prefix):
            return []
        revoked = runtime.store.recovery.revoke_owned(owner_prefix)
        for key, old_token in revoked:
            if not runtime.leases.in_store:
                runtime.leases.release(key, old_token)
    except StoreError as exc:
        logger.warning("celery_guard drain could not use the store: %s", exc)
        return []
    keys = [key for key, _ in revoked]
    logger.warning(
        "celery_guard drain timeout (%ss): revoked %d running key(s) for other workers: %s",
        runtime.config.drain_timeout,
        len(keys),
        ", ".join(keys[:20]),
    )
    return keys


class WorkerMonitor:
    """The main process's view of its worker: heartbeat row, samples, metrics snapshot."""

    def __init__(
        self,
        runtime: Any,
        parent: Any,
        *,
        live_fenced: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.runtime = runtime
        #: Fenced executions over every process of the worker (``None``: this process only).
        self.live_fenced = live_fenced
        self.parent = parent
        self.hostname: str = parent.hostname
        self.pid = os.getpid()
        self.sample_: Sample | None = None
        queues = sorted(parent.app.amqp.queues.consume_from or parent.app.amqp.queues)
        self.sampler = Sampler(parent.app, runtime.store, queues)

    def state(self) -> tuple[str, int, int]:
        """(state, running, fenced): the main process's lifecycle, else its children's work."""
        fenced = self.live_fenced()
        if fenced is None:
            running, fenced = self.runtime.states.counts()
        else:
            running = guarded_requests_executing()
        lifecycle = self.runtime.states.lifecycle
        if lifecycle is None and self.runtime.circuit.state is CircuitState.OPEN:
            lifecycle = WorkerState.DRAINING  # store failing: no new work (docs/backpressure.md)
        return combine_state(lifecycle, running, fenced).value, running, fenced

    def beat(self) -> None:
        """Record this worker as alive for one lease TTL (every reaper interval)."""
        state, running, fenced = self.state()
        try:
            self.runtime.store.workers.beat_worker(
                self.hostname,
                pid=self.pid,
                state=state,
                running=running,
                fenced=fenced,
                circuit=self._circuit_name(),
                ttl=self.runtime.config.lease_ttl,
            )
        except StoreError as exc:
            logger.info("celery_guard worker heartbeat not recorded: %s", exc)

    def sample(self) -> None:
        """The reaper's holder samples the store and the broker for the cluster-wide series."""
        self.sample_ = self.sampler.sample()

    def record_report(self, report: ReaperReport) -> None:
        if not report.leader:
            self.sample_ = None  # only the holder exports the sampled series

    def _circuit_name(self) -> str | None:
        circuit = self.runtime.circuit
        return circuit.state.name if circuit.config.circuit_enabled else None

    def snapshot(self) -> WorkerSnapshot:
        pool = getattr(self.parent, "pool", None)
        reaper = self.runtime.reaper
        leader = bool(reaper is not None and reaper.leader)
        circuit = self.runtime.circuit
        enabled = circuit.config.circuit_enabled
        state, running, _ = self.state()
        return WorkerSnapshot(
            state=state,
            running=running,
            leader=leader,
            circuit_state=int(circuit.state) if enabled else None,
            circuit_opened=circuit.opened if enabled else None,
            pool_concurrency=circuit.concurrency or getattr(pool, "num_processes", None),
            store_calls=circuit.store_call_totals(),
            sample=self.sample_ if leader else None,
        )

    def leave(self) -> None:
        """Clean shutdown: drop this worker's heartbeat row (a killed worker's just expires)."""
        self.sampler.close()
        try:
            self.runtime.store.workers.remove_worker(self.hostname, self.pid)
        except StoreError as exc:
            logger.info("celery_guard could not remove the worker heartbeat: %s", exc)


def guarded_requests_executing() -> int:
    """Guarded tasks this worker executes now, from Celery's own bookkeeping.

    The worker's main process keeps every request its pool has accepted and not finished in
    ``celery.worker.state.active_requests`` (what ``celery inspect active`` answers), whatever
    the pool. Counting them here spares each pool process two shared-gauge writes per delivery.
    A task counts from its acceptance to its end, a duplicate that runs no body included.
    """
    # list() copies the set in one step: the consumer's thread adds and removes requests.
    return sum(
        1
        for request in list(celery_worker_state.active_requests)
        if getattr(request.task, "guarded", False)
    )


class CircuitStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no types
    """Starts the monitor in the worker's main process (after the pool, like the reaper)."""

    label = "celery_guard.circuit"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.monitor: CircuitMonitor | None = None
        self.control: ConsumerControl | None = None

    def create(self, parent: Any) -> None:
        # No service object: Celery would call its stop()/terminate() without the parent.
        return None

    def start(self, parent: Any) -> None:
        runtime = get_runtime(parent.app)
        circuit: Circuit = runtime.circuit
        config = runtime.config
        if circuit.block is None:
            if circuit.enabled:
                circuit_logger.error(
                    "celery_guard circuit: no shared block (worker_init did not run); off"
                )
            return
        pool = parent.pool
        prefork = isinstance(pool, PreforkPool)
        if not prefork:
            # Deliveries run in this process: its store calls are the ones the metrics count.
            circuit.record_in_this_process()
        if not circuit.enabled:
            return
        adaptive_from: int | None = None
        if config.adaptive_concurrency:
            if not prefork:
                circuit_logger.info(
                    "celery_guard adaptive concurrency is off: the pool is not prefork (%s)",
                    type(pool).__module__,
                )
            elif getattr(parent, "autoscaler", None):
                circuit_logger.info(
                    "celery_guard adaptive concurrency is off: --autoscale sizes the pool"
                )
            else:
                adaptive_from = int(pool.num_processes)
        self.control = ConsumerControl(parent)
        self.monitor = CircuitMonitor(
            circuit, runtime.store, runtime.leases, self.control, adaptive_from=adaptive_from
        )
        circuit.monitor = self.monitor
        self.monitor.start()

    def register_with_event_loop(self, parent: Any, hub: Any) -> None:
        # Called each time the consumer (re)connects; Celery cancels these entries on a
        # connection loss.
        if self.control is not None:
            self.control.attach(hub)
            hub.call_repeatedly(RECONCILE_INTERVAL, self.control.reconcile)

    def stop(self, parent: Any) -> None:
        self._stop()

    def terminate(self, parent: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor.circuit.monitor = None
            self.monitor = None
