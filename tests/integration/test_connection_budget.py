"""The pieces of the connection budget against a real PostgreSQL (docs/design.md).

A pool process (``StoreEngine.budget == "child"``) runs its claim, its body's transaction and
its completion on one connection; the renewal relay runs a pool process's heartbeat round in
the main process and tells when a pool process is gone. tests/acceptance/test_connection_budget.py
counts the connections of real workers.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Column, Integer, MetaData, Table, func, insert, select

from celery_guard import GuardConfig
from celery_guard.errors import StoreUnavailable, TransactionMisuse
from celery_guard.execution import Execution
from celery_guard.lease.backends import SqlLeases
from celery_guard.lease.relay import RelayRenewer, RenewalRelay
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore
from tests.rig.procs import wait_until

pytestmark = pytest.mark.postgres

rows = Table("budget_rows", MetaData(), Column("id", Integer, primary_key=True))


@pytest.fixture
def child_store(pg_url: str) -> Iterator[SqlStore]:
    """A store as a prefork pool process uses it, named so its connections can be counted."""
    store = SqlStore(GuardConfig(store_url=pg_url))
    store.ensure_schema()
    rows.create(store.engine, checkfirst=True)
    store.dispose()
    store.db.budget = "child"
    store.db.worker_tag = f"test{os.getpid()}"
    try:
        yield store
    finally:
        store.dispose()


def _connections(store: SqlStore) -> int:
    url = store.engine.url
    with psycopg.connect(
        host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
    ) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"celery_guard {store.db.worker_tag}/%",),
        ).fetchone()
    return int(row[0]) if row is not None else 0


def _claim(store: SqlStore, key: str) -> int:
    result = store.keys.claim(
        ClaimRequest(
            key=key,
            task_name="t",
            fingerprint="fp",
            check_fingerprint=True,
            owner=f"host/{os.getpid()}",
            message=None,
            lease_ttl=30.0,
        )
    )
    assert result.outcome is ClaimOutcome.CLAIMED
    token = result.record.fencing_token
    assert token is not None
    return token


def _execution(store: SqlStore, key: str) -> Execution:
    """The execution a claim of ``key`` hands its body."""
    token = _claim(store, key)
    return Execution(store.keys, key=key, fencing_token=token, attempts=1, claim_reason="NEW")


def _count(store: SqlStore) -> int:
    with store.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(rows)).scalar_one())


def test_claim_body_and_completion_share_one_connection(child_store: SqlStore) -> None:
    store = child_store
    for n in range(3):
        execution = _execution(store, f"k{n}")
        with execution.transaction() as connection:
            connection.execute(insert(rows).values(id=n))
            hot = store.db.hot.connection(store.engine)
            assert connection.connection.dbapi_connection is hot, "the body runs on the hot one"
            assert not hot.autocommit
        execution.finish('"done"', retention=None)
        assert store.db.hot.connection(store.engine).autocommit, "back to autocommit after"
        assert store.keys.get(f"k{n}").state == "COMPLETED"
    assert _connections(store) == 1


def test_a_refused_commit_commits_nothing_and_the_next_claim_gets_a_fresh_connection(
    child_store: SqlStore,
) -> None:
    store = child_store
    execution = _execution(store, "refused")
    with execution.transaction() as connection:
        connection.execute(insert(rows).values(id=100))
        with pytest.raises(TransactionMisuse):
            connection.commit()
    with pytest.raises(TransactionMisuse):
        execution.finish('"done"', retention=None)
    assert _count(store) == 0, "nothing of the refused body committed"
    execution = _execution(store, "after")
    with execution.transaction() as connection:
        connection.execute(insert(rows).values(id=101))
    execution.finish('"done"', retention=None)
    assert _count(store) == 1
    assert _connections(store) == 1


def test_a_statement_inside_the_body_borrows_a_connection_for_that_call_only(
    child_store: SqlStore,
) -> None:
    store = child_store
    execution = _execution(store, "nested")
    with execution.transaction() as connection:
        connection.execute(insert(rows).values(id=200))
        assert store.keys.get("nested").state == "RUNNING"  # on a connection of its own
        released_elsewhere = store.now()
        assert released_elsewhere > 0
    execution.finish('"done"', retention=None)
    wait_until(lambda: _connections(store) == 1, 10, "the borrowed connection to close")


def test_the_relay_renews_a_round_and_tells_when_a_pool_process_is_gone(pg_url: str) -> None:
    main = SqlStore(GuardConfig(store_url=pg_url))
    main.ensure_schema()
    child = SqlStore(GuardConfig(store_url=pg_url))
    gone: list[int] = []
    leases = SqlLeases(main.keys)
    relay = RenewalRelay(
        lambda pairs, ttl: leases.renew_leases(pairs, ttl), on_process_gone=gone.append
    )
    relay.bind()
    relay.start()
    try:
        token = _claim(child, "relayed")
        renewer = RelayRenewer(relay.address, timeout=5)
        try:
            assert renewer.renew_leases([("relayed", token)], 30.0) == {"relayed"}
            assert renewer.renew_leases([("relayed", token + 1)], 30.0) == set(), "token-checked"
        finally:
            renewer.close()
        # A presence connection, closed as a dying process's is.
        presence = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        presence.connect(relay.address)
        presence.sendall(b'{"presence": 4242}\n')
        presence.close()
        wait_until(lambda: gone == [4242], 10, "the relay to see the process gone")
    finally:
        relay.stop()
        main.dispose()
        child.dispose()
    with pytest.raises(StoreUnavailable):
        RelayRenewer(relay.address, timeout=1).renew_leases([("relayed", 1)], 30.0)


def test_a_frozen_relay_answer_is_a_store_that_does_not_answer(pg_url: str) -> None:
    blocked = threading.Event()

    def renew(pairs: list[tuple[str, int]], ttl: float) -> set[str]:
        blocked.wait(10)
        return set()

    relay = RenewalRelay(renew)
    relay.bind()
    relay.start()
    try:
        with pytest.raises(StoreUnavailable):
            RelayRenewer(relay.address, timeout=0.5).renew_leases([("k", 1)], 30.0)
    finally:
        blocked.set()
        relay.stop()
