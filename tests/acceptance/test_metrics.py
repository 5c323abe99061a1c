"""Metrics scraped over HTTP from a real prefork worker equal what happened, summed over children.

One worker, concurrency 2, its own queue and store database, short TTLs. The scenario: two
duplicates prevented, one transient retry, one dead letter, one takeover after a child is
SIGKILLed (its counters must survive it), a backlog for queue lag and oldest-waiting age, and
a second worker SIGKILLed that must drop out of ``celery_guard_worker_up`` within one TTL.
"""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from celery import Celery
from prometheus_client import multiprocess
from prometheus_client.parser import text_string_to_metric_families

import celery_guard
from celery_guard import GuardConfig
from celery_guard.store.sql import SqlStore
from tests.acceptance.conftest import (
    ROOT,
    new_store_database,
    open_gates,
    start_workers,
    wait_owner,
)
from tests.rig.ports import free_port
from tests.rig.procs import pid_alive, wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

LEASE_TTL = 2.0
REAPER_INTERVAL = 0.5

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample the worker exports, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


@dataclass
class Scene:
    env: dict[str, str]
    queue: str
    client: Celery
    store: SqlStore
    port: int
    workers: list[WorkerProcess] = field(default_factory=list)

    def send(self, name: str, *args: object, **options: object):  # type: ignore[no-untyped-def]
        return self.client.send_task(name, args=args, queue=self.queue, **options)

    def scrape(self) -> Samples:
        return scrape(self.port)

    def wait_for(self, name: str, expected: float, timeout: float = 30, **labels: str) -> None:
        seen: list[float] = []

        def reached() -> bool:
            seen.append(value(self.scrape(), name, **labels))
            return seen[-1] == expected

        try:
            wait_until(reached, timeout, f"{name}{labels} == {expected}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; last value {seen[-1:]}") from None


@pytest.fixture
def scene(postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Scene]:
    port = free_port()
    env = {
        "CG_MARKER_DIR": str(tmp_path),  # the gates of shop.gated
        "CG_BROKER_URL": redis_server.url_for(7),
        "CG_RESULT_URL": redis_server.url_for(8),
        "CG_STORE_URL": new_store_database(postgres, "metrics"),
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_METRICS_PORT": str(port),
    }
    client = Celery("metrics-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    # A producer that installs celery_guard stamps each message's publish time (queue lag).
    celery_guard.install(client)
    store = SqlStore(GuardConfig(store_url=env["CG_STORE_URL"]))
    scene = Scene(env, f"metrics-{uuid.uuid4().hex[:8]}", client, store, port)
    try:
        yield scene
    finally:
        for worker in scene.workers:
            worker.kill()
        store.dispose()
        client.close()


def test_counters_equal_the_scenario_summed_over_children_and_survive_a_killed_child(
    scene: Scene,
) -> None:
    (worker,) = start_workers(1, scene.env, queues=scene.queue, concurrency=2)
    scene.workers.append(worker)
    tag = uuid.uuid4().hex[:10]
    # No per-task series before a task runs (docs/monitoring.md, "Cardinality"); the few
    # per-worker label sets exist at zero from the start.
    at_start = scene.scrape()
    assert not any("task" in dict(labels) for _, labels in at_start)
    assert at_start[("celery_guard_store_calls_total", frozenset({("result", "error")}))] == 0

    # Two duplicates prevented: three deliveries of one key, one after the other.
    for _ in range(3):
        assert scene.send("shop.record", f"dup-{tag}").get(timeout=30)["tag"] == f"dup-{tag}"
    # One transient retry, then success.
    assert scene.send("shop.flaky", f"flaky-{tag}", 1).get(timeout=30) == 2
    # One dead letter (a permanent error).
    dead = scene.send("shop.reject_order", f"dead-{tag}")
    with pytest.raises(Exception, match="no lines"):
        dead.get(timeout=30)

    # One takeover: the child running a body is SIGKILLed; Celery requeues the message
    # (acks_late, reject_on_worker_lost) and a replacement child takes the key over. The body
    # is held at its gate until the scrapes saw it running and beating, so a loaded machine
    # cannot let it finish first.
    long_result = scene.send("shop.gated", tag)
    child = int(wait_owner(scene.store, f"gated:{tag}").rsplit("/", 1)[1])
    scene.wait_for("celery_guard_executions_running", 1)
    scene.wait_for("celery_guard_worker_state", 1, state="PROCESSING")
    wait_until(
        lambda: value(scene.scrape(), "celery_guard_heartbeat_gap_seconds_count") >= 1,
        30,
        "a heartbeat of the held body",
    )
    # A pool process writes its counts every metrics.FLUSH_EVERY seconds: this claim's are
    # written before the kill, and must outlive the child.
    scene.wait_for("celery_guard_lease_acquisitions_total", 1, task="shop.gated", reason="new")
    worker.kill_child(child)
    wait_until(lambda: not pid_alive(child), 10, "the child to die")
    open_gates(scene.env["CG_MARKER_DIR"], tag, 2)  # the owner that takes the key over
    assert long_result.get(timeout=60)["pid"] != child

    outcomes = {
        ("shop.record", "completed"): 1,
        ("shop.record", "duplicate_prevented"): 2,
        ("shop.flaky", "retried"): 1,
        ("shop.flaky", "released"): 0,  # one outcome per delivery: the retry says it
        ("shop.flaky", "completed"): 1,
        ("shop.reject_order", "dead_lettered"): 1,
        ("shop.gated", "completed"): 1,
    }
    # Each pool process writes its counts within metrics.FLUSH_EVERY seconds.
    for (task, outcome), expected in outcomes.items():
        if expected:
            scene.wait_for("celery_guard_tasks_total", expected, task=task, outcome=outcome)
    scene.wait_for("celery_guard_task_duration_seconds_count", 3, outcome="completed")
    samples = scene.scrape()
    for (task, outcome), expected in outcomes.items():
        got = value(samples, "celery_guard_tasks_total", task=task, outcome=outcome)
        assert got == expected, (task, outcome, got)
    assert value(samples, "celery_guard_tasks_total", outcome="fenced") == 0
    assert value(samples, "celery_guard_retries_total", task="shop.flaky", error_class="transient")
    assert value(samples, "celery_guard_retries_total") == 1
    assert (
        value(
            samples,
            "celery_guard_dead_letters_total",
            task="shop.reject_order",
            error_class="permanent",
        )
        == 1
    )
    # The "new" acquisition of the long task was counted only by the child that was killed:
    # its counter file outlives it and stays in the sum.
    acquisitions = "celery_guard_lease_acquisitions_total"
    assert value(samples, acquisitions, task="shop.gated", reason="new") == 1
    assert value(samples, acquisitions, task="shop.gated", reason="takeover") == 1
    assert value(samples, acquisitions, task="shop.flaky", reason="retry") == 1
    # Completed executions have a duration; every claimed delivery had a queue lag.
    assert value(samples, "celery_guard_task_duration_seconds_count", outcome="completed") == 3
    assert value(samples, "celery_guard_queue_lag_seconds_count") == value(samples, acquisitions)
    assert value(samples, "celery_guard_heartbeat_gap_seconds_count") >= 1  # the held body
    # The killed child's live gauges were dropped: nothing runs now.
    scene.wait_for("celery_guard_executions_running", 0)
    scene.wait_for("celery_guard_worker_state", 1, state="READY")
    # The reaper's holder samples the store.
    scene.wait_for("celery_guard_keys", 3, state="COMPLETED")
    scene.wait_for("celery_guard_keys", 1, state="DEAD")
    scene.wait_for("celery_guard_dead_letters_pending", 1)
    assert value(scene.scrape(), "celery_guard_reaper_leader") == 1


def test_a_backlog_shows_in_queue_depth_oldest_age_and_queue_lag(scene: Scene) -> None:
    (worker,) = start_workers(1, scene.env, queues=scene.queue, concurrency=2)
    scene.workers.append(worker)
    tag = uuid.uuid4().hex[:10]
    # Both children held at their gates until the scrapes saw the backlog; with prefetch 1 the
    # rest wait in the broker's queue.
    blocking = [f"{tag}-b{i}" for i in range(2)]
    blockers = [scene.send("shop.gated", blocker) for blocker in blocking]
    waiting = [scene.send("shop.record", f"{tag}-w{i}") for i in range(4)]

    def backlog_seen() -> bool:
        samples = scene.scrape()
        depth = value(samples, "celery_guard_queue_depth", queue=scene.queue)
        age = value(samples, "celery_guard_queue_oldest_age_seconds", queue=scene.queue)
        return depth >= 2 and age >= 1.0

    try:
        wait_until(backlog_seen, 30, "the backlog to show in depth and oldest age")
    finally:
        for blocker in blocking:
            open_gates(scene.env["CG_MARKER_DIR"], blocker, 1)
    for result in blockers + waiting:
        result.get(timeout=60)
    # Each pool process writes its observations within metrics.FLUSH_EVERY seconds.
    scene.wait_for("celery_guard_queue_lag_seconds_count", 4, task="shop.record")
    samples = scene.scrape()
    lag_count = value(samples, "celery_guard_queue_lag_seconds_count", task="shop.record")
    under_a_second = value(
        samples, "celery_guard_queue_lag_seconds_bucket", task="shop.record", le="1.0"
    )
    assert lag_count == 4
    # At least the two that waited behind the held bodies waited more than a second.
    assert under_a_second <= 2
    scene.wait_for("celery_guard_queue_depth", 0, queue=scene.queue)
    # Drained, the queue's Redis list is gone: its depth reads 0 rather than vanishing.
    assert any(
        name == "celery_guard_queue_depth" and ("queue", scene.queue) in labels
        for name, labels in scene.scrape()
    ), "the drained queue's depth series disappeared"


def test_a_sigkilled_worker_drops_out_of_worker_up_within_one_ttl(scene: Scene) -> None:
    (first,) = start_workers(1, scene.env, queues=scene.queue, concurrency=1)
    scene.workers.append(first)
    # The second serves no metrics (one port per worker); the first exports the cluster view.
    (second,) = start_workers(1, {**scene.env, "CG_METRICS_PORT": ""}, queues=scene.queue)
    scene.workers.append(second)
    hostname = second.hostname.replace("%h", socket.gethostname())
    scene.wait_for("celery_guard_workers_alive", 2)
    scene.wait_for("celery_guard_worker_up", 1, worker=hostname)
    second.kill()
    # One TTL for its heartbeat to expire, plus a few reaper passes to notice (and, if the
    # killed worker held the reaper's lease, 3 passes for that lease to pass on).
    scene.wait_for(
        "celery_guard_worker_up", 0, timeout=LEASE_TTL + 8 * REAPER_INTERVAL + 3, worker=hostname
    )
    assert value(scene.scrape(), "celery_guard_workers_alive") == 1


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def series_by_task(text: str) -> tuple[dict[str, int], int]:
    """Series per ``task`` label value, and the series without one."""
    per_task: dict[str, int] = {}
    other = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            task = sample.labels.get("task")
            if task is None:
                other += 1
            else:
                per_task[task] = per_task.get(task, 0) + 1
    return per_task, other


#: The budget docs/monitoring.md states ("Cardinality").
SERIES_PER_COMPLETED_TASK = 38
SERIES_PER_WORKER = 100
BYTES_PER_TASK = 4096
BYTES_PER_WORKER = 16384


def test_a_worker_with_200_task_names_stays_within_the_series_budget(scene: Scene) -> None:
    """docs/monitoring.md, "Cardinality": per task name, only what happened to it."""
    from tests.apps.many_tasks import many_task_names

    names = many_task_names()
    assert len(names) == 200
    worker = WorkerProcess(
        "tests.apps.many_tasks", env=scene.env, cwd=ROOT, concurrency=2, queues=scene.queue
    )
    scene.workers.append(worker)
    worker.start()
    # Registered but not run: no series at all (the shop's own tasks are registered too).
    per_task, _ = series_by_task(scrape_text(scene.port))
    assert per_task == {}

    results = [scene.send(name, index) for index, name in enumerate(names)]
    for index, result in enumerate(results):
        assert result.get(timeout=120) == index
    scene.wait_for("celery_guard_tasks_total", 200, outcome="completed")
    started = time.monotonic()
    text = scrape_text(scene.port)
    seconds = time.monotonic() - started
    per_task, per_worker = series_by_task(text)
    assert sorted(per_task) == names
    # Each: 1 outcome, 1 claim reason, queue lag and duration histograms of 18 series each.
    assert set(per_task.values()) == {SERIES_PER_COMPLETED_TASK}
    assert per_worker <= SERIES_PER_WORKER
    assert len(text.encode()) <= BYTES_PER_TASK * len(names) + BYTES_PER_WORKER
    # Measured here: 0.25 s on 2 loaded cores; Prometheus's default scrape_timeout is 10 s.
    assert seconds < 5, f"a scrape took {seconds:.2f} s"


def recorded(directory: Path) -> Samples:
    """What a worker's processes recorded in their multiprocess files (summed as a scrape does)."""
    collector = multiprocess.MultiProcessCollector(None, str(directory))
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in collector.collect()
        for sample in family.samples
    }


@pytest.mark.parametrize("served", [True, False], ids=["endpoint", "no-endpoint"])
def test_metrics_are_recorded_only_by_a_worker_that_serves_them(
    scene: Scene, tmp_path: Path, served: bool
) -> None:
    directory = tmp_path / f"prometheus-{served}"
    directory.mkdir()
    env = {**scene.env, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    if not served:
        del env["CG_METRICS_PORT"]
    (worker,) = start_workers(1, env, queues=scene.queue, concurrency=1)
    scene.workers.append(worker)
    tag = uuid.uuid4().hex[:10]
    assert scene.send("shop.record", f"off-{tag}").get(timeout=30)["tag"] == f"off-{tag}"
    if served:
        # The claim and the completion at least, counted as they were made.
        assert value(scene.scrape(), "celery_guard_store_calls_total", result="ok") >= 2
    # A warm shutdown: the pool process writes what it has recorded as it exits (it would
    # within metrics.FLUSH_EVERY seconds anyway), so the files now hold all there is.
    worker.stop()
    # No pool process writes a gauge per delivery, served or not: the main process counts the
    # guarded tasks its pool executes (the heartbeat row's and the scrape's running count).
    samples = recorded(directory)
    assert not any(name == "celery_guard_executions_running" for name, _ in samples)
    completed = value(samples, "celery_guard_tasks_total", task="shop.record", outcome="completed")
    # Store calls are no multiprocess value: the main process reads them from the circuit's
    # shared block at each scrape, so no pool process writes one per delivery either.
    assert not any(name == "celery_guard_store_calls_total" for name, _ in samples)
    if served:
        assert completed == 1
    else:
        assert completed == 0
