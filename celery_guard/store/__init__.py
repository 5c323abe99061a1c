"""The store: the durable source of truth for idempotency keys."""

from celery_guard.store.base import ClaimOutcome, ClaimRequest, ClaimResult, KeyRecord
from celery_guard.store.schema import ClaimReason, KeyState, keys, metadata
from celery_guard.store.sql import SqlStore

__all__ = [
    "ClaimOutcome",
    "ClaimReason",
    "ClaimRequest",
    "ClaimResult",
    "KeyRecord",
    "KeyState",
    "SqlStore",
    "keys",
    "metadata",
]
