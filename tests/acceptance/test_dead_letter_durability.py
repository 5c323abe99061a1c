"""Dead letters outlive a restart of the broker and of the worker."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_guard import GuardConfig
from celery_guard.deadletters import dead_letter_queue
from celery_guard.store.sql import SqlStore
from tests.acceptance.conftest import new_store_database, start_workers
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.workers


@pytest.fixture
def persistent_redis() -> Iterator[RedisServer]:
    server = RedisServer(persistent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def queued_letters(client: Celery, queue_name: str) -> list[dict[str, object]]:
    """The dead-letter queue's messages, read and put back (nothing is consumed)."""
    bodies = []
    with client.connection_for_read() as connection:
        queue = connection.SimpleQueue(dead_letter_queue(queue_name))
        messages = []
        try:
            while True:
                try:
                    messages.append(queue.get(timeout=1))
                except queue.Empty:
                    break
            bodies = [json.loads(message.body) for message in messages]
        finally:
            for message in messages:
                message.requeue()
            queue.close()
    return bodies


def test_dead_letters_survive_a_broker_and_a_worker_restart(
    postgres: PostgresServer, persistent_redis: RedisServer
) -> None:
    store_url = new_store_database(postgres, "dlq")
    env = {
        "CG_BROKER_URL": persistent_redis.url_for(0),
        "CG_RESULT_URL": persistent_redis.url_for(1),
        "CG_STORE_URL": store_url,
    }
    client = Celery("dlq-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    store = SqlStore(GuardConfig(store_url=store_url))
    (worker,) = start_workers(1, env)
    try:
        tag = uuid.uuid4().hex[:12]
        with pytest.raises(ValueError, match="has no lines"):
            client.send_task("shop.reject_order", args=(tag,)).get(timeout=60)
        (letter,) = store.dead_letters.list_dead_letters(limit=10)
        assert worker.stop() == 0
        persistent_redis.restart()
        (worker,) = start_workers(1, env)
        assert store.dead_letters.list_dead_letters(limit=10) == [letter], (
            "the table outlives everything"
        )
        record = store.keys.get(f"reject:{tag}")
        assert record is not None and record.state == "DEAD"
        found: list[list[dict[str, object]]] = []
        wait_until(
            lambda: (
                found.append(queued_letters(client, "celery_guard.dead_letters"))
                or len(found[-1]) == 1
            ),
            timeout=30,
            what="the dead letter in the restarted broker's queue",
        )
        assert found[-1][0]["id"] == letter.id and found[-1][0]["key"] == f"reject:{tag}"
    finally:
        worker.kill()
        store.dispose()
        client.close()
