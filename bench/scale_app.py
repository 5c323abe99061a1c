"""The Celery app bench/scale.py's many-claimers run starts in real workers.

One ``GuardedTask``, keyed by its argument (``idempotency_key="scale:{n}"``), that writes its
effect row in the transaction the guard commits with the key's COMPLETED marker: one row per
key, however many messages repeat it and however many workers claim at once.

Configured from the environment so the benchmark and its workers agree: ``BENCH_BROKER_URL``
(Redis) and ``BENCH_STORE_URL`` (the store, whose database holds the effect table too: the
effect commits on the guard's own connection).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from sqlalchemy import BigInteger, Column, Double, Integer, MetaData, String, Table, insert, text

import celery_guard
from celery_guard import GuardedTask
from celery_guard.store.schema import EPOCH_NOW_SQL

STORE_URL = os.environ.get("BENCH_STORE_URL", "postgresql+psycopg://postgres@127.0.0.1/bench")

app = Celery(
    "scale_app",
    broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"),
    set_as_current=False,
)
app.conf.update(
    guard_store_url=STORE_URL,
    guard_metrics_port=None,  # several workers share this host
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
)
# Extra guard_* settings, e.g. BENCH_GUARD_CONF='{"guard_store_pooling": "transaction"}'
# (bench/scale.py --pgbouncer).
app.conf.update(json.loads(os.environ.get("BENCH_GUARD_CONF") or "{}"))
celery_guard.install(app)

metadata = MetaData()
effects = Table(
    "bench_scale_effects",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("key", String(64), nullable=False),
    Column("worker", String(255), nullable=False),
    # When the effect committed, by the database's clock: the drain rate leaves start-up out.
    Column("at", Double, nullable=False, server_default=text(EPOCH_NOW_SQL["postgresql"])),
)


@app.task(name="bench.scale.effect", base=GuardedTask, bind=True, idempotency_key="scale:{n}")
def effect(self: Any, n: int) -> int:
    with self.guard.transaction() as connection:
        connection.execute(
            insert(effects).values(key=f"scale:{n}", worker=str(self.request.hostname))
        )
    return n
