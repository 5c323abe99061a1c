"""A Django-style app: its settings on one object, read with ``namespace="CELERY"``.

As ``app.config_from_object("django.conf:settings", namespace="CELERY")`` reads a Django
settings module: Celery's keys are ``CELERY_BROKER_URL`` ..., the guard's
``CELERY_GUARD_STORE_URL`` ..., next to settings of other libraries. Values come from the
environment, as in ``tests/apps/shop.py``: ``CG_BROKER_URL``, ``CG_STORE_URL`` (unset: the
embedded SQLite default), ``CG_EXTRA_SETTINGS`` (JSON, added as they are spelled), and
``CG_INSTALL_FIRST=1`` to call ``celery_guard.install(app)`` before ``config_from_object``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from sqlalchemy import insert

import celery_guard
from tests.apps.shop_tables import effects


class Settings:
    """Stands for a Django settings module."""

    DEBUG = False
    INSTALLED_APPS = ("shop",)
    CELERY_BROKER_URL = os.environ.get("CG_BROKER_URL", "memory://")
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
    CELERY_WORKER_PREFETCH_MULTIPLIER = 1
    CELERY_GUARD_LEASE_TTL = 5.0
    CELERY_GUARD_REAPER_INTERVAL = 1.0
    CELERY_GUARD_METRICS_PORT = None  # several test workers share this host


if os.environ.get("CG_STORE_URL"):
    Settings.CELERY_GUARD_STORE_URL = os.environ["CG_STORE_URL"]  # type: ignore[attr-defined]
for _name, _value in json.loads(os.environ.get("CG_EXTRA_SETTINGS") or "{}").items():
    setattr(Settings, _name, _value)

app = Celery("namespaced", set_as_current=False, task_cls="celery_guard:GuardedTask")
if os.environ.get("CG_INSTALL_FIRST") == "1":
    celery_guard.install(app)
    app.config_from_object(Settings, namespace="CELERY")
else:
    app.config_from_object(Settings, namespace="CELERY")
    celery_guard.install(app)


@app.task(name="namespaced.record", bind=True, idempotency_key="ns:{tag}")
def record(self: Any, tag: str) -> str:
    """One effect row in the store's database, written in the claim's transaction."""
    with self.guard.transaction() as connection:
        connection.execute(
            insert(effects).values(
                tag=tag,
                idempotency_key=self.guard.key,
                fencing_token=self.guard.fencing_token,
                pid=os.getpid(),
            )
        )
    return tag


@app.task(name="namespaced.ping", idempotency_key="ping:{tag}")
def ping(tag: str) -> str:
    """Touches no table of its own: runs on a store with only the guard's tables."""
    return tag
