"""The canvas tasks of ``tests/acceptance/test_canvas_dropin.py``, defined on any app.

The same bodies run on a plain Celery app (``canvas_plain``) and on one whose ``task_cls`` is
``celery_guard:GuardedTask`` (``canvas_guarded``), so a test can compare both outcomes. Counters
live in Redis (the result backend's database) so the test process reads what each body did.
Tasks are not shared (``shared=False``): each app keeps its own.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, chord, group

_client: redis.Redis | None = None


def counters() -> redis.Redis:
    """The Redis client the counters live in (created on first use, per process)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["CANVAS_RESULT_URL"])
    return _client


def bump(name: str) -> int:
    """Count one event; returns the count so far (bodies use it to act on their n-th run)."""
    return int(counters().incr(f"canvas:{name}"))


def count(name: str) -> int:
    value = counters().get(f"canvas:{name}")
    return int(value) if value is not None else 0


def define(app: Celery) -> None:
    """Register the canvas tasks on ``app``."""

    @app.task(name="canvas.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="canvas.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    @app.task(name="canvas.mark", shared=False)
    def mark(value: Any, tag: str) -> Any:
        """A link callback: counts its calls and passes its parent's value on."""
        bump(f"mark:{tag}")
        return value

    @app.task(name="canvas.on_error", shared=False)
    def on_error(request: Any, exc: BaseException, traceback: Any, tag: str) -> None:
        """An errback in Celery's (request, exc, traceback) form: counts its calls."""
        bump(f"errback:{tag}")

    @app.task(name="canvas.fail", shared=False)
    def fail(tag: str) -> None:
        """Raises an exception no classification names (RuntimeError) on every run."""
        bump(f"run:{tag}")
        raise RuntimeError(f"fail {tag}")

    @app.task(name="canvas.fail_with", shared=False)
    def fail_with(tag: str, kind: str) -> None:
        bump(f"run:{tag}")
        raise {"connection": ConnectionError, "runtime": RuntimeError}[kind](tag)

    @app.task(name="canvas.replace_with_add", bind=True, shared=False)
    def replace_with_add(self: Any, x: int, tag: str) -> Any:
        bump(f"run:{tag}")
        raise self.replace(add.si(x, 100))

    @app.task(name="canvas.replace_with_chord", bind=True, shared=False)
    def replace_with_chord(self: Any, n: int, tag: str) -> Any:
        bump(f"run:{tag}")
        raise self.replace(chord([add.si(i, i) for i in range(n)], tsum.s()))

    @app.task(name="canvas.retry_then_add", bind=True, shared=False)
    def retry_then_add(self: Any, x: int, tag: str, retries: int = 1) -> int:
        """Calls ``self.retry()`` ``retries`` times, then returns ``x + 1``."""
        if bump(f"run:{tag}") <= retries:
            raise self.retry(countdown=0.05, max_retries=retries)
        return x + 1

    @app.task(name="canvas.retry_forever", bind=True, shared=False, max_retries=2)
    def retry_forever(self: Any, tag: str) -> None:
        bump(f"run:{tag}")
        raise self.retry(countdown=0.05, exc=LookupError(tag))

    @app.task(name="canvas.sleep", shared=False)
    def sleep(seconds: float, tag: str) -> str:
        bump(f"run:{tag}")
        time.sleep(seconds)
        return tag

    @app.task(name="canvas.start_one", shared=False)
    def start_one(x: int) -> Any:
        """Returns the AsyncResult of a task it started."""
        return add.delay(x, x)

    @app.task(name="canvas.start_group", shared=False)
    def start_group(n: int) -> Any:
        """Returns the GroupResult of a group it started."""
        return group(add.si(i, i) for i in range(n)).apply_async()
