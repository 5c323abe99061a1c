"""The floor: the least a durable two-statement claim costs, as a Celery task base class.

bench/overhead.py measures celery_guard's ``GuardedTask`` against this, so that what the guard
costs above what any durable claim must cost is visible apart from what the claim itself costs.
:class:`FloorTask` does exactly what a durable two-statement claim must do, and nothing else:

1. before the body, ONE ``INSERT ... ON CONFLICT ... DO UPDATE ... RETURNING token`` on a
   connection kept per process in autocommit, through a server-side prepared statement
   (psycopg ``prepare=True``); the row has a lease column, and a RUNNING row whose lease has
   expired is taken over with the next token. Its commit does not wait for the WAL flush
   (``synchronous_commit`` off for that transaction, as celery_guard's claim by default);
   :attr:`FloorTask.claim_synchronous_commit` ``None`` makes it wait (``--variants
   floor_flush``);
2. the body's writes go through :meth:`FloorTask.transaction` (an SQLAlchemy connection from
   the bench's own engine, as the plain tasks use), and the token-checked ``UPDATE ... SET
   state = 'COMPLETED'`` runs inside that transaction, before its one COMMIT; a body that
   never opened a transaction gets the UPDATE autocommitted on the kept connection.

With ``one_commit = True`` (:class:`OneCommitFloorTask`) the claim runs inside the body's
transaction instead (``BEGIN; claim; body; COMPLETED; COMMIT``): one commit per task, the
ceiling the claim-inside-the-transaction design could reach. A concurrent duplicate then waits
on the uncommitted row's unique index entry and sees it once the first commits.

What it does NOT do (everything ``GuardedTask`` does beyond this is its own bookkeeping):
no fencing check beyond the token in the UPDATE's WHERE clause, no lease renewal (a body
longer than ``LEASE_SECONDS`` can be taken over), no retries and no failure policy (an
exception leaves the key RUNNING until the lease lapses), no dead letters, no stored message
and so no recovery of a lost message (the broker's redelivery only), no fingerprint (a
different payload under the same key is a duplicate), no result stored or returned to a
duplicate, no store-error handling (a lost connection fails the task), no metrics, no signals,
no circuit breaker, no watchdog, and a duplicate or in-flight delivery is simply acknowledged
(skipped), never deferred. It is a measuring stick, not something to run tasks with.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import psycopg
from celery import Task
from sqlalchemy import Column, Connection, Double, Engine, Integer, MetaData, String, Table

#: Seconds a claim's lease lasts (never renewed).
LEASE_SECONDS = 300.0

FLOOR_KEYS = "bench_floor_keys"


def define_table(metadata: MetaData) -> Table:
    """The floor's key table: key, state, token and the lease's expiry."""
    return Table(
        FLOOR_KEYS,
        metadata,
        Column("key", String(200), primary_key=True),
        Column("state", String(16), nullable=False),
        Column("token", Integer, nullable=False),
        Column("lease_expires_at", Double, nullable=True),
    )


# Epoch seconds by the database's clock, as celery_guard's own columns are.
_NOW = "extract(epoch from clock_timestamp())"


def claim_sql(synchronous_commit: str | None) -> str:
    """The claim; with ``synchronous_commit`` ("off"), its own commit at that level, set in
    its RETURNING as celery_guard's claim does (``guard_claim_synchronous_commit``)."""
    level = (
        f", set_config('synchronous_commit', '{synchronous_commit}', true)"
        if synchronous_commit
        else ""
    )
    return (
        f"INSERT INTO {FLOOR_KEYS} AS k (key, state, token, lease_expires_at) "
        f"VALUES (%(key)s, 'RUNNING', 1, {_NOW} + %(lease)s) "
        "ON CONFLICT (key) DO UPDATE SET state = 'RUNNING', token = k.token + 1, "
        "lease_expires_at = excluded.lease_expires_at "
        f"WHERE k.state = 'RUNNING' AND k.lease_expires_at <= {_NOW} "
        f"RETURNING token{level}"
    )


COMPLETE = (
    f"UPDATE {FLOOR_KEYS} SET state = 'COMPLETED', lease_expires_at = NULL "
    "WHERE key = %(key)s AND token = %(token)s AND state = 'RUNNING'"
)


class _PerProcess:
    """The kept autocommit connection, opened on first use after fork (never inherited)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.connection: psycopg.Connection[Any] | None = None

    def get(self, dsn: str) -> psycopg.Connection[Any]:
        if self.pid != os.getpid() or self.connection is None or self.connection.closed:
            self.connection = psycopg.connect(dsn, autocommit=True)
            self.pid = os.getpid()
        return self.connection


def forget_connection() -> None:
    """Close this process's kept connection; the next claim opens a new session."""
    connection = FloorTask._kept.connection
    FloorTask._kept.connection = None
    if connection is not None and FloorTask._kept.pid == os.getpid():
        connection.close()


class FloorTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A task run at most once per key by the two statements above (see the module docstring).

    Subclasses set :attr:`engine` (a callable returning the per-process SQLAlchemy engine the
    body's transaction borrows from), :attr:`dsn` and :attr:`floor_key` (a format string over
    the keyword arguments).
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    one_commit: ClassVar[bool] = False
    #: The claim's own commit level (``None``: the session's, which waits for the WAL flush).
    claim_synchronous_commit: ClassVar[str | None] = "off"
    floor_key: ClassVar[str] = "{row_id}"
    dsn: ClassVar[str] = ""
    _kept = _PerProcess()
    _parameter_names: ClassVar[list[str] | None] = None

    @staticmethod
    def engine() -> Engine:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = self._parameter_names
        if names is None:
            names = type(self)._parameter_names = list(inspect.signature(self.run).parameters)
        key = self.floor_key.format(**dict(zip(names, args, strict=False)), **kwargs)
        request = self.request
        request.floor_connection = None
        request.floor_transaction = None
        if self.one_commit:
            return self._call_one_commit(key, args, kwargs)
        kept = self._kept.get(self.dsn)
        claim = claim_sql(self.claim_synchronous_commit)
        row = kept.execute(claim, {"key": key, "lease": LEASE_SECONDS}, prepare=True).fetchone()
        if row is None:
            return None  # COMPLETED, or RUNNING under a live lease: skipped, acknowledged
        token = row[0]
        try:
            value = self.run(*args, **kwargs)
            connection = request.floor_connection
            if connection is None:
                kept.execute(COMPLETE, {"key": key, "token": token}, prepare=True)
            else:
                driver = connection.connection.driver_connection
                driver.execute(COMPLETE, {"key": key, "token": token}, prepare=True)
                request.floor_transaction.commit()
            return value
        finally:
            if request.floor_connection is not None:
                request.floor_connection.close()  # rolls back whatever did not commit

    def _call_one_commit(self, key: str, args: Any, kwargs: Any) -> Any:
        request = self.request
        connection = request.floor_connection = self.engine().connect()
        request.floor_transaction = connection.begin()
        try:
            driver = connection.connection.driver_connection
            row = driver.execute(
                claim_sql(None), {"key": key, "lease": LEASE_SECONDS}, prepare=True
            ).fetchone()
            if row is None:
                return None
            value = self.run(*args, **kwargs)
            driver.execute(COMPLETE, {"key": key, "token": row[0]}, prepare=True)
            request.floor_transaction.commit()
            return value
        finally:
            connection.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """The body's transaction; committed with the COMPLETED UPDATE after the body."""
        request = self.request
        if request.floor_connection is None:
            request.floor_connection = self.engine().connect()
            request.floor_transaction = request.floor_connection.begin()
        yield request.floor_connection


class OneCommitFloorTask(FloorTask):
    """The floor with the claim inside the body's transaction: one commit per task."""

    abstract = True
    one_commit = True
