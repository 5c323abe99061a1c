"""The shop's own tables, importable without configuring the app (which reads the environment)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Integer, MetaData, String, Table

metadata = MetaData()
#: One row per body execution that committed: what the tests count.
effects = Table(
    "effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tag", String(200), nullable=False),
    Column("idempotency_key", String(255)),
    Column("fencing_token", BigInteger),
    Column("pid", Integer),
)

#: One row per retry celery_guard decided, with its full-jitter delay.
retry_log = Table(
    "retry_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idempotency_key", String(255), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("delay", Float, nullable=False),
)
