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

import logging
from dataclasses import dataclass
from typing import Final, Literal

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
    multiprocess_mode: str = "livesum"

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The names that appear in the exposition (``_total``, ``_bucket``...)."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in ("_bucket", "_count", "_sum"))
        return (self.name,)


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
        "Guarded bodies running now in this worker.",
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
