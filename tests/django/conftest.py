"""The Django integration's tests: the example project (example_project/django_shop) with
pytest-django, on the rig's PostgreSQL (alias ``default``) and an SQLite file (alias
``sqlite``).

Django is configured here with ``settings.configure()`` from the project's settings module,
not through ``DJANGO_SETTINGS_MODULE``: the variable would reach every worker the rest of the
suite starts, and Celery's Django fixup would set Django up in them.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django
import pytest
from django.conf import settings

from celery_guard.install import GuardRuntime
from celery_guard.runtime import find_runtime
from tests.rig.procs import remove_at_exit
from tests.rig.servers import PostgresServer, RedisServer

_SQLITE_DIR = Path(tempfile.mkdtemp(prefix="django-shop-"))
remove_at_exit(_SQLITE_DIR)  # after pytest-django has dropped the test databases

# Read before anything imports the project's package, whose __init__ imports its Celery module,
# which sets the variable (as Django projects do).
_SETTINGS_MODULE_BEFORE = os.environ.get("DJANGO_SETTINGS_MODULE")

if not settings.configured:
    from example_project.django_shop import settings as shop_settings

    values = {name: getattr(shop_settings, name) for name in dir(shop_settings) if name.isupper()}
    values["DATABASES"] = {
        # Pointed at the rig's PostgreSQL by django_db_modify_db_settings, before pytest-django
        # creates the test database.
        "default": {"ENGINE": "django.db.backends.postgresql", "NAME": "django_shop"},
        "sqlite": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(_SQLITE_DIR / "shop.sqlite3"),
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 10},
            "TEST": {"NAME": str(_SQLITE_DIR / "test_shop.sqlite3")},
        },
    }
    settings.configure(**values)
    try:
        django.setup()  # imports the project's Celery app, whose module sets the variable
    finally:
        if _SETTINGS_MODULE_BEFORE is None:
            os.environ.pop("DJANGO_SETTINGS_MODULE", None)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(postgres: PostgresServer) -> None:
    """The ``default`` alias on the rig's PostgreSQL (pytest-django's hook for this)."""
    database = settings.DATABASES["default"]
    database.update(
        NAME=f"django_shop_{uuid.uuid4().hex[:8]}",
        USER="postgres",
        HOST="127.0.0.1",
        PORT=str(postgres.port),
    )


@pytest.fixture(scope="session")
def broker(redis_server: RedisServer) -> dict[str, str]:
    """The project's broker and result backend on the rig's Redis, for this process's app."""
    from example_project.django_shop import celery_app

    urls = {"broker": redis_server.url_for(8), "results": redis_server.url_for(9)}
    celery_app.conf.update(broker_url=urls["broker"], result_backend=urls["results"])
    return urls


def count(model: Any, **filters: Any) -> int:
    return int(model.objects.filter(**filters).count())


@pytest.fixture
def shop_app(broker: dict[str, str]) -> Any:
    """The project's Celery app, current in this process (``shared_task`` and
    ``delay_on_commit`` publish through the current app; other tests create apps of their own)."""
    from example_project.django_shop import celery_app

    celery_app.set_current()
    return celery_app


@pytest.fixture(scope="session", autouse=True)
def _close_store_connections(django_db_setup: None) -> Iterator[None]:
    """Close this process's store connections before pytest-django drops the test databases
    (PostgreSQL refuses to drop a database a session is still connected to)."""
    yield
    from example_project.django_shop import celery_app

    runtime = find_runtime(celery_app)
    if isinstance(runtime, GuardRuntime):
        runtime.store.dispose()
