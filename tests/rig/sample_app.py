"""Tiny Celery app for the rig's own tests; broker and result backend come from RIG_BROKER_URL.

Run from this directory as ``celery -A sample_app worker``. The task has an explicit name so
it is the same whether the module is imported as ``sample_app`` or ``rig.sample_app``.
"""

from __future__ import annotations

import os

from celery import Celery

_url = os.environ.get("RIG_BROKER_URL", "redis://127.0.0.1:6379/0")

app = Celery("sample_app", broker=_url, backend=_url, set_as_current=False)
app.conf.broker_connection_retry_on_startup = True


@app.task(name="sample_app.add")
def add(x: int, y: int) -> int:
    return x + y
