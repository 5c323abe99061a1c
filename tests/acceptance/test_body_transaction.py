"""Whatever a body does with its transaction, a key gets at most one committed effect.

Real workers (tests/apps/shop.py ``shop.transaction_habit``), PostgreSQL and Redis. Each habit's
key is published several times: it ends COMPLETED with one effect, or dead-lettered after one
execution with an error that says what to do — never RUNNING, and never re-run by the reaper as
an orphan. The same patterns on both stores, in one process:
tests/integration/test_body_transaction.py.
"""

from __future__ import annotations

from types import ModuleType

import pytest

import celery_guard
from tests.acceptance.conftest import effect_count, wait_for_key_state
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

COPIES = 3
RESULT_TIMEOUT = 60


def publish_copies(shop: ModuleType, tag: str, habit: str) -> list[object]:
    return [shop.transaction_habit.delay(tag, habit) for _ in range(COPIES)]


@pytest.mark.parametrize(
    "habit",
    ["commit", "close", "rollback_then_write", "session_control_fully", "session_rollback"],
)
def test_ending_the_guards_transaction_is_refused_and_nothing_commits(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str, habit: str
) -> None:
    results = publish_copies(shop, tag, habit)
    record = wait_for_key_state(shop, f"habit:{tag}", "DEAD", timeout=RESULT_TIMEOUT)
    for result in results:
        with pytest.raises(celery_guard.GuardError):  # the misuse, or DeadLettered for a copy
            result.get(timeout=RESULT_TIMEOUT)  # type: ignore[attr-defined]
    assert record.attempts == 1, "a programming error is not retried"
    assert effect_count(shop, tag) == 0
    store = celery_guard.get_runtime(shop.app).store
    (letter,) = [
        d for d in store.dead_letters.list_dead_letters(limit=1000) if d.key == f"habit:{tag}"
    ]
    assert (letter.error_type, letter.error_class, letter.attempts) == (
        "TransactionMisuse",
        "permanent",
        1,
    )
    assert "not allowed" in letter.error


@pytest.mark.parametrize("habit", ["nested", "guard_session"])
def test_savepoints_and_the_guard_session_commit_once(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str, habit: str
) -> None:
    results = publish_copies(shop, tag, habit)
    assert [r.get(timeout=RESULT_TIMEOUT) for r in results] == [habit] * COPIES  # type: ignore[attr-defined]
    record = wait_for_key_state(shop, f"habit:{tag}", "COMPLETED")
    assert record.attempts == 1
    assert effect_count(shop, tag) == 1


def test_an_error_while_completing_fails_the_key_with_the_real_error(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    """An unexpected error at completion is classified like one from the body (here: not
    declared, so transient, retried up to the task's max_attempts=2), never left RUNNING for
    the reaper to re-run as an orphan."""
    results = publish_copies(shop, tag, "invalidate")
    record = wait_for_key_state(shop, f"habit:{tag}", "DEAD", timeout=RESULT_TIMEOUT)
    for result in results:
        with pytest.raises(Exception):  # noqa: B017 - the copies see the error or DeadLettered
            result.get(timeout=RESULT_TIMEOUT)  # type: ignore[attr-defined]
    assert record.attempts == 2
    assert effect_count(shop, tag) == 0
    store = celery_guard.get_runtime(shop.app).store
    (letter,) = [
        d for d in store.dead_letters.list_dead_letters(limit=1000) if d.key == f"habit:{tag}"
    ]
    assert letter.error_type not in ("AttemptLimitReached", "TransactionMisuse")
    assert "exhausted" in letter.reason and letter.error_class == "transient"
