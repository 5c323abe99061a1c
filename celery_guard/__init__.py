"""celery_guard: idempotency and self-healing for ordinary Celery tasks.

At-least-once delivery stays; what changes is the effect: a guarded task commits to the store's
database once per idempotency key, however often its message is delivered.
"""

from celery_guard.config import GuardConfig
from celery_guard.errors import (
    ConfigurationError,
    DeadLettered,
    Fenced,
    GuardError,
    IdempotencyConflict,
    InFlightElsewhere,
    InvalidIdempotencyKey,
    PermanentError,
    ResultNotSerializable,
    ResultTooLarge,
    StoreError,
    StoreUnavailable,
    TransactionMisuse,
    TransientError,
    UnserializableArguments,
)
from celery_guard.execution import Execution
from celery_guard.install import GuardRuntime, get_runtime, install
from celery_guard.keys import BY_ARGUMENTS, MAX_KEY_LENGTH
from celery_guard.store.schema import metadata
from celery_guard.task import GuardedTask

__version__ = "0.1.0"

__all__ = [
    "BY_ARGUMENTS",
    "MAX_KEY_LENGTH",
    "ConfigurationError",
    "DeadLettered",
    "Execution",
    "Fenced",
    "GuardConfig",
    "GuardError",
    "GuardRuntime",
    "GuardedTask",
    "IdempotencyConflict",
    "InFlightElsewhere",
    "InvalidIdempotencyKey",
    "PermanentError",
    "ResultNotSerializable",
    "ResultTooLarge",
    "StoreError",
    "StoreUnavailable",
    "TransactionMisuse",
    "TransientError",
    "UnserializableArguments",
    "__version__",
    "get_runtime",
    "install",
    "metadata",
]
