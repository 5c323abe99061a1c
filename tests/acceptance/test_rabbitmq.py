"""The self-healing scenarios on RabbitMQ (AMQP), where most production Celery runs.

AMQP differs from the Redis transport where it matters here: a consumer's unacknowledged
messages go back to the queue the moment its connection closes (a SIGKILLed worker's kernel
closes its socket), and a rejected message is requeued by the broker at once. The reaper still
re-publishes what a frozen worker holds, whose connection stays open. Whatever the path, each
scenario ends with exactly one effect.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from celery import Celery

from celery_guard import GuardConfig
from celery_guard.deadletters import dead_letter_queue
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
from tests.rig.servers import PostgresServer, RabbitMQServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

LEASE_TTL = 2.0
REAPER_INTERVAL = 0.5
RESULT_DB = 14


@dataclass
class AmqpCluster:
    env: dict[str, str]
    queue: str
    client: Celery
    store: SqlStore
    workers: list[WorkerProcess] = field(default_factory=list)

    def start(self, count: int = 1, concurrency: int = 1, **overrides: str) -> list[WorkerProcess]:
        started = start_workers(
            count, {**self.env, **overrides}, queues=self.queue, concurrency=concurrency
        )
        self.workers.extend(started)
        return started

    def send(self, name: str, *args: object, **options: object):  # type: ignore[no-untyped-def]
        return self.client.send_task(name, args=args, queue=self.queue, **options)

    def effects(self, tag: str) -> int:
        return effects_in(self.store, tag)

    def wait_running(self, key: str) -> WorkerProcess:
        return worker_running(self.workers, wait_owner(self.store, key, 60))


@pytest.fixture
def amqp(
    rabbitmq: RabbitMQServer, postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> Iterator[AmqpCluster]:
    store_url = new_store_database(postgres, "amqp")
    env = {
        "CG_BROKER_URL": rabbitmq.url,
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": store_url,
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_DEAD_LETTER_QUEUE": f"dlq-{uuid.uuid4().hex[:8]}",
        "CG_MARKER_DIR": str(tmp_path),  # the gates of shop.gated
    }
    client = Celery("amqp-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    store = SqlStore(GuardConfig(store_url=store_url))
    cluster = AmqpCluster(env, f"amqp-{uuid.uuid4().hex[:8]}", client, store)
    try:
        yield cluster
    finally:
        for worker in cluster.workers:
            worker.kill()
        store.dispose()
        client.close()


def test_a_whole_worker_sigkilled_mid_task_runs_once(amqp: AmqpCluster) -> None:
    """RabbitMQ hands the dead consumer's message to the other worker at once (its connection
    closed), unlike Redis, which keeps it for the visibility timeout. That copy finds the key
    in flight and is deferred until the reaper, seeing the owner's liveness lock gone, ends the
    lease (and re-publishes); then it takes over. Observed: recovered about 0.4 s after the
    kill.
    """
    amqp.start(2)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    # Held at its gate, the body is mid-task when its worker dies; the owner that takes the
    # key over (token 2) is let through at once.
    result = amqp.send("shop.gated", tag)
    victim = amqp.wait_running(key)
    victim.kill()
    killed_at = time.monotonic()
    open_gates(amqp.env["CG_MARKER_DIR"], tag, 2)
    value = result.get(timeout=90)
    recovered_in = time.monotonic() - killed_at
    assert value["fencing_token"] == 2
    assert recovered_in < LEASE_TTL + 30  # the lease at worst, a loaded host
    record = amqp.store.keys.get(key)
    assert record is not None
    assert (record.state, record.claim_reason, record.attempts) == ("COMPLETED", "TAKEOVER", 2)
    assert amqp.effects(tag) == 1
    # The key is COMPLETED with its one effect in the same transaction: a later copy (the
    # broker's redelivery or the reaper's re-publish, whichever did not take over) finds it so.


def test_a_frozen_worker_is_taken_over_and_its_late_commit_refused(amqp: AmqpCluster) -> None:
    """A SIGSTOPped worker keeps its AMQP connection (and the unacked message); the reaper
    re-publishes the key after its lease, the other worker completes it, and the zombie's
    commit after SIGCONT is refused.
    """
    amqp.start(2)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    gates = amqp.env["CG_MARKER_DIR"]
    # The first owner is held at its gate until it was frozen, taken over and thawed; then it
    # tries to commit late. The owner that takes over (token 2) is let through.
    result = amqp.send("shop.gated", tag)
    zombie = amqp.wait_running(key)
    zombie.freeze()
    try:
        open_gates(gates, tag, 2)
        value = result.get(timeout=90)
        assert value["fencing_token"] == 2, "completed by the worker that took over"
        assert amqp.effects(tag) == 1
    finally:
        zombie.thaw()
        open_gates(gates, tag, 1)
    wait_until(
        lambda: "completion refused (fenced)" in zombie.log_text(),
        timeout=60,
        what="the zombie's commit to be refused",
    )
    assert amqp.effects(tag) == 1
    record = amqp.store.keys.get(key)
    assert record is not None and (record.state, record.fencing_token) == ("COMPLETED", 2)


def test_a_poison_pill_is_dead_lettered_and_other_work_goes_on(amqp: AmqpCluster) -> None:
    """A body that kills its process every time: AMQP requeues it at once each time; the
    attempts counted at claim stop it at the limit, and the other tasks all complete.
    """
    (worker,) = amqp.start(1, concurrency=2, CG_MAX_ATTEMPTS="3")
    tag = uuid.uuid4().hex[:12]
    pill = amqp.send("shop.poison", tag)
    others = [amqp.send("shop.record", f"{tag}-{n}") for n in range(10)]
    assert [o.get(timeout=90)["tag"] for o in others] == [f"{tag}-{n}" for n in range(10)]
    key = f"poison:{tag}"
    wait_until(
        lambda: (amqp.store.keys.get(key) or _absent).state == "DEAD",
        timeout=120,
        what="the poison pill to be dead-lettered",
    )
    (letter,) = [
        letter
        for letter in amqp.store.dead_letters.list_dead_letters(limit=50)
        if letter.key == key
    ]
    assert letter.error_class == "poison" and letter.attempts == 3
    record = amqp.store.keys.get(key)
    assert record is not None and record.attempts == 4, "stopped at the 4th claim, unrun"
    with pytest.raises(Exception):  # noqa: B017 - WorkerLostError or DeadLettered
        pill.get(timeout=60)
    assert worker.is_alive()
    # The dead letter is in the broker's dead-letter queue too (AMQP, durable).
    with amqp.client.connection_for_read() as connection:
        queue = connection.SimpleQueue(dead_letter_queue(amqp.env["CG_DEAD_LETTER_QUEUE"]))
        try:
            message = queue.get(timeout=10)
            message.ack()
        finally:
            queue.close()
    assert key in message.body if isinstance(message.body, str) else key.encode() in message.body


class _Absent:
    state = "ABSENT"


_absent = _Absent()
