"""``0002_partial_key_indexes`` upgrades a database that ``0001_initial`` made with the first
schema, on PostgreSQL and SQLite, and running it again changes nothing."""

from __future__ import annotations

import importlib

import pytest
from django.db import connections

from celery_guard.store.schema import LEGACY_KEY_INDEXES, PRUNABLE_INDEX, RUNNING_INDEX

pytestmark = [
    # Not inside a test transaction: PostgreSQL builds the indexes CONCURRENTLY.
    pytest.mark.django_db(transaction=True, databases=["default", "sqlite"]),
]

MIGRATION = importlib.import_module(
    "celery_guard.contrib.django.migrations.0002_partial_key_indexes"
)
LEGACY_DDL = (
    "CREATE INDEX ix_celery_guard_keys_state_lease ON celery_guard_keys (state, lease_expires_at)",
    "CREATE INDEX ix_celery_guard_keys_expires_at ON celery_guard_keys (expires_at)",
)


def _indexes(alias: str) -> set[str]:
    connection = connections[alias]
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, "celery_guard_keys")
    return {name for name, info in constraints.items() if info["index"] and not info["primary_key"]}


def _upgrade(alias: str) -> None:
    with connections[alias].schema_editor(atomic=False) as editor:
        MIGRATION.upgrade(None, editor)


@pytest.mark.parametrize("alias", ["default", "sqlite"])
def test_0002_upgrades_a_first_schema_database_and_can_run_again(alias: str) -> None:
    assert {RUNNING_INDEX, PRUNABLE_INDEX} <= _indexes(alias), "0001 on a new database"
    with connections[alias].cursor() as cursor:
        for name in (RUNNING_INDEX, PRUNABLE_INDEX):
            cursor.execute(f"DROP INDEX {name}")
        for statement in LEGACY_DDL:
            cursor.execute(statement)
    assert set(LEGACY_KEY_INDEXES) <= _indexes(alias)
    for _ in range(2):
        _upgrade(alias)
        found = _indexes(alias)
        assert {RUNNING_INDEX, PRUNABLE_INDEX} <= found
        assert not set(LEGACY_KEY_INDEXES) & found
    assert MIGRATION.Migration.atomic is False
