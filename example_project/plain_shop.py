"""The same shop on plain Celery: the demo's control group. Do not copy this one.

The task bodies call the same business steps as ``shop.py``, configured as a careful Celery user
would: ``acks_late`` and ``reject_on_worker_lost`` (a message is acknowledged only after its body
ran, and comes back when the pool process running it dies), ``autoretry_for`` the provider's
transient errors with jittered exponential backoff, one prefetched message per process, and the
Redis transport's default visibility timeout (one hour). What it cannot have is an idempotency
key or a fencing token: nothing tells a second delivery of a message that the first one already
ran, so each delivery charges, reserves and invoices again.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from sqlalchemy import Engine, create_engine

from example_project import domain
from example_project.payment_provider import PaymentProvider, ProviderUnavailable

app = Celery(
    "plain_shop",
    broker=os.environ.get("PLAIN_SHOP_BROKER_URL", "redis://127.0.0.1:6379/2"),
    set_as_current=False,
)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # Said out loud: the Redis transport's default. A message whose worker died is redelivered
    # only after it; a shorter one redelivers tasks that are merely slow (or frozen), which then
    # run twice.
    broker_transport_options={"visibility_timeout": 3600},
)

provider = PaymentProvider(os.environ.get("PLAIN_SHOP_PROVIDER_URL", "http://127.0.0.1:8099"))

_engine: Engine | None = None
_engine_pid: int | None = None


def engine() -> Engine:
    """One engine per process, created after fork (an engine used before fork loses writes)."""
    global _engine, _engine_pid
    if _engine is None or _engine_pid != os.getpid():
        url = os.environ.get("PLAIN_SHOP_DB_URL", "sqlite:///plain_shop.sqlite3")
        _engine = domain.sqlite_engine(url) if url.startswith("sqlite") else create_engine(url)
        _engine_pid = os.getpid()
    return _engine


def _written_by(task: Any) -> dict[str, Any]:
    return {"task_id": task.request.id, "worker": task.request.hostname}


_RETRY = {
    "autoretry_for": (ProviderUnavailable, ConnectionError, TimeoutError),
    "retry_backoff": 1,
    "retry_backoff_max": 2,
    "retry_jitter": True,
    "max_retries": 8,
}


@app.task(bind=True, name="plain_shop.charge_payment", **_RETRY)
def charge_payment(self: Any, order_id: int, amount_cents: int) -> dict[str, Any]:
    charge = provider.charge(order_id, amount_cents, client=self.request.hostname)
    with engine().begin() as connection:
        domain.record_payment(
            connection,
            order_id=order_id,
            amount_cents=amount_cents,
            provider_charge_id=charge["id"],
            **_written_by(self),
        )
    return {"order_id": order_id, "charge_id": charge["id"]}


@app.task(bind=True, name="plain_shop.reserve_stock")
def reserve_stock(self: Any, order_id: int, sku: str, quantity: int) -> dict[str, Any]:
    with engine().begin() as connection:
        domain.reserve(
            connection, order_id=order_id, sku=sku, quantity=quantity, **_written_by(self)
        )
    return {"order_id": order_id, "sku": sku, "reserved": quantity}


@app.task(bind=True, name="plain_shop.send_invoice")
def send_invoice(self: Any, order_id: int, customer_email: str, vat_number: str) -> str:
    pdf = domain.render_invoice_pdf(order_id, vat_number)
    with engine().begin() as connection:
        return domain.issue_invoice(
            connection,
            order_id=order_id,
            customer_email=customer_email,
            pdf=pdf,
            **_written_by(self),
        )
