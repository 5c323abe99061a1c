"""``self.guard``: what a running task body sees of its own guarded execution."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from sqlalchemy import Connection, RootTransaction
from sqlalchemy.orm import Session

from celery_guard.errors import ConfigurationError, Fenced, GuardError, TransactionMisuse
from celery_guard.lease.heartbeat import Lease
from celery_guard.store.base import KeyStore

logger = logging.getLogger("celery_guard")


class JoinedTransaction(Protocol):
    """A transaction on a connection celery_guard does not own (Django's, for one) that the
    completion marker joins: celery_guard ends it, committing it only with the marker.

    ``celery_guard.contrib.django`` provides one for ``self.guard.atomic()``.
    """

    @property
    def misuse(self) -> TransactionMisuse | None:
        """The error for the body's attempt to end this transaction itself, if it made one."""

    def complete(self, key: str, token: int, result: str, retention: float | None) -> None:
        """Run the token-checked completion marker inside it; ``Fenced`` when not owned."""

    def commit(self) -> None:
        """Commit it (the body's writes and the marker); failures the store did not answer
        are ``StoreError``."""

    def rollback(self) -> None:
        """Roll it back, if still open (called again after an end, it does nothing)."""


#: Opens ``self.guard.atomic(**options)`` for an execution; it joins the execution (see
#: :meth:`Execution.join`) on first use. Given by an integration (``celery_guard.contrib.django``).
AtomicFactory = Callable[["Execution", dict[str, Any]], AbstractContextManager[Any]]


class Execution:
    """One execution of a task body, as the body sees it through ``self.guard``.

    The body's writes in :meth:`transaction` stay uncommitted until the body returns; then they
    commit together with the key's COMPLETED marker and result, or not at all.
    """

    def __init__(
        self,
        store: KeyStore,
        *,
        key: str | None,
        fencing_token: int | None,
        attempts: int,
        claim_reason: str | None,
        lease: Lease | None = None,
        atomic: AtomicFactory | None = None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._atomic = atomic
        self._joined: JoinedTransaction | None = None
        #: The joined transaction's misuse, kept once it has ended.
        self._joined_misuse: TransactionMisuse | None = None
        self._connection: Connection | None = None
        self._transaction: RootTransaction | None = None
        self._finished = False
        #: Set once celery_guard itself ends the transaction (commit, rollback on failure).
        self._ending = False
        #: The boundary ("commit", "rollback") the body tried and was refused, if any.
        self._misuse: str | None = None
        self._committed = False
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

        The transaction is celery_guard's to end: ``commit()``, ``rollback()`` or ``close()`` on
        the connection (or through an ORM ``Session`` in ``control_fully`` mode) raises
        :class:`~celery_guard.TransactionMisuse` and reaches nothing, and the execution then
        fails without committing anything. To undo a part of the work, use a savepoint
        (``with conn.begin_nested():``); for the ORM, :meth:`session`.
        """
        if self._finished:
            raise GuardError("self.guard.transaction() was used after the task body returned")
        if self._joined is not None:
            raise TransactionMisuse(_BOTH)
        if self._connection is None:
            self._connection = self._store.connect(on_boundary=self._on_boundary)
            self._ending = False
            self._transaction = self._connection.begin()
        try:
            yield self._connection
        except BaseException:
            self.abort()
            raise

    def atomic(self, **options: Any) -> AbstractContextManager[Any]:
        """The body's transaction on a framework's own connection, joined to the completion.

        With ``celery_guard.contrib.django`` it is ``django.db.transaction.atomic`` on the
        store's database alias: the ORM writes in it, the key's COMPLETED marker and its result
        commit together when the body returns, or not at all (docs/django.md).
        """
        if self._finished:
            raise GuardError("self.guard.atomic() was used after the task body returned")
        if self._atomic is None:
            raise ConfigurationError(
                "self.guard.atomic() needs a framework integration: for Django, call "
                "celery_guard.contrib.django.install(app) instead of celery_guard.install(app) "
                "(docs/django.md); without one, use self.guard.transaction()"
            )
        return self._atomic(self, options)

    def join(self, transaction: JoinedTransaction) -> None:
        """Have the completion marker commit in ``transaction`` (an integration's ``atomic()``).

        One per execution, and not beside :meth:`transaction`: the marker can commit in only
        one of them.
        """
        if self._finished:
            raise GuardError("self.guard.atomic() was used after the task body returned")
        if self._connection is not None:
            raise TransactionMisuse(_BOTH)
        if self._joined is not None and self._joined is not transaction:
            raise GuardError("this execution has joined another transaction already")
        self._joined = transaction

    @property
    def joined(self) -> JoinedTransaction | None:
        """The transaction :meth:`join` was given and that has not ended yet, if any."""
        return self._joined

    @contextmanager
    def session(self, **options: Any) -> Iterator[Session]:
        """An SQLAlchemy ORM ``Session`` inside :meth:`transaction`.

        The session joins the guard's transaction through a savepoint
        (``join_transaction_mode="create_savepoint"``): ``session.commit()`` keeps its writes in
        the guard's transaction, which commits with the COMPLETED marker when the body returns;
        ``session.rollback()`` undoes the session's writes since its last commit, nothing else.
        When the block ends normally the session is committed that way (so forgetting
        ``commit()`` loses nothing); when it raises, its writes are rolled back with the rest
        of the execution's. ``expire_on_commit`` defaults to False: objects stay readable
        after the block. Other ``options`` go to ``Session``.
        """
        options.setdefault("expire_on_commit", False)
        with self.transaction() as connection:
            orm_session = Session(
                bind=connection, join_transaction_mode="create_savepoint", **options
            )
            try:
                yield orm_session
                orm_session.commit()
            finally:
                orm_session.close()

    @property
    def misuse(self) -> TransactionMisuse | None:
        """The error for the body's attempt to end the guard's transaction, if it made one."""
        if self._misuse is not None:
            return TransactionMisuse(_MISUSE[self._misuse])
        if self._joined is not None:
            return self._joined.misuse
        return self._joined_misuse

    def _on_boundary(self, action: str) -> None:
        """Called by the store before a transaction on the body's connection ends."""
        if self._ending:
            return
        self._misuse = action
        raise TransactionMisuse(_MISUSE[action])

    def finish(self, result: str, retention: float | None) -> None:
        """Commit the body's writes and, for a guarded execution, the COMPLETED marker."""
        self._finished = True
        connection, transaction, joined = self._connection, self._transaction, self._joined
        try:
            # A lease known to be lost refuses the commit even if no one has taken over yet:
            # the reaper may already be re-publishing the key.
            self.check()
            misuse = self.misuse
            if misuse is not None:
                # The body caught the refusal and returned: its writes still do not count.
                raise misuse
            if connection is not None and self._store.transaction_failed(connection):
                raise TransactionMisuse(_FAILED_STATEMENT)
            if joined is not None:
                if self.key is not None and self.fencing_token is not None:
                    joined.complete(self.key, self.fencing_token, result, retention)
                self._ending = True
                joined.commit()
                self._committed = True
            elif self.key is not None and self.fencing_token is not None:
                self._store.complete(
                    self.key, self.fencing_token, result, retention, connection=connection
                )
            if transaction is not None:
                self._ending = True
                self._store.commit(transaction)
                self._committed = True
        except BaseException:
            self.abort()
            raise
        if connection is None and joined is None:  # nothing opened (a no-op body's case)
            self._ending = True
            return
        try:
            self.abort()  # the commit landed: nothing is left to roll back, only to close
        except Exception as exc:
            # The execution is complete; a failure to hand the connection back must not turn
            # it into a failed one.
            logger.warning("celery_guard could not close a completed transaction: %s", exc)

    def abort(self) -> None:
        """Roll back and close the body's transaction, if one is open."""
        connection, transaction = self._connection, self._transaction
        self._connection = self._transaction = None
        self._ending = True
        joined, self._joined = self._joined, None
        if joined is not None:
            self._joined_misuse = self._joined_misuse or joined.misuse
            if not self._committed:
                joined.rollback()
        try:
            if transaction is not None and transaction.is_active:
                transaction.rollback()
            elif transaction is not None and connection is not None and not self._committed:
                # A commit or rollback refused by _on_boundary leaves SQLAlchemy's transaction
                # inactive while the database still holds it open, and close() would hand the
                # connection back to the pool as already reset (sqlalchemy/engine/base.py,
                # RootTransaction._do_commit keeps a failed commit for a rollback that
                # _close_impl skips once inactive). Discarding the connection ends it for sure.
                connection.invalidate()
        finally:
            if connection is not None:
                connection.close()


#: What a refused boundary says, by the action the body attempted.
_MISUSE = {
    "commit": (
        "the task body tried to commit the transaction of self.guard.transaction(); not allowed, "
        "nothing of this execution is committed. celery_guard commits the body's writes "
        "together with the key's COMPLETED marker when the body returns: remove the commit() "
        "(an ORM Session joins through self.guard.session(), where session.commit() is safe)"
    ),
    "rollback": (
        "the task body tried to roll back or close the connection of "
        "self.guard.transaction(); not allowed, nothing of this execution is committed. To undo "
        "part of the work use a savepoint (with conn.begin_nested(): ...); to give up the whole "
        "execution, raise from the body (an ORM Session joins through self.guard.session())"
    ),
}
_BOTH = (
    "self.guard.transaction() and self.guard.atomic() were both used in one execution: the "
    "COMPLETED marker commits in only one transaction, so use one of them"
)
_FAILED_STATEMENT = (
    "a statement failed inside self.guard.transaction() and the body caught its error: the "
    "database has aborted the transaction, so nothing of this execution can commit. Wrap a "
    "statement that may fail in a savepoint (with conn.begin_nested(): ...) and catch the "
    "error outside it"
)
