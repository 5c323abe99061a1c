"""Bring an existing database's celery_guard tables up to :mod:`celery_guard.store.schema`.

``create_all`` (a worker's ``guard_create_tables``) creates what is missing but leaves an
existing table as it is, indexes included. What changed since the first schema, applied here
by ``celery -A app guard migrate`` and by the Django migration ``0002_partial_key_indexes``:

- the keys table's two full indexes are replaced by two partial ones (the RUNNING keys; the
  COMPLETED keys with an expiry), which stay small however many keys are retained;
- the keys table's autovacuum thresholds (storage parameters) on PostgreSQL.

Every step is idempotent, so running it again, or on a database ``create_all`` made with the
current schema, changes nothing. On PostgreSQL the indexes are built ``CONCURRENTLY`` (claims
keep running while a large table is indexed), so the steps run outside a transaction; a build
that failed half way leaves an invalid index, which the next run drops and builds again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex

from celery_guard.store.schema import KEYS_TABLE_OPTIONS, LEGACY_KEY_INDEXES, keys

_DIALECTS: dict[str, Any] = {
    "postgresql": postgresql.dialect(),  # type: ignore[no-untyped-call]
    "sqlite": sqlite.dialect(),
}

#: Whether a PostgreSQL index exists and is valid: no row, or (indisvalid,).
_PG_INDEX_STATE = (
    "SELECT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass('{name}')"
)


def upgrade_keys_table(
    dialect_name: str, execute: Callable[[str], None], query: Callable[[str], list[Any]]
) -> list[str]:
    """Apply the steps through ``execute`` (one statement, autocommitted) and ``query`` (the
    rows of one statement); return the statements that changed something."""
    dialect = _DIALECTS[dialect_name]
    done: list[str] = []

    def run(statement: str) -> None:
        execute(statement)
        done.append(statement)

    for index in sorted(keys.indexes, key=lambda index: str(index.name)):
        create = str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect))
        if dialect_name == "postgresql":
            rows = query(_PG_INDEX_STATE.format(name=index.name))
            if rows and rows[0][0]:
                continue
            if rows:  # an earlier concurrent build failed half way: start it again
                run(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
            create = create.replace(
                "CREATE INDEX IF NOT EXISTS", "CREATE INDEX CONCURRENTLY IF NOT EXISTS"
            )
            run(create)
        else:
            before = query(
                f"SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = '{index.name}'"
            )
            if not before:
                run(create)
    for name in LEGACY_KEY_INDEXES:
        if dialect_name == "postgresql":
            if query(_PG_INDEX_STATE.format(name=name)):
                run(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
        elif query(f"SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = '{name}'"):
            run(f'DROP INDEX IF EXISTS "{name}"')
    if dialect_name == "postgresql":
        wanted = {f"{name}={value}" for name, value in KEYS_TABLE_OPTIONS.items()}
        rows = query(f"SELECT reloptions FROM pg_class WHERE oid = to_regclass('{keys.name}')")
        if not wanted <= set(rows[0][0] or []):
            options = ", ".join(f"{name} = {value}" for name, value in KEYS_TABLE_OPTIONS.items())
            run(f"ALTER TABLE {keys.name} SET ({options})")
    return done


def upgrade(engine: Engine) -> list[str]:
    """Upgrade the database ``engine`` connects to (its tables must exist); see the module."""
    if engine.dialect.name != "postgresql":
        # SQLite builds an index under its database lock anyway: one transaction.
        with engine.begin() as connection:
            return upgrade_keys_table(engine.dialect.name, *_runners(connection))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        # An index build on a large table outlasts guard_store_timeout's statement_timeout.
        connection.execute(text("SET statement_timeout = 0"))
        try:
            return upgrade_keys_table(engine.dialect.name, *_runners(connection))
        finally:
            # Back to the connection's own (guard_store_timeout) before the pool has it again.
            connection.execute(text("RESET statement_timeout"))


def _runners(
    connection: Connection,
) -> tuple[Callable[[str], None], Callable[[str], list[Any]]]:
    def execute(statement: str) -> None:
        connection.execute(text(statement))

    def query(statement: str) -> list[Any]:
        return list(connection.execute(text(statement)).fetchall())

    return execute, query
