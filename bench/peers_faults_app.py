"""bench/recovery_app.py's app with one "order" task four ways, for bench/peers.py's faults.

Imported by bench/peers.py and by its workers (``celery -A bench.peers_faults_app worker``). It
reads bench/recovery_app.py's environment (``BENCH_BROKER_URL``, ``BENCH_MARKER_URL``,
``BENCH_STORE_URL``, ``BENCH_INSTALL_GUARD``: ``0`` for the plain and peer workers), plus:

- ``BENCH_LOCK_URL``: Redis database of celery-once's and celery-singleton's locks;
- ``BENCH_ONCE_TIMEOUT``: celery-once's lock timeout for the order task (its ``once={'timeout'}``);
- ``BENCH_VISIBILITY_TIMEOUT``: the Redis transport's visibility timeout, and its unacked sweep
  every second, so a broker redelivery can be watched within the run (kombu's default is 3600 s,
  swept about every 100 s).

The order task, the same in all four variants: it records its start, works ``seconds / 2``,
writes one row to ``bench_effects`` (the effect being counted; a guarded task writes it in
``self.guard.transaction()``, which commits when the body returns), records that it wrote, then
works ``seconds / 2`` more. The business key is the order's ``tag``: ``idempotency_key``
``order:{tag}``, celery-once ``once={'keys': ['tag']}``, celery-singleton ``unique_on=['tag']``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import signals
from celery_once import QueueOnce
from celery_singleton import Singleton
from sqlalchemy import insert

from bench.recovery_app import _engine, _markers, _record_start, _work, app, effects, metadata
from celery_guard import GuardedTask

LOCK_URL = os.environ.get("BENCH_LOCK_URL", "redis://127.0.0.1:6379/2")
ONCE_TIMEOUT = int(os.environ.get("BENCH_ONCE_TIMEOUT", "3600"))

app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": LOCK_URL, "default_timeout": ONCE_TIMEOUT},
}
app.conf.singleton_backend_url = LOCK_URL
if os.environ.get("BENCH_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["BENCH_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }

__all__ = ["TASKS", "app", "effects", "ended_key", "metadata", "wrote_key"]


def wrote_key(tag: str) -> str:
    """Redis list with one JSON entry per execution of ``tag`` that passed its write."""
    return f"bench:wrote:{tag}"


def ended_key(tag: str) -> str:
    """Redis list with one JSON entry per delivery of ``tag`` that ended (``task_postrun``)."""
    return f"bench:ended:{tag}"


def _row(tag: str, started: float, token: int | None = None) -> Any:
    return insert(effects).values(
        tag=tag, pid=os.getpid(), fencing_token=token, started_at=started, finished_at=time.time()
    )


def _wrote(tag: str) -> None:
    _markers().rpush(wrote_key(tag), json.dumps({"pid": os.getpid(), "at": time.time()}))


def _unguarded(tag: str, seconds: float) -> None:
    started = _record_start(tag)
    _work(seconds / 2)
    with _engine().begin() as connection:
        connection.execute(_row(tag, started))
    _wrote(tag)
    _work(seconds / 2)


PLAIN = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}


@app.task(name="peers.plain_order", **PLAIN)
def plain_order(self: Any, tag: str, seconds: float) -> None:
    _unguarded(tag, seconds)


@app.task(
    name="peers.once_order",
    base=QueueOnce,
    once={"keys": ["tag"], "timeout": ONCE_TIMEOUT, "graceful": False},
    **PLAIN,
)
def once_order(self: Any, tag: str, seconds: float) -> None:
    _unguarded(tag, seconds)


@app.task(name="peers.singleton_order", base=Singleton, unique_on=["tag"], **PLAIN)
def singleton_order(self: Any, tag: str, seconds: float) -> None:
    _unguarded(tag, seconds)


@app.task(name="peers.guarded_order", base=GuardedTask, bind=True, idempotency_key="order:{tag}")
def guarded_order(self: Any, tag: str, seconds: float) -> None:
    started = _record_start(tag)
    _work(seconds / 2)
    with self.guard.transaction() as connection:
        connection.execute(_row(tag, started, self.guard.fencing_token))
    _wrote(tag)
    _work(seconds / 2)


TASKS = {
    "plain": plain_order,
    "once": once_order,
    "singleton": singleton_order,
    "guarded": guarded_order,
}


@signals.task_postrun.connect
def _record_end(task: Any = None, args: Any = None, state: Any = None, **_: Any) -> None:
    """Every delivery of an order that ended in a pool process, body run or not, and how."""
    if task is not None and task.name in {t.name for t in TASKS.values()} and args:
        entry = {"pid": os.getpid(), "at": time.time(), "state": str(state)}
        _markers().rpush(ended_key(str(args[0])), json.dumps(entry))
