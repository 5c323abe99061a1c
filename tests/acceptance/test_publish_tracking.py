"""Publish tracking with real workers, a Redis broker and PostgreSQL.

kombu's Redis transport takes a message with BRPOP and records it as unacknowledged only
afterwards; a worker SIGKILLed in between takes the message with it, before any claim, so no
key row exists for the reaper. These tests make a message vanish the same way (removed from
the Redis list before any worker took it) and check that the reaper publishes it again from
its tracked record, that it then runs once, and that a message merely waiting in a backlog is
left alone.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

import celery_guard
from celery_guard.store import SqlStore
from celery_guard.store.base import PublishRecord
from tests.acceptance.conftest import (
    ROOT,
    SHOP_APP,
    effects_in,
    new_store_database,
    start_workers,
)
from tests.acceptance.test_cli import guard_json
from tests.apps.shop_producer import TASKS, producer_app
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess, stop_all

pytestmark = pytest.mark.workers

BROKER_DB, RESULT_DB = 15, 13
#: guard_unclaimed_republish_after in these tests (300 s by default).
DELAY = 2.0
TIMEOUT = 60


@dataclass
class Scene:
    env: dict[str, str]
    producer: Celery
    store: SqlStore
    redis: RedisServer
    queue: str
    workers: list[WorkerProcess] = field(default_factory=list)

    def send(self, tag: str, queue: str | None = None) -> AsyncResult:
        task = self.producer.tasks["shop.record"]
        return task.apply_async((tag,), queue=queue or self.queue)

    def start_worker(self) -> WorkerProcess:
        (worker,) = start_workers(1, self.env, queues=self.queue)
        self.workers.append(worker)
        return worker

    def records(self) -> dict[str, PublishRecord]:
        return {r.key: r for r in self.store.publishes.due_publishes(after=-86400, limit=1000)}

    def queued(self, queue: str | None = None) -> list[bytes]:
        with self.redis.client(BROKER_DB) as client:
            return list(client.lrange(queue or self.queue, 0, -1))

    def lose(self, task_id: str, queue: str | None = None) -> None:
        """Take a message out of the queue unseen, as a worker SIGKILLed after BRPOP does."""
        name = queue or self.queue
        with self.redis.client(BROKER_DB) as client:
            for raw in client.lrange(name, 0, -1):
                if json.loads(raw)["headers"]["id"] == task_id:
                    assert client.lrem(name, 1, raw) == 1
                    return
        raise AssertionError(f"message {task_id} is not in {name}")

    def republished(self) -> str:
        return "\n".join(
            line
            for worker in self.workers
            for line in worker.log_text().splitlines()
            if "re-published unclaimed publish" in line
        )


@pytest.fixture
def scene(postgres: PostgresServer, redis_server: RedisServer) -> Iterator[Scene]:
    env = {
        "CG_BROKER_URL": redis_server.url_for(BROKER_DB),
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": new_store_database(postgres, "tracking"),
        "CG_TRACK_PUBLISHES": "1",
        "CG_UNCLAIMED_REPUBLISH_AFTER": str(DELAY),
        "CG_REAPER_INTERVAL": "0.5",
        "CG_LEASE_TTL": "5",
    }
    producer = producer_app(
        env["CG_BROKER_URL"],
        env["CG_STORE_URL"],
        result_backend=env["CG_RESULT_URL"],
        guard_track_publishes=True,
        guard_unclaimed_republish_after=DELAY,
    )
    store = celery_guard.get_runtime(producer).store
    made = Scene(env, producer, store, redis_server, f"tracking-{uuid.uuid4().hex[:8]}")
    try:
        yield made
    finally:
        stop_all(made.workers)
        store.dispose()
        producer.close()


def test_a_message_lost_before_any_claim_is_re_published_and_runs_once(scene: Scene) -> None:
    tags = [uuid.uuid4().hex[:10] for _ in range(3)]
    results = [scene.send(tag) for tag in tags]
    assert set(scene.records()) == {f"record:{tag}" for tag in tags}
    scene.lose(results[1].id)
    assert len(scene.queued()) == 2

    status = guard_json("status", env=scene.env)
    assert status["unclaimed_publishes"]["count"] == 3
    assert status["unclaimed_publishes"]["oldest_age_seconds"] >= 0

    scene.start_worker()
    for result, tag in zip(results, tags, strict=True):
        assert result.get(timeout=TIMEOUT) == {"tag": tag, "value": None}
    # The others were still queued, then claimed: not copied. (A reaper pass landing in the
    # milliseconds between a worker's BRPOP and its claim could copy one, harmlessly: the
    # effect counts below would still be 1.)
    assert f"key=record:{tags[1]} " in scene.republished()
    wait_until(lambda: scene.records() == {}, TIMEOUT, "every record to be forgotten")
    assert [effects_in(scene.store, tag) for tag in tags] == [1, 1, 1]
    assert guard_json("status", env=scene.env)["unclaimed_publishes"] == {
        "count": 0,
        "oldest_age_seconds": None,
    }


def test_a_message_waiting_in_a_backlog_is_not_re_published(scene: Scene) -> None:
    """On a Redis broker the reaper re-publishes only once the queue has moved past the
    message: its oldest waiting message is newer, or it is empty."""
    scene.start_worker()  # consumes its own queue and runs the reaper; nobody consumes this one
    backlog = f"backlog-{uuid.uuid4().hex[:8]}"
    waiting = scene.send(uuid.uuid4().hex[:10], queue=backlog)
    key = next(iter(scene.records()))

    def looked_at_twice() -> bool:
        record = scene.records()[key]
        return record.waiting_since - record.due_at >= 2 * DELAY - 0.5

    wait_until(looked_at_twice, TIMEOUT, "the reaper to find the message still queued, twice")
    record = scene.records()[key]
    assert (record.republishes, record.republished_at) == (0, None)
    assert len(scene.queued(backlog)) == 1 and scene.republished() == ""

    # The queue moves past it: a newer message is now the oldest waiting, and the first one
    # is gone unseen. Only then is it published again.
    newer = scene.send(uuid.uuid4().hex[:10], queue=backlog)
    scene.lose(waiting.id, queue=backlog)
    wait_until(  # the record is marked just before the copy is sent: wait for both
        lambda: scene.records()[key].republishes == 1 and len(scene.queued(backlog)) == 2,
        TIMEOUT,
        "the lost message's re-publish",
    )
    copies = [json.loads(raw)["headers"]["id"] for raw in scene.queued(backlog)]
    assert sorted(copies) == sorted([newer.id, waiting.id]), "one copy, same task id"
    assert f"key={key} " in scene.republished()


def test_revoked_and_unknown_messages_are_forgotten_not_re_published(scene: Scene) -> None:
    """No claim will ever come for them; the reaper would otherwise send them again and again."""
    worker = scene.start_worker()

    @scene.producer.task(name="shop.only_in_producer", shared=False, bind=True)
    def only_in_producer(self: Any, tag: str) -> str:
        return tag

    unknown = only_in_producer.apply_async(("x",), queue=scene.queue)
    revoked_id = str(uuid.uuid4())
    # From another process: Celery's remote control leaves after-fork hooks in this one that
    # hang a later multiprocessing fork (tests/integration/test_store.py forks).
    revoke = subprocess.run(
        [sys.executable, "-m", "celery", "-A", SHOP_APP, "control", "revoke", revoked_id],
        cwd=ROOT,
        env={**os.environ, **scene.env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert revoke.returncode == 0, revoke.stderr
    wait_until(
        lambda: f"Tasks flagged as revoked: {revoked_id}" in worker.log_text(),
        TIMEOUT,
        "the revoke to reach the worker",
    )
    tag = uuid.uuid4().hex[:10]
    scene.producer.tasks["shop.record"].apply_async((tag,), queue=scene.queue, task_id=revoked_id)
    wait_until(lambda: scene.records() == {}, TIMEOUT, "both records to be forgotten")
    log = worker.log_text()
    assert f"id={unknown.id}: unknown task" in log and f"id={revoked_id}: revoked" in log
    assert [letter.task_id for letter in scene.store.dead_letters.list_dead_letters()] == [
        unknown.id
    ]
    assert effects_in(scene.store, tag) == 0 and scene.republished() == ""


def test_the_producer_declares_the_shop_tasks_as_the_workers_run_them(shop: ModuleType) -> None:
    """tests/apps/shop_producer.py repeats names, signatures and key options: kept in step."""
    for name, function, key in TASKS:
        theirs = shop.app.tasks[name]
        assert type(theirs).idempotency_key == key, name
        assert parameters(function) == parameters(type(theirs).run), name


def parameters(function: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]
