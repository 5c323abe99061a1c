"""The keys table's partial indexes and storage parameters, on a database ``0001_initial`` made
with the first schema: the steps of ``celery_guard/store/upgrade.py`` (what ``celery guard
migrate`` runs), on Django's connection. Each step checks first, so on a database made with the
current schema (by ``0001_initial`` now, or by a worker) nothing happens.

Not atomic: PostgreSQL builds the indexes ``CONCURRENTLY``, which a transaction forbids, so the
claims of running workers are not blocked while a large table is indexed."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from celery_guard.store.upgrade import upgrade_keys_table

_VENDORS = {"postgresql": "postgresql", "sqlite": "sqlite"}


def upgrade(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    dialect = _VENDORS.get(connection.vendor)
    if dialect is None:  # a database the store cannot live on (see 0001_initial)
        return

    def execute(statement: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(statement)

    def query(statement: str) -> list[Any]:
        with connection.cursor() as cursor:
            cursor.execute(statement)
            return list(cursor.fetchall())

    if dialect == "postgresql":
        # An index build on a large table outlasts a project's statement_timeout, if it has one.
        execute("SET statement_timeout = 0")
        try:
            upgrade_keys_table(dialect, execute, query)
        finally:
            execute("RESET statement_timeout")
    else:
        upgrade_keys_table(dialect, execute, query)


class Migration(migrations.Migration):  # type: ignore[misc]  # django ships no types
    atomic = False
    dependencies = [("celery_guard", "0001_initial")]
    operations = [migrations.RunPython(upgrade, migrations.RunPython.noop, elidable=False)]
