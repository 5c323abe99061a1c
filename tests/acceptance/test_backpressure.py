"""docs/backpressure.md: a worker whose store fails stops consuming instead of storming it,
gives prefetched deliveries back unacknowledged, resumes when the store answers, and shrinks its
pool while store calls time out.

Real worker processes, a real PostgreSQL (stopped and restarted, or locked) and a real Redis
broker, read directly to see what is waiting in it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import create_engine, func, select

from tests.acceptance.conftest import new_store_database, start_workers
from tests.acceptance.test_metrics import scrape, value
from tests.apps import shop_tables
from tests.rig.ports import free_port
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

BROKER_DB = 14
ADAPTIVE_BROKER_DB = 8
RESULT_DB = 15


@pytest.fixture
def stoppable_postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:  # its own server: this test stops and restarts it
        yield server


def effect_counts(store_url: str, tags: list[str]) -> dict[str, int]:
    engine = create_engine(store_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                select(shop_tables.effects.c.tag, func.count())
                .where(shop_tables.effects.c.tag.in_(tags))
                .group_by(shop_tables.effects.c.tag)
            ).all()
    finally:
        engine.dispose()
    return {str(tag): int(count) for tag, count in rows}


def broker_messages(broker: redis.Redis) -> Counter[tuple[str, int]]:
    """(task id, deferral count) of every task message in the broker, read atomically.

    A message is either waiting in a queue (a list) or delivered and not yet acknowledged (the
    ``unacked`` hash): together, everything not done yet. A re-published deferral shows up as
    the same id with a higher deferral count.
    """
    lists = [key for key in broker.scan_iter() if broker.type(key) == b"list"]
    pipe = broker.pipeline(transaction=True)  # MULTI/EXEC: one snapshot
    for key in lists:
        pipe.lrange(key, 0, -1)
    pipe.hvals("unacked")
    *waiting, unacked = pipe.execute()
    payloads = [json.loads(raw) for values in waiting for raw in values]
    payloads += [json.loads(raw)[0] for raw in unacked]
    found: Counter[tuple[str, int]] = Counter()
    for payload in payloads:
        headers = payload.get("headers") or {}
        if "task" in headers:  # not a remote-control reply
            found[(headers["id"], int(headers.get("guard_deferrals") or 0))] += 1
    return found


def consumed_queues(client: Celery, worker: WorkerProcess) -> list[str] | None:
    """The queues ``worker`` consumes from, or ``None`` when it did not answer."""
    replies = client.control.inspect([worker.node_name], timeout=3).active_queues() or {}
    if len(replies) != 1:
        return None
    (queues,) = replies.values()
    return [queue["name"] for queue in queues]


def pool_processes(client: Celery, worker: WorkerProcess) -> int | None:
    """How many pool processes ``worker`` runs, or ``None`` when it did not answer."""
    replies = client.control.inspect([worker.node_name], timeout=3).stats() or {}
    if len(replies) != 1:
        return None
    (stats,) = replies.values()
    return len(stats["pool"]["processes"])


def test_the_circuit_opens_while_the_store_is_down_and_every_task_still_runs_once(
    stoppable_postgres: PostgresServer, redis_server: RedisServer
) -> None:
    store_url = new_store_database(stoppable_postgres, "backpressure")
    env = {
        "CG_BROKER_URL": redis_server.url_for(BROKER_DB),
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": store_url,
        "CG_STORE_TIMEOUT": "1",
        "CG_CIRCUIT_WINDOW": "3",
        "CG_CIRCUIT_MIN_CALLS": "3",
        "CG_CIRCUIT_PROBE_INTERVAL": "0.5",
        "CG_CIRCUIT_HOLD": "1",
        "CG_METRICS_PORT": str(metrics_port := free_port()),
    }
    with redis_server.client(BROKER_DB) as broker:
        broker.flushdb()
    client = Celery("backpressure-client", broker=env["CG_BROKER_URL"])
    tag = uuid.uuid4().hex[:8]
    first = [f"{tag}-first-{i}" for i in range(12)]
    # Prefetched at once and held in the worker until their countdown: they come due while
    # the circuit is open, so they must be held and then given back, not run. The countdown
    # only has to outlast the circuit's opening (a few seconds: three failed store calls), and
    # is long because a busy machine stretches that; the test asserts it did come due after.
    later = [f"{tag}-later-{i}" for i in range(2)]
    countdown = 20.0
    second = [f"{tag}-second-{i}" for i in range(10)]
    third = [f"{tag}-third-{i}" for i in range(10)]
    worker: WorkerProcess | None = None
    try:
        (worker,) = start_workers(1, env)  # prefork, concurrency 2
        log = worker.log_text
        later_sent = time.monotonic()
        later_ids = [
            client.send_task("shop.record", args=(name,), countdown=countdown).id for name in later
        ]
        wait_until(
            lambda: all(f"[{task_id}]" in log() for task_id in later_ids),
            timeout=30,
            what="the worker to hold the countdown tasks",
        )
        for name in first:
            client.send_task("shop.slow", args=(name, 0.2))
        wait_until(
            lambda: sum(effect_counts(store_url, first).values()) >= 3,
            timeout=30,
            what="the first batch to be under way",
        )
        stoppable_postgres.stop(keep_data=True)
        stopped_at = time.monotonic()
        for name in second:
            client.send_task("shop.record", args=(name,))

        # The circuit opens: logged with its cause, and the worker consumes from no queue.
        wait_until(lambda: "-> OPEN" in log(), timeout=20, what="the circuit to open")
        opened_after = time.monotonic() - stopped_at
        assert time.monotonic() - later_sent < countdown, (
            "the circuit opened after the countdown tasks came due: lengthen the countdown"
        )
        assert "store calls failed" in log()
        wait_until(
            lambda: consumed_queues(client, worker) == [], timeout=10, what="consumption to stop"
        )
        # The metrics say so too: circuit open, the worker takes no new work.
        samples = scrape(metrics_port)
        assert value(samples, "celery_guard_circuit_state") == 1
        assert value(samples, "celery_guard_worker_state", state="DRAINING") == 1
        assert (
            value(samples, "celery_guard_store_calls_total", result="error")
            + value(samples, "celery_guard_store_calls_total", result="timeout")
            >= 3
        )

        # The prefetched deliveries that came due while open were held, then given back.
        wait_until(
            lambda: log().count("given back to the broker unacknowledged") >= len(later),
            timeout=countdown + 20,
            what="the held deliveries to be given back",
        )
        # No retry storm: while open, nothing is re-published, consumed or lost.
        time.sleep(1.5)
        with redis_server.client(BROKER_DB) as broker:
            before = broker_messages(broker)
            time.sleep(3)
            after = broker_messages(broker)
        assert before == after, "messages were re-published or consumed while the circuit was open"
        waiting_ids = {task_id for task_id, _ in after}
        assert len(waiting_ids) >= len(second) + len(later)
        assert max(deferrals for _, deferrals in after) <= 6, after
        assert consumed_queues(client, worker) == []

        stoppable_postgres.restart()
        wait_until(lambda: "HALF_OPEN -> CLOSED" in log(), timeout=30, what="the circuit to close")
        wait_until(
            lambda: consumed_queues(client, worker) == ["celery"],
            timeout=10,
            what="consumption to resume",
        )
        samples = scrape(metrics_port)
        assert value(samples, "celery_guard_circuit_state") == 0
        assert value(samples, "celery_guard_circuit_opened_total") >= 1
        for name in third:
            client.send_task("shop.record", args=(name,))

        everything = first + later + second + third
        wait_until(
            lambda: len(effect_counts(store_url, everything)) == len(everything),
            timeout=60,
            what="every task of the three batches to complete",
        )
        time.sleep(1)  # a duplicate would land now
        counts = effect_counts(store_url, everything)
        assert counts == dict.fromkeys(everything, 1)
        text = log()
        assert text.count("-> OPEN") >= 1
        assert "CLOSED -> OPEN" in text and "OPEN -> HALF_OPEN" in text
        assert "stopped consuming from celery" in text
        assert "consuming from celery again" in text
        print(f"circuit opened {opened_after:.1f}s after the store stopped")
    finally:
        if worker is not None:
            worker.stop()
        client.close()


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_in_process_pools_open_and_close_the_circuit_too(
    stoppable_postgres: PostgresServer, redis_server: RedisServer, pool: str
) -> None:
    """Deliveries run in the main process: it counts its own store calls (slot 0)."""
    store_url = new_store_database(stoppable_postgres, "inprocess")
    env = {
        "CG_BROKER_URL": redis_server.url_for(BROKER_DB),
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": store_url,
        "CG_STORE_TIMEOUT": "1",
        "CG_CIRCUIT_WINDOW": "2",
        "CG_CIRCUIT_MIN_CALLS": "3",
        "CG_CIRCUIT_PROBE_INTERVAL": "0.5",
        "CG_CIRCUIT_HOLD": "1",
    }
    with redis_server.client(BROKER_DB) as broker:
        broker.flushdb()
    client = Celery(f"{pool}-client", broker=env["CG_BROKER_URL"])
    names = [f"{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
    worker: WorkerProcess | None = None
    try:
        (worker,) = start_workers(1, env, pool=pool)
        log = worker.log_text
        assert "adaptive concurrency is off: the pool is not prefork" in log()
        stoppable_postgres.stop(keep_data=True)
        for name in names:
            client.send_task("shop.record", args=(name,))
        wait_until(lambda: "CLOSED -> OPEN" in log(), timeout=20, what="the circuit to open")
        wait_until(
            lambda: consumed_queues(client, worker) == [], timeout=15, what="consumption to stop"
        )
        stoppable_postgres.restart()
        wait_until(lambda: "HALF_OPEN -> CLOSED" in log(), timeout=30, what="the circuit to close")
        wait_until(
            lambda: consumed_queues(client, worker) == ["celery"],
            timeout=15,
            what="consumption to resume",
        )
        wait_until(
            lambda: len(effect_counts(store_url, names)) == len(names),
            timeout=60,
            what="every task to complete",
        )
        time.sleep(1)
        assert effect_counts(store_url, names) == dict.fromkeys(names, 1)
    finally:
        if worker is not None:
            worker.stop()
        client.close()


def test_store_timeouts_shrink_the_pool_and_healthy_windows_grow_it_back(
    postgres: PostgresServer, redis_server: RedisServer
) -> None:
    """A store that answers too slowly (a lock held on the keys table, every claim runs into
    ``lock_timeout``) makes the pool shrink; once it answers again the pool grows back.

    The circuit breaker is off here: with every call timing out it would (rightly) open and
    stop the work instead. Shrinking is the answer to a store that is slow, not gone.
    """
    store_url = new_store_database(postgres, "adaptive")
    env = {
        "CG_BROKER_URL": redis_server.url_for(ADAPTIVE_BROKER_DB),
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": store_url,
        "CG_STORE_TIMEOUT": "0.5",
        "CG_CIRCUIT_ENABLED": "0",
        "CG_CIRCUIT_WINDOW": "2",
        "CG_CIRCUIT_MIN_CALLS": "2",
    }
    with redis_server.client(ADAPTIVE_BROKER_DB) as broker:
        broker.flushdb()
    client = Celery("adaptive-client", broker=env["CG_BROKER_URL"])
    tag = uuid.uuid4().hex[:8]
    names = [f"{tag}-{i}" for i in range(10)]
    worker: WorkerProcess | None = None
    locker: psycopg.Connection[Any] | None = None
    try:
        (worker,) = start_workers(1, env)  # prefork, concurrency 2
        log = worker.log_text
        wait_until(
            lambda: pool_processes(client, worker) == 2, timeout=10, what="two pool processes"
        )
        locker = psycopg.connect(store_url.replace("+psycopg", ""), autocommit=False)
        locker.execute("LOCK TABLE celery_guard_keys IN ACCESS EXCLUSIVE MODE")
        for name in names:
            client.send_task("shop.record", args=(name,))
        wait_until(lambda: "pool shrunk to 1" in log(), timeout=20, what="the pool to shrink")
        assert "timed out" in log()
        wait_until(lambda: pool_processes(client, worker) == 1, timeout=15, what="one pool process")
        time.sleep(2.5)  # another window of timeouts: one process is the floor
        assert "pool shrunk to 0" not in log()
        assert effect_counts(store_url, names) == {}

        locker.rollback()  # the store answers again
        locker.close()
        locker = None
        wait_until(lambda: "pool grown to 2" in log(), timeout=20, what="the pool to grow")
        wait_until(
            lambda: pool_processes(client, worker) == 2, timeout=15, what="two pool processes"
        )
        wait_until(
            lambda: len(effect_counts(store_url, names)) == len(names),
            timeout=40,
            what="every task to complete",
        )
        time.sleep(1)
        assert effect_counts(store_url, names) == dict.fromkeys(names, 1)
        assert log().count("pool shrunk") == 1
    finally:
        if locker is not None:
            locker.close()
        if worker is not None:
            worker.stop()
        client.close()
