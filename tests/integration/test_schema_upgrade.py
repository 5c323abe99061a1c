"""Upgrading a database made with the first schema (``SqlStore.migrate``, what ``guard migrate``
runs), and the bounded pruning pass, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, inspect, text

from celery_guard import GuardConfig
from celery_guard.store import SqlStore
from celery_guard.store.schema import (
    KEYS_TABLE_OPTIONS,
    LEGACY_KEY_INDEXES,
    PRUNABLE_INDEX,
    RUNNING_INDEX,
    keys,
)
from tests.integration.claims import claim
from tests.rig.procs import wait_until

#: The first schema's indexes on the keys table, as it created them.
LEGACY_DDL = (
    "CREATE INDEX ix_celery_guard_keys_state_lease ON celery_guard_keys (state, lease_expires_at)",
    "CREATE INDEX ix_celery_guard_keys_expires_at ON celery_guard_keys (expires_at)",
)


def _make_legacy(url: str) -> None:
    """Turn a current schema into the first one: its two full indexes, no table options."""
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            for name in (RUNNING_INDEX, PRUNABLE_INDEX):
                connection.execute(text(f"DROP INDEX {name}"))
            for statement in LEGACY_DDL:
                connection.execute(text(statement))
            if engine.dialect.name == "postgresql":
                options = ", ".join(KEYS_TABLE_OPTIONS)
                connection.execute(text(f"ALTER TABLE celery_guard_keys RESET ({options})"))
    finally:
        engine.dispose()


def _key_indexes(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {str(index["name"]) for index in inspect(engine).get_indexes(keys.name)}
    finally:
        engine.dispose()


@pytest.fixture
def legacy_store(store_url: str) -> Iterator[SqlStore]:
    """A store whose database has the first schema, with keys written under it."""
    store = SqlStore(GuardConfig(store_url=store_url, store_timeout=5.0))
    store.ensure_schema()
    _make_legacy(store_url)
    try:
        yield store
    finally:
        store.dispose()


def test_an_old_database_is_upgraded_then_works_and_a_second_migrate_changes_nothing(
    legacy_store: SqlStore, store_url: str
) -> None:
    store = legacy_store
    assert _key_indexes(store_url) == set(LEGACY_KEY_INDEXES)
    expired = claim(store, "expired")
    store.keys.complete("expired", expired, "1", retention=0.0)
    claim(store, "orphan", ttl=0.1)
    kept = claim(store, "kept")
    store.keys.complete("kept", kept, "1", retention=600.0)

    changed = store.migrate()
    assert changed, "the first migrate upgrades"
    assert _key_indexes(store_url) == {RUNNING_INDEX, PRUNABLE_INDEX}
    assert store.migrate() == [], "a second migrate has nothing left to do"

    # What the reaper and pruning must still find, through the new indexes.
    wait_until(
        lambda: [r.key for r in store.recovery.orphans(republish_after=60, limit=10)] == ["orphan"],
        timeout=10,
        what="the orphan's lease to expire",
    )
    assert store.recovery.prune_pass(budget=10.0) == 1
    assert store.keys.get("expired") is None
    assert store.keys.get("kept") is not None
    assert claim(store, "new") >= 1, "claims work after the upgrade"
    assert store.keys.oldest_running() is not None


def test_migrate_on_a_current_database_changes_nothing(store: SqlStore) -> None:
    assert store.migrate() == []


def test_a_half_built_concurrent_index_is_built_again(pg_url: str) -> None:
    store = SqlStore(GuardConfig(store_url=pg_url, store_timeout=5.0))
    try:
        store.ensure_schema()
        engine = create_engine(pg_url)
        try:
            with engine.begin() as connection:
                # What a CREATE INDEX CONCURRENTLY that failed half way leaves behind.
                connection.execute(
                    text(
                        "UPDATE pg_index SET indisvalid = false "
                        "WHERE indexrelid = to_regclass(:name)"
                    ),
                    {"name": PRUNABLE_INDEX},
                )
            changed = store.migrate()
            assert any(PRUNABLE_INDEX in statement for statement in changed)
            with engine.connect() as connection:
                valid = connection.scalar(
                    text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:n)"),
                    {"n": PRUNABLE_INDEX},
                )
            assert valid is True
        finally:
            engine.dispose()
    finally:
        store.dispose()


def test_a_pruning_pass_is_bounded_by_its_batch_cap_and_the_next_pass_goes_on(
    store: SqlStore,
) -> None:
    for n in range(25):
        key = f"gone-{n}"
        store.keys.complete(key, claim(store, key), "1", retention=0.0)
    assert store.recovery.prune_pass(budget=60.0, batch=10, max_batches=2) == 20
    assert store.recovery.prune_pass(budget=60.0, batch=10, max_batches=2) == 5
    assert store.recovery.prune_pass(budget=60.0, batch=10, max_batches=2) == 0


def test_a_pruning_pass_stops_at_its_time_budget(store: SqlStore) -> None:
    for n in range(5):
        key = f"gone-{n}"
        store.keys.complete(key, claim(store, key), "1", retention=0.0)
    # A spent budget still runs one batch, so every pass makes progress.
    assert store.recovery.prune_pass(budget=0.0, batch=2) == 2


def test_the_reapers_scans_read_the_partial_indexes_even_as_prepared_statements(
    pg_url: str,
) -> None:
    """The scans name their state as a literal: a prepared statement's generic plan for
    ``state = $1`` could not prove a partial index's predicate and would read the whole table.
    Run past psycopg's prepare threshold and PostgreSQL's five custom plans, with sequential
    scans priced out, the index scan counters must move."""
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            database = connection.scalar(text("SELECT current_database()"))
            connection.execute(text(f'ALTER DATABASE "{database}" SET enable_seqscan = off'))
        store = SqlStore(GuardConfig(store_url=pg_url, store_timeout=5.0))
        try:
            store.ensure_schema()
            store.keys.complete("gone", claim(store, "gone"), "1", retention=0.0)
            for _ in range(12):
                store.recovery.orphans(republish_after=60, limit=10)
                store.recovery.prune_pass(budget=10.0)
                store.keys.count_expired_leases()
        finally:
            store.dispose()  # a backend reports its counters when it ends

        def scans() -> dict[str, int]:
            with admin.connect() as connection:
                connection.execute(text("SELECT pg_stat_clear_snapshot()"))
                rows = connection.execute(
                    text(
                        "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes "
                        "WHERE relname = 'celery_guard_keys'"
                    )
                ).fetchall()
            return {str(name): int(count) for name, count in rows}

        wait_until(
            lambda: scans().get(RUNNING_INDEX, 0) >= 24 and scans().get(PRUNABLE_INDEX, 0) >= 12,
            timeout=15,
            what=f"index scans of the partial indexes (now {scans()})",
        )
    finally:
        admin.dispose()


def test_a_key_taken_over_while_pruning_waits_on_its_row_is_not_deleted(pg_url: str) -> None:
    """Pruning picks its batch from a snapshot, then deletes. A claim that takes an expired key
    over in between holds the row; when the delete gets it, the row is RUNNING and must stay.
    (PostgreSQL re-checks only the delete's own conditions against the row's new version, not
    the subquery's: those conditions are repeated on the delete.)"""
    store = SqlStore(GuardConfig(store_url=pg_url, store_timeout=10.0))
    engine = create_engine(pg_url)
    try:
        store.ensure_schema()
        store.keys.complete("k", claim(store, "k"), "1", retention=0.0)
        with engine.connect() as claimer:
            claimer.execute(
                text(
                    "UPDATE celery_guard_keys SET state = 'RUNNING', "
                    "fencing_token = fencing_token + 1, expires_at = NULL WHERE key = 'k'"
                )
            )  # a takeover, not committed yet
            pruned: list[int] = []
            worker = threading.Thread(target=lambda: pruned.append(store.recovery.prune_pass(10)))
            worker.start()

            def waiting() -> bool:
                with engine.connect() as observer:
                    return bool(
                        observer.scalar(
                            text(
                                "SELECT count(*) FROM pg_stat_activity WHERE "
                                "wait_event_type = 'Lock' AND query LIKE 'DELETE FROM%'"
                            )
                        )
                    )

            wait_until(waiting, timeout=10, what="pruning's delete to wait on the row")
            claimer.commit()
            worker.join(timeout=10)
        assert pruned == [0]
        record = store.keys.get("k")
        assert record is not None and record.state == "RUNNING"
    finally:
        engine.dispose()
        store.dispose()
