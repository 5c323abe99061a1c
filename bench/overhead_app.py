"""The Celery app bench/overhead.py runs in real workers: plain, the floor and GuardedTask.

Three task bodies, each in three variants: plain Celery, the floor (bench/floor.py: the least a
durable two-statement claim costs) and ``GuardedTask``. A fourth variant, GuardedTask with
every option that costs something on, runs the guarded tasks in a worker started with
``BENCH_GUARD_CONF`` (bench/overhead.py sets it).

- *noop*: returns.
- *credit*: inserts a start row in its own transaction, then its ledger row in the transaction
  the guard commits with its COMPLETED marker (``self.guard.transaction()``, the floor's
  ``self.transaction()``); plain Celery writes both in their own transactions.
- *insert*: one row in the guard's transaction (bench/peers.py compares it with its peers).

Configured from the environment so the benchmark process and its workers agree:
``BENCH_BROKER_URL`` (Redis broker), ``BENCH_REDIS_URL`` (Redis for the completion counter),
``BENCH_STORE_URL`` (PostgreSQL: celery_guard's store and the table the insert tasks write) and
``BENCH_PREFETCH`` (worker_prefetch_multiplier). No result backend: every task ignores results.

Completion is detected the same way for all four tasks: ``task_prerun`` records the first start
(once per process) and ``task_postrun`` increments a Redis counter and stamps the time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from celery import Celery, signals
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine, insert

import celery_guard
from bench import floor
from bench.floor import FloorTask, OneCommitFloorTask
from celery_guard import GuardedTask

DONE_KEY = "bench:done"
FIRST_START_KEY = "bench:first_start"
LAST_END_KEY = "bench:last_end"

STORE_URL = os.environ.get("BENCH_STORE_URL", "postgresql+psycopg://postgres@127.0.0.1/bench")

app = Celery(
    "overhead_app",
    broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"),
    set_as_current=False,
)
app.conf.update(
    guard_store_url=STORE_URL,
    task_ignore_result=True,
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
)
# Extra guard_* settings for experiments, e.g. BENCH_GUARD_CONF='{"guard_metrics_port": null}'.
app.conf.update(json.loads(os.environ.get("BENCH_GUARD_CONF") or "{}"))
celery_guard.install(app)

metadata = MetaData()
rows = Table(
    "bench_rows",
    metadata,
    Column("row_id", Integer, primary_key=True),
    Column("variant", String(32), nullable=False),
)
#: The credit task's first write, committed on its own before the guarded part.
starts = Table(
    "bench_starts",
    metadata,
    Column("row_id", Integer, primary_key=True),
    Column("variant", String(32), nullable=False),
)
floor_keys = floor.define_table(metadata)

T = TypeVar("T")
_per_process: dict[str, tuple[int, Any]] = {}


def per_process(name: str, factory: Callable[[], T]) -> T:
    """One ``factory()`` value per process, built on first use after fork (never inherited)."""
    pid, value = _per_process.get(name, (None, None))
    if pid != os.getpid():
        value = factory()
        _per_process[name] = (os.getpid(), value)
    return value  # type: ignore[no-any-return]


def plain_engine() -> Engine:
    return per_process("engine", lambda: create_engine(STORE_URL))


def counter() -> redis.Redis:
    url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/1")
    return per_process("redis", lambda: redis.Redis.from_url(url))


# -- the four tasks ---------------------------------------------------------------------------
# GuardedTask forces acks_late and reject_on_worker_lost; the plain tasks get the same.
PLAIN = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}


@app.task(name="bench.plain_noop", **PLAIN)
def plain_noop(self: Any, row_id: int) -> None:
    return None


@app.task(name="bench.plain_insert", **PLAIN)
def plain_insert(self: Any, row_id: int) -> None:
    with plain_engine().begin() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="plain_insert"))


@app.task(name="bench.guarded_noop", base=GuardedTask, bind=True, idempotency_key="noop:{row_id}")
def guarded_noop(self: Any, row_id: int) -> None:
    return None


@app.task(name="bench.guarded_insert", base=GuardedTask, bind=True, idempotency_key="row:{row_id}")
def guarded_insert(self: Any, row_id: int) -> None:
    with self.guard.transaction() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="guarded_insert"))


def _start(row_id: int, variant: str) -> None:
    with plain_engine().begin() as connection:
        connection.execute(insert(starts).values(row_id=row_id, variant=variant))


@app.task(name="bench.plain_credit", **PLAIN)
def plain_credit(self: Any, row_id: int) -> None:
    _start(row_id, "plain_credit")
    with plain_engine().begin() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="plain_credit"))


@app.task(name="bench.guarded_credit", base=GuardedTask, bind=True, idempotency_key="cr:{row_id}")
def guarded_credit(self: Any, row_id: int) -> None:
    _start(row_id, "guarded_credit")
    with self.guard.transaction() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="guarded_credit"))


class BenchFloor(FloorTask):  # type: ignore[misc]
    abstract = True
    dsn = STORE_URL.replace("postgresql+psycopg://", "postgresql://")
    engine = staticmethod(plain_engine)
    # BENCH_FLOOR_CLAIM_COMMIT="" makes the floor's claim wait for its WAL flush (floor_flush).
    claim_synchronous_commit = os.environ.get("BENCH_FLOOR_CLAIM_COMMIT", "off") or None


class BenchOneCommitFloor(OneCommitFloorTask):  # type: ignore[misc]
    abstract = True
    dsn = BenchFloor.dsn
    engine = staticmethod(plain_engine)


@app.task(name="bench.floor_noop", base=BenchFloor, bind=True, floor_key="noop:{row_id}")
def floor_noop(self: Any, row_id: int) -> None:
    return None


@app.task(name="bench.floor_credit", base=BenchFloor, bind=True, floor_key="cr:{row_id}")
def floor_credit(self: Any, row_id: int) -> None:
    _start(row_id, "floor_credit")
    with self.transaction() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="floor_credit"))


@app.task(name="bench.floor1_noop", base=BenchOneCommitFloor, bind=True, floor_key="n1:{row_id}")
def floor1_noop(self: Any, row_id: int) -> None:
    return None


@app.task(name="bench.floor1_credit", base=BenchOneCommitFloor, bind=True, floor_key="c1:{row_id}")
def floor1_credit(self: Any, row_id: int) -> None:
    # The start row commits on its own connection while the claim's transaction is open.
    _start(row_id, "floor1_credit")
    with self.transaction() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="floor1_credit"))


TASKS = {
    "plain_noop": plain_noop,
    "guarded_noop": guarded_noop,
    "plain_insert": plain_insert,
    "guarded_insert": guarded_insert,
    "plain_credit": plain_credit,
    "guarded_credit": guarded_credit,
    "floor_noop": floor_noop,
    "floor_credit": floor_credit,
    "floor1_noop": floor1_noop,
    "floor1_credit": floor1_credit,
}


# -- completion detection, identical for every task ---------------------------------------------


_started_in_pid: int | None = None


@signals.task_prerun.connect
def _record_first_start(**_: Any) -> None:
    global _started_in_pid
    if _started_in_pid != os.getpid():  # once per process: the earliest SET wins
        _started_in_pid = os.getpid()
        counter().set(FIRST_START_KEY, repr(time.time()), nx=True)


@signals.task_postrun.connect
def _count_done(**_: Any) -> None:
    pipe = counter().pipeline(transaction=False)
    pipe.incr(DONE_KEY).set(LAST_END_KEY, repr(time.time())).execute()
