"""The example shop: a Celery app whose charge task is guarded by a business key.

Copy from here. The broker and store come from the environment so the demo can point the app at
the private servers it starts; in your project they would be plain settings.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, insert

import celery_guard
from celery_guard import GuardedTask

app = Celery(
    "shop",
    broker=os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("SHOP_RESULT_URL", os.environ.get("SHOP_BROKER_URL")),
)
app.conf.update(
    # The store: the idempotency table lives here, and so do the tables the tasks write.
    guard_store_url=os.environ.get("SHOP_STORE_URL", "sqlite:///shop.sqlite3"),
    guard_lease_ttl=10,
    guard_result_ttl=7 * 24 * 3600,
    # Each worker serves its metrics on its own port (SHOP_METRICS_PORT); none when unset.
    guard_metrics_port=int(os.environ["SHOP_METRICS_PORT"])
    if os.environ.get("SHOP_METRICS_PORT")
    else None,
    guard_metrics_address="127.0.0.1",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
celery_guard.install(app)

metadata = MetaData()
payments = Table(
    "payments",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", Integer, nullable=False),
    Column("amount_cents", Integer, nullable=False),
    # Handed to the payment provider in a real shop, so it can refuse a stale owner's charge.
    Column("fencing_token", BigInteger, nullable=False),
    Column("worker", String(200), nullable=False),
)


@app.task(base=GuardedTask, bind=True, idempotency_key="charge:{order_id}")
def charge(self: Any, order_id: int, amount_cents: int) -> dict[str, Any]:
    """Charge an order once: the payment row and the key's COMPLETED marker commit together."""
    with self.guard.transaction() as connection:
        connection.execute(
            insert(payments).values(
                order_id=order_id,
                amount_cents=amount_cents,
                fencing_token=self.guard.fencing_token,
                worker=self.request.hostname or "?",
            )
        )
    return {"order_id": order_id, "charged_cents": amount_cents}
