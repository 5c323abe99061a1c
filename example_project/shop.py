"""The example shop: a Celery app whose order tasks change the world once per order.

Copy from here. When an order is placed, the shop's checkout enqueues three tasks:

* ``charge_payment``: charge the card at the payment provider (an HTTP service), record it;
* ``reserve_stock``: reserve the ordered units in the ``stock`` table;
* ``send_invoice``: render the invoice PDF and issue it (an outbox row a mail relay sends).

Each one's message may arrive more than once: the checkout retries a publish it is unsure of,
Redis redelivers an unacknowledged message, a worker dies mid-task and its task runs again, a
frozen worker wakes up after another one took its task over. Each task is therefore a
``GuardedTask`` with a *business key* (``charge:{order_id}``): whichever delivery claims the key
first runs the body; the others get its stored result back. The body's database writes happen
in ``self.guard.transaction()``, so they commit together with the key's COMPLETED marker, or not
at all. The one effect outside the database, the charge, carries the key and the execution's
fencing token to the provider, which uses them to refuse a repeat and a stale owner.

The broker, store and provider come from the environment so the demo can point this app at
the private servers it starts; in your project they would be plain settings.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

import celery_guard
from celery_guard import Fenced, GuardedTask
from example_project import domain
from example_project.domain import invoices, metadata, orders, payments, reservations, stock
from example_project.payment_provider import PaymentProvider, StaleFencingToken

__all__ = ["app", "invoices", "metadata", "orders", "payments", "reservations", "stock"]


def _setting(name: str, default: str) -> str:
    return os.environ.get(f"SHOP_{name}", default)


app = Celery(
    "shop",
    broker=_setting("BROKER_URL", "redis://127.0.0.1:6379/0"),
    # No result backend: the checkout does not wait for results. With one, a prevented duplicate
    # returns the first execution's result like any successful task.
    backend=os.environ.get("SHOP_RESULT_URL") or None,
)
app.conf.update(
    # The store: celery_guard's key table lives here, and so must every table the tasks write
    # in self.guard.transaction() (one database, one transaction).
    guard_store_url=_setting("STORE_URL", "sqlite:///shop.sqlite3"),
    # How long a claim's lease lasts without renewal. A worker that dies (or freezes) mid-task is
    # taken over about this long after its last heartbeat. Production: the default, 10 s; the
    # demo sets 3 s so its chaos finishes quickly.
    guard_lease_ttl=float(_setting("LEASE_TTL", "10")),
    # How often each worker's reaper looks for orphaned keys and re-publishes their messages.
    guard_reaper_interval=float(_setting("REAPER_INTERVAL", "2")),
    # A key that has been claimed this many times without completing is dead-lettered at its
    # next claim: that is what stops a poison pill that kills its process every time.
    guard_max_attempts=int(_setting("MAX_ATTEMPTS", "5")),
    # Full-jitter retry delays: random(0, min(max, base * 2**attempt)) seconds.
    guard_backoff_base=float(_setting("BACKOFF_BASE", "1")),
    guard_backoff_max=float(_setting("BACKOFF_MAX", "60")),
    # A COMPLETED key keeps deduplicating for a week.
    guard_result_ttl=7 * 24 * 3600,
    # Each worker serves Prometheus metrics on its own port (SHOP_METRICS_PORT); none when unset.
    guard_metrics_port=int(os.environ["SHOP_METRICS_PORT"])
    if os.environ.get("SHOP_METRICS_PORT")
    else None,
    guard_metrics_address="127.0.0.1",
    # One message per pool process at a time: a worker that dies holds as few messages as it can.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
# Validates the guard_* keys, hooks worker start and fork, and stamps the publish time on every
# message this process sends (so install it in the checkout's process too).
celery_guard.install(app)

provider = PaymentProvider(_setting("PAYMENT_PROVIDER_URL", "http://127.0.0.1:8099"))


def _written_by(task: Any) -> dict[str, Any]:
    """Who wrote a row: this execution's fencing token, task id and worker (for auditing)."""
    return {
        "fencing_token": task.guard.fencing_token,
        "task_id": task.request.id,
        "worker": task.request.hostname,
    }


@app.task(
    base=GuardedTask,
    bind=True,
    name="shop.charge_payment",
    idempotency_key="charge:{order_id}",
    # The provider fails transiently now and then (HTTP 503, classified as transient from the
    # exception's status_code), and each attempt is cheap: allow more than the app's limit.
    max_attempts=8,
)
def charge_payment(self: Any, order_id: int, amount_cents: int) -> dict[str, Any]:
    """Charge an order's card once, however often this message is delivered."""
    # About to act outside the store's database: if this execution has already lost its lease
    # (its worker froze, or lost the store, past the TTL), another worker may own the key now.
    # check() raises Fenced; celery_guard then answers with the new owner's outcome.
    self.guard.check()
    try:
        charge = provider.charge(
            order_id,
            amount_cents,
            # The same key on every execution: a repeat after a takeover gets the first charge.
            idempotency_key=self.guard.key,
            # Rises with every new owner: the provider refuses an older owner's request.
            fencing_token=self.guard.fencing_token,
            client=self.request.hostname,
        )
    except StaleFencingToken:
        # The provider has seen a newer owner of this key: this execution was taken over while
        # it ran. Nothing it does may count any more.
        raise Fenced(self.guard.key, self.guard.fencing_token) from None
    # Keep network calls outside the transaction: it holds database locks until the body returns.
    with self.guard.transaction() as connection:
        domain.record_payment(
            connection,
            order_id=order_id,
            amount_cents=amount_cents,
            provider_charge_id=charge["id"],
            **_written_by(self),
        )
    return {"order_id": order_id, "charge_id": charge["id"]}


@app.task(
    base=GuardedTask, bind=True, name="shop.reserve_stock", idempotency_key="reserve:{order_id}"
)
def reserve_stock(self: Any, order_id: int, sku: str, quantity: int) -> dict[str, Any]:
    """Reserve an order's units once: ``reserved = reserved + quantity`` must not run twice."""
    with self.guard.transaction() as connection:
        domain.reserve(
            connection, order_id=order_id, sku=sku, quantity=quantity, **_written_by(self)
        )
    return {"order_id": order_id, "sku": sku, "reserved": quantity}


@app.task(
    base=GuardedTask, bind=True, name="shop.send_invoice", idempotency_key="invoice:{order_id}"
)
def send_invoice(self: Any, order_id: int, customer_email: str, vat_number: str) -> str:
    """Render and issue an order's invoice once.

    The renderer crashes its process on some VAT numbers (see ``domain.render_invoice_pdf``).
    Each crash costs one attempt, counted when the key is claimed; once the app's
    ``guard_max_attempts`` are used up, the next delivery dead-letters the message instead of
    running it, and ``celery -A example_project.shop guard dlq list`` shows it.
    """
    pdf = domain.render_invoice_pdf(order_id, vat_number)
    with self.guard.transaction() as connection:
        return domain.issue_invoice(
            connection,
            order_id=order_id,
            customer_email=customer_email,
            pdf=pdf,
            **_written_by(self),
        )
