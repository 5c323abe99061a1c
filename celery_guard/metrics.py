"""Prometheus metrics: what celery_guard exports, and how prefork children's values add up.

Two kinds of series:

* **Process metrics** (counters, histograms and a few gauges) are written by whichever process
  sees the event, usually a prefork child running a body. In a worker they live in
  prometheus_client's multiprocess mode: each process writes its values to files in one
  directory, and the worker's main process sums them at scrape time. Counters of a child that
  died or was replaced stay in the sum, so a counter never goes backwards when the pool
  recycles a child.
* **Worker metrics** (worker state, circuit state, reaper leadership, and what the reaper's
  holder samples from the store and the broker: keys per state, queue depth, workers alive)
  are read from the main process's memory at scrape time by :class:`WorkerCollector`.
  Sampled series are exported only by the worker that holds the reaper's lease, so summing
  over all workers never counts them twice: use ``max without (instance)`` in queries.

:data:`CATALOGUE` lists every series; the shipped alert rules and Grafana dashboard are tested
against it.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    multiprocess,
    start_http_server,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from celery_guard import signals
from celery_guard.worker_state import WorkerState

logger = logging.getLogger("celery_guard.metrics")

PREFIX: Final = "celery_guard_"
#: The environment variable prometheus_client reads to switch to multiprocess mode.
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    #: "process": written where the event happens, aggregated over prefork children;
    #: "worker": the worker's main process; "sampled": only the reaper's holder exports it.
    scope: Literal["process", "worker", "sampled"] = "process"
    #: How a gauge of several processes is combined (prometheus_client multiprocess modes).
    multiprocess_mode: Literal["livesum", "livemax"] = "livesum"

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The names that appear in the exposition (``_total``, ``_bucket``...)."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in ("_bucket", "_count", "_sum"))
        return (self.name,)


#: A delivery's recorder's series (:meth:`ProcessMetrics.series_for`): the task it is for,
#: the counter's child, the histogram's child and that histogram's bucket bounds.
_Series = tuple[Any, Any, Any, tuple[float, ...] | None]
#: Histograms labelled by outcome as well as by task (the queue lag is by task only).
_BY_OUTCOME = frozenset({"celery_guard_task_duration_seconds"})

#: Counters whose value lives elsewhere (the circuit's shared block) and is read at scrape time.
_READ_AT_SCRAPE = frozenset({"celery_guard_circuit_opened", "celery_guard_store_calls"})

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
_RECOVERY_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300, 900, 3600)

CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    # -- per delivery (prefork children) ---------------------------------------------------
    MetricSpec(
        "celery_guard_tasks",
        "counter",
        "Guarded deliveries by outcome (completed, duplicate_prevented, in_flight_deferred, "
        "store_unavailable_deferred, circuit_open_deferred, payload_conflict, fenced, released, "
        "retried, dead_lettered, dead_letter_skipped).",
        ("task", "outcome"),
    ),
    MetricSpec(
        "celery_guard_retries",
        "counter",
        "Retries scheduled by the failure policy, by error class.",
        ("task", "error_class"),
    ),
    MetricSpec(
        "celery_guard_dead_letters",
        "counter",
        "Deliveries dead-lettered, by error class (transient, permanent, poison).",
        ("task", "error_class"),
    ),
    MetricSpec(
        "celery_guard_queue_lag_seconds",
        "histogram",
        "Seconds from publish (or the message's ETA, if later) to the claim.",
        ("task",),
    ),
    MetricSpec(
        "celery_guard_task_duration_seconds",
        "histogram",
        "Seconds from claim to the end of the execution, by outcome.",
        ("task", "outcome"),
    ),
    MetricSpec(
        "celery_guard_lease_acquisitions",
        "counter",
        "Keys claimed, by reason: new, retry (after a release) or takeover (of an expired lease).",
        ("task", "reason"),
    ),
    MetricSpec(
        "celery_guard_lease_renewal_failures",
        "counter",
        "Lease renewal rounds that failed: store_error (the store did not answer) or lost "
        "(the token no longer owns the key).",
        ("reason",),
    ),
    MetricSpec(
        "celery_guard_lease_expirations",
        "counter",
        "Leases this worker lost while the body ran, by reason: taken_over, expired, "
        "store_unreachable.",
        ("reason",),
    ),
    MetricSpec(
        "celery_guard_heartbeat_gap_seconds",
        "histogram",
        "Seconds between two successful renewals of the same lease (or claim and first renewal).",
    ),
    MetricSpec(
        "celery_guard_lease_age_seconds",
        "gauge",
        "Age of the oldest lease held by a process (lock age), summed as the max over processes.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "celery_guard_lease_progress_age_seconds",
        "gauge",
        "Longest time any running body has gone without progress (self.guard.progress(), or "
        "its start), max over processes: heartbeats without progress.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        "celery_guard_executions_running",
        "gauge",
        "Guarded tasks this worker is executing now (Celery's active requests of guarded tasks).",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_executions_fenced",
        "gauge",
        "Guarded bodies running now whose lease was lost (their commit will be refused).",
    ),
    MetricSpec(
        "celery_guard_store_calls",
        "counter",
        "Store calls made for deliveries, by result: ok, error (the store did not answer) or "
        "timeout.",
        ("result",),
        # Counted by the processes that make the calls, in the circuit's shared block, which
        # the main process reads at scrape time (_READ_AT_SCRAPE): no write per delivery.
    ),
    # -- the worker's main process -------------------------------------------------------------
    MetricSpec(
        "celery_guard_orphans_recovered",
        "counter",
        "Orphaned keys (owner dead or frozen past its lease) re-published by the reaper.",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_orphan_recovery_seconds",
        "histogram",
        "Seconds from an orphaned key's last lease renewal to its re-publish by the reaper.",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_unclaimed_republished",
        "counter",
        "Tracked publishes (guard_track_publishes) no worker claimed within "
        "guard_unclaimed_republish_after of their due time, re-published by the reaper: "
        "messages the broker transport lost before any claim, or a killed worker took along.",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_unclaimed_abandoned",
        "counter",
        "Tracked publishes the reaper gave up on after re-publishing them 3 times without a "
        "claim (logged at ERROR): workers that never claim the task.",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_dead_owner_takeovers",
        "counter",
        "Leases ended early because their owner process was found dead (liveness lock gone).",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_worker_state",
        "gauge",
        "1 for this worker's current state (READY, PROCESSING, DRAINING, FENCED, STOPPED).",
        ("state",),
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_reaper_leader",
        "gauge",
        "1 when this worker holds the reaper's lease (and exports the sampled series).",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_circuit_state",
        "gauge",
        "The store circuit breaker: 0 closed, 1 open (consumption paused), 2 half-open.",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_circuit_opened",
        "counter",
        "Times the store circuit breaker opened.",
        scope="worker",
    ),
    MetricSpec(
        "celery_guard_pool_concurrency",
        "gauge",
        "Pool processes now (adaptive concurrency shrinks it while store calls time out).",
        scope="worker",
    ),
    # -- sampled by the reaper's holder ------------------------------------------------------
    MetricSpec(
        "celery_guard_keys",
        "gauge",
        "Idempotency keys in the store, by state.",
        ("state",),
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_expired_leases",
        "gauge",
        "RUNNING keys whose lease has expired and that are not yet recovered.",
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_oldest_running_seconds",
        "gauge",
        "Age of the oldest RUNNING key's current claim.",
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_dead_letters_pending",
        "gauge",
        "Dead letters in the store not yet replayed.",
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_queue_depth",
        "gauge",
        "Messages waiting in a broker queue this worker consumes.",
        ("queue",),
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_queue_oldest_age_seconds",
        "gauge",
        "Age of the oldest waiting message of a queue (from its publish-time header; Redis).",
        ("queue",),
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_workers_alive",
        "gauge",
        "Workers whose heartbeat in the store is younger than one lease TTL.",
        scope="sampled",
    ),
    MetricSpec(
        "celery_guard_worker_up",
        "gauge",
        "Per worker: 1 while its heartbeat in the store is fresh, 0 once it is older than one "
        "lease TTL (a SIGKILLed worker drops out within one TTL).",
        ("worker",),
        scope="sampled",
    ),
)

SPECS: Final = {spec.name: spec for spec in CATALOGUE}


def exported_names() -> set[str]:
    """Every sample name celery_guard exports (for checking dashboards and rules)."""
    return {name for spec in CATALOGUE for name in spec.sample_names}


# -- process metrics ---------------------------------------------------------------------------


#: Seconds a process keeps its deliveries' counts before it writes them to its metric files
#: (multiprocess mode): well under any scrape interval.
FLUSH_EVERY: Final = 0.5


class ProcessMetrics:
    """The prometheus_client objects of one process (created lazily, after multiprocess setup).

    In multiprocess mode (a worker) the per-delivery series are recorded through
    :meth:`count` and :meth:`observe`, which add to this process's pending totals; a daemon
    thread writes them to the metric files every :data:`FLUSH_EVERY` seconds, and a child's
    shutdown and the scrape of an in-process pool write them at once (:meth:`flush`). Each
    write to a file is a locked, pid-checked ``mmap`` update: a delivery made six of them
    (about 60 Python calls, a sixth of what celery_guard adds to a no-op task), where it now
    adds to two dicts. What it changes: a scrape sees a delivery up to half a second late, and
    a child killed with SIGKILL takes its last half second of counts with it. Outside
    multiprocess mode values are written at once.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.objects: dict[str, Any] = {}
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        #: (id(task), outcome or claim reason) -> (task, counter child, histogram child, its
        #: bucket bounds): what a delivery's two recorders write, looked up once per process.
        self.series: dict[tuple[int, str | None], _Series] = {}
        self.batched = registry is None  # multiprocess mode: values live in files
        self._pending_lock = threading.Lock()
        #: child -> increments, and histogram child -> [sum, count per bucket...], unwritten.
        self._pending_counts: dict[Any, float] = {}
        self._pending_observations: dict[Any, list[float]] = {}
        self._flusher: threading.Thread | None = None
        for spec in CATALOGUE:
            if (spec.kind == "gauge" and spec.scope != "process") or spec.name in _READ_AT_SCRAPE:
                continue  # read at scrape time by WorkerCollector
            options: dict[str, Any] = {"labelnames": spec.labels, "registry": registry}
            if spec.kind == "counter":
                metric: Any = Counter(spec.name, spec.help, **options)
            elif spec.kind == "histogram":
                buckets = _RECOVERY_BUCKETS if "recovery" in spec.name else _LATENCY_BUCKETS
                metric = Histogram(spec.name, spec.help, buckets=buckets, **options)
            else:
                metric = Gauge(
                    spec.name, spec.help, multiprocess_mode=spec.multiprocess_mode, **options
                )
            self.objects[spec.name] = metric

    def __getitem__(self, name: str) -> Any:
        return self.objects[name]

    def child(self, name: str, *values: str) -> Any:
        """The metric's child for these label values (in the catalogue's label order), kept.

        prometheus_client's ``labels()`` validates and locks on every call; a delivery records
        three or four series, the same few every time. A kept child stays right across fork:
        prometheus_client's multiprocess values notice the new pid themselves.
        """
        key = (name, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = self.objects[name].labels(*values)
        return found

    def count(self, name: str, *values: str) -> None:
        """Add one to counter ``name`` with these label values (written by the next flush)."""
        child = self._children.get((name, values))  # self.child()'s lookup, inline: per delivery
        if child is None:
            child = self.child(name, *values)
        if not self.batched:
            child.inc()
            return
        with self._pending_lock:
            pending = self._pending_counts
            pending[child] = pending.get(child, 0) + 1
        if self._flusher is None:
            self._start_flusher()

    def observe(self, name: str, value: float, *values: str) -> None:
        """Observe ``value`` in histogram ``name`` (written by the next flush)."""
        child = self._children.get((name, values))
        if child is None:
            child = self.child(name, *values)
        bounds = getattr(child, "_upper_bounds", None)
        if not self.batched or bounds is None:
            child.observe(value)
            return
        # prometheus_client counts an observation in the first bucket whose bound is >= it.
        bucket = bisect_left(bounds, value)
        with self._pending_lock:
            pending = self._pending_observations.get(child)
            if pending is None:
                pending = self._pending_observations[child] = [0.0] * (len(bounds) + 1)
            pending[0] += value
            pending[bucket + 1] += 1
        if self._flusher is None:
            self._start_flusher()

    def series_for(
        self, task: Any, label: str | None, counter: str, histogram: str, *values: str
    ) -> _Series:
        """The children a delivery's recorder writes for ``task``, kept in :attr:`series`:
        ``counter`` and ``histogram`` with the task's name, then ``values``, as labels."""
        name = _task_name(task)
        counted = self.child(counter, name, *values)
        observed = self.child(histogram, name, *(values if histogram in _BY_OUTCOME else ()))
        found = self.series[(id(task), label)] = (
            task,
            counted,
            observed,
            getattr(observed, "_upper_bounds", None),
        )
        return found

    def record(self, series: _Series, value: float | None) -> None:
        """One delivery's claim or outcome: add one to the series' counter and, when ``value``
        is not ``None``, observe it in its histogram (under one lock, written by the next
        flush)."""
        _, counted, observed, bounds = series
        if not self.batched or bounds is None:
            counted.inc()
            if value is not None:
                observed.observe(value)
            return
        with self._pending_lock:
            counts = self._pending_counts
            counts[counted] = counts.get(counted, 0) + 1
            if value is not None:
                pending = self._pending_observations.get(observed)
                if pending is None:
                    pending = self._pending_observations[observed] = [0.0] * (len(bounds) + 1)
                pending[0] += value
                # prometheus_client counts an observation in the first bucket whose bound is
                # >= it.
                pending[bisect_left(bounds, value) + 1] += 1
        if self._flusher is None:
            self._start_flusher()

    def flush(self) -> None:
        """Write this process's pending counts and observations to its metric files now."""
        with self._pending_lock:
            counts, self._pending_counts = self._pending_counts, {}
            observations, self._pending_observations = self._pending_observations, {}
        for child, amount in counts.items():
            child.inc(amount)
        for child, pending in observations.items():
            # Histogram.observe() once per observation would write once per delivery again;
            # these are the values it writes (prometheus_client/metrics.py, Histogram).
            child._sum.inc(pending[0])
            for bucket, hits in zip(child._buckets, pending[1:], strict=True):
                if hits:
                    bucket.inc(hits)

    def forget_parent(self) -> None:
        """In a forked child, before anything else runs: the parent's pending values are the
        parent's to write, and its lock (which its flusher may have held) and thread are not
        this process's."""
        self._pending_lock = threading.Lock()
        self._pending_counts = {}
        self._pending_observations = {}
        self._flusher = None

    def _start_flusher(self) -> None:
        with self._pending_lock:
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(
                target=self._flush_periodically, name="celery_guard-metrics", daemon=True
            )
            self._flusher.start()

    def _flush_periodically(self) -> None:
        # Daemon thread: ends with its process, whose shutdown hook flushes what is left.
        while True:
            time.sleep(FLUSH_EVERY)
            try:
                self.flush()
            except Exception:  # keep the thread: the next flush writes what this one had
                logger.exception("celery_guard could not write its metrics")


_lock = threading.Lock()
_metrics: ProcessMetrics | None = None
#: Where single-process metrics live (never prometheus_client's global REGISTRY, so an app's
#: own metrics and ours never collide).
_local_registry = CollectorRegistry(auto_describe=True)
_multiprocess_dir: str | None = None
_owned_dir: str | None = None


def process_metrics() -> ProcessMetrics:
    """This process's metric objects."""
    global _metrics
    metrics = _metrics
    if metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = ProcessMetrics(None if _multiprocess_dir else _local_registry)
            metrics = _metrics
    return metrics


def _after_fork_in_child() -> None:
    metrics = _metrics
    if metrics is not None:
        metrics.forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


def flush() -> None:
    """Write this process's pending metric values now (a pool process's shutdown)."""
    metrics = _metrics
    if metrics is not None:
        metrics.flush()


def multiprocess_directory() -> str | None:
    """The directory children write their values to, once :func:`enable_multiprocess` ran."""
    return _multiprocess_dir


def enable_multiprocess() -> str:
    """Switch this process (and the children it forks later) to multiprocess metrics.

    Called in a worker's main process before the pool forks. Uses ``PROMETHEUS_MULTIPROC_DIR``
    when the user set it (then clearing it between runs is theirs to do, as prometheus_client
    documents); otherwise a fresh private directory, removed when the main process exits.
    """
    global _metrics, _multiprocess_dir, _owned_dir
    with _lock:
        if _multiprocess_dir is not None:
            return _multiprocess_dir
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory:
            directory = tempfile.mkdtemp(prefix="celery_guard-metrics-")
            _owned_dir = directory
            os.environ[MULTIPROC_ENV] = directory
            atexit.register(_remove_owned_dir, os.getpid())
        os.makedirs(directory, exist_ok=True)
        # prometheus_client picks its value class when first imported; metric objects made
        # from now on (ours are made lazily) write to files in ``directory``.
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        _metrics = None
        _multiprocess_dir = directory
        return directory


def _remove_owned_dir(pid: int) -> None:
    if os.getpid() == pid and _owned_dir is not None:  # never from a forked child
        shutil.rmtree(_owned_dir, ignore_errors=True)


def forget_dead_processes(directory: str) -> None:
    """Drop the live-gauge files of processes that are gone (SIGKILLed children included).

    prometheus_client's ``mark_process_dead`` is meant for a process manager's exit hook; a
    SIGKILLed child runs no hook, so the main process checks pids at each scrape instead.
    Counters and histograms are kept: their totals must survive the child.
    """
    pids = set()
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        match = re.search(r"_(\d+)\.db$", path)
        if match:
            pids.add(int(match.group(1)))
    for pid in pids:
        if not _pid_alive(pid):
            multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_fenced_count() -> int | None:
    """Guarded executions whose lease was lost, summed over this worker's processes.

    ``None`` outside multiprocess mode (the process's own tracker knows then).
    """
    directory = _multiprocess_dir
    if directory is None:
        return None
    forget_dead_processes(directory)
    files = glob.glob(os.path.join(directory, "gauge_livesum_*.db"))
    merged = multiprocess.MultiProcessCollector.merge(  # type: ignore[no-untyped-call]
        files, accumulate=False
    )
    return int(
        sum(
            sample.value
            for metric in merged
            for sample in metric.samples
            if sample.name == "celery_guard_executions_fenced"
        )
    )


# -- recording (recorders of celery_guard's signals; nothing else feeds the metrics) -------------


def _task_name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or sender)


def record_outcome(sender: Any = None, outcome: str = "", **extra: Any) -> None:
    """``celery_guard.signals.outcome`` recorder."""
    metrics = _metrics or process_metrics()
    series = metrics.series.get((id(sender), outcome))
    if series is None or series[0] is not sender:
        series = metrics.series_for(
            sender, outcome, "celery_guard_tasks", "celery_guard_task_duration_seconds", outcome
        )
    metrics.record(series, extra.get("seconds"))
    if outcome == signals.RETRIED:
        error_class = str(extra.get("error_class") or "unknown")
        metrics.count("celery_guard_retries", _task_name(sender), error_class)
    elif outcome == signals.DEAD_LETTERED:
        error_class = str(extra.get("error_class") or "unknown")
        metrics.count("celery_guard_dead_letters", _task_name(sender), error_class)


def record_claim(sender: Any = None, reason: str | None = None, **extra: Any) -> None:
    """``celery_guard.signals.claimed`` recorder."""
    metrics = _metrics or process_metrics()
    series = metrics.series.get((id(sender), reason))
    if series is None or series[0] is not sender:
        series = metrics.series_for(
            sender,
            reason,
            "celery_guard_lease_acquisitions",
            "celery_guard_queue_lag_seconds",
            (reason or "new").lower(),
        )
    metrics.record(series, extra.get("queue_lag"))


def record_fenced(fenced: int = 0, **_: Any) -> None:
    """``celery_guard.signals.executions_fenced`` recorder."""
    process_metrics()["celery_guard_executions_fenced"].set(fenced)


def record_renewal_failed(reason: str = "", **_: Any) -> None:
    """``celery_guard.signals.lease_renewal_failed`` recorder."""
    process_metrics()["celery_guard_lease_renewal_failures"].labels(reason=reason).inc()


def record_lease_lost(cause: str = "", **_: Any) -> None:
    """``celery_guard.signals.lease_lost`` recorder."""
    process_metrics()["celery_guard_lease_expirations"].labels(reason=cause).inc()


def record_renewed(gap: float = 0.0, **_: Any) -> None:
    """``celery_guard.signals.lease_renewed`` recorder."""
    process_metrics()["celery_guard_heartbeat_gap_seconds"].observe(gap)


def record_heartbeat_round(
    oldest_lease_age: float = 0.0, oldest_progress_age: float = 0.0, **_: Any
) -> None:
    """``celery_guard.signals.heartbeat_round`` recorder."""
    metrics = process_metrics()
    metrics["celery_guard_lease_age_seconds"].set(oldest_lease_age)
    metrics["celery_guard_lease_progress_age_seconds"].set(oldest_progress_age)


def record_reaper_pass(
    recovered_for: list[float] | None = None,
    dead_owners: int = 0,
    unclaimed_republished: int = 0,
    unclaimed_abandoned: int = 0,
    **_: Any,
) -> None:
    """``celery_guard.signals.reaper_pass`` recorder (worker's main process)."""
    metrics = process_metrics()
    for seconds in recovered_for or ():
        metrics["celery_guard_orphans_recovered"].inc()
        metrics["celery_guard_orphan_recovery_seconds"].observe(seconds)
    if dead_owners:
        metrics["celery_guard_dead_owner_takeovers"].inc(dead_owners)
    if unclaimed_republished:
        metrics["celery_guard_unclaimed_republished"].inc(unclaimed_republished)
    if unclaimed_abandoned:
        metrics["celery_guard_unclaimed_abandoned"].inc(unclaimed_abandoned)


def declare_series() -> None:
    """Create this worker's fixed label combinations at zero (worker start).

    Only the few per-worker ones (renewal failures, lease expirations: 5 series; the store
    calls' 3 are read from the circuit's shared block and exported from the start),
    so ``rate()`` over them reads 0 rather than nothing from the start. Per-task series are
    not declared: each task name would cost a series per outcome whether it ever happened or
    not (11 per task; 2,200 for 200 task names). They appear at their first event, which the
    shipped rare-event alerts count in full (``x unless x offset 10m``); see
    docs/monitoring.md, "Cardinality".
    """
    metrics = process_metrics()
    for reason in ("store_error", "lost"):
        metrics["celery_guard_lease_renewal_failures"].labels(reason=reason)
    for cause in ("taken_over", "expired", "store_unreachable"):
        metrics["celery_guard_lease_expirations"].labels(reason=cause)


#: Every signal the metrics record from, with its recorder: the only way they are fed.
#: Recorders, not receivers: each signal calls them directly (:class:`signals.GuardSignal`).
_RECORDERS: Final = (
    (signals.outcome, record_outcome),
    (signals.claimed, record_claim),
    (signals.lease_renewed, record_renewed),
    (signals.lease_renewal_failed, record_renewal_failed),
    (signals.heartbeat_round, record_heartbeat_round),
    (signals.lease_lost, record_lease_lost),
    (signals.reaper_pass, record_reaper_pass),
)
#: Recorded even without an endpoint: the worker's heartbeat row reads the fenced count of its
#: pool from this gauge (:func:`live_fenced_count`). The running count is not recorded by the
#: children at all: its two signals and four gauge writes per delivery were 76 Python calls,
#: more than half of what all the other metrics cost a delivery, and the main process knows
#: what its pool executes (``WorkerSnapshot.running``).
_STATE_RECORDERS: Final = ((signals.executions_fenced, record_fenced),)


def connect_state_signals() -> None:
    """Subscribe what the worker's own state needs (idempotent; ``install()`` does it)."""
    for signal, recorder in _STATE_RECORDERS:
        signal.record_with(recorder)


def connect_signals(enabled: bool = True) -> None:
    """Subscribe the recorders to celery_guard's signals, or unsubscribe them (idempotent).

    A worker connects them at ``worker_init`` when it serves metrics (``guard_metrics_port``
    set), before the pool forks; with no endpoint nothing is recorded, and a signal with
    neither recorders nor receivers costs its sender next to nothing.
    """
    connect_state_signals()
    for signal, recorder in _RECORDERS:
        signal.record_with(recorder, enabled)


# -- what the worker's main process exports -----------------------------------------------------


@dataclass(frozen=True)
class WorkerSnapshot:
    """The main process's view at scrape time (built by the runtime)."""

    state: str
    leader: bool
    circuit_state: int | None = None
    circuit_opened: int | None = None
    pool_concurrency: int | None = None
    #: Guarded tasks the worker executes now (``None``: not known here).
    running: int | None = None
    #: Store calls made for deliveries since the worker started: ok, error, timeout
    #: (``Circuit.store_call_totals``; ``None``: not counted here).
    store_calls: tuple[int, int, int] | None = None
    #: The reaper holder's last sample (``None`` when this worker does not hold the lease).
    sample: Any = None


class WorkerCollector(Collector):
    """Main-process series, read from ``snapshot()`` at each scrape."""

    def __init__(self, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        state = _family("celery_guard_worker_state")
        for name in WorkerState:
            state.add_metric([name.value], 1.0 if name.value == snap.state else 0.0)
        yield state
        yield _single("celery_guard_reaper_leader", 1.0 if snap.leader else 0.0)
        if snap.circuit_state is not None:
            yield _single("celery_guard_circuit_state", float(snap.circuit_state))
        if snap.circuit_opened is not None:
            yield CounterMetricFamily(
                "celery_guard_circuit_opened",
                SPECS["celery_guard_circuit_opened"].help,
                value=float(snap.circuit_opened),
            )
        if snap.pool_concurrency is not None:
            yield _single("celery_guard_pool_concurrency", float(snap.pool_concurrency))
        if snap.running is not None:
            yield _single("celery_guard_executions_running", float(snap.running))
        if snap.store_calls is not None:
            calls = CounterMetricFamily(
                "celery_guard_store_calls",
                SPECS["celery_guard_store_calls"].help,
                labels=["result"],
            )
            for result, count in zip(("ok", "error", "timeout"), snap.store_calls, strict=True):
                calls.add_metric([result], float(count))
            yield calls
        sample = snap.sample
        if sample is None:
            return
        keys = _family("celery_guard_keys")
        for key_state, count in sorted(sample.keys_by_state.items()):
            keys.add_metric([key_state], float(count))
        yield keys
        yield _single("celery_guard_expired_leases", float(sample.expired_leases))
        yield _single("celery_guard_oldest_running_seconds", sample.oldest_running_seconds)
        yield _single("celery_guard_dead_letters_pending", float(sample.dead_letters_pending))
        depth = _family("celery_guard_queue_depth")
        oldest = _family("celery_guard_queue_oldest_age_seconds")
        for queue, (count, age) in sorted(sample.queues.items()):
            depth.add_metric([queue], float(count))
            if age is not None:
                oldest.add_metric([queue], age)
        yield depth
        yield oldest
        up = _family("celery_guard_worker_up")
        alive = 0
        for worker in sample.workers:
            up.add_metric([worker.hostname], 1.0 if worker.alive else 0.0)
            alive += int(worker.alive)
        yield up
        yield _single("celery_guard_workers_alive", float(alive))


def _family(name: str) -> GaugeMetricFamily:
    spec = SPECS[name]
    return GaugeMetricFamily(name, spec.help, labels=list(spec.labels))


def _single(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, SPECS[name].help, value=value)


class ProcessCollector(Collector):
    """Every process's counters, histograms and gauges, summed (or this process's alone)."""

    def collect(self) -> Iterator[Metric]:
        directory = _multiprocess_dir
        if directory is None:
            process_metrics()  # so that every family is exported, even at zero
            yield from _local_registry.collect()
            return
        # An in-process pool (solo, threads) records in this process: what it has not
        # written yet belongs in this scrape.
        process_metrics().flush()
        forget_dead_processes(directory)
        collector = multiprocess.MultiProcessCollector(None, directory)  # type: ignore[no-untyped-call]
        yield from collector.collect()  # type: ignore[no-untyped-call]


def build_registry(snapshot: Callable[[], WorkerSnapshot]) -> CollectorRegistry:
    """A registry with everything celery_guard exports from a worker.

    To mount it into an exporter you already run, register :class:`ProcessCollector` and a
    :class:`WorkerCollector` there instead (see docs/monitoring.md).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessCollector())
    registry.register(WorkerCollector(snapshot))
    return registry


class MetricsServer:
    """prometheus_client's HTTP exposition in a daemon thread of the worker's main process."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int) -> None:
        self.registry = registry
        self.address = address
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Serve; False (logged) when the port cannot be bound, so the worker still runs."""
        try:
            self._server, self._thread = start_http_server(
                self.port, addr=self.address, registry=self.registry
            )
        except OSError as exc:
            logger.error(
                "celery_guard metrics: cannot listen on %s:%s (%s); metrics are not served "
                "(set guard_metrics_port to a free port, or None)",
                self.address,
                self.port,
                exc,
            )
            return False
        self.port = self._server.server_port
        logger.info("celery_guard metrics on http://%s:%s/metrics", self.address, self.port)
        return True

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
