"""A PostgreSQL that accepts and acknowledges but never answers (a frozen server, or a proxy in
front of one that is gone) fails every store call within a bound instead of hanging it.

statement_timeout runs on the server, which never sees the statement; tcp_user_timeout never
fires, the peer's kernel acknowledges. Without the client-side watchdog
(``celery_guard/store/watchdog.py``) each call below blocks until the peer answers again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy.exc import DBAPIError

from celery_guard import GuardConfig, StoreUnavailable
from celery_guard.store import ClaimOutcome, SqlStore
from tests.apps import shop_tables
from tests.integration.test_store import request
from tests.rig.faultproxy import FaultProxy
from tests.rig.servers import PostgresServer

pytestmark = pytest.mark.postgres

STORE_TIMEOUT = 1.0
#: The watchdog's deadline (1.5 s for 1 s) plus one reconnect's connect_timeout (2 s), with room
#: for a loaded machine; the bug it guards against is a call that never returns.
BOUND = 20.0


@pytest.fixture
def proxied(postgres: PostgresServer, pg_url: str) -> Iterator[tuple[SqlStore, FaultProxy]]:
    with FaultProxy(postgres.port) as proxy:
        url = pg_url.replace(f"127.0.0.1:{postgres.port}/", f"127.0.0.1:{proxy.port}/")
        store = SqlStore(GuardConfig(store_url=url, store_timeout=STORE_TIMEOUT))
        store.ensure_schema()
        shop_tables.metadata.create_all(store.engine)
        try:
            yield store, proxy
        finally:
            proxy.heal()
            store.dispose()


def bounded(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``call`` on a thread; what it raised and how long it took. Fails if it hangs."""
    outcome: list[BaseException | None] = []
    started = time.monotonic()

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert outcome, f"the store call still hangs after {BOUND}s"
    return outcome[0], time.monotonic() - started


def effects_tagged(store: SqlStore, tag: str) -> list[Any]:
    """The rows a test's body wrote with ``tag``, read once the peer answers again."""
    with store.engine.connect() as check:
        return list(
            check.execute(select(shop_tables.effects).where(shop_tables.effects.c.tag == tag)).all()
        )


def test_claim_renew_and_read_fail_fast_on_a_silent_peer(
    proxied: tuple[SqlStore, FaultProxy],
) -> None:
    store, proxy = proxied
    token = store.keys.claim(request("silent")).record.fencing_token
    proxy.blackhole()  # the pooled connection stays open; nothing comes back
    for call in (
        lambda: store.keys.claim(request("other")),
        lambda: store.keys.renew_leases([("silent", token)], ttl=30.0),
        store.now,
    ):
        error, _seconds = bounded(call)
        assert isinstance(error, StoreUnavailable), error
    proxy.heal()
    # (The claim of "other" sent into the silence may land now, as a lost reply's would: its
    # lease then expires unrenewed, as after any claim whose answer never came.)
    assert store.keys.renew_leases([("silent", token)], ttl=30.0) == {"silent"}
    assert store.keys.claim(request("after")).outcome is ClaimOutcome.CLAIMED


def test_a_tasks_commit_fails_fast_on_a_silent_peer_and_writes_nothing(
    proxied: tuple[SqlStore, FaultProxy],
) -> None:
    store, proxy = proxied
    token = store.keys.claim(request("commit")).record.fencing_token
    connection = store.keys.connect()
    transaction = connection.begin()
    connection.execute(insert(shop_tables.effects).values(tag="silent-commit"))
    store.keys.complete("commit", token, "null", None, connection=connection)
    proxy.blackhole()
    try:
        error, _seconds = bounded(lambda: store.keys.commit(transaction))
        assert isinstance(error, StoreUnavailable), error
    finally:
        connection.invalidate()
        connection.close()
    proxy.heal()
    rows = effects_tagged(store, "silent-commit")
    record = store.keys.get("commit")
    assert record is not None
    # The COMMIT was sent before the peer went silent, and the proxy, like TCP, may deliver it
    # once the path heals: "may or may not have landed", as the handler assumes. Either way the
    # task's write and the COMPLETED marker are one.
    assert (len(rows), record.state) in ((0, "RUNNING"), (1, "COMPLETED"))


@pytest.mark.parametrize("budget", ["process", "child"])
def test_a_statement_in_a_tasks_transaction_fails_fast_on_a_silent_peer(
    proxied: tuple[SqlStore, FaultProxy], budget: str
) -> None:
    """The body's own statements are watched too: on a pool connection, and (``child``) on
    the connection the claims use, lent to the body."""
    store, proxy = proxied
    store.db.budget = budget
    store.keys.claim(request("body"))
    connection = store.keys.connect()
    connection.begin()
    proxy.blackhole()
    try:
        error, _seconds = bounded(
            lambda: connection.execute(insert(shop_tables.effects).values(tag="silent-body"))
        )
        assert isinstance(error, DBAPIError) and error.connection_invalidated, error
    finally:
        connection.invalidate()
        connection.close()
    proxy.heal()
    rows = effects_tagged(store, "silent-body")
    assert rows == []
    # The store works again once the peer answers: the next claim opens a new connection.
    assert store.keys.claim(request("after")).outcome is ClaimOutcome.CLAIMED


def test_requests_are_unchanged_when_the_peer_answers(proxied: tuple[SqlStore, FaultProxy]) -> None:
    """A slow but answering store (latency under the deadline) is not cut off."""
    store, proxy = proxied
    proxy.latency(upstream=0.3, downstream=0.3)
    assert store.keys.claim(request("slow")).outcome is ClaimOutcome.CLAIMED
