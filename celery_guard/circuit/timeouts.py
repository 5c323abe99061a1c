"""Which store errors were timeouts (they drive adaptive concurrency as well as the breaker)."""

from __future__ import annotations

import sqlite3

import psycopg.errors
import redis.exceptions
from sqlalchemy import exc as sa_exc

_TIMEOUT_TYPES: tuple[type[BaseException], ...] = (
    TimeoutError,  # socket timeouts too
    sa_exc.TimeoutError,  # no pooled connection free in time
    redis.exceptions.TimeoutError,
    psycopg.errors.QueryCanceled,  # statement_timeout
    psycopg.errors.LockNotAvailable,  # lock_timeout
    *((psycopg.errors.ConnectionTimeout,) if hasattr(psycopg.errors, "ConnectionTimeout") else ()),
)

#: A failed call that took this share of ``guard_store_timeout`` or more ran into the timeout,
#: whatever its error says (a connect timeout reads "connection timeout expired" on one libpq
#: and "timeout expired" on another).
NEAR_TIMEOUT = 0.9


def is_timeout(error: BaseException) -> bool:
    """True when ``error`` (a StoreError) or what caused it was a timeout."""
    todo: list[BaseException] = [error]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _TIMEOUT_TYPES):
            return True
        if isinstance(current, sqlite3.OperationalError) and "locked" in str(current):
            return True  # SQLite's busy_timeout ran out
        # SQLAlchemy keeps the driver's exception in ``orig``; ours keep theirs as the cause.
        for nested in (getattr(current, "orig", None), current.__cause__, current.__context__):
            if isinstance(nested, BaseException):
                todo.append(nested)
    return False


def timed_out(error: BaseException | None, seconds: float, store_timeout: float) -> bool:
    """Whether a store call that ended with ``error`` after ``seconds`` counts as a timeout."""
    if error is None:
        return False
    return is_timeout(error) or seconds >= NEAR_TIMEOUT * store_timeout
