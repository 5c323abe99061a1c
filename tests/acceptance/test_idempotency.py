"""The foundation's promises, checked with real prefork workers, Redis and PostgreSQL."""

from __future__ import annotations

from types import ModuleType

import pytest
from celery import chain

from celery_guard import IdempotencyConflict, InvalidIdempotencyKey, UnserializableArguments
from celery_guard.keys import MAX_KEY_LENGTH
from tests.acceptance.conftest import effect_count, key_record, open_gates, wait_for_key_state
from tests.rig.procs import wait_until
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

RESULT_TIMEOUT = 60


def test_one_key_delivered_50_times_across_two_workers_runs_once(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    key = f"dup:{tag}"
    results = [
        shop.record.apply_async((tag,), {"value": 7}, idempotency_key=key) for _ in range(50)
    ]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in results]
    assert values == [{"tag": tag, "value": 7}] * 50
    assert effect_count(shop, tag) == 1
    record = key_record(shop, key)
    assert record is not None
    assert record.state == "COMPLETED"
    assert record.duplicates == 49, "every other delivery is a prevented duplicate"
    assert record.attempts == 1


def test_per_call_key_beats_the_task_option(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    first = shop.record.apply_async((tag,), idempotency_key=f"call-a:{tag}")
    second = shop.record.apply_async((tag,), idempotency_key=f"call-b:{tag}")
    assert first.get(timeout=RESULT_TIMEOUT) == second.get(timeout=RESULT_TIMEOUT)
    # Two per-call keys: both ran, although the option ("record:{tag}") would be the same.
    assert effect_count(shop, tag) == 2
    assert key_record(shop, f"record:{tag}") is None


def test_the_task_option_beats_the_task_id(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    results = [shop.record.delay(tag) for _ in range(3)]
    for result in results:
        result.get(timeout=RESULT_TIMEOUT)
    assert effect_count(shop, tag) == 1
    for result in results:
        assert key_record(shop, result.id) is None


def test_by_arguments_dedups_equal_calls_however_they_are_spelled(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    calls = [
        shop.by_args.delay(tag, 1),
        shop.by_args.apply_async(kwargs={"n": 1, "tag": tag}),
        shop.by_args.delay(tag, 2),
    ]
    assert [call.get(timeout=RESULT_TIMEOUT) for call in calls] == [1, 1, 2]
    assert effect_count(shop, tag) == 2


def test_a_task_without_arguments_sent_three_times_runs_three_times(
    shop: ModuleType, shop_workers: list[WorkerProcess]
) -> None:
    results = [shop.tick.delay() for _ in range(3)]
    assert [result.get(timeout=RESULT_TIMEOUT) for result in results] == ["tock"] * 3
    for result in results:
        assert effect_count(shop, f"tick:{result.id}") == 1
        record = key_record(shop, result.id)
        assert record is not None and record.state == "COMPLETED"


def test_the_same_message_redelivered_runs_once(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    task_id = f"redelivered-{tag}"
    for _ in range(3):
        shop.record_by_id.apply_async((tag,), task_id=task_id)

    def all_delivered() -> bool:
        record = key_record(shop, task_id)
        return record is not None and record.state == "COMPLETED" and record.duplicates == 2

    wait_until(all_delivered, RESULT_TIMEOUT, "three deliveries of one message")
    assert effect_count(shop, tag) == 1


def test_a_payload_mismatch_under_one_key_is_refused_and_changes_nothing(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    key = f"mismatch:{tag}"
    assert shop.record.apply_async((tag, 1), idempotency_key=key).get(timeout=RESULT_TIMEOUT) == {
        "tag": tag,
        "value": 1,
    }
    before = key_record(shop, key)
    conflicting = shop.record.apply_async((tag, 2), idempotency_key=key)
    with pytest.raises(IdempotencyConflict, match=key):
        conflicting.get(timeout=RESULT_TIMEOUT)
    assert key_record(shop, key) == before
    assert effect_count(shop, tag) == 1


def test_a_body_that_writes_then_raises_leaves_nothing_and_its_retry_writes_once(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    result = shop.write_then_fail.delay(tag, 2)
    assert result.get(timeout=RESULT_TIMEOUT) == 2, "ran on the third attempt"
    assert effect_count(shop, tag) == 1
    record = key_record(shop, f"wtf:{tag}")
    assert record is not None
    assert (record.state, record.attempts, record.claim_reason) == ("COMPLETED", 3, "RETRY")


def test_an_in_flight_duplicate_is_deferred_and_answers_with_the_stored_result(
    shop: ModuleType, shop_env: dict[str, str], shop_workers: list[WorkerProcess], tag: str
) -> None:
    # The first body is held at its gate until the second delivery was seen deferred (Celery
    # state RETRY): with a fixed-length body a busy machine could deliver the second only after
    # the first completed, and the test would pass without any delivery in flight.
    first = shop.gated.delay(tag)
    try:
        wait_for_key_state(shop, f"gated:{tag}", "RUNNING")
        second = shop.gated.delay(tag)
        wait_until(lambda: second.state == "RETRY", 30, "the duplicate to be deferred")
        assert effect_count(shop, tag) == 0
    finally:
        open_gates(shop_env["CG_MARKER_DIR"], tag, 1)
    answer = first.get(timeout=RESULT_TIMEOUT)
    assert answer["tag"] == tag and second.get(timeout=RESULT_TIMEOUT) == answer
    assert effect_count(shop, tag) == 1
    record = key_record(shop, f"gated:{tag}")
    assert record is not None and (record.duplicates, record.attempts) == (1, 1)


def test_task_retry_reuses_the_task_id_and_the_next_attempt_runs(
    shop: ModuleType, shop_workers: list[WorkerProcess]
) -> None:
    result = shop.retry_once.delay(21)
    assert result.get(timeout=RESULT_TIMEOUT) == 42
    record = key_record(shop, result.id)
    assert record is not None
    assert (record.state, record.attempts, record.claim_reason) == ("COMPLETED", 2, "RETRY")


def test_task_replace_reuses_the_task_id_and_the_replacement_runs(
    shop: ModuleType, shop_workers: list[WorkerProcess]
) -> None:
    result = shop.replace_with_add.delay(2)
    assert result.get(timeout=RESULT_TIMEOUT) == 102
    record = key_record(shop, result.id)
    assert record is not None
    assert (record.state, record.task_name) == ("COMPLETED", "shop.add")


def test_a_chain_whose_middle_task_replaces_itself_completes(
    shop: ModuleType, shop_workers: list[WorkerProcess]
) -> None:
    workflow = chain(shop.add.s(1, 1), shop.replace_with_add.s(), shop.add.s(10))
    assert workflow.apply_async().get(timeout=RESULT_TIMEOUT) == 112


def test_an_unserializable_result_is_refused_and_nothing_is_committed(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    with pytest.raises(Exception, match="cannot be stored as JSON"):
        shop.unserializable_result.delay(tag).get(timeout=RESULT_TIMEOUT)
    assert effect_count(shop, tag) == 0
    record = key_record(shop, f"unser:{tag}")
    assert record is not None and record.state == "DEAD", "a permanent error: dead-lettered"


def test_bad_keys_and_arguments_fail_in_the_caller_before_anything_is_sent(
    shop: ModuleType, tag: str
) -> None:
    with pytest.raises(InvalidIdempotencyKey, match="at most"):
        shop.record.apply_async((tag,), idempotency_key="k" * (MAX_KEY_LENGTH + 1))
    with pytest.raises(InvalidIdempotencyKey, match="must be a string"):
        shop.record.apply_async((tag,), idempotency_key=12345)
    with pytest.raises(UnserializableArguments, match="JSON-serializable"):
        shop.record.delay(tag, object())
