"""The guard's tables, as ``celery_guard/store/schema.py`` declares them (one source of truth):
the DDL is SQLAlchemy's ``CreateTable``/``CreateIndex`` of that metadata, compiled for the
database the migration runs on, with ``IF NOT EXISTS`` so a database whose tables a worker or
``celery guard migrate`` created already is adopted as it is."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import migrations
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable, DropTable

from celery_guard.store.schema import metadata

_DIALECTS = {
    "postgresql": postgresql.dialect(),  # type: ignore[no-untyped-call]
    "sqlite": sqlite.dialect(),
}


def _on_store_alias(schema_editor: Any) -> bool:
    """The tables live only in the store's database (``CELERY_GUARD_DATABASE``); migrating
    the project's other databases leaves them alone (Django's advice for RunPython in a
    project with several databases)."""
    alias = getattr(settings, "CELERY_GUARD_DATABASE", None) or "default"
    return bool(schema_editor.connection.alias == alias)


def _dialect(schema_editor: Any) -> Any:
    vendor = schema_editor.connection.vendor
    if vendor not in _DIALECTS:
        raise RuntimeError(
            f"celery_guard's tables run on PostgreSQL and SQLite, not {vendor}: point "
            "CELERY_GUARD_DATABASE at an alias of one of them"
        )
    return _DIALECTS[vendor]


def create_tables(apps: Any, schema_editor: Any) -> None:
    if not _on_store_alias(schema_editor):
        return
    dialect = _dialect(schema_editor)
    for table in metadata.sorted_tables:
        schema_editor.execute(str(CreateTable(table, if_not_exists=True).compile(dialect=dialect)))
        for index in sorted(table.indexes, key=lambda index: str(index.name)):
            schema_editor.execute(
                str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect))
            )


def drop_tables(apps: Any, schema_editor: Any) -> None:
    if not _on_store_alias(schema_editor):
        return
    dialect = _dialect(schema_editor)
    for table in reversed(metadata.sorted_tables):
        schema_editor.execute(str(DropTable(table, if_exists=True).compile(dialect=dialect)))


class Migration(migrations.Migration):  # type: ignore[misc]  # django ships no types
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(create_tables, drop_tables, elidable=False)]
