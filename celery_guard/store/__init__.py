"""The store: the durable source of truth for idempotency keys.

``SqlStore`` (``sql.py``) is made of one part per table (``keys``, ``dead_letters``,
``recovery``, ``publishes``, ``workers``) over one shared engine (``engine.py``); the tables
themselves are in ``schema.py`` (``celery_guard.store.schema.keys`` is the keys ``Table``:
``celery_guard.store.keys`` is the module of its statements).
"""

from celery_guard.store.base import ClaimOutcome, ClaimRequest, ClaimResult, KeyRecord
from celery_guard.store.schema import ClaimReason, KeyState, metadata
from celery_guard.store.sql import SqlStore

__all__ = [
    "ClaimOutcome",
    "ClaimReason",
    "ClaimRequest",
    "ClaimResult",
    "KeyRecord",
    "KeyState",
    "SqlStore",
    "metadata",
]
