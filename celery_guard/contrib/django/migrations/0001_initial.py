"""The guard's tables, as ``celery_guard/store/schema.py`` declares them (one source of truth):
the DDL is SQLAlchemy's ``CreateTable``/``CreateIndex`` of that metadata, compiled for the
database the migration runs on, with ``IF NOT EXISTS`` so a database whose tables a worker or
``celery guard migrate`` created already is adopted as it is."""

from __future__ import annotations

from typing import Any

from django.db import migrations
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable, DropTable

from celery_guard.store.schema import metadata

_DIALECTS = {
    "postgresql": postgresql.dialect(),  # type: ignore[no-untyped-call]
    "sqlite": sqlite.dialect(),
}


def _dialect(schema_editor: Any) -> Any:
    """The dialect of the database being migrated, or ``None`` where the store cannot live
    (a project's MySQL ``default`` beside a PostgreSQL store alias): nothing is created there.
    Which databases the migration runs on is Django's to decide (``migrate --database``, and a
    router's ``allow_migrate`` for the app label ``celery_guard``, which RunPython honours)."""
    return _DIALECTS.get(schema_editor.connection.vendor)


def create_tables(apps: Any, schema_editor: Any) -> None:
    dialect = _dialect(schema_editor)
    if dialect is None:
        return
    for table in metadata.sorted_tables:
        schema_editor.execute(str(CreateTable(table, if_not_exists=True).compile(dialect=dialect)))
        for index in sorted(table.indexes, key=lambda index: str(index.name)):
            schema_editor.execute(
                str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect))
            )


def drop_tables(apps: Any, schema_editor: Any) -> None:
    dialect = _dialect(schema_editor)
    if dialect is None:
        return
    for table in reversed(metadata.sorted_tables):
        schema_editor.execute(str(DropTable(table, if_exists=True).compile(dialect=dialect)))


class Migration(migrations.Migration):  # type: ignore[misc]  # django ships no types
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(create_tables, drop_tables, elidable=False)]
