"""The reaper holder's broker sampling on a real Redis and a real RabbitMQ.

A queue with nothing in it must read depth 0: kombu's Redis transport answers a passive declare
of an empty queue with 404 (Redis deletes an empty list), and RabbitMQ does the same for a queue
no worker has declared yet. Either used to end the pass early, drop the depth series of the
drained queue and every queue after it, and reconnect to the broker on the next pass.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_guard import GuardConfig
from celery_guard.messages import PUBLISHED_AT_HEADER
from celery_guard.sampling import Sampler
from celery_guard.store.sql import SqlStore
from tests.rig.servers import RabbitMQServer, RedisServer


def broker_app(url: str) -> Celery:
    app = Celery(f"sampling-{uuid.uuid4().hex[:8]}", broker=url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = False
    return app


def publish(app: Celery, queue: str, count: int, published_at: float | None = None) -> None:
    headers = {} if published_at is None else {PUBLISHED_AT_HEADER: published_at}
    with app.producer_or_acquire() as producer:
        for number in range(count):
            app.send_task(
                "sampling.noop", args=(number,), queue=queue, headers=headers, producer=producer
            )


def drain(app: Celery, queue: str, count: int) -> None:
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue)
        try:
            for _ in range(count):
                simple.get(timeout=5).ack()
        finally:
            simple.close()


@pytest.fixture
def redis_app(redis_server: RedisServer) -> Iterator[Celery]:
    app = broker_app(redis_server.url_for(14))
    yield app
    app.close()


@pytest.fixture
def rabbit_app(rabbitmq: RabbitMQServer) -> Iterator[Celery]:
    app = broker_app(rabbitmq.url)
    yield app
    app.close()


def queue_names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"empty-{tag}", f"busy-{tag}"


def test_redis_empty_queue_reads_zero_and_later_queues_are_still_read(
    redis_app: Celery, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    empty, busy = queue_names()
    publish(redis_app, busy, 3, published_at=time.time())
    store = SqlStore(GuardConfig(store_url=sqlite_url))
    sampler = Sampler(redis_app, store, queues=[empty, busy])
    try:
        with caplog.at_level(logging.INFO, logger="celery_guard.sampling"):
            # Sampled "30 s later": the age is the sampling time minus the oldest stamp (this
            # test's header, or celery_guard's publish hook's if an installed app stamped it).
            first = sampler.queue_stats(time.time() + 30)
            connection = sampler._connection
            drain(redis_app, busy, 3)
            second = sampler.queue_stats(time.time())
        assert first[empty] == (0, None)
        depth, age = first[busy]
        assert depth == 3
        assert age is not None and 29 <= age <= 120
        # Drained: the series reads 0 rather than disappearing.
        assert second == {empty: (0, None), busy: (0, None)}
        assert sampler._connection is connection, "the sampler reconnected after an empty queue"
        assert caplog.records == []
    finally:
        sampler.close()
        store.dispose()


def test_rabbitmq_missing_queue_reads_zero_once_logged_and_the_channel_recovers(
    rabbit_app: Celery, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    missing, busy = queue_names()
    publish(rabbit_app, busy, 2)
    store = SqlStore(GuardConfig(store_url=sqlite_url))
    store.ensure_schema()
    sampler = Sampler(rabbit_app, store, queues=[missing, busy])
    try:
        with caplog.at_level(logging.INFO, logger="celery_guard.sampling"):
            passes = [sampler.sample() for _ in range(3)]
        for sample in passes:
            assert sample.keys_by_state == {}
            assert sample.queues == {missing: (0, None), busy: (2, None)}
        notes = [record.getMessage() for record in caplog.records]
        assert notes == [f"celery_guard sampling: queue {missing!r} does not exist (yet)"]
    finally:
        sampler.close()
        store.dispose()
        with rabbit_app.connection_for_write() as connection:
            connection.default_channel.queue_delete(busy)
