"""``self.guard``: what a running task body sees of its own guarded execution."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, RootTransaction

from celery_guard.errors import Fenced, GuardError
from celery_guard.lease.heartbeat import Lease
from celery_guard.store.sql import SqlStore


class Execution:
    """One execution of a task body, as the body sees it through ``self.guard``.

    The body's writes in :meth:`transaction` stay uncommitted until the body returns; then they
    commit together with the key's COMPLETED marker and result, or not at all.
    """

    def __init__(
        self,
        store: SqlStore,
        *,
        key: str | None,
        fencing_token: int | None,
        attempts: int,
        claim_reason: str | None,
        lease: Lease | None = None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._connection: Connection | None = None
        self._transaction: RootTransaction | None = None
        self._finished = False
        #: The idempotency key this execution owns (``None`` for a direct, unguarded call).
        self.key = key
        #: Strictly increasing per key: pass it to stores outside the database so they can refuse
        #: writes from an older owner.
        self.fencing_token = fencing_token
        #: How many executions (this one included) have claimed the key.
        self.attempts = attempts
        #: ``NEW``, ``RETRY`` or ``TAKEOVER`` (see :class:`celery_guard.store.ClaimReason`).
        self.claim_reason = claim_reason
        self._started = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the claim."""
        return time.monotonic() - self._started

    @property
    def guarded(self) -> bool:
        """False when the task was called directly as a function: there is no key to protect."""
        return self.key is not None

    def check(self) -> None:
        """Raise :class:`~celery_guard.Fenced` if this execution lost its lease.

        Call it before an effect outside the store's database: once fenced, another owner may
        run the key, and :attr:`fencing_token` is no longer the newest.
        """
        if self._lease is not None:
            self._lease.check()

    @property
    def fenced(self) -> bool:
        """True once the lease is known lost (taken over, or not renewed past its TTL)."""
        if self._lease is None:
            return False
        try:
            self._lease.check()
        except Fenced:
            return True
        return False

    def progress(self, info: object = None) -> None:
        """Report progress; with a ``progress_timeout`` this is what keeps the lease renewed."""
        if self._lease is not None:
            self._lease.progress(info)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """The task's database transaction in the store's database.

        Use it for every write that must happen once. Entering it again in the same execution
        yields the same connection and transaction. If the block raises, everything written in it
        is rolled back; otherwise it commits when the body returns, together with the COMPLETED
        marker (fencing-token checked).
        """
        if self._finished:
            raise GuardError("self.guard.transaction() was used after the task body returned")
        if self._connection is None:
            self._connection = self._store.connect()
            self._transaction = self._connection.begin()
        try:
            yield self._connection
        except BaseException:
            self.abort()
            raise

    def finish(self, result: str, retention: float | None) -> None:
        """Commit the body's writes and, for a guarded execution, the COMPLETED marker."""
        self._finished = True
        connection, transaction = self._connection, self._transaction
        try:
            # A lease known to be lost refuses the commit even if no one has taken over yet:
            # the reaper may already be re-publishing the key.
            self.check()
            if self.key is not None and self.fencing_token is not None:
                self._store.complete(
                    self.key, self.fencing_token, result, retention, connection=connection
                )
            if transaction is not None:
                self._store.commit(transaction)
        finally:
            self.abort()

    def abort(self) -> None:
        """Roll back and close the body's transaction, if one is open."""
        connection, transaction = self._connection, self._transaction
        self._connection = self._transaction = None
        try:
            if transaction is not None and transaction.is_active:
                transaction.rollback()
        finally:
            if connection is not None:
                connection.close()
