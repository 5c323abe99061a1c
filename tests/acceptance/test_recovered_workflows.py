"""A task the reaper recovers after its worker was SIGKILLed still runs the rest of its workflow.

The reaper re-publishes an orphaned key's stored message; the message must carry what Celery
needs to go on after the task: its ``link`` callbacks, ``link_error`` errbacks and the rest of
its ``chain``. Otherwise a chain whose worker died mid-task ends silently at that task (its
original message, which has them, returns only after the visibility timeout: an hour).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery, chain

from celery_guard import GuardConfig
from celery_guard.store.sql import SqlStore
from tests.acceptance.conftest import (
    effects_in,
    new_store_database,
    open_gates,
    start_workers,
    wait_owner,
    worker_running,
)
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

LEASE_TTL = 2.0
REAPER_INTERVAL = 0.5


@dataclass
class Cluster:
    queue: str
    client: Celery
    store: SqlStore
    workers: list[WorkerProcess]
    gates: Path

    def effects(self, tag: str) -> int:
        return effects_in(self.store, tag)

    def kill_the_worker_running(self, tag: str) -> None:
        """Kill the worker whose ``shop.gated`` body for ``tag`` is held at its gate; let the
        owner that takes the key over (token 2) through."""
        worker_running(self.workers, wait_owner(self.store, f"gated:{tag}")).kill()
        open_gates(self.gates, tag, 2)


@pytest.fixture
def cluster(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Cluster]:
    store_url = new_store_database(postgres, "flows")
    env = {
        "CG_BROKER_URL": redis_server.url_for(5),
        "CG_RESULT_URL": redis_server.url_for(6),
        "CG_STORE_URL": store_url,
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_MARKER_DIR": str(tmp_path),  # the gates of shop.gated
    }
    queue = f"flows-{uuid.uuid4().hex[:8]}"
    client = Celery("flows-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    store = SqlStore(GuardConfig(store_url=store_url))
    running = Cluster(queue, client, store, [], tmp_path)
    try:
        running.workers = start_workers(2, env, queues=queue, concurrency=1)
        yield running
    finally:
        for worker in running.workers:
            worker.kill()
        store.dispose()
        client.close()


def test_a_recovered_task_still_runs_the_rest_of_its_chain(cluster: Cluster) -> None:
    tag, after = uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]
    first = cluster.client.signature("shop.gated", args=(tag,), queue=cluster.queue)
    then = cluster.client.signature("shop.record", args=(after,), immutable=True)
    chain(first, then.set(queue=cluster.queue)).apply_async()
    cluster.kill_the_worker_running(tag)
    wait_until(lambda: cluster.effects(after) == 1, 60, "the chain's next task to run")
    assert cluster.effects(tag) == 1


def test_a_recovered_task_still_calls_its_link(cluster: Cluster) -> None:
    tag, after = uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]
    callback = cluster.client.signature(
        "shop.record", args=(after,), immutable=True, queue=cluster.queue
    )
    cluster.client.send_task("shop.gated", args=(tag,), queue=cluster.queue, link=callback)
    cluster.kill_the_worker_running(tag)
    wait_until(lambda: cluster.effects(after) == 1, 60, "the link callback to run")
    assert cluster.effects(tag) == 1
