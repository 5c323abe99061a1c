"""The store through PgBouncer in transaction pooling (tests/rig/servers.py PgBouncerServer).

What ``guard_store_pooling = "transaction"`` changes, against a real PgBouncer 1.18: no startup
``options`` (refused by PgBouncer), no server-side prepared statements (two clients sharing a
server session would collide on psycopg's statement names, or miss them on another session),
the timeouts read from the role, and liveness locks only through a direct URL.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import psycopg
import pytest

from celery_guard import GuardConfig
from celery_guard.errors import StoreUnavailable
from celery_guard.lease.liveness import ProcessLiveness, liveness_store
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore
from tests.rig.procs import wait_until
from tests.rig.servers import PgBouncerServer, PostgresServer


def request(key: str, owner: str, owner_lock: int | None = None) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="shop.record",
        fingerprint="fp",
        check_fingerprint=True,
        owner=owner,
        owner_lock=owner_lock,
        message=None,
        lease_ttl=30.0,
    )


def pooled(url: str, **settings: object) -> SqlStore:
    return SqlStore(GuardConfig(store_url=url, store_pooling="transaction", **settings))  # type: ignore[arg-type]


def test_session_settings_through_pgbouncer_fail_naming_the_setting_to_use(
    pg_url: str, pgbouncer: PgBouncerServer
) -> None:
    store = SqlStore(GuardConfig(store_url=pgbouncer.serve(pg_url)))
    try:
        with pytest.raises(StoreUnavailable, match="set guard_store_pooling = 'transaction'"):
            store.ensure_schema()
    finally:
        store.dispose()


def test_two_workers_sharing_server_sessions_claim_complete_and_release(
    pg_url: str, pgbouncer: PgBouncerServer
) -> None:
    """Well past psycopg's prepare_threshold (5) on each hot connection, interleaved: with
    prepared statements the second client would find the first's ``_pg3_0`` on the session."""
    url = pgbouncer.serve(pg_url)
    stores = [pooled(url), pooled(url)]
    try:
        stores[0].ensure_schema()
        for n in range(12):
            for index, store in enumerate(stores):
                key = f"k{n}-{index}"
                claimed = store.keys.claim(request(key, f"w{index}/1"))
                assert claimed.outcome is ClaimOutcome.CLAIMED
                token = claimed.record.fencing_token
                if n % 2:
                    assert store.keys.release(key, token, None)
                else:
                    store.keys.complete(key, token, '"done"', retention=60.0)
        for store in stores:
            assert store.db.hot._connection.prepare_threshold is None
        record = stores[1].keys.get("k10-0")
        assert record is not None and record.state == "COMPLETED"
    finally:
        for store in stores:
            store.dispose()


def test_a_body_transaction_through_pgbouncer_reads_the_roles_timeouts(
    pg_url: str, pgbouncer: PgBouncerServer
) -> None:
    store = pooled(pgbouncer.serve(pg_url, timeout="3s"))
    try:
        store.ensure_schema()
        with store.engine.connect() as connection, connection.begin():
            values = connection.exec_driver_sql(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
            ).one()
        assert tuple(values) == ("3s", "3s")
    finally:
        store.dispose()


def test_a_server_without_timeouts_is_reported_once(
    postgres: PostgresServer, pgbouncer: PgBouncerServer, caplog: pytest.LogCaptureFixture
) -> None:
    direct = postgres.create_database("pgb_no_timeouts")
    store = pooled(pgbouncer.through(direct))
    try:
        with caplog.at_level(logging.WARNING, logger="celery_guard.store.engine"):
            store.ensure_schema()
            store.keys.get("absent")
        warnings = [r.getMessage() for r in caplog.records if "ALTER ROLE" in r.getMessage()]
        assert len(warnings) == 1
        assert "statement_timeout = 0, lock_timeout = 0" in warnings[0]
    finally:
        store.dispose()


def test_which_session_holds_the_liveness_lock(pg_url: str, pgbouncer: PgBouncerServer) -> None:
    session = GuardConfig(store_url=pg_url)
    store = SqlStore(session)
    assert liveness_store(session, store.db) is store.db, "direct: the store's own engine"
    assert liveness_store(replace(session, liveness_locks=False), store.db) is None
    transaction = GuardConfig(store_url=pgbouncer.through(pg_url), store_pooling="transaction")
    assert liveness_store(transaction, store.db) is None, "behind the pooler, without a URL: off"
    store.dispose()


def test_a_liveness_lock_through_the_direct_url_is_seen_and_lost_by_the_pooled_reaper(
    pg_url: str, postgres: PostgresServer, pgbouncer: PgBouncerServer
) -> None:
    store = pooled(pgbouncer.serve(pg_url), liveness_url=pg_url)
    direct = liveness_store(store.config, store.db)
    assert direct is not None and direct is not store.db
    assert direct.config.store_url == store.config.liveness_url
    liveness = ProcessLiveness(direct, recheck_after=30)
    try:
        store.ensure_schema()
        lock = liveness.lock_id("w/1")
        assert lock is not None
        assert store.keys.claim(request("k", "w/1", lock)).outcome is ClaimOutcome.CLAIMED
        assert store.recovery.dead_owner_keys(limit=10) == [], "its session holds the lock"
        # The owner's session ends, as a SIGKILLed process's would.
        with psycopg.connect(postgres.dsn_for("postgres"), autocommit=True) as admin:
            # This test's database only: the server is the whole session's.
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE query LIKE '%%pg_try_advisory_lock%%' AND pid <> pg_backend_pid()"
                " AND datname = %s",
                (pg_url.rsplit("/", 1)[1],),
            ).fetchall()
        assert ended == [(True,)]
        wait_until(
            lambda: [key for key, _, _ in store.recovery.dead_owner_keys(limit=10)] == ["k"],
            timeout=10,
            what="the pooled store to see the owner's lock gone",
        )
    finally:
        liveness._drop()  # its session was ended: close the client side too
        store.dispose()
        direct.dispose()
