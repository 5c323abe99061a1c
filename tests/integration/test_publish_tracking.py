"""The producer's side of publish tracking, in process, against a real Redis broker and store."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery, Task
from kombu.exceptions import OperationalError

import celery_guard
from celery_guard import outbox
from celery_guard.store import SqlStore
from celery_guard.store.base import PublishRecord
from tests.apps.shop_producer import producer_app
from tests.rig.faultproxy import FaultProxy
from tests.rig.ports import free_port
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer

BROKER_DB = 14


@dataclass
class Producer:
    app: Celery
    store: SqlStore
    queue: str
    redis: RedisServer

    def send(self, name: str, *args: Any, **options: Any) -> Any:
        """``apply_async`` of the producer's own task object (what application code calls)."""
        return self.app.tasks[name].apply_async(args, queue=self.queue, **options)

    def records(self) -> dict[str, PublishRecord]:
        return {r.key: r for r in self.store.publishes.due_publishes(after=-86400, limit=1000)}

    def queued(self) -> list[dict[str, Any]]:
        """The messages waiting in the queue, oldest first (kombu's envelopes)."""
        with self.redis.client(BROKER_DB) as client:
            return [json.loads(raw) for raw in reversed(client.lrange(self.queue, 0, -1))]


def make_producer(redis: RedisServer, store_url: str, **conf: Any) -> Producer:
    app = producer_app(redis.url_for(BROKER_DB), store_url, guard_track_publishes=True, **conf)
    return Producer(
        app, celery_guard.get_runtime(app).store, f"tracked-{uuid.uuid4().hex[:8]}", redis
    )


def echo(value: Any) -> Any:
    return value


@pytest.fixture
def producer(store_url: str, redis_server: RedisServer) -> Iterator[Producer]:
    made = make_producer(redis_server, store_url)
    try:
        yield made
    finally:
        made.store.dispose()
        made.app.close()


def test_each_guarded_publish_is_recorded_under_the_key_its_worker_will_use(
    producer: Producer,
) -> None:
    tag = uuid.uuid4().hex[:8]
    by_option = producer.send("shop.record", f"{tag}-opt")
    per_call = producer.send("shop.record", f"{tag}-call", idempotency_key=f"call:{tag}")
    by_args = producer.send("shop.by_args", tag, 7)
    by_id = producer.send("shop.record_by_id", tag)
    later = producer.send("shop.record", f"{tag}-eta", countdown=120, expires=3600)
    by_name = producer.app.send_task("shop.record", args=(f"{tag}-name",), queue=producer.queue)
    producer.app.send_task("shop.not_here", args=(tag,), queue=producer.queue)
    plain = producer.app.task(name="plain.echo", base=Task, shared=False)(echo)
    plain.apply_async((tag,), queue=producer.queue)

    records = producer.records()
    by_args_key = producer.app.tasks["shop.by_args"]._key_from_option((tag, 7), {})
    expected = {
        f"record:{tag}-opt": by_option.id,
        f"call:{tag}": per_call.id,
        by_args_key: by_args.id,
        by_id.id: by_id.id,
        f"record:{tag}-eta": later.id,
        f"record:{tag}-name": by_name.id,
    }
    assert {key: r.task_id for key, r in records.items()} == expected, (
        "one record per guarded publish; none for an unknown or unguarded task"
    )
    message = json.loads(records[f"record:{tag}-opt"].message)
    assert message == {
        "task": "shop.record",
        "id": by_option.id,
        "args": [f"{tag}-opt"],
        "kwargs": {},
        "headers": {"guard_idempotency_key": f"record:{tag}-opt", "guard_key_source": "option"},
        "exchange": "",
        "routing_key": producer.queue,
        "priority": None,
    }
    assert json.loads(records[by_id.id].message)["headers"]["guard_key_source"] == "task_id"
    delayed = records[f"record:{tag}-eta"]
    assert 119 < delayed.due_at - delayed.published_at <= 120.5, "due at its countdown"
    assert delayed.expires_at is not None and delayed.expires_at - delayed.published_at > 3599
    assert json.loads(delayed.message)["expires"], "a re-published copy keeps the expiry"
    queued = {m["headers"]["id"]: m["headers"] for m in producer.queued()}
    assert len(queued) == 8, "every publish went out, tracked or not"
    # send_task by name carries the option's key like apply_async does, so the worker runs
    # it under the key its record names.
    assert queued[by_name.id]["guard_idempotency_key"] == f"record:{tag}-name"
    for key, task_id in expected.items():
        assert records[key].publisher_stamp == queued[task_id]["guard_published_at"]


def test_a_publish_the_broker_refuses_leaves_no_record(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's error means "not sent": the reaper must not send it later either."""
    caplog.set_level(logging.INFO, logger="celery_guard.outbox")
    dead_broker = RedisServer(port=free_port())  # never started: nothing listens there
    made = make_producer(
        dead_broker,
        pg_url,
        task_publish_retry=False,
        broker_transport_options={"max_retries": 0},  # fail at once, no reconnecting
    )
    try:
        with pytest.raises(OperationalError):
            made.send("shop.record", "refused")
        with pytest.raises(OperationalError):
            made.app.send_task("shop.record", args=("refused-by-name",), queue=made.queue)
        assert made.records() == {}
        # Written before the broker was reached, then deleted: not just never written.
        assert caplog.text.count("its publish failed") == 2
    finally:
        made.store.dispose()
        made.app.close()


def test_a_store_that_does_not_answer_delays_one_publish_then_they_go_out_untracked(
    postgres: PostgresServer,
    pg_url: str,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Documented choice: a publish is never refused or held for long because the store is
    down. The first publish waits out the store's timeouts, is sent untracked and pauses
    tracking; the next ones go out at once; tracking resumes when the pause ends."""
    monkeypatch.setattr(outbox, "TRACKING_PAUSE", 3.0)
    caplog.set_level(logging.INFO, logger="celery_guard.outbox")
    proxy = FaultProxy(postgres.port).start()
    through_proxy = pg_url.replace(f":{postgres.port}/", f":{proxy.port}/")
    made = make_producer(redis_server, through_proxy, guard_store_timeout=1.0)
    direct = SqlStore(celery_guard.GuardConfig(store_url=pg_url))
    try:
        made.send("shop.record", "healthy")  # a pooled connection to the store now exists
        proxy.blackhole()
        started = time.monotonic()
        first = made.send("shop.record", "first-in-outage")
        slow = time.monotonic() - started
        started = time.monotonic()
        second = made.send("shop.record", "second-in-outage")
        fast = time.monotonic() - started
        assert slow < 8.0, f"a publish waited {slow:.1f}s for the store"
        assert fast < 0.5, f"the next publish waited {fast:.1f}s: tracking was not paused"
        sent = {m["headers"]["id"] for m in made.queued()}
        assert {first.id, second.id} <= sent, "both were published"
        recorded = {r.task_id for r in direct.publishes.due_publishes(-86400, 100)}
        assert first.id not in recorded and second.id not in recorded
        assert "sent untracked" in caplog.text

        proxy.heal()
        tags = iter(range(1000))

        def tracked_again() -> bool:
            result = made.send("shop.record", f"after-{next(tags)}")
            return result.id in {r.task_id for r in direct.publishes.due_publishes(-86400, 1000)}

        wait_until(tracked_again, 30, "tracking to resume after the pause", interval=0.5)
        assert "publish tracking resumed" in caplog.text
    finally:
        direct.dispose()
        made.store.dispose()
        made.app.close()
        proxy.stop()
