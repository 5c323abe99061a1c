"""The claim's own commit level (``guard_claim_synchronous_commit``), on a durable PostgreSQL.

What is asserted is where the WAL stands when a call returns, read from the server itself: a
claim at ``"off"`` returns before its WAL is flushed; a claim at ``None`` (the session's
``on``) and every completion return only once everything up to them is flushed, which makes
an earlier asynchronous claim durable too (WAL is flushed in order).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import text

from celery_guard import ConfigurationError, GuardConfig
from celery_guard.store import SqlStore
from tests.integration.claims import claim
from tests.rig.servers import PostgresServer


@pytest.fixture(scope="module")
def durable_postgres() -> Iterator[PostgresServer]:
    """fsync and synchronous_commit on; the WAL writer asleep for a minute between rounds, so
    WAL that nobody waited for stays unflushed while the test looks."""
    server = PostgresServer(durable=True)
    server.start()
    try:
        with psycopg.connect(_dsn(server.url), autocommit=True) as connection:
            connection.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            connection.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.stop()


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _store(url: str, level: str | None) -> SqlStore:
    store = SqlStore(GuardConfig(store_url=url, claim_synchronous_commit=level))
    store.ensure_schema()
    return store


def _unflushed_bytes(observer: psycopg.Connection[tuple[int]]) -> int:
    row = observer.execute(
        "SELECT pg_current_wal_insert_lsn() - pg_current_wal_flush_lsn()"
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("level", ["off", None])
def test_the_claim_waits_for_its_wal_flush_only_when_asked(
    durable_postgres: PostgresServer, level: str | None
) -> None:
    store = _store(durable_postgres.url, level)
    try:
        with psycopg.connect(_dsn(durable_postgres.url), autocommit=True) as observer:
            observer.execute("CHECKPOINT")  # flushes everything before the claims
            unflushed = []
            for n in range(5):
                claim(store, f"{level}-{n}")  # asserts CLAIMED
                unflushed.append(_unflushed_bytes(observer))
            if level is None:
                assert unflushed == [0] * 5
            else:
                # The WAL writer may wake for a full page; not for every one of five claims.
                assert sum(1 for n in unflushed if n > 0) >= 3, unflushed
    finally:
        store.dispose()


def test_a_completion_is_durable_and_flushes_its_claim(durable_postgres: PostgresServer) -> None:
    store = _store(durable_postgres.url, "off")
    try:
        with psycopg.connect(_dsn(durable_postgres.url), autocommit=True) as observer:
            token = claim(store, "completed")
            assert _unflushed_bytes(observer) > 0
            store.keys.complete("completed", token, "null", 60.0)
            assert _unflushed_bytes(observer) == 0
            # The level was the claim's transaction's only: the claiming session still waits.
            rows, _ = store.db.execute_hot(text("SHOW synchronous_commit"), {})
            assert rows == [{"synchronous_commit": "on"}]
    finally:
        store.dispose()


def test_a_release_is_durable(durable_postgres: PostgresServer) -> None:
    store = _store(durable_postgres.url, "off")
    try:
        with psycopg.connect(_dsn(durable_postgres.url), autocommit=True) as observer:
            token = claim(store, "released")
            assert store.keys.release("released", token, "boom")
            assert _unflushed_bytes(observer) == 0
    finally:
        store.dispose()


@pytest.mark.parametrize("level", ["async", "OFF", 0, ""])
def test_an_unknown_level_is_refused(level: object) -> None:
    with pytest.raises(ConfigurationError, match="guard_claim_synchronous_commit"):
        GuardConfig(claim_synchronous_commit=level)  # type: ignore[arg-type]
