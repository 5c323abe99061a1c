"""System checks (``python manage.py check``; Celery's Django fixup runs them at worker start).

They catch what would otherwise surface only at the first task: a database the store cannot
live on, and a Celery app whose guard does not use Django's database.
"""

from __future__ import annotations

from typing import Any

import django
from celery import _state as celery_state
from celery.fixups.django import DjangoFixup
from django.conf import settings
from django.core import checks

from celery_guard.errors import ConfigurationError
from celery_guard.install import GuardRuntime
from celery_guard.runtime import find_runtime

from .database import DEFAULT_ALIAS, check_alias
from .integration import NAME


def _alias() -> Any:
    return getattr(settings, "CELERY_GUARD_DATABASE", None) or DEFAULT_ALIAS


def check_database(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """The store's alias exists and is PostgreSQL or an SQLite file (E001); SQLite takes its
    write lock when a transaction begins (W001)."""
    alias = _alias()
    if not isinstance(alias, str):
        return [
            checks.Error(
                f"CELERY_GUARD_DATABASE must be a database alias, got {alias!r}",
                hint="Name one of the keys of DATABASES.",
                id="celery_guard.E001",
            )
        ]
    try:
        check_alias(alias)
    except ConfigurationError as exc:
        return [checks.Error(str(exc), id="celery_guard.E001")]
    found: list[checks.CheckMessage] = []
    database = settings.DATABASES[alias]
    if (
        database.get("ENGINE", "").endswith("sqlite3")
        and django.VERSION >= (5, 1)
        and str((database.get("OPTIONS") or {}).get("transaction_mode", "")).upper() != "IMMEDIATE"
    ):
        found.append(
            checks.Warning(
                f"Django database {alias!r} is SQLite with deferred transactions: a task body "
                "that reads before it writes in self.guard.atomic() can fail with 'database is "
                "locked' while the guard renews a lease on the same file.",
                hint=f"Set DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
                id="celery_guard.W001",
            )
        )
    return found


def check_celery_apps(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """Every Celery app loaded here with celery_guard installed uses the Django integration
    (W002) and has Celery's Django fixup, which closes Django's connections around every task
    and after fork (W003)."""
    found: list[checks.CheckMessage] = []
    for app in list(celery_state._get_active_apps()):
        runtime = find_runtime(app)
        if not isinstance(runtime, GuardRuntime):
            continue
        integration = runtime.integration
        if integration is None or integration.name != NAME:
            found.append(
                checks.Warning(
                    f"Celery app {app.main!r} has celery_guard installed without the Django "
                    "integration: its store is not Django's database, and self.guard.atomic() "
                    "is not available.",
                    hint="Call celery_guard.contrib.django.install(app) instead of "
                    "celery_guard.install(app).",
                    id="celery_guard.W002",
                )
            )
        if not any(isinstance(fixup, DjangoFixup) for fixup in getattr(app, "_fixups", ())):
            found.append(
                checks.Warning(
                    f"Celery app {app.main!r} has no Django fixup: its workers neither set "
                    "Django up nor close Django's connections around tasks and after fork.",
                    hint="Set DJANGO_SETTINGS_MODULE before creating the Celery app, as "
                    "Celery's 'First steps with Django' does.",
                    id="celery_guard.W003",
                )
            )
    return found
