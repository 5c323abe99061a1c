"""GuardedTask in the test process: option checks at definition, eager and direct calls."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, Table, func, insert, select

import celery_guard
from celery_guard import (
    ConfigurationError,
    DeadLettered,
    GuardedTask,
    GuardError,
    InFlightElsewhere,
    ResultNotSerializable,
    ResultTooLarge,
)

tables = MetaData()
rows = Table("rows", tables, Column("id", Integer, primary_key=True))


@pytest.fixture
def app(sqlite_url: str) -> Iterator[Celery]:
    celery_app = Celery("inprocess", broker="memory://", set_as_current=False)
    celery_app.conf.update(
        guard_store_url=sqlite_url, task_always_eager=True, task_eager_propagates=True
    )
    runtime = celery_guard.install(celery_app)
    tables.create_all(runtime.store.engine)
    try:
        yield celery_app
    finally:
        runtime.store.dispose()


def row_count(app: Celery) -> int:
    with celery_guard.get_runtime(app).store.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(rows)).scalar_one())


def test_unknown_guard_options_fail_when_the_task_is_defined(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="unknown celery_guard option 'idempotency_tll'"):

        @app.task(base=GuardedTask, idempotency_tll=5, shared=False)
        def typo() -> None: ...

        typo.run  # noqa: B018 - tasks are created lazily; touching one creates it


def test_bad_option_values_fail_when_the_task_is_defined(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="idempotency_ttl"):

        @app.task(base=GuardedTask, idempotency_ttl="a day", shared=False)
        def bad_ttl() -> None: ...

        bad_ttl.run  # noqa: B018
    with pytest.raises(ConfigurationError, match="idempotency_key"):

        @app.task(base=GuardedTask, idempotency_key=42, shared=False)
        def bad_key() -> None: ...

        bad_key.run  # noqa: B018


def test_dead_lettered_is_an_expected_failure_whatever_the_task_declares(app: Celery) -> None:
    """Celery logs an expected failure at INFO, without a traceback (get_log_policy)."""

    @app.task(base=GuardedTask, shared=False)
    def plain() -> None: ...

    @app.task(base=GuardedTask, throws=(KeyError,), shared=False)
    def own() -> None: ...

    @app.task(base=GuardedTask, throws=(Exception,), shared=False)
    def broad() -> None: ...

    assert plain.throws == (DeadLettered,)
    assert own.throws == (KeyError, DeadLettered)
    assert broad.throws == (Exception,)


def test_a_callable_key_option_gets_the_task_arguments_not_the_task(app: Celery) -> None:
    @app.task(base=GuardedTask, bind=True, idempotency_key=lambda n: f"n:{n}", shared=False)
    def keyed(self: Any, n: int) -> str:
        return str(self.guard.key)

    assert keyed.delay(3).get() == "n:3"


def test_eager_calls_are_guarded_and_direct_calls_commit_their_transaction(app: Celery) -> None:
    @app.task(base=GuardedTask, bind=True, idempotency_key="row:{n}", shared=False)
    def write(self: Any, n: int) -> int:
        with self.guard.transaction() as connection:
            connection.execute(insert(rows).values(id=n))
        return n

    assert write.delay(1).get() == 1
    assert write.delay(1).get() == 1
    assert row_count(app) == 1
    assert write(2) == 2, "a direct call runs the body, unguarded"
    assert row_count(app) == 2


def test_guard_outside_a_running_body_is_a_clear_error(app: Celery) -> None:
    @app.task(base=GuardedTask, shared=False)
    def plain() -> None: ...

    with pytest.raises(GuardError, match="only while the task body runs"):
        plain.guard  # noqa: B018


def test_an_unserializable_result_commits_nothing(app: Celery) -> None:
    @app.task(base=GuardedTask, bind=True, idempotency_key="bad:{n}", shared=False)
    def returns_object(self: Any, n: int) -> object:
        with self.guard.transaction() as connection:
            connection.execute(insert(rows).values(id=n))
        return object()

    with pytest.raises(ResultNotSerializable, match="cannot be stored as JSON"):
        returns_object.delay(9)
    assert row_count(app) == 0


def test_an_eager_call_meeting_a_live_lease_says_so(app: Celery) -> None:
    entered, release = threading.Event(), threading.Event()

    @app.task(base=GuardedTask, bind=True, idempotency_key="hold", shared=False)
    def hold(self: Any) -> str:
        entered.set()
        release.wait(timeout=30)
        return "held"

    holder = threading.Thread(target=hold.delay)
    holder.start()
    try:
        assert entered.wait(timeout=30)
        with pytest.raises(InFlightElsewhere, match="'hold'"):
            hold.delay()
    finally:
        release.set()
        holder.join(timeout=30)


def test_a_result_above_the_payload_bound_commits_nothing(sqlite_url: str) -> None:
    bounded = Celery("bounded", broker="memory://", set_as_current=False)
    bounded.conf.update(
        guard_store_url=sqlite_url,
        guard_max_payload_bytes=1024,
        task_always_eager=True,
        task_eager_propagates=True,
    )
    runtime = celery_guard.install(bounded)
    tables.create_all(runtime.store.engine)
    try:

        @bounded.task(base=GuardedTask, bind=True, idempotency_key="big:{n}", shared=False)
        def big(self: Any, n: int) -> str:
            with self.guard.transaction() as connection:
                connection.execute(insert(rows).values(id=n))
            return "x" * n

        assert big.delay(1022).get() == "x" * 1022, "1024 bytes of JSON: at the bound"
        with pytest.raises(ResultTooLarge, match=r"1025 bytes of JSON, more than .* \(1024\)"):
            big.delay(1023)
        assert row_count(bounded) == 1
        record = runtime.store.keys.get("big:1023")
        assert record is not None and record.state == "DEAD"
    finally:
        runtime.store.dispose()


def test_only_a_first_delivery_claims_its_key_as_likely_new(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry or a deferral is a message for a key claimed before: its claim goes to the
    store's upsert at once (``ClaimRequest.likely_new``); a first delivery tries the insert."""
    store = celery_guard.get_runtime(app).handler.store
    seen: list[bool] = []
    real_claim = store.claim

    def recording_claim(request: Any) -> Any:
        seen.append(request.likely_new)
        return real_claim(request)

    monkeypatch.setattr(store, "claim", recording_claim)

    @app.task(base=GuardedTask, idempotency_key="hint:{n}", shared=False)
    def hinted(n: int) -> int:
        return n

    assert hinted.apply((1,)).get() == 1
    assert hinted.apply((2,), retries=1).get() == 2
    assert hinted.apply((3,), headers={"guard_deferrals": 1}).get() == 3
    assert seen == [True, False, False]
