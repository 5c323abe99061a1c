"""bench/overhead_app.py's app with the same two tasks as celery-once and celery-singleton tasks.

Imported by bench/peers.py and by its workers (``celery -A bench.peers_app worker``). It reads the
same environment as bench/overhead_app.py, plus ``BENCH_LOCK_URL``: the Redis database both peers
keep their locks in (the same private Redis server as the broker, another database).

The peers lock at publish time (``apply_async``) and unlock when the task ends: celery-once in
``after_return`` (``DEL``), celery-singleton in ``on_success`` / ``on_failure`` (``DEL``). The
worker itself checks no lock, so only the unlock is inside the timed window of bench/overhead.py.
"""

from __future__ import annotations

import os
from typing import Any

from celery_once import QueueOnce
from celery_singleton import Singleton
from sqlalchemy import insert

from bench import overhead_app
from bench.overhead_app import (  # noqa: F401  (re-exported: bench/overhead.py's run_once reads them)
    DONE_KEY,
    FIRST_START_KEY,
    LAST_END_KEY,
    STORE_URL,
    app,
    metadata,
    plain_engine,
    rows,
)

LOCK_URL = os.environ.get("BENCH_LOCK_URL", "redis://127.0.0.1:6379/2")
#: celery-once's lock timeout when a task does not set one (its own default is 3600 s).
ONCE_TIMEOUT = 3600

app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": LOCK_URL, "default_timeout": ONCE_TIMEOUT},
}
app.conf.singleton_backend_url = LOCK_URL

# The same options as the plain tasks: acks_late and reject_on_worker_lost.
PEER = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}


@app.task(name="bench.once_noop", base=QueueOnce, once={"keys": ["row_id"]}, **PEER)
def once_noop(self: Any, row_id: int) -> None:
    return None


@app.task(name="bench.once_insert", base=QueueOnce, once={"keys": ["row_id"]}, **PEER)
def once_insert(self: Any, row_id: int) -> None:
    with plain_engine().begin() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="once_insert"))


@app.task(name="bench.singleton_noop", base=Singleton, unique_on=["row_id"], **PEER)
def singleton_noop(self: Any, row_id: int) -> None:
    return None


@app.task(name="bench.singleton_insert", base=Singleton, unique_on=["row_id"], **PEER)
def singleton_insert(self: Any, row_id: int) -> None:
    with plain_engine().begin() as connection:
        connection.execute(insert(rows).values(row_id=row_id, variant="singleton_insert"))


TASKS = {
    **overhead_app.TASKS,
    "once_noop": once_noop,
    "once_insert": once_insert,
    "singleton_noop": singleton_noop,
    "singleton_insert": singleton_insert,
}
#: Redis key patterns of each peer's locks, to check none is left after a run.
LOCK_PATTERNS = {"once": "qo_*", "singleton": "SINGLETONLOCK_*"}
