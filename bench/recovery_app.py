"""The Celery app bench/recovery.py runs in real workers: a long task, plain and guarded.

Configured from the environment so the benchmark process and its workers agree:

- ``BENCH_BROKER_URL``: the Redis broker. Its transport options are left alone, so the visibility
  timeout is kombu's default (3600 s), as a user who never touched it has.
- ``BENCH_MARKER_URL``: Redis where each execution of a long task records its start.
- ``BENCH_STORE_URL``: PostgreSQL, celery_guard's store and the ``bench_effects`` table.
- ``BENCH_INSTALL_GUARD``: ``0`` makes this a plain Celery app (no ``celery_guard.install``, so no
  reaper bootstep either); the vanilla variant runs that way.
- ``BENCH_LEASE_URL``, ``BENCH_LEASE_TTL``, ``BENCH_REAPER_INTERVAL``, ``BENCH_LIVENESS_LOCKS``
  (``0``/``1``): ``guard_lease_url``, ``guard_lease_ttl``, ``guard_reaper_interval`` and
  ``guard_liveness_locks``, set only when given (else celery_guard's defaults apply).

No result backend: every task ignores results. The effect of a long task is one row in
``bench_effects``; a guarded task writes it in ``self.guard.transaction()``, so it commits together
with the key's COMPLETED marker.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, cast

import redis
from celery import Celery
from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Engine,
    Integer,
    MetaData,
    NullPool,
    String,
    Table,
    create_engine,
    insert,
)

import celery_guard
from celery_guard import GuardedTask

STORE_URL = os.environ.get("BENCH_STORE_URL", "postgresql+psycopg://postgres@127.0.0.1/bench")
MARKER_URL = os.environ.get("BENCH_MARKER_URL", "redis://127.0.0.1:6379/1")
GUARDED = os.environ.get("BENCH_INSTALL_GUARD", "1") != "0"

app = Celery(
    "recovery_app",
    broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"),
    set_as_current=False,
)
app.conf.update(
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    guard_store_url=STORE_URL,
    # Several workers on one host: no metrics endpoint (each would need its own port).
    guard_metrics_port=None,
)
if os.environ.get("BENCH_LEASE_URL"):
    app.conf.guard_lease_url = os.environ["BENCH_LEASE_URL"]
if os.environ.get("BENCH_LEASE_TTL"):
    app.conf.guard_lease_ttl = float(os.environ["BENCH_LEASE_TTL"])
if os.environ.get("BENCH_REAPER_INTERVAL"):
    app.conf.guard_reaper_interval = float(os.environ["BENCH_REAPER_INTERVAL"])
if os.environ.get("BENCH_LIVENESS_LOCKS"):
    app.conf.guard_liveness_locks = os.environ["BENCH_LIVENESS_LOCKS"] != "0"
if GUARDED:
    celery_guard.install(app)

metadata = MetaData()
#: One row per execution that committed its effect.
effects = Table(
    "bench_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tag", String(64), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("fencing_token", BigInteger),
    Column("started_at", Double, nullable=False),
    Column("finished_at", Double, nullable=False),
)

_per_process: dict[str, tuple[int, Any]] = {}


def _engine() -> Engine:
    """The plain task's engine; NullPool: one connection per task, nothing shared across fork."""
    pid, engine = _per_process.get("engine", (None, None))
    if pid != os.getpid():
        engine = create_engine(STORE_URL, poolclass=NullPool)
        _per_process["engine"] = (os.getpid(), engine)
    return cast(Engine, engine)


def _markers() -> redis.Redis:
    pid, client = _per_process.get("markers", (None, None))
    if pid != os.getpid():
        client = redis.Redis.from_url(MARKER_URL, socket_timeout=5, socket_connect_timeout=5)
        _per_process["markers"] = (os.getpid(), client)
    return cast(redis.Redis, client)


def started_key(tag: str) -> str:
    """Redis list with one JSON entry per execution of ``tag`` that started: pid and time."""
    return f"bench:started:{tag}"


def _record_start(tag: str) -> float:
    started = time.time()
    _markers().rpush(started_key(tag), json.dumps({"pid": os.getpid(), "at": started}))
    return started


def _work(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


@app.task(name="recovery.plain_long", bind=True, acks_late=True, reject_on_worker_lost=True)
def plain_long(self: Any, tag: str, seconds: float) -> None:
    """Works for ``seconds``, then writes its row: plain Celery with the recommended options."""
    started = _record_start(tag)
    _work(seconds)
    with _engine().begin() as connection:
        connection.execute(
            insert(effects).values(
                tag=tag, pid=os.getpid(), started_at=started, finished_at=time.time()
            )
        )


@app.task(name="recovery.guarded_long", base=GuardedTask, bind=True, idempotency_key="long:{tag}")
def guarded_long(self: Any, tag: str, seconds: float) -> None:
    """The same work, guarded: the row commits with the key's COMPLETED marker."""
    started = _record_start(tag)
    _work(seconds)
    with self.guard.transaction() as connection:
        connection.execute(
            insert(effects).values(
                tag=tag,
                pid=os.getpid(),
                fencing_token=self.guard.fencing_token,
                started_at=started,
                finished_at=time.time(),
            )
        )


@app.task(name="recovery.guarded_sleep", base=GuardedTask, bind=True, idempotency_key="sleep:{n}")
def guarded_sleep(self: Any, n: int, seconds: float) -> None:
    """Only sleeps: while it runs, the database sees nothing but celery_guard's own statements."""
    time.sleep(seconds)
