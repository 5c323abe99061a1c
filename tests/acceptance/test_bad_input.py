"""Bad input a worker meets, with real worker processes, PostgreSQL and a Redis broker.

Each case ends in a clear error and loses nothing: the message waits in the broker, comes back
by itself once the cause is fixed, or is kept as a dead letter to replay. ``docs/bad-input.md``
catalogues every case and the test proving it (here and elsewhere).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import NotRegistered
from celery.result import AsyncResult
from sqlalchemy import create_engine

from celery_guard import (
    GuardConfig,
    InvalidIdempotencyKey,
    ResultTooLarge,
    UnserializableArguments,
)
from celery_guard.cli.reconcile import _decode_envelope
from celery_guard.store import SqlStore
from celery_guard.store.base import DeadLetter
from tests.acceptance.conftest import (
    effects_in,
    new_store_database,
    start_workers,
)
from tests.acceptance.test_cli import guard_ok, run_guard
from tests.apps import shop_tables
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess, stop_all

pytestmark = pytest.mark.workers

RESULT_TIMEOUT = 60


@dataclass
class Scene:
    """One queue, one store database and one dead-letter queue of its own; a plain producer."""

    env: dict[str, str]
    queue: str
    client: Celery
    store: SqlStore
    workers: list[WorkerProcess] = field(default_factory=list)

    def send(self, name: str, *args: Any, **options: Any) -> AsyncResult:
        return self.client.send_task(name, args=args, queue=self.queue, **options)

    def start_worker(self, **env: str) -> WorkerProcess:
        (worker,) = start_workers(1, {**self.env, **env}, queues=self.queue)
        self.workers.append(worker)
        return worker

    def effects(self, tag: str) -> int:
        return effects_in(self.store, tag)

    def letters(self, task_name: str) -> list[DeadLetter]:
        return self.store.dead_letters.list_dead_letters(task_name=task_name, limit=100)

    def wait_for_letter(self, task_id: str, task_name: str) -> DeadLetter:
        found: list[DeadLetter] = []

        def kept() -> bool:
            found.extend(r for r in self.letters(task_name) if r.task_id == task_id)
            return bool(found)

        wait_until(kept, RESULT_TIMEOUT, f"a dead letter for task {task_id}")
        return found[0]

    def queued_letter_ids(self) -> set[int]:
        """Ids of the letters in the broker's dead-letter queue, read without consuming."""
        client = redis.Redis.from_url(self.env["CG_BROKER_URL"])
        try:
            raws = client.lrange(self.env["CG_DEAD_LETTER_QUEUE"], 0, -1)
        finally:
            client.close()
        return {letter["id"] for raw in raws if (letter := _decode_envelope(raw)) is not None}

    def queued_messages(self) -> int:
        client = redis.Redis.from_url(self.env["CG_BROKER_URL"])
        try:
            return int(client.llen(self.queue))
        finally:
            client.close()


@pytest.fixture
def scene(postgres: PostgresServer, redis_server: RedisServer) -> Iterator[Scene]:
    name = uuid.uuid4().hex[:8]
    env = {
        "CG_BROKER_URL": redis_server.url_for(11),
        "CG_RESULT_URL": redis_server.url_for(12),
        "CG_STORE_URL": new_store_database(postgres, "badinput"),
        "CG_DEAD_LETTER_QUEUE": f"dead-{name}",
        "CG_LEASE_TTL": "5",
    }
    client = Celery("bad-input-producer", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    store = SqlStore(GuardConfig(store_url=env["CG_STORE_URL"]))
    scene = Scene(env, f"bad-{name}", client, store)
    try:
        yield scene
    finally:
        stop_all(scene.workers)
        store.dispose()
        client.close()


def test_a_task_name_the_worker_does_not_know_is_kept_and_runs_once_deployed(
    scene: Scene,
) -> None:
    old = scene.start_worker()
    tag = uuid.uuid4().hex[:12]
    result = scene.send("shop.late", tag)
    with pytest.raises(NotRegistered, match=r"shop\.late"):
        result.get(timeout=RESULT_TIMEOUT)
    # Celery discards the message; celery_guard keeps it as a dead letter, table and queue.
    letter = scene.wait_for_letter(result.id, "shop.late")
    assert (letter.error_type, letter.attempts) == ("NotRegistered", 0)
    assert letter.message is not None and json.loads(letter.message)["args"] == [tag]
    # The worker logs after the store has the letter: wait for the line, do not race it.
    kept = f"kept the message of unknown task shop.late (id {result.id})"
    wait_until(lambda: kept in old.log_text(), 10, "the worker to log the kept message")
    assert "Received unregistered task of type 'shop.late'" in old.log_text()
    assert letter.id in scene.queued_letter_ids()
    old.stop()

    scene.start_worker(CG_LATE_TASK="1")  # the task is deployed
    assert "replayed" in guard_ok("dlq", "replay", str(letter.id), env=scene.env)
    wait_until(
        lambda: scene.client.AsyncResult(result.id).state == "SUCCESS",
        RESULT_TIMEOUT,
        "the replayed task to succeed",
    )
    assert scene.client.AsyncResult(result.id).get(timeout=5) == tag
    assert "already" in guard_ok("dlq", "replay", str(letter.id), env=scene.env)
    assert scene.effects(tag) == 1


def test_missing_tables_defer_deliveries_until_migrated(
    scene: Scene, postgres: PostgresServer
) -> None:
    url = postgres.create_database(f"notables_{uuid.uuid4().hex[:8]}")
    engine = create_engine(url)
    try:
        shop_tables.metadata.create_all(engine)  # the shop's tables only, not the guard's
    finally:
        engine.dispose()
    env = {"CG_STORE_URL": url, "CG_CREATE_TABLES": "0", "CG_STORE_TIMEOUT": "1"}
    worker = scene.start_worker(**env)
    tag = uuid.uuid4().hex[:12]
    result = scene.send("shop.record", tag)
    wait_until(lambda: result.state == "RETRY", RESULT_TIMEOUT, "the delivery to be deferred")
    assert "celery_guard tables are missing" in worker.log_text()
    assert "run `celery -A <app> guard migrate`" in worker.log_text()
    assert "celery_guard tables are ready" in guard_ok("migrate", env={**scene.env, **env})
    assert result.get(timeout=RESULT_TIMEOUT) == {"tag": tag, "value": None}
    scene.store = SqlStore(GuardConfig(store_url=url))
    try:
        assert scene.effects(tag) == 1
    finally:
        scene.store.dispose()


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ({"guard_lease_ttl": "ten"}, "guard_lease_ttl must be a number of seconds, got 'ten'"),
        (
            {"guard_track_publishes": True, "guard_unclaimed_republish_after": 0},
            "guard_unclaimed_republish_after must be a finite number of seconds > 0, got 0",
        ),
    ],
    ids=["lease_ttl", "unclaimed_republish_after"],
)
def test_a_worker_with_a_wrong_config_type_refuses_to_start_and_loses_nothing(
    scene: Scene, setting: dict[str, Any], error: str
) -> None:
    tag = uuid.uuid4().hex[:12]
    result = scene.send("shop.record", tag)
    bad = WorkerProcess(
        "tests.apps.shop",
        env={**scene.env, "CG_EXTRA_CONF": json.dumps(setting)},
        queues=scene.queue,
    )
    scene.workers.append(bad)
    bad.start(wait_ready=False)
    wait_until(lambda: bad.returncode is not None, RESULT_TIMEOUT, "the worker to refuse")
    assert bad.returncode != 0
    assert f"ConfigurationError: {error}" in bad.log_text()
    assert scene.queued_messages() == 1, "the message waits in the broker"
    scene.start_worker()
    assert result.get(timeout=RESULT_TIMEOUT) == {"tag": tag, "value": None}
    assert scene.effects(tag) == 1


@pytest.mark.parametrize(
    ("bad_key", "message"),
    [("k" * 300, "at most 255"), ("order:\x00:1", "must not contain NUL")],
    ids=["too-long", "nul"],
)
def test_a_key_the_store_cannot_hold_from_a_foreign_producer_is_dead_lettered(
    scene: Scene, bad_key: str, message: str
) -> None:
    """A producer that skipped GuardedTask.apply_async's checks (send_task with a raw header)."""
    scene.start_worker()
    tag = uuid.uuid4().hex[:12]
    result = scene.send(
        "shop.record",
        tag,
        headers={"guard_idempotency_key": bad_key, "guard_key_source": "call"},
    )
    with pytest.raises(InvalidIdempotencyKey, match=message):
        result.get(timeout=RESULT_TIMEOUT)
    letter = scene.wait_for_letter(result.id, "shop.record")
    assert letter.error_type == "InvalidIdempotencyKey" and message in letter.error
    assert letter.message is not None
    kept = json.loads(letter.message)
    assert kept["args"] == [tag] and kept["headers"]["guard_idempotency_key"] == bad_key
    assert letter.id in scene.queued_letter_ids()
    assert scene.effects(tag) == 0


def test_keys_and_arguments_the_store_cannot_hold_fail_in_the_caller(
    shop: ModuleType,
) -> None:
    tag = uuid.uuid4().hex[:12]
    with pytest.raises(InvalidIdempotencyKey, match="must not contain NUL"):
        shop.record.apply_async((tag,), idempotency_key="order:\x00:1")
    with pytest.raises(InvalidIdempotencyKey, match="not valid Unicode text"):
        shop.record.apply_async((tag,), idempotency_key="order:\ud800")
    with pytest.raises(InvalidIdempotencyKey, match="must not contain NUL"):
        shop.record.delay(f"{tag}\x00")  # the key option formats it from the argument
    with pytest.raises(UnserializableArguments, match="surrogates not allowed"):
        shop.by_args.delay("\ud800", 1)


def test_arguments_that_do_not_fit_fail_in_the_caller_as_in_plain_celery(
    shop: ModuleType,
) -> None:
    """With a key option over the arguments, too: the check comes before the key."""
    plain = Celery("plain-producer", broker="memory://", set_as_current=False)
    plain_record = plain.task(name="plain.record", bind=True)(shop.record.__wrapped__)
    plain_by_args = plain.task(name="plain.by_args", bind=True)(shop.by_args.__wrapped__)
    cases = [
        (shop.record, plain_record, (), {}, "missing 1 required positional argument: 'tag'"),
        (shop.record, plain_record, ("t",), {"colour": 1}, "unexpected keyword argument 'colour'"),
        (shop.by_args, plain_by_args, ("t",), {}, "missing 1 required positional argument: 'n'"),
        (shop.by_args, plain_by_args, ("t", 1, 2), {}, "takes 3 positional arguments but 4"),
    ]
    for guarded, unguarded, args, kwargs, message in cases:
        with pytest.raises(TypeError) as expected:
            unguarded.apply_async(args, kwargs)
        with pytest.raises(TypeError) as raised:
            guarded.apply_async(args, kwargs)
        assert type(raised.value) is TypeError and message in str(raised.value)
        assert str(raised.value) == str(expected.value), "the message plain Celery gives"
        with pytest.raises(TypeError, match=message):
            guarded.apply_async(args, kwargs, idempotency_key="a-per-call-key")


def test_arguments_that_do_not_fit_from_a_foreign_producer_are_dead_lettered(
    scene: Scene,
) -> None:
    """send_task skips apply_async's check: the worker raises the TypeError and keeps the
    message (a key option needs the arguments: no key, so no execution) or dead-letters it
    after the one execution whose call raised it (a task-id key)."""
    scene.start_worker()
    tag = uuid.uuid4().hex[:12]
    missing = scene.send("shop.record")  # its key option formats {tag}
    extra = scene.send("shop.record_by_id", tag, "surplus")  # keyed by the task id
    with pytest.raises(TypeError) as raised:
        missing.get(timeout=RESULT_TIMEOUT)
    assert str(raised.value) == "record() missing 1 required positional argument: 'tag'"
    letter = scene.wait_for_letter(missing.id, "shop.record")
    assert (letter.error_class, letter.error_type, letter.attempts) == ("permanent", "TypeError", 0)
    assert letter.error == str(raised.value) and "signature" in letter.reason
    assert letter.message is not None and json.loads(letter.message)["args"] == []
    assert letter.id in scene.queued_letter_ids()

    with pytest.raises(TypeError, match=r"record_by_id\(\) takes 2 positional arguments but 3"):
        extra.get(timeout=RESULT_TIMEOUT)
    letter = scene.wait_for_letter(extra.id, "shop.record_by_id")
    assert (letter.error_class, letter.error_type, letter.attempts) == ("permanent", "TypeError", 1)
    record = scene.store.keys.get(extra.id)
    assert record is not None and (record.state, record.attempts) == ("DEAD", 1)
    assert letter.message is not None and json.loads(letter.message)["args"] == [tag, "surplus"]
    assert scene.effects(tag) == 0
    assert scene.queued_messages() == 0, "both messages were acknowledged, not left to loop"


def test_an_oversized_result_is_dead_lettered_and_replays_once_the_bound_is_raised(
    scene: Scene,
) -> None:
    small = scene.start_worker(CG_MAX_PAYLOAD_BYTES="4096")
    tag = uuid.uuid4().hex[:12]
    result = scene.send("shop.big_result", tag, 10_000)
    with pytest.raises(ResultTooLarge, match=r"more than guard_max_payload_bytes \(4096\)"):
        result.get(timeout=RESULT_TIMEOUT)
    assert scene.effects(tag) == 0, "nothing was committed"
    record = scene.store.keys.get(f"big:{tag}")
    assert record is not None and record.state == "DEAD"
    letter = scene.wait_for_letter(result.id, "shop.big_result")
    assert letter.error_class == "permanent" and letter.message is not None

    # A big message (not result) is run, but not stored with its claim.
    padded = uuid.uuid4().hex[:12]
    assert scene.send("shop.big_result", padded, 3, "p" * 10_000).get(RESULT_TIMEOUT) == "xxx"
    record = scene.store.keys.get(f"big:{padded}")
    assert record is not None and record.state == "COMPLETED" and record.message is None
    assert "does not store the" in small.log_text()

    small.stop()
    scene.start_worker(CG_MAX_PAYLOAD_BYTES="65536")
    assert "replayed" in guard_ok("dlq", "replay", str(letter.id), env=scene.env)
    wait_until(
        lambda: scene.client.AsyncResult(result.id).state == "SUCCESS",
        RESULT_TIMEOUT,
        "the replayed task to succeed",
    )
    assert scene.client.AsyncResult(result.id).get(timeout=5) == "x" * 10_000
    assert scene.effects(tag) == 1


def test_replaying_an_unknown_dead_letter_fails_in_one_line_and_changes_nothing(
    scene: Scene,
) -> None:
    completed = run_guard("dlq", "replay", "987654321", env=scene.env)
    assert completed.returncode == 1 and completed.stdout == ""
    assert completed.stderr.strip() == "Error: unknown dead letter id 987654321"
    assert scene.store.dead_letters.list_dead_letters() == []
