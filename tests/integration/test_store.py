"""The store's transitions, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import Column, Integer, MetaData, Table, event, insert, select, text
from sqlalchemy.engine import make_url

from celery_guard import Fenced, GuardConfig, StoreError, StoreUnavailable
from celery_guard.store import ClaimOutcome, ClaimRequest, KeyState, SqlStore
from tests.rig.ports import free_port
from tests.rig.procs import wait_until

effects_metadata = MetaData()
effects = Table("store_effects", effects_metadata, Column("id", Integer, primary_key=True))


def request(key: str = "k", fingerprint: str | None = "fp-a", **overrides: Any) -> ClaimRequest:
    values: dict[str, Any] = {
        "key": key,
        "task_name": "tests.task",
        "fingerprint": fingerprint,
        "check_fingerprint": True,
        "owner": "w1/1",
        "message": '{"task": "tests.task"}',
        "lease_ttl": 30.0,
    }
    values.update(overrides)
    return ClaimRequest(**values)


def test_first_claim_owns_the_key(store: SqlStore) -> None:
    claim = store.keys.claim(request())
    assert claim.outcome is ClaimOutcome.CLAIMED
    record = claim.record
    assert (record.state, record.attempts, record.fencing_token) == ("RUNNING", 1, 1)
    assert record.claim_reason == "NEW"
    assert 29.0 < claim.lease_remaining <= 30.0


def test_a_live_lease_is_in_flight_for_everyone_else(store: SqlStore) -> None:
    store.keys.claim(request())
    second = store.keys.claim(request(owner="w2/2"))
    assert second.outcome is ClaimOutcome.IN_FLIGHT
    assert second.record.owner == "w1/1"
    assert second.record.fencing_token == 1
    assert 0 < second.lease_remaining <= 30.0


def test_completed_key_answers_with_its_result_and_counts_duplicates(store: SqlStore) -> None:
    token = store.keys.claim(request()).record.fencing_token
    store.keys.complete("k", token, '{"charged": 10}', retention=60.0)
    for expected_duplicates in (1, 2, 3):
        replay = store.keys.claim(request(owner="w2/2"))
        assert replay.outcome is ClaimOutcome.DUPLICATE
        assert replay.record.result == '{"charged": 10}'
        assert replay.record.duplicates == expected_duplicates
    record = store.keys.get("k")
    assert record is not None and record.state == KeyState.COMPLETED.value
    assert record.attempts == 1 and record.fencing_token == 1


@pytest.mark.parametrize("complete_first", [False, True])
def test_a_different_payload_under_one_key_conflicts_and_changes_nothing(
    store: SqlStore, complete_first: bool
) -> None:
    token = store.keys.claim(request()).record.fencing_token
    if complete_first:
        store.keys.complete("k", token, "1", retention=60.0)
    before = store.keys.get("k")
    conflict = store.keys.claim(request(fingerprint="fp-b", owner="w2/2"))
    assert conflict.outcome is ClaimOutcome.CONFLICT
    assert store.keys.get("k") == before


def test_task_id_keys_accept_a_new_payload_after_release(store: SqlStore) -> None:
    """Task.replace() reuses the task id with another task: it must be able to claim."""
    token = store.keys.claim(request(check_fingerprint=False)).record.fencing_token
    assert store.keys.release("k", token, "Ignore: replaced")
    successor = store.keys.claim(request(fingerprint="fp-b", check_fingerprint=False))
    assert successor.outcome is ClaimOutcome.CLAIMED
    assert successor.record.fingerprint == "fp-b"


def test_a_new_keys_claim_answers_with_the_row_as_stored(store: SqlStore) -> None:
    """On PostgreSQL a new key's claim is the insert-only statement, and its record is built
    from the request and the returned columns: it must be the row the database holds."""
    claim = store.keys.claim(request(owner_lock=7))
    stored = store.keys.get("k")
    assert stored is not None and stored.message == '{"task": "tests.task"}'
    # The claim reads the stored message back only for a DEAD key.
    assert claim.record == dataclasses.replace(stored, message=None)


@pytest.mark.parametrize("likely_new", [True, False], ids=["thought-new", "thought-existing"])
def test_a_claim_answers_alike_whether_or_not_its_key_was_thought_new(
    store: SqlStore, likely_new: bool
) -> None:
    """``likely_new`` picks the statements, never the outcome: every kind of existing row
    answers as the upsert decides, and a new key is claimed either way."""
    keys = store.keys

    def claim(key: str, **overrides: Any) -> Any:
        return keys.claim(request(key, likely_new=likely_new, **overrides))

    first = claim("k")
    assert (first.outcome, first.record.fencing_token, first.record.claim_reason) == (
        ClaimOutcome.CLAIMED,
        1,
        "NEW",
    )
    in_flight = claim("k", owner="w2/2")
    assert (in_flight.outcome, in_flight.record.owner) == (ClaimOutcome.IN_FLIGHT, "w1/1")
    conflict = claim("k", fingerprint="fp-other")
    assert conflict.outcome is ClaimOutcome.CONFLICT
    assert keys.release("k", first.record.fencing_token, "ValueError: boom")
    retry = claim("k")
    assert (retry.outcome, retry.record.fencing_token, retry.record.claim_reason) == (
        ClaimOutcome.CLAIMED,
        2,
        "RETRY",
    )
    keys.complete("k", retry.record.fencing_token, '{"n": 1}', retention=60.0)
    duplicate = claim("k", owner="w2/2")
    assert (duplicate.outcome, duplicate.record.result) == (ClaimOutcome.DUPLICATE, '{"n": 1}')
    assert duplicate.record.duplicates == 1
    expired = keys.claim(request("gone", likely_new=likely_new, lease_ttl=0.0))
    assert expired.outcome is ClaimOutcome.CLAIMED
    takeover = claim("gone", owner="w2/2")
    assert (takeover.outcome, takeover.record.claim_reason) == (ClaimOutcome.CLAIMED, "TAKEOVER")
    assert takeover.record.fencing_token == expired.record.fencing_token + 1


def test_release_lets_the_next_delivery_retry_with_a_newer_token(store: SqlStore) -> None:
    token = store.keys.claim(request()).record.fencing_token
    assert store.keys.release("k", token, "ValueError: boom")
    released = store.keys.get("k")
    assert released is not None and released.state == "RELEASED"
    assert released.last_error == "ValueError: boom"
    retry = store.keys.claim(request())
    assert retry.outcome is ClaimOutcome.CLAIMED
    assert (retry.record.attempts, retry.record.fencing_token) == (2, 2)
    assert retry.record.claim_reason == "RETRY"
    assert not store.keys.release("k", token, "stale owner"), "an old token cannot release"


def test_each_claim_stores_its_own_message_and_a_same_message_retry_keeps_the_stored_one(
    store: SqlStore,
) -> None:
    first = '{"task": "tests.task", "id": "a"}'
    token = store.keys.claim(request(message=first)).record.fencing_token
    store.keys.release("k", token, "boom")
    token = store.keys.claim(request(message=first)).record.fencing_token
    assert (stored := store.keys.get("k")) is not None and stored.message == first
    store.keys.release("k", token, "boom")
    # Another delivery of the key (another task id, or its place in a workflow): its message.
    second = '{"task": "tests.task", "id": "b", "workflow": {"link": []}}'
    token = store.keys.claim(request(message=second)).record.fencing_token
    assert (stored := store.keys.get("k")) is not None and stored.message == second
    store.keys.release("k", token, "boom")
    store.keys.claim(request(message=None))  # above guard_max_payload_bytes: none stored
    assert (stored := store.keys.get("k")) is not None and stored.message is None


def test_a_same_message_retry_writes_no_new_copy_of_a_large_message(pg_url: str) -> None:
    store = SqlStore(GuardConfig(store_url=pg_url))
    store.ensure_schema()
    key = f"toast-{free_port()}"
    # Random, so it does not compress into the row: stored out of line (TOAST).
    message = '{"args": ["' + os.urandom(40_000).hex() + '"]}'
    size = text(
        "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE relname = 'celery_guard_keys'"
    )
    try:
        token = store.keys.claim(request(key, message=message)).record.fencing_token
        store.keys.release(key, token, "boom")
        with store.db.ready_engine().connect() as connection:
            before = connection.execute(size).scalar_one()
        for _ in range(3):
            claim = store.keys.claim(request(key, message=message))
            assert claim.record.claim_reason == "RETRY"
            store.keys.release(key, claim.record.fencing_token, "boom")
        with store.db.ready_engine().connect() as connection:
            assert connection.execute(size).scalar_one() == before
        assert (stored := store.keys.get(key)) is not None and stored.message == message
    finally:
        store.dispose()


def test_expired_lease_is_taken_over_and_the_old_owner_is_fenced(store: SqlStore) -> None:
    old = store.keys.claim(request(lease_ttl=0.2))
    takeover = None

    def taken_over() -> bool:
        nonlocal takeover
        takeover = store.keys.claim(request(owner="w2/2"))
        return takeover.outcome is ClaimOutcome.CLAIMED

    wait_until(taken_over, timeout=10, what="the expired lease to be taken over")
    assert takeover is not None
    assert takeover.record.claim_reason == "TAKEOVER"
    assert takeover.record.fencing_token == old.record.fencing_token + 1
    assert takeover.record.attempts == 2
    with pytest.raises(Fenced):
        store.keys.complete("k", old.record.fencing_token, '"old"', retention=60.0)
    store.keys.complete("k", takeover.record.fencing_token, '"new"', retention=60.0)
    record = store.keys.get("k")
    assert record is not None and record.result == '"new"'


def test_zero_retention_dedups_only_while_in_flight_and_tokens_keep_rising(
    store: SqlStore,
) -> None:
    first = store.keys.claim(request())
    store.keys.complete("k", first.record.fencing_token, "1", retention=0.0)
    again = store.keys.claim(request(fingerprint="fp-other"))
    assert again.outcome is ClaimOutcome.CLAIMED
    assert again.record.attempts == 1
    assert again.record.claim_reason == "NEW"
    assert again.record.fencing_token == first.record.fencing_token + 1


def test_no_retention_keeps_the_result(store: SqlStore) -> None:
    token = store.keys.claim(request()).record.fencing_token
    store.keys.complete("k", token, "1", retention=None)
    record = store.keys.get("k")
    assert record is not None and record.expires_at is None
    assert store.keys.claim(request()).outcome is ClaimOutcome.DUPLICATE


def test_completion_in_a_transaction_commits_with_the_task_writes(store: SqlStore) -> None:
    effects_metadata.create_all(store.engine)
    token = store.keys.claim(request()).record.fencing_token
    with store.keys.connect() as connection:
        transaction = connection.begin()
        connection.execute(insert(effects).values(id=1))
        store.keys.complete("k", token, "1", retention=60.0, connection=connection)
        store.keys.commit(transaction)
    with store.engine.connect() as connection:
        assert connection.execute(select(effects.c.id)).scalars().all() == [1]
    record = store.keys.get("k")
    assert record is not None and record.state == "COMPLETED"


def test_a_fenced_completion_rolls_back_the_task_writes(store: SqlStore) -> None:
    effects_metadata.create_all(store.engine)
    stale = store.keys.claim(request(lease_ttl=0.1)).record.fencing_token
    wait_until(
        lambda: store.keys.claim(request(owner="w2/2")).outcome is ClaimOutcome.CLAIMED,
        timeout=10,
        what="takeover",
    )
    with store.keys.connect() as connection:
        transaction = connection.begin()
        connection.execute(insert(effects).values(id=1))
        with pytest.raises(Fenced):
            store.keys.complete("k", stale, "1", retention=60.0, connection=connection)
        transaction.rollback()
    with store.engine.connect() as connection:
        assert connection.execute(select(effects.c.id)).scalars().all() == []


def test_concurrent_claims_have_exactly_one_winner(store: SqlStore) -> None:
    outcomes: list[ClaimOutcome] = []
    barrier = threading.Barrier(8)
    lock = threading.Lock()

    def claimer(n: int) -> None:
        barrier.wait(timeout=10)
        outcome = store.keys.claim(request(owner=f"w{n}/{n}")).outcome
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(o.value for o in outcomes) == ["claimed"] + ["in_flight"] * 7


def test_a_claim_is_one_statement_on_postgresql_unless_a_key_thought_new_exists(
    pg_url: str,
) -> None:
    """Counted at the driver (its cursor, or libpq's calls past it): the claim and completion
    skip SQLAlchemy's execution events. A
    key thought new is inserted; if it exists after all, the upsert follows (two statements);
    a key thought to exist (a retry) goes to the upsert at once."""
    store = SqlStore(GuardConfig(store_url=pg_url))
    statements: list[str] = []

    class CountingCursor(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append(str(query))
            return super().execute(query, *args, **kwargs)

    def count_on(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.cursor_factory = CountingCursor

    event.listen(store.engine, "connect", count_on)
    # The hot statements go to libpq past the cursor (celery_guard/store/prepared.py).
    prepared = store.db.prepared
    run_prepared = prepared.run

    def counting_run(connection: Any, sql: str, values: dict[str, Any]) -> Any:
        ran = run_prepared(connection, sql, values)
        if ran is not None:
            statements.append(sql)
        return ran

    prepared.run = counting_run  # type: ignore[method-assign]
    store.ensure_schema()
    statements.clear()
    try:
        token = store.keys.claim(request()).record.fencing_token
        assert len(statements) == 1 and statements[0].lstrip().upper().startswith("INSERT")
        assert "DO NOTHING" in statements[0]
        store.keys.complete("k", token, "1", retention=60.0)
        assert len(statements) == 2 and statements[1].lstrip().upper().startswith("UPDATE")
        statements.clear()
        assert store.keys.claim(request(owner="w2/2")).outcome is ClaimOutcome.DUPLICATE
        assert ["DO NOTHING" in sql for sql in statements] == [True, False]
        statements.clear()
        retried = store.keys.claim(request("r", likely_new=False))
        assert retried.outcome is ClaimOutcome.CLAIMED
        assert len(statements) == 1 and "DO UPDATE" in statements[0]
    finally:
        store.dispose()


def test_a_failed_claim_hands_its_connection_back_out_of_autocommit(pg_url: str) -> None:
    """The hot path runs in autocommit; an error must not leak that mode into a pooled
    connection (a task's transaction() on it would then commit each statement)."""
    store = SqlStore(GuardConfig(store_url=pg_url))
    store.ensure_schema()
    try:
        with pytest.raises(StoreError, match="too long"):
            store.keys.claim(request(key="k" * 300))  # past the column: PostgreSQL refuses it
        assert store.engine.pool.checkedin() == 1, "one connection, so the next one is it"
        pooled = store.engine.raw_connection()
        try:
            assert pooled.driver_connection.autocommit is False
        finally:
            pooled.close()
        with store.keys.connect() as connection:
            connection.execute(text("CREATE TEMP TABLE t (n int)"))
            connection.execute(text("INSERT INTO t VALUES (1)"))
            connection.rollback()
            assert connection.execute(text("SELECT to_regclass('pg_temp.t')")).scalar() is None
    finally:
        store.dispose()


def test_the_hot_path_borrows_from_the_pool_while_its_connection_is_busy(pg_url: str) -> None:
    """Another thread of the process (a threads or gevent pool) holding the hot connection:
    the statement runs on a pooled connection, which goes back out of autocommit."""
    store = SqlStore(GuardConfig(store_url=pg_url))
    store.ensure_schema()
    try:
        token = store.keys.claim(request(key="first")).record.fencing_token  # opens the hot one
        assert store.db.hot.try_acquire()  # what a concurrent claim in another thread holds
        try:
            assert store.keys.claim(request(key="second")).outcome is ClaimOutcome.CLAIMED
            with pytest.raises(StoreError, match="too long"):
                store.keys.claim(request(key="k" * 300))
        finally:
            store.db.hot.lock.release()
        assert store.engine.pool.checkedout() == 0, "both borrowed connections went back"
        with store.keys.connect() as connection:
            assert connection.connection.driver_connection.autocommit is False
        store.keys.complete("first", token, "1", retention=60.0)  # the hot connection again
        record = store.keys.get("first")
        assert record is not None and record.state == KeyState.COMPLETED.value
    finally:
        store.dispose()


def test_the_hot_connection_is_replaced_after_the_server_drops_it(pg_url: str) -> None:
    """A terminated backend (server restart, idle-connection reaper, failover): the next claim
    notices the dead connection, opens a new one and succeeds, without the caller seeing it."""
    store = SqlStore(GuardConfig(store_url=pg_url))
    store.ensure_schema()
    try:
        store.keys.claim(request(key="before"))
        with psycopg.connect(_dsn(pg_url), autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'celery_guard' AND datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        assert killed, "the store had a connection to terminate"
        assert store.keys.claim(request(key="after")).outcome is ClaimOutcome.CLAIMED
        assert store.keys.claim(request(key="after")).outcome is ClaimOutcome.IN_FLIGHT
    finally:
        store.dispose()


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _claim_in_child(store: SqlStore, queue: Any) -> None:
    claim = store.keys.claim(request(key="child"))
    store.keys.complete("child", claim.record.fencing_token, '"from child"', retention=60.0)
    queue.put(claim.outcome.value)


def test_a_forked_child_builds_its_own_engine(store: SqlStore) -> None:
    """An engine used before fork must not be shared: the child opens its own connections."""
    store.keys.claim(request(key="parent"))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_claim_in_child, args=(store, queue))
    child.start()
    try:
        assert queue.get(timeout=30) == "claimed"
    finally:
        child.join(timeout=30)
        queue.close()
        queue.join_thread()
    assert child.exitcode == 0
    record = store.keys.get("child")
    assert record is not None and record.result == '"from child"'
    assert store.keys.claim(request(key="parent")).outcome is ClaimOutcome.IN_FLIGHT


@pytest.mark.parametrize("create_tables", [True, False])
def test_an_unreachable_store_fails_fast_without_leaking_the_password(
    create_tables: bool,
) -> None:
    """With create_tables off (or the schema known), the per-delivery calls reach the store
    first through the hot path: they must fail the same way (not with a raw driver error)."""
    url = f"postgresql://shop:s3cret@127.0.0.1:{free_port()}/shop"
    store = SqlStore(GuardConfig(store_url=url, store_timeout=1.0, create_tables=create_tables))
    seen: list[object] = []
    store.observer = lambda seconds, error: seen.append(error)
    calls = [
        lambda: store.keys.claim(request()),
        lambda: store.keys.complete("k", 1, "null", 60.0),
        lambda: store.keys.release("k", 1, None),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable) as caught:
            call()
        assert "s3cret" not in str(caught.value)
        assert "127.0.0.1" in str(caught.value)
    assert len(seen) == 3 and all(isinstance(error, StoreUnavailable) for error in seen)


def test_missing_tables_name_the_fix(sqlite_url: str) -> None:
    store = SqlStore(GuardConfig(store_url=sqlite_url, create_tables=False))
    with pytest.raises(StoreError, match="guard migrate"):
        store.keys.claim(request())
    store.dispose()
