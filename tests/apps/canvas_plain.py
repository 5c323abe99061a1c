"""The canvas tasks on a plain Celery app: what ``canvas_guarded`` must behave like."""

from __future__ import annotations

import os

from celery import Celery

from tests.apps.canvas_tasks import define

app = Celery(
    "canvas_plain",
    broker=os.environ.get("CANVAS_BROKER_URL", "redis://127.0.0.1:6379/3"),
    backend=os.environ.get("CANVAS_RESULT_URL", "redis://127.0.0.1:6379/4"),
    set_as_current=False,
)
app.conf.update(
    task_default_queue="canvas-plain" + os.environ.get("CANVAS_QUEUE_SUFFIX", ""),
    worker_prefetch_multiplier=1,
    result_expires=600,
    broker_connection_retry_on_startup=True,
)
define(app)
