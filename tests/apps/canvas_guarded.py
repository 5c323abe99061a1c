"""The canvas tasks on an app whose every task is guarded (``task_cls``), as a user switching a
whole app would have it; otherwise configured as ``canvas_plain``."""

from __future__ import annotations

import json
import os

from celery import Celery

import celery_guard
from tests.apps.canvas_tasks import define

app = Celery(
    "canvas_guarded",
    broker=os.environ.get("CANVAS_BROKER_URL", "redis://127.0.0.1:6379/3"),
    backend=os.environ.get("CANVAS_RESULT_URL", "redis://127.0.0.1:6379/4"),
    set_as_current=False,
    task_cls="celery_guard:GuardedTask",
)
app.conf.update(
    task_default_queue="canvas-guarded" + os.environ.get("CANVAS_QUEUE_SUFFIX", ""),
    worker_prefetch_multiplier=1,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    guard_store_url=os.environ.get("CANVAS_STORE_URL", "sqlite:///canvas.sqlite3"),
    guard_lease_ttl=5.0,
    guard_reaper_interval=0.5,
    guard_backoff_base=0.02,
    guard_backoff_max=0.1,
    guard_metrics_port=None,
)
# Per-run settings (the failure policy a test compares), as JSON.
app.conf.update(json.loads(os.environ.get("CANVAS_GUARD_CONF") or "{}"))
define(app)
celery_guard.install(app)
