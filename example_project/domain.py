"""The shop's tables and business steps, shared by the guarded app and its plain-Celery twin.

Nothing here knows about Celery or celery_guard: each function takes an open SQLAlchemy
``Connection`` and does one business step. ``shop.py`` runs them inside
``self.guard.transaction()`` (so they commit together with the idempotency key's COMPLETED
marker, or not at all); ``plain_shop.py`` runs the very same steps in an ordinary transaction,
which is what lets the demo compare the two fairly.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Double,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    insert,
    update,
)

metadata = MetaData()

#: Orders as the web shop's checkout writes them, before it enqueues the tasks below.
orders = Table(
    "orders",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("customer_email", String(200), nullable=False),
    Column("sku", String(40), nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("amount_cents", Integer, nullable=False),
    Column("vat_number", String(64), nullable=False),
    Column("created_at", Double, nullable=False),
)

#: Units on hand and units reserved for paid orders, per product.
stock = Table(
    "stock",
    metadata,
    Column("sku", String(40), primary_key=True),
    Column("on_hand", Integer, nullable=False),
    Column("reserved", Integer, nullable=False),
)

# The three effect tables below deliberately have no UNIQUE(order_id): the demo counts the rows
# plain Celery writes twice. In your own schema do add one. It is a good last line of defence,
# but it fires only after the payment provider has already taken the money a second time.

#: One row per successful charge the shop recorded.
payments = Table(
    "payments",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", Integer, nullable=False, index=True),
    Column("amount_cents", Integer, nullable=False),
    Column("provider_charge_id", String(64), nullable=False),
    # Which execution wrote the row: the fencing token (GuardedTask only), the Celery task id and
    # the worker. Handy when auditing, as the demo does.
    Column("fencing_token", BigInteger, nullable=True),
    Column("task_id", String(64), nullable=True),
    Column("worker", String(200), nullable=True),
    Column("created_at", Double, nullable=False),
)

#: One row per stock reservation (and ``stock.reserved`` went up by its quantity).
reservations = Table(
    "reservations",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", Integer, nullable=False, index=True),
    Column("sku", String(40), nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("fencing_token", BigInteger, nullable=True),
    Column("task_id", String(64), nullable=True),
    Column("worker", String(200), nullable=True),
    Column("created_at", Double, nullable=False),
)

#: One row per invoice issued. A mail relay (not part of the example) emails each new row: an
#: *outbox*. Writing the row in the task's transaction, instead of calling the mail server from
#: the task, is how an effect outside the database gets exactly-once without fencing support.
invoices = Table(
    "invoices",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", Integer, nullable=False, index=True),
    Column("number", String(40), nullable=False),
    Column("emailed_to", String(200), nullable=False),
    Column("pdf_bytes", Integer, nullable=False),
    Column("fencing_token", BigInteger, nullable=True),
    Column("task_id", String(64), nullable=True),
    Column("worker", String(200), nullable=True),
    Column("created_at", Double, nullable=False),
)

#: Products the demo sells, each with plenty of stock.
SKUS = ("mug", "teapot", "kettle", "grinder", "scale", "filter", "beans-1kg", "beans-250g")

#: The (pretend) native PDF library's buffer for a VAT number; longer ones crash it.
VAT_NUMBER_BUFFER = 20


def record_payment(
    connection: Connection,
    *,
    order_id: int,
    amount_cents: int,
    provider_charge_id: str,
    fencing_token: int | None = None,
    task_id: str | None = None,
    worker: str | None = None,
) -> None:
    """Record a charge the payment provider confirmed."""
    connection.execute(
        insert(payments).values(
            order_id=order_id,
            amount_cents=amount_cents,
            provider_charge_id=provider_charge_id,
            fencing_token=fencing_token,
            task_id=task_id,
            worker=worker,
            created_at=time.time(),
        )
    )


def reserve(
    connection: Connection,
    *,
    order_id: int,
    sku: str,
    quantity: int,
    fencing_token: int | None = None,
    task_id: str | None = None,
    worker: str | None = None,
) -> None:
    """Reserve ``quantity`` units of ``sku`` for an order.

    ``reserved = reserved + quantity`` is not idempotent: run twice, it reserves twice. That is
    the kind of write an idempotency key protects.
    """
    connection.execute(
        update(stock).where(stock.c.sku == sku).values(reserved=stock.c.reserved + quantity)
    )
    connection.execute(
        insert(reservations).values(
            order_id=order_id,
            sku=sku,
            quantity=quantity,
            fencing_token=fencing_token,
            task_id=task_id,
            worker=worker,
            created_at=time.time(),
        )
    )


def render_invoice_pdf(order_id: int, vat_number: str) -> bytes:
    """Render an invoice. Stands in for a native PDF library with a bug.

    A VAT number longer than the library's buffer makes it crash the whole process (as a
    segfault would): no Python exception, no error handler, nothing logged by the task. Such a
    message is a *poison pill*: every process that takes it dies.
    """
    time.sleep(0.05)  # rendering takes a moment
    if len(vat_number) > VAT_NUMBER_BUFFER:
        time.sleep(0.25)
        os.kill(os.getpid(), signal.SIGKILL)
    return f"%PDF-1.7 invoice {order_id} VAT {vat_number}".encode()


def issue_invoice(
    connection: Connection,
    *,
    order_id: int,
    customer_email: str,
    pdf: bytes,
    fencing_token: int | None = None,
    task_id: str | None = None,
    worker: str | None = None,
) -> str:
    """Issue the order's invoice (the outbox row the mail relay sends); return its number."""
    number = f"INV-{order_id:06d}"
    connection.execute(
        insert(invoices).values(
            order_id=order_id,
            number=number,
            emailed_to=customer_email,
            pdf_bytes=len(pdf),
            fencing_token=fencing_token,
            task_id=task_id,
            worker=worker,
            created_at=time.time(),
        )
    )
    return number


def sqlite_engine(url: str, timeout: float = 5.0) -> Engine:
    """A SQLAlchemy engine for a SQLite file shared by several processes.

    WAL lets readers run beside the one writer; ``BEGIN IMMEDIATE`` takes the write lock when the
    transaction starts, so a busy database waits up to ``timeout`` instead of failing at the
    first write. (celery_guard configures its own SQLite store the same way.)
    """
    engine = create_engine(url, connect_args={"timeout": timeout})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event issues BEGIN
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
