"""Classification, full-jitter retries, poison pills and dead letters with real workers."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import select

import celery_guard
from celery_guard import DeadLettered
from celery_guard.deadletters import dead_letter_queue
from tests.acceptance.conftest import effect_count, key_record, start_workers
from tests.rig.procs import wait_until
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

RESULT_TIMEOUT = 60


def dead_letters_for(shop: ModuleType, key: str) -> list[celery_guard.store.DeadLetter]:
    store = celery_guard.get_runtime(shop.app).store
    return [
        letter for letter in store.dead_letters.list_dead_letters(limit=500) if letter.key == key
    ]


def drain_dead_letter_queue(shop: ModuleType, queue_name: str) -> list[dict[str, object]]:
    """Everything in the broker's dead-letter queue (consumed: each test uses its own keys)."""
    bodies = []
    with shop.app.connection_for_read() as connection:
        queue = connection.SimpleQueue(dead_letter_queue(queue_name), no_ack=True)
        try:
            while True:
                try:
                    message = queue.get(timeout=1)
                except queue.Empty:
                    break
                bodies.append(json.loads(message.body))
        finally:
            queue.close()
    return bodies


def test_a_transient_failure_is_retried_with_full_jitter_until_it_succeeds(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    assert shop.flaky.delay(tag, 3).get(timeout=RESULT_TIMEOUT) == 4
    assert effect_count(shop, tag) == 1, "the three failed attempts rolled back their writes"
    record = key_record(shop, f"flaky:{tag}")
    assert record is not None and (record.state, record.attempts) == ("COMPLETED", 4)
    with celery_guard.get_runtime(shop.app).store.engine.connect() as connection:
        retries = connection.execute(
            select(shop.retry_log.c.attempt, shop.retry_log.c.delay)
            .where(shop.retry_log.c.idempotency_key == f"flaky:{tag}")
            .order_by(shop.retry_log.c.attempt)
        ).all()
    assert [attempt for attempt, _ in retries] == [1, 2, 3]
    base, cap = 0.05, 1.0  # the shop's guard_backoff_base and guard_backoff_max
    for attempt, delay in retries:
        assert 0.0 <= delay <= min(cap, base * 2**attempt)


def test_a_permanent_error_is_dead_lettered_after_one_attempt(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    with pytest.raises(ValueError, match="has no lines"):
        shop.reject_order.delay(tag).get(timeout=RESULT_TIMEOUT)
    key = f"reject:{tag}"
    record = key_record(shop, key)
    assert record is not None and (record.state, record.attempts) == ("DEAD", 1)
    assert effect_count(shop, tag) == 0
    (letter,) = dead_letters_for(shop, key)
    assert (letter.error_class, letter.error_type, letter.attempts) == (
        "permanent",
        "ValueError",
        1,
    )
    assert letter.traceback is not None and "raise ValueError" in letter.traceback
    assert letter.message is not None and json.loads(letter.message)["args"] == [tag]
    queued = [
        body
        for body in drain_dead_letter_queue(shop, "celery_guard.dead_letters")
        if body["key"] == key
    ]
    assert len(queued) == 1 and queued[0]["id"] == letter.id
    assert "raise ValueError" in str(queued[0]["traceback"])
    # A later delivery of the dead key does not run it, and its failure is logged as the
    # expected outcome it is: one INFO line, no ERROR traceback.
    later = shop.reject_order.delay(tag)
    with pytest.raises(DeadLettered):
        later.get(timeout=RESULT_TIMEOUT)
    expected = f"shop.reject_order[{later.id}] raised expected: DeadLettered"
    wait_until(
        lambda: any(expected in worker.log_text() for worker in shop_workers),
        timeout=10,
        what="the worker to log the dead key's copy",
    )
    assert not any(
        f"[{later.id}] raised unexpected" in worker.log_text() for worker in shop_workers
    )


def test_a_programming_error_is_dead_lettered_after_one_execution(
    shop: ModuleType, shop_workers: list[WorkerProcess], shop_env: dict[str, str], tag: str
) -> None:
    with pytest.raises(NameError, match="undefined_helper"):
        shop.buggy.delay(tag).get(timeout=RESULT_TIMEOUT)
    key = f"buggy:{tag}"
    record = key_record(shop, key)
    assert record is not None and (record.state, record.attempts) == ("DEAD", 1)
    runs = (Path(shop_env["CG_MARKER_DIR"]) / f"{tag}.runs").read_text().split()
    assert runs == ["1"], "one execution: retrying cannot fix a bug"
    assert effect_count(shop, tag) == 0
    (letter,) = dead_letters_for(shop, key)
    assert (letter.error_class, letter.error_type, letter.attempts, letter.reason) == (
        "permanent",
        "NameError",
        1,
        "permanent error",
    )
    assert letter.message is not None and json.loads(letter.message)["args"] == [tag]


def test_transient_failures_past_the_attempt_limit_are_dead_lettered(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    with pytest.raises(ConnectionError):
        shop.flaky.delay(tag, 99).get(timeout=RESULT_TIMEOUT)
    record = key_record(shop, f"flaky:{tag}")
    assert record is not None and (record.state, record.attempts) == ("DEAD", 5)
    (letter,) = dead_letters_for(shop, f"flaky:{tag}")
    assert letter.error_class == "transient" and "exhausted" in letter.reason
    assert effect_count(shop, tag) == 0


def test_a_poison_pill_is_dead_lettered_without_stopping_other_work(
    shop: ModuleType, shop_env: dict[str, str], tag: str
) -> None:
    queue = f"poison-{tag}"
    workers = start_workers(
        1,
        {**shop_env, "CG_LEASE_TTL": "2", "CG_REAPER_INTERVAL": "0.5", "CG_MAX_ATTEMPTS": "3"},
        queues=queue,
        concurrency=2,
    )
    try:
        pill = shop.poison.apply_async((tag,), queue=queue)
        others = [shop.record.apply_async((f"{tag}-{n}",), queue=queue) for n in range(20)]
        assert [o.get(timeout=RESULT_TIMEOUT)["tag"] for o in others] == [
            f"{tag}-{n}" for n in range(20)
        ]
        key = f"poison:{tag}"
        wait_until(
            lambda: (key_record(shop, key) or record_placeholder).state == "DEAD",
            timeout=90,
            what="the poison pill to be dead-lettered",
        )
        (letter,) = dead_letters_for(shop, key)
        assert letter.error_class == "poison" and letter.attempts == 3
        record = key_record(shop, key)
        assert record is not None and record.attempts == 4, "stopped at the 4th claim, unrun"
        with pytest.raises(Exception):  # noqa: B017 - WorkerLostError or DeadLettered
            pill.get(timeout=RESULT_TIMEOUT)
        assert all(worker.is_alive() for worker in workers)
    finally:
        for worker in workers:
            worker.kill()


class _Placeholder:
    state = "ABSENT"


record_placeholder = _Placeholder()
