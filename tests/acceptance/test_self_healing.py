"""Killed, frozen and hung workers are non-events: real workers, Redis broker, PostgreSQL store.

Each test has its own queue and its own store database, so no other worker's reaper or
consumer takes part, and short TTLs set for the test keep it fast.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery

from celery_guard import GuardConfig
from celery_guard.store.sql import SqlStore
from tests.acceptance.conftest import (
    effects_in,
    empty_redis_databases,
    new_store_database,
    open_gates,
    start_workers,
    wait_owner,
    worker_running,
)
from tests.rig.procs import pid_alive, wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

LEASE_TTL = 2.0
REAPER_INTERVAL = 0.5
#: The broker's visibility timeout where a test waits for a killed worker's message to come
#: back (kombu's Redis transport hands an unacknowledged message out again once it is older
#: than this; tests/apps/shop.py sweeps for them every second). It must outlast the reaper's
#: recovery, or a test would see the broker recover the key instead of the reaper; recovery
#: takes 2-3 s here, on a loaded host too, so 15 s leaves room; the test waits for that
#: redelivery, so every second more is a second more of the suite.
VISIBILITY_TIMEOUT = 15.0


@dataclass
class Cluster:
    """A test's own queue, store and client; workers are started by the test."""

    env: dict[str, str]
    queue: str
    client: Celery
    store: SqlStore
    workers: list[WorkerProcess]
    lease_backend: str

    def start(self, count: int = 1, **overrides: str) -> list[WorkerProcess]:
        started = start_workers(count, {**self.env, **overrides}, queues=self.queue, concurrency=1)
        self.workers.extend(started)
        return started

    def send(self, name: str, *args: object, **options: object):  # type: ignore[no-untyped-def]
        return self.client.send_task(name, args=args, queue=self.queue, **options)

    def effects(self, tag: str) -> int:
        return effects_in(self.store, tag)


@pytest.fixture(params=["sql-leases", "redis-leases"])
def cluster(
    request: pytest.FixtureRequest,
    postgres: PostgresServer,
    redis_server: RedisServer,
    tmp_path: Path,
) -> Iterator[Cluster]:
    """Each test runs twice: leases in the store's rows, and leases in Redis."""
    empty_redis_databases(redis_server, 3, 4)
    store_url = new_store_database(postgres, "heal")
    env = {
        "CG_BROKER_URL": redis_server.url_for(3),
        "CG_RESULT_URL": redis_server.url_for(4),
        "CG_STORE_URL": store_url,
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_LEASE_URL": redis_server.url_for(11) if request.param == "redis-leases" else "",
        "CG_MARKER_DIR": str(tmp_path),  # the gates of shop.gated
    }
    client = Celery("heal-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    store = SqlStore(GuardConfig(store_url=store_url))
    running = Cluster(env, f"heal-{uuid.uuid4().hex[:8]}", client, store, [], request.param)
    try:
        yield running
    finally:
        for worker in running.workers:
            worker.kill()
        store.dispose()
        client.close()


class _Never:
    duplicates = -1


_never = _Never()


def wait_running(cluster: Cluster, key: str, timeout: float = 30) -> str:
    """Wait until some worker runs ``key``; return its owner (``hostname/pid``)."""
    return wait_owner(cluster.store, key, timeout)


def worker_of(cluster: Cluster, owner: str) -> WorkerProcess:
    return worker_running(cluster.workers, owner)


def test_a_whole_worker_sigkilled_mid_task_is_recovered_by_the_reaper(cluster: Cluster) -> None:
    cluster.start(2, CG_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT))
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    # Held at its gate, the body is mid-task when its worker dies; the owner that takes the
    # key over (token 2) is let through at once.
    result = cluster.send("shop.gated", tag)
    victim = worker_of(cluster, wait_running(cluster, key))
    victim.kill()
    killed_at = time.monotonic()
    open_gates(cluster.env["CG_MARKER_DIR"], tag, 2)
    bound = LEASE_TTL + REAPER_INTERVAL + 5 + 6.0  # 6 s of slack for a loaded host
    assert bound < VISIBILITY_TIMEOUT, "the reaper's bound ends before the broker's redelivery"
    value = result.get(timeout=bound + 30)
    recovered_in = time.monotonic() - killed_at
    assert recovered_in <= bound
    assert cluster.effects(tag) == 1
    record = cluster.store.keys.get(key)
    assert record is not None
    assert (record.state, record.claim_reason, record.fencing_token) == ("COMPLETED", "TAKEOVER", 2)
    assert value["fencing_token"] == 2
    # The killed worker's message comes back after the (test's short) visibility timeout; its
    # claim finds the key COMPLETED and runs nothing.
    wait_until(
        lambda: (cluster.store.keys.get(key) or _never).duplicates >= 1,
        timeout=90,
        what="the original message's redelivery",
    )
    assert cluster.effects(tag) == 1


def test_a_dead_workers_keys_are_taken_over_without_waiting_for_the_lease(
    cluster: Cluster,
) -> None:
    """The liveness lock dies with the worker: recovery does not wait out a 60 s lease."""
    lease_ttl = 60.0
    cluster.start(2, CG_LEASE_TTL=str(lease_ttl))
    tag = uuid.uuid4().hex[:12]
    result = cluster.send("shop.gated", tag)  # held at its gate: mid-task when killed
    victim = worker_of(cluster, wait_running(cluster, f"gated:{tag}"))
    victim.kill()
    killed_at = time.monotonic()
    open_gates(cluster.env["CG_MARKER_DIR"], tag, 2)
    assert result.get(timeout=60)["fencing_token"] == 2
    assert time.monotonic() - killed_at < REAPER_INTERVAL + 10 < lease_ttl
    assert cluster.effects(tag) == 1


def test_a_prefork_child_sigkilled_mid_task_runs_once(cluster: Cluster) -> None:
    (worker,) = cluster.start(1)
    tag = uuid.uuid4().hex[:12]
    # Held at its gate, the body is still running when its child is killed, however loaded
    # the machine; the owner that takes the key over (token 2) is let through.
    result = cluster.send("shop.gated", tag)
    owner = wait_running(cluster, f"gated:{tag}")
    child = int(owner.rsplit("/", 1)[1])
    assert child in worker.child_pids()
    worker.kill_child(child)
    wait_until(lambda: not pid_alive(child), 10, "the child to die")
    open_gates(cluster.env["CG_MARKER_DIR"], tag, 2)
    value = result.get(timeout=60)
    assert value["pid"] != child and value["fencing_token"] == 2
    assert cluster.effects(tag) == 1
    record = cluster.store.keys.get(f"gated:{tag}")
    assert record is not None and record.state == "COMPLETED" and record.attempts == 2


def test_a_frozen_worker_is_taken_over_and_its_late_commit_is_refused(cluster: Cluster) -> None:
    cluster.start(2)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    gates = cluster.env["CG_MARKER_DIR"]
    # The first owner is held at its gate until it was frozen, taken over and thawed; then it
    # tries to commit late. The owner that takes over (token 2) is let through.
    result = cluster.send("shop.gated", tag)
    zombie = worker_of(cluster, wait_running(cluster, key))
    zombie.freeze()
    try:
        open_gates(gates, tag, 2)
        value = result.get(timeout=60)
        assert value["fencing_token"] == 2, "completed by the worker that took over"
        assert cluster.effects(tag) == 1
    finally:
        zombie.thaw()
        open_gates(gates, tag, 1)
    wait_until(
        lambda: "completion refused (fenced)" in zombie.log_text(),
        timeout=30,
        what="the zombie's commit to be refused",
    )
    assert cluster.effects(tag) == 1
    record = cluster.store.keys.get(key)
    assert record is not None and record.fencing_token == 2 and record.state == "COMPLETED"


def test_a_body_hung_on_a_socket_loses_its_lease_after_the_hard_deadline(
    cluster: Cluster,
) -> None:
    cluster.start(2, CG_HARD_DEADLINE="2")
    tag = uuid.uuid4().hex[:12]
    result = cluster.send("shop.hang_first_attempt", tag)
    assert result.get(timeout=60) == 2, "the second execution took the key over"
    assert cluster.effects(tag) == 1
    record = cluster.store.keys.get(f"hang:{tag}")
    assert record is not None and record.claim_reason == "TAKEOVER"


def test_a_warm_shutdown_mid_task_finishes_the_task_once(cluster: Cluster) -> None:
    (worker,) = cluster.start(1)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    # The body is held at its gate until the worker is seen draining: it is mid-task when the
    # shutdown begins, whatever the machine's load.
    result = cluster.send("shop.gated", tag)
    try:
        wait_running(cluster, key)
        worker.request_warm_shutdown()
        wait_until(lambda: "DRAINING" in worker.log_text(), 30, "the worker to drain")
        record = cluster.store.keys.get(key)
        assert record is not None and record.state == "RUNNING" and cluster.effects(tag) == 0
    finally:
        open_gates(cluster.env["CG_MARKER_DIR"], tag, 1)
    assert worker.stop(timeout=30) == 0
    assert result.get(timeout=10)["fencing_token"] == 1
    assert cluster.effects(tag) == 1


def test_a_warm_shutdown_hands_back_what_outlives_the_drain_timeout(cluster: Cluster) -> None:
    """A body still running at the drain deadline is revoked and taken over at once."""
    (draining,) = cluster.start(1, CG_DRAIN_TIMEOUT="1")
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    gates = cluster.env["CG_MARKER_DIR"]
    # The first body is held at its gate past the drain timeout and the other worker's claim;
    # then it tries to commit late. The other worker's owner (token 3) is let through.
    result = cluster.send("shop.gated", tag)
    try:
        wait_running(cluster, key)
        draining.request_warm_shutdown()
        wait_until(lambda: "revoked 1 running key" in draining.log_text(), 30, "the revocation")
        open_gates(gates, tag, 3)
        cluster.start(1)
        value = result.get(timeout=60)
        assert value["fencing_token"] == 3, "revoked (2), then claimed by the other worker (3)"
        assert cluster.effects(tag) == 1
    finally:
        open_gates(gates, tag, 1)
    assert draining.stop(timeout=30) == 0
    wait_until(
        lambda: "completion refused (fenced)" in draining.log_text(),
        timeout=10,
        what="the drained worker's late commit to be refused",
    )
    assert cluster.effects(tag) == 1


def test_a_countdown_longer_than_the_visibility_timeout_runs_once(cluster: Cluster) -> None:
    cluster.start(2, CG_VISIBILITY_TIMEOUT="2")
    tag = uuid.uuid4().hex[:12]
    result = cluster.send("shop.long_write", tag, 0.1, countdown=6)
    assert result.get(timeout=60)["tag"] == tag
    # The broker handed the waiting message out again while it waited for its ETA; that copy
    # reaches the store as a prevented duplicate.
    wait_until(
        lambda: (cluster.store.keys.get(f"long:{tag}") or _never).duplicates >= 1,
        timeout=60,
        what="the broker's redelivery of the ETA message",
    )
    assert cluster.effects(tag) == 1


def test_heartbeats_renew_the_lease_where_it_lives(cluster: Cluster) -> None:
    """SQL leases move the row's lease forward; Redis leases never write the row while running."""
    cluster.start(1)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    # The body is held at its gate until the test has seen its lease renewed: a fixed-length
    # body could end first on a loaded machine.
    result = cluster.send("shop.gated", tag)
    try:
        wait_running(cluster, key)
        claimed = cluster.store.keys.get(key)
        assert claimed is not None and claimed.lease_expires_at is not None
        # Wait past the claim-time lease while the body still runs.
        wait_until(
            lambda: cluster.store.now() > (claimed.lease_expires_at or 0) + 0.5,
            timeout=30,
            what="the claim-time lease to pass",
        )
        running = cluster.store.keys.get(key)
        assert running is not None and running.state == "RUNNING"
        assert running.fencing_token == claimed.fencing_token, "never taken over"
        if cluster.lease_backend == "redis-leases":
            assert running.updated_at == claimed.updated_at
            assert running.lease_expires_at == claimed.lease_expires_at, "no heartbeat in SQL"
        else:
            assert (running.lease_expires_at or 0) > (claimed.lease_expires_at or 0)
    finally:
        open_gates(cluster.env["CG_MARKER_DIR"], tag, 1)
    assert result.get(timeout=60)["fencing_token"] == claimed.fencing_token
    assert cluster.effects(tag) == 1
