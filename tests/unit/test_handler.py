"""The handler's decisions, on an in-memory store (tests/unit/memory_store.py): no database, no
broker, no Celery worker. What a delivery answers is an exception or a value; these tests read
both, and the key's row, for every branch of claim -> run -> complete / fail.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import Retry

from celery_guard import signals
from celery_guard.errors import (
    DeadLettered,
    Fenced,
    IdempotencyConflict,
    ResultNotSerializable,
    TransactionMisuse,
)
from celery_guard.execution import Execution
from celery_guard.handler import (
    Delivery,
    DeliveryDeferred,
    GuardHandler,
    RetryLater,
    TaskTerms,
)
from celery_guard.keys import KeySource
from celery_guard.lease.backends import SqlLeases
from celery_guard.lease.heartbeat import Heartbeat
from celery_guard.policy import ErrorPolicy
from celery_guard.store.base import ClaimRequest
from tests.unit.memory_store import MemoryKeyStore

LEASE_TTL = 10.0


class FakeTask:
    """What the handler needs of a task: something to send signals as."""

    name = "tests.unit.task"


@pytest.fixture
def store() -> MemoryKeyStore:
    return MemoryKeyStore()


@pytest.fixture
def handler(store: MemoryKeyStore) -> Iterator[GuardHandler]:
    leases = SqlLeases(store)  # leases in the rows, as by default: the claim takes them
    heartbeat = Heartbeat(leases, interval=3600.0)
    yield GuardHandler(
        store,
        leases,
        heartbeat,
        lease_ttl=LEASE_TTL,
        backoff_base=1.0,
        backoff_max=60.0,
        control_flow=(Retry,),
        rng=random.Random(7),
    )
    heartbeat.stop()


@pytest.fixture
def outcomes() -> Iterator[list[str]]:
    seen: list[str] = []

    def record(sender: Any = None, **event: Any) -> None:
        seen.append(event["outcome"])

    signals.outcome.connect(record, weak=False)
    yield seen
    signals.outcome.disconnect(record)


#: The Delivery options that are the task's (``TaskTerms``), not the message's.
_TERMS = frozenset(field.name for field in dataclasses.fields(TaskTerms))


def delivery(key: str = "k", fingerprint: str | None = "fp", **options: Any) -> Delivery:
    """A delivery of ``tests.unit.task``; ``options`` may name the task's terms (``classify``,
    ``max_attempts``...) or the message's fields (``deferrals``...)."""
    terms = TaskTerms(
        task_name="tests.unit.task",
        retention=3600.0,
        **{name: options.pop(name) for name in list(options) if name in _TERMS},
    )
    return Delivery(
        terms=terms,
        key=key,
        key_source=KeySource.OPTION,
        fingerprint=fingerprint,
        message='{"id": "task-1"}',
        owner="host/1",
        task_id="task-1",
        max_attempts=terms.max_attempts,  # no retries asked of Celery
        **options,
    )


def returns(value: Any) -> Any:
    def body(execution: Execution) -> Any:
        with execution.transaction() as connection:
            connection.execute(("write", execution.key, execution.fencing_token))
        return value

    return body


def raises(exc: BaseException) -> Any:
    def body(execution: Execution) -> Any:
        with execution.transaction() as connection:
            connection.execute(("write", execution.key))
            raise exc

    return body


def state(store: MemoryKeyStore, key: str = "k") -> tuple[str, int, int]:
    record = store.get(key)
    assert record is not None
    return record.state, record.attempts, record.fencing_token


def test_a_first_delivery_runs_and_commits_its_writes_with_the_marker(
    handler: GuardHandler, store: MemoryKeyStore, outcomes: list[str]
) -> None:
    assert handler.execute(FakeTask(), delivery(), returns({"n": 1})) == {"n": 1}
    assert store.committed == [("write", "k", 1)]
    assert state(store) == ("COMPLETED", 1, 1)
    assert outcomes == [signals.COMPLETED]


def test_a_duplicate_answers_the_stored_result_without_running(
    handler: GuardHandler, store: MemoryKeyStore, outcomes: list[str]
) -> None:
    handler.execute(FakeTask(), delivery(), returns([1, 2]))

    def must_not_run(execution: Execution) -> None:
        raise AssertionError("a duplicate ran its body")

    assert handler.execute(FakeTask(), delivery(), must_not_run) == [1, 2]
    assert store.committed == [("write", "k", 1)]
    assert outcomes == [signals.COMPLETED, signals.DUPLICATE_PREVENTED]
    assert store.get("k").duplicates == 1  # type: ignore[union-attr]


def test_the_same_key_with_another_payload_is_a_conflict(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    handler.execute(FakeTask(), delivery(fingerprint="a"), returns(None))
    with pytest.raises(IdempotencyConflict):
        handler.execute(FakeTask(), delivery(fingerprint="b"), returns(None))
    assert len(store.committed) == 1


def test_a_key_in_flight_elsewhere_is_deferred_within_its_lease(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    def nested_copy(execution: Execution) -> None:
        # A second delivery of the same key arrives while this one runs.
        with pytest.raises(DeliveryDeferred) as deferred:
            handler.execute(FakeTask(), delivery(), returns("copy"))
        assert 0 < deferred.value.countdown <= LEASE_TTL
        assert "in flight" in deferred.value.reason

    handler.execute(FakeTask(), delivery(), nested_copy)
    assert state(store) == ("COMPLETED", 1, 1)


def test_a_transient_error_releases_the_key_for_a_jittered_retry(
    handler: GuardHandler, store: MemoryKeyStore, outcomes: list[str]
) -> None:
    with pytest.raises(RetryLater) as later:
        handler.execute(FakeTask(), delivery(), raises(ConnectionError("refused")))
    assert 0.0 <= later.value.delay <= min(60.0, 1.0 * 2**1)
    assert isinstance(later.value.__cause__, ConnectionError)
    assert state(store)[:2] == ("RELEASED", 1)
    assert store.committed == []  # the attempt's write rolled back
    assert outcomes == [signals.RETRIED]
    # The retry claims the released key with the next token and completes.
    assert handler.execute(FakeTask(), delivery(), returns("ok")) == "ok"
    assert state(store) == ("COMPLETED", 2, 2)


def test_a_permanent_error_is_dead_lettered_at_once(
    handler: GuardHandler, store: MemoryKeyStore, outcomes: list[str]
) -> None:
    with pytest.raises(ValueError, match="no lines"):
        handler.execute(FakeTask(), delivery(), raises(ValueError("no lines")))
    assert state(store)[:2] == ("DEAD", 1)
    (letter,) = store.letters
    assert (letter.error_class, letter.error_type, letter.attempts) == (
        "permanent",
        "ValueError",
        1,
    )
    assert letter.traceback is not None and "no lines" in letter.traceback
    assert outcomes == [signals.DEAD_LETTERED]
    with pytest.raises(DeadLettered) as dead:
        handler.execute(FakeTask(), delivery(), returns(None))
    assert dead.value.failed_task_id == "task-1"


def test_a_programming_error_is_permanent_by_default(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    with pytest.raises(NameError):
        handler.execute(FakeTask(), delivery(), raises(NameError("name 'x' is not defined")))
    assert state(store)[:2] == ("DEAD", 1)


def test_transient_errors_past_the_attempt_limit_are_dead_lettered(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    for _ in range(2):
        with pytest.raises(RetryLater):
            handler.execute(FakeTask(), delivery(max_attempts=3), raises(TimeoutError()))
    with pytest.raises(TimeoutError):
        handler.execute(FakeTask(), delivery(max_attempts=3), raises(TimeoutError()))
    assert state(store)[:2] == ("DEAD", 3)
    (letter,) = store.letters
    assert "exhausted (3/3)" in letter.reason


def test_a_poison_pill_is_stopped_at_claim(handler: GuardHandler, store: MemoryKeyStore) -> None:
    """Executions that died without reporting still count: the claim counts them."""
    for _ in range(2):
        # The body "kills its process": the key stays RUNNING until its lease runs out.
        store.claim(
            ClaimRequest(
                key="k",
                task_name="tests.unit.task",
                fingerprint="fp",
                check_fingerprint=True,
                owner="host/2",
                message=None,
                lease_ttl=LEASE_TTL,
            )
        )
        store.take_over("k")
    with pytest.raises(DeadLettered, match="attempt limit"):
        handler.execute(FakeTask(), delivery(max_attempts=2), returns(None))
    (letter,) = store.letters
    assert (letter.error_class, letter.error_type, letter.attempts) == (
        "poison",
        "AttemptLimitReached",
        2,
    )
    assert store.committed == []


def test_a_store_that_does_not_answer_defers_the_delivery(
    handler: GuardHandler, store: MemoryKeyStore, outcomes: list[str]
) -> None:
    store.down = True
    with pytest.raises(DeliveryDeferred) as deferred:
        handler.execute(FakeTask(), delivery(deferrals=3), returns(None))
    assert 0 < deferred.value.countdown <= 0.5 * 2**3
    assert outcomes == [signals.STORE_UNAVAILABLE_DEFERRED]
    store.down = False
    assert store.get("k") is None


def test_a_taken_over_execution_cannot_commit(
    handler: GuardHandler, store: MemoryKeyStore, outcomes: list[str]
) -> None:
    def frozen_then_taken_over(execution: Execution) -> str:
        with execution.transaction() as connection:
            connection.execute(("stale write",))
        store.take_over("k")
        # The new owner claims and completes while this one is still in its body.
        assert handler.execute(FakeTask(), delivery(), returns("winner")) == "winner"
        return "loser"

    # The fenced execution answers with the winner's stored result, and its write is gone.
    assert handler.execute(FakeTask(), delivery(), frozen_then_taken_over) == "winner"
    assert store.committed == [("write", "k", 2)]
    assert state(store) == ("COMPLETED", 2, 2)
    assert signals.FENCED in outcomes


def test_an_unserializable_result_commits_nothing(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    with pytest.raises(ResultNotSerializable):
        handler.execute(FakeTask(), delivery(), returns(object()))
    assert store.committed == []
    assert state(store)[:2] == ("DEAD", 1)


def test_control_flow_only_releases_the_key(handler: GuardHandler, store: MemoryKeyStore) -> None:
    with pytest.raises(Retry):
        handler.execute(FakeTask(), delivery(), raises(Retry()))
    assert state(store)[:2] == ("RELEASED", 1)
    assert store.letters == []


def test_a_body_that_commits_itself_is_refused_and_dead_lettered(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    def commits(execution: Execution) -> None:
        with execution.transaction() as connection:
            connection.execute(("write",))
            connection.on_boundary("commit")  # what SQLAlchemy's commit event does

    with pytest.raises(TransactionMisuse):
        handler.execute(FakeTask(), delivery(), commits)
    assert store.committed == []
    assert state(store)[:2] == ("DEAD", 1)


def test_an_unexpected_error_while_completing_is_classified_not_orphaned(
    store: MemoryKeyStore, handler: GuardHandler
) -> None:
    original = store.commit

    def broken_commit(transaction: Any) -> None:
        raise RuntimeError("driver bug while committing")

    store.commit = broken_commit  # type: ignore[method-assign]
    with pytest.raises(RetryLater) as later:
        handler.execute(FakeTask(), delivery(), returns("x"))
    assert isinstance(later.value.__cause__, RuntimeError)
    assert state(store)[:2] == ("RELEASED", 1), "never left RUNNING for the reaper"
    store.commit = original  # type: ignore[method-assign]
    assert handler.execute(FakeTask(), delivery(), returns("x")) == "x"


def test_celery_autoretry_spent_is_dead_lettered(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    with pytest.raises(ConnectionError):
        handler.execute(
            FakeTask(),
            delivery(celery_retries_for=(ConnectionError,)),
            raises(ConnectionError("still down")),
        )
    (letter,) = store.letters
    assert "autoretry_for" in letter.reason


def test_a_task_layer_overrides_the_defaults(handler: GuardHandler, store: MemoryKeyStore) -> None:
    policy = ErrorPolicy().with_layer(transient=(NameError,))
    with pytest.raises(RetryLater):
        handler.execute(FakeTask(), delivery(classify=policy.classify), raises(NameError("x")))
    assert state(store)[:2] == ("RELEASED", 1)


def test_fenced_raised_by_the_body_never_releases(
    handler: GuardHandler, store: MemoryKeyStore
) -> None:
    def loses(execution: Execution) -> None:
        store.take_over("k")
        raise Fenced("k", execution.fencing_token or 0)

    with pytest.raises(DeliveryDeferred, match="fenced"):
        handler.execute(FakeTask(), delivery(), loses)
    assert state(store)[0] == "RUNNING", "left for its lease to end and the reaper"
