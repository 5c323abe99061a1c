"""The SQL store: every statement celery_guard runs against the database is in this module.

One engine per process, created on first use after fork (a pooled connection shared across a
prefork fork loses writes). The guard's own single statements run in autocommit on PostgreSQL so
that a claim is exactly one round trip; on SQLite every transaction starts ``BEGIN IMMEDIATE`` so a
writer waits for the lock (``busy_timeout``) instead of failing on a read-to-write upgrade.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import psycopg
from sqlalchemy import (
    BigInteger,
    Connection,
    Double,
    Engine,
    RootTransaction,
    and_,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    exists,
    func,
    insert,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url

from celery_guard.config import GuardConfig
from celery_guard.errors import Fenced, StoreError, StoreUnavailable
from celery_guard.store.base import (
    ClaimOutcome,
    ClaimRequest,
    ClaimResult,
    DeadLetter,
    KeyRecord,
    PublishRecord,
    WorkerRecord,
)
from celery_guard.store.schema import (
    KeyState,
    db_epoch_now,
    dead_letters,
    keys,
    leaders,
    metadata,
    published,
    workers,
)
from celery_guard.store.watchdog import CallWatchdog

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Told about every store call: (seconds it took, the StoreError it ended with or ``None``).
StoreObserver = Callable[[float, StoreError | None], None]

#: Execution option: this SQLite transaction only reads, so it need not wait for the write lock.
_SQLITE_READ_ONLY = "celery_guard_read_only"

#: The ``celery_guard_leaders`` row whose ``term`` is the highest fencing token of any pruned
#: key row: a key's new row starts above it, so tokens rise across a prune too.
TOKEN_FLOOR = "celery_guard.token_floor"

RUNNING = KeyState.RUNNING.value
COMPLETED = KeyState.COMPLETED.value
RELEASED = KeyState.RELEASED.value
DEAD = KeyState.DEAD.value


class SqlStore:
    """The durable idempotency table on PostgreSQL or SQLite."""

    #: Told the outcome and latency of every call (the circuit breaker's counts); ``None``: none.
    observer: StoreObserver | None = None

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._engine_pid: int | None = None
        self._schema_ready = False
        #: PostgreSQL: this process's connection for the per-delivery statements (see _hot).
        self._hot = _HotConnection()
        self.dialect_name = make_url(config.store_url).get_backend_name()
        self._observing = threading.local()  # a call inside a call is not counted twice
        #: id(statement) -> (statement, driver SQL, fixed parameters); statements are built once.
        self._compiled_cache: dict[int, tuple[Any, str, dict[str, Any]]] = {}
        self._names_cache: dict[int, list[str]] = {}
        #: PostgreSQL: closes a call's connection when the server never answers (watchdog.py).
        self._watchdog = CallWatchdog(config.store_timeout + max(1.0, config.store_timeout / 2))

    # -- engine lifecycle ---------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This process's engine; a forked child builds its own instead of reusing the parent's."""
        pid = os.getpid()
        engine = self._engine
        if engine is not None and self._engine_pid == pid:
            return engine
        with self._lock:
            if self._engine is not None and self._engine_pid != pid:
                # Inherited across fork: drop the parent's pool without closing its sockets,
                # which the parent still uses (SQLAlchemy "Using Connection Pools with
                # Multiprocessing").
                self._engine.dispose(close=False)
                self._engine = None
                self._schema_ready = False
            if self._engine is None:
                self._engine = self._create_engine()
                self._engine_pid = pid
            return self._engine

    def reset_after_fork(self) -> None:
        """Forget the parent's engine; called from ``worker_process_init``."""
        with self._lock:
            self._hot.forget()
            if self._engine is not None and self._engine_pid != os.getpid():
                self._engine.dispose(close=False)
                self._engine = None
                self._schema_ready = False

    def dispose(self) -> None:
        """Close this process's connections (before a fork, or at shutdown)."""
        with self._lock:
            self._hot.close()
            if self._engine is not None and self._engine_pid == os.getpid():
                self._engine.dispose()
            self._engine = None
            self._schema_ready = False

    def _create_engine(self) -> Engine:
        timeout = self.config.store_timeout
        url = make_url(self.config.store_url)
        if self.dialect_name == "sqlite":
            engine = create_engine(url, connect_args={"timeout": timeout}, pool_timeout=timeout)
            _configure_sqlite(engine, timeout)
            _report_boundaries(engine)
            return engine
        millis = max(1, int(timeout * 1000))
        connect_args: dict[str, Any] = {
            # libpq rounds connect_timeout below 2 up to 2 seconds.
            "connect_timeout": max(2, int(timeout + 0.999)),
            # Bounds a statement stuck on the server (statement_timeout), a lock wait
            # (lock_timeout), and a peer that vanished mid-statement (tcp_user_timeout).
            "options": f"-c statement_timeout={millis} -c lock_timeout={millis}",
            "keepalives": 1,
            "keepalives_idle": max(1, int(timeout)),
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": millis,
            "application_name": "celery_guard",
        }
        engine = create_engine(url, connect_args=connect_args, pool_timeout=timeout)
        self._watchdog.install(engine)
        _report_boundaries(engine)
        return engine

    def ensure_schema(self) -> None:
        """Create the tables if they are missing (when ``guard_create_tables`` is on)."""
        if self._schema_ready:
            return
        try:
            self._call(lambda: metadata.create_all(self.engine, checkfirst=True))
        except StoreError:
            # Several processes starting at once race between "does it exist?" and CREATE;
            # the loser's CREATE fails on the winner's table. Look again: it is there now.
            self._call(lambda: metadata.create_all(self.engine, checkfirst=True))
        self._schema_ready = True

    def _ready_engine(self) -> Engine:
        engine = self.engine
        if self.config.create_tables and not self._schema_ready:
            self.ensure_schema()
        return engine

    # -- the primitives -----------------------------------------------------------------------

    def claim(self, request: ClaimRequest) -> ClaimResult:
        """Insert or take over the key's row in one statement and say what happened."""
        claim_id = uuid.uuid4().hex
        statement = _claim_statement(
            self.dialect_name, request.check_fingerprint, request.external_token is not None
        )
        parameters = {
            "p_key": request.key,
            "p_task_name": request.task_name,
            "p_owner": request.owner,
            "p_owner_lock": request.owner_lock,
            "p_claim_id": claim_id,
            "p_fingerprint": request.fingerprint,
            "p_message": request.message,
            "p_lease_ttl": request.lease_ttl,
        }
        if request.external_token is not None:
            parameters["p_external_token"] = request.external_token
        row = _only_row(self._call(lambda: self._execute_hot(statement, parameters))[0])
        record = KeyRecord.from_mapping(row)
        return ClaimResult(
            outcome=_classify(record, request, claim_id),
            record=record,
            lease_remaining=float(row["lease_remaining"] or 0.0),
        )

    def complete(
        self,
        key: str,
        token: int,
        result: str,
        retention: float | None,
        connection: Connection | None = None,
    ) -> None:
        """Mark the key COMPLETED with its result if ``token`` still owns it, else raise Fenced.

        With ``connection`` the marker joins that open transaction (the task's own writes) and the
        caller commits; without it the marker is one autocommitted statement.
        """
        statement = _complete_statement(retention is not None)
        parameters = {"p_key": key, "p_token": token, "p_result": result, "p_retention": retention}
        if connection is not None and self.dialect_name == "postgresql":
            rowcount = self._observed(
                lambda: self._execute_in_transaction(connection, statement, parameters)
            )
        elif connection is not None:
            rowcount = self._call(lambda: connection.execute(statement, parameters).rowcount)
        else:
            rowcount = self._call(lambda: self._execute_hot(statement, parameters))[1]
        if rowcount == 1:
            return
        if connection is None:
            # A resent autocommit statement whose first reply was lost finds its own row.
            record = self.get(key)
            if record is not None and record.state == COMPLETED and record.fencing_token == token:
                return
        raise Fenced(key, token)

    def release(self, key: str, token: int, error: str | None) -> bool:
        """Give the key up after an execution that did not complete; False if it was not ours."""
        parameters = {"p_key": key, "p_token": token, "p_error": error}
        return self._call(lambda: self._execute_hot(_RELEASE, parameters))[1] == 1

    def renew_leases(self, leases: Iterable[tuple[str, int]], ttl: float) -> set[str]:
        """Extend the leases still held by their tokens, in one statement; return those keys."""
        pairs = list(leases)
        if not pairs:
            return set()
        now = db_epoch_now()
        statement = (
            update(keys)
            .where(
                tuple_(keys.c.key, keys.c.fencing_token).in_(pairs),
                keys.c.state == RUNNING,
            )
            .values(lease_expires_at=now + ttl)
            .returning(keys.c.key)
        )
        rows = self._call(lambda: self._execute_single(statement))[0]
        return {row["key"] for row in rows}

    # -- dead letters ---------------------------------------------------------------------------

    def dead_letter(self, token: int, letter: DeadLetter) -> DeadLetter:
        """Mark the key DEAD (if ``token`` still owns it) and store the letter, atomically."""
        engine = self._ready_engine()

        def write() -> DeadLetter:
            with engine.begin() as connection:
                owned = connection.execute(
                    _MARK_DEAD, {"p_key": letter.key, "p_token": token, "p_error": letter.error}
                ).rowcount
                if owned != 1:
                    raise Fenced(letter.key, token)
                values = {k: v for k, v in letter.as_dict().items() if k not in _GENERATED}
                row = connection.execute(
                    insert(dead_letters)
                    .values(**values, created_at=db_epoch_now())
                    .returning(dead_letters.c.id, dead_letters.c.created_at)
                ).one()
            return replace(letter, id=int(row.id), created_at=float(row.created_at))

        return self._call(write)

    def add_dead_letter(self, letter: DeadLetter) -> DeadLetter:
        """Record a dead letter no key row owns: a delivery that could not even be claimed
        (an unknown task, a key the store cannot hold). No key's state changes."""
        values = {k: v for k, v in letter.as_dict().items() if k not in _GENERATED}
        statement = (
            insert(dead_letters)
            .values(**values, created_at=db_epoch_now())
            .returning(dead_letters.c.id, dead_letters.c.created_at)
        )
        row = _only_row(self._call(lambda: self._execute_single(statement))[0])
        return replace(letter, id=int(row["id"]), created_at=float(row["created_at"]))

    def list_dead_letters(
        self, *, task_name: str | None = None, since: float | None = None, limit: int = 50
    ) -> list[DeadLetter]:
        """Dead letters, newest first."""
        statement = select(dead_letters).order_by(dead_letters.c.id.desc()).limit(limit)
        if task_name is not None:
            statement = statement.where(dead_letters.c.task_name == task_name)
        if since is not None:
            statement = statement.where(dead_letters.c.created_at >= since)
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [DeadLetter.from_mapping(row) for row in rows]

    def get_dead_letter(self, letter_id: int) -> DeadLetter | None:
        statement = select(dead_letters).where(dead_letters.c.id == letter_id)
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return DeadLetter.from_mapping(rows[0]) if rows else None

    def revive(self, letter_id: int) -> DeadLetter | None:
        """Mark a dead letter replayed and make its key claimable with fresh attempts.

        Returns the letter when this call revived it; ``None`` when it was replayed already (a
        replay is itself idempotent).
        """
        engine = self._ready_engine()

        def write() -> DeadLetter | None:
            with engine.begin() as connection:
                row = connection.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id == letter_id, dead_letters.c.replayed_at.is_(None))
                    .values(replayed_at=db_epoch_now())
                    .returning(*dead_letters.c)
                ).one_or_none()
                if row is None:
                    return None
                letter = DeadLetter.from_mapping(row._mapping)
                connection.execute(_REVIVE_KEY, {"p_key": letter.key})
            return letter

        return self._call(write)

    def revive_key(self, key: str) -> bool:
        """Make a DEAD key claimable again with fresh attempts (nothing is re-published)."""
        return self._call(lambda: self._execute_single(_REVIVE_KEY, {"p_key": key}))[1] == 1

    def unrevive(self, letter_id: int) -> None:
        """Undo :meth:`revive` after its message could not be published."""
        engine = self._ready_engine()

        def write() -> None:
            with engine.begin() as connection:
                key = connection.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id == letter_id)
                    .values(replayed_at=None)
                    .returning(dead_letters.c.key)
                ).scalar_one_or_none()
                if key is not None:
                    connection.execute(
                        update(keys)
                        .where(keys.c.key == key, keys.c.state == RELEASED, keys.c.attempts == 0)
                        .values(state=DEAD, updated_at=db_epoch_now())
                    )

        self._call(write)

    def purge_dead_letters(self, before: float | None = None) -> list[int]:
        """Delete dead letters (created before ``before``, when given); return their ids."""
        statement = delete(dead_letters).returning(dead_letters.c.id)
        if before is not None:
            statement = statement.where(dead_letters.c.created_at < before)
        rows = self._call(lambda: self._execute_single(statement))[0]
        return sorted(int(row["id"]) for row in rows)

    # -- the reaper's primitives ----------------------------------------------------------------

    def acquire_leadership(self, name: str, holder: str, ttl: float) -> bool:
        """Take or keep the named lease for ``holder``; True while ``holder`` has it."""
        now = db_epoch_now()
        insert = self._upsert(leaders).values(
            name=name, holder=holder, term=1, expires_at=now + ttl
        )
        new = insert.excluded
        free = or_(leaders.c.expires_at <= now, leaders.c.holder == new.holder)
        statement = insert.on_conflict_do_update(
            index_elements=[leaders.c.name],
            set_={
                "holder": case((free, new.holder), else_=leaders.c.holder),
                "term": case(
                    (leaders.c.holder == new.holder, leaders.c.term),
                    (free, leaders.c.term + 1),
                    else_=leaders.c.term,
                ),
                "expires_at": case((free, new.expires_at), else_=leaders.c.expires_at),
            },
        ).returning(leaders.c.holder)
        row = _only_row(self._call(lambda: self._execute_single(statement))[0])
        return bool(row["holder"] == holder)

    def resign_leadership(self, name: str, holder: str) -> None:
        """Give the named lease up at once (clean shutdown), if ``holder`` has it."""
        statement = (
            update(leaders)
            .where(leaders.c.name == name, leaders.c.holder == holder)
            .values(expires_at=db_epoch_now())
        )
        self._call(lambda: self._execute_single(statement))

    def orphans(self, republish_after: float, limit: int) -> list[KeyRecord]:
        """RUNNING keys whose lease expired, not re-published in the last ``republish_after`` s."""
        now = db_epoch_now()
        statement = (
            select(keys)
            .where(
                keys.c.state == RUNNING,
                keys.c.lease_expires_at <= now,
                or_(
                    keys.c.republished_at.is_(None),
                    keys.c.republished_at <= now - republish_after,
                ),
            )
            .order_by(keys.c.lease_expires_at)
            .limit(limit)
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [KeyRecord.from_mapping(row) for row in rows]

    def mark_republished(self, key: str, token: int, republish_after: float) -> bool:
        """Record a re-publish; False when someone claimed or re-published the key meanwhile."""
        now = db_epoch_now()
        statement = (
            update(keys)
            .where(
                keys.c.key == key,
                keys.c.fencing_token == token,
                keys.c.state == RUNNING,
                keys.c.lease_expires_at <= now,
                or_(
                    keys.c.republished_at.is_(None),
                    keys.c.republished_at <= now - republish_after,
                ),
            )
            .values(republished_at=now)
        )
        return self._call(lambda: self._execute_single(statement))[1] == 1

    def dead_owner_keys(self, limit: int) -> list[tuple[str, int, bool]]:
        """RUNNING keys whose owner's liveness lock is gone (PostgreSQL only).

        Returns (key, fencing token, whether the row's lease is still running).
        """
        if self.dialect_name != "postgresql":
            return []
        rows = self._call(
            lambda: self._execute_single(_DEAD_OWNERS, {"p_limit": limit}, read_only=True)
        )[0]
        return [(row["key"], int(row["fencing_token"]), bool(row["live"])) for row in rows]

    def count_running_owned(self, owner_prefix: str) -> int:
        """RUNNING keys whose owner string starts with ``owner_prefix`` (one worker's)."""
        statement = (
            select(func.count())
            .select_from(keys)
            .where(
                keys.c.state == RUNNING,
                func.substr(keys.c.owner, 1, len(owner_prefix)) == owner_prefix,
            )
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return int(next(iter(rows[0].values())))

    def revoke_owned(self, owner_prefix: str) -> list[tuple[str, int]]:
        """Move the token on and end the lease of a worker's RUNNING keys.

        Its executions are fenced (renewal and commit refused) and the reaper recovers the keys
        at once. Returns (key, the token that was revoked).
        """
        statement = (
            update(keys)
            .where(
                keys.c.state == RUNNING,
                func.substr(keys.c.owner, 1, len(owner_prefix)) == owner_prefix,
            )
            .values(
                fencing_token=keys.c.fencing_token + 1,
                lease_expires_at=db_epoch_now(),
                updated_at=db_epoch_now(),
            )
            .returning(keys.c.key, keys.c.fencing_token)
        )
        rows = self._call(lambda: self._execute_single(statement))[0]
        return [(row["key"], int(row["fencing_token"]) - 1) for row in rows]

    def expire_lease(self, key: str, token: int) -> bool:
        """End a running lease now (its owner is dead), so the orphan pass takes it over."""
        parameters = {"p_key": key, "p_token": token}
        return self._call(lambda: self._execute_single(_EXPIRE_LEASE, parameters))[1] == 1

    def prune_completed(self, limit: int, keep_tracked: bool = False) -> int:
        """Delete up to ``limit`` COMPLETED keys whose retention ended; return how many.

        A deleted row takes its fencing tokens with it, and the key's next claim inserts a new
        row. So the token floor is raised to the highest token of the rows about to go, and only
        rows at or below the floor are deleted: a new row starts above the floor
        (:data:`TOKEN_FLOOR`), and an execution still holding a token of the old row stays fenced.

        ``keep_tracked`` (publish tracking on): a key whose tracked publish is still recorded
        stays until the reaper has forgotten that record. Pruned first, the record would look
        never claimed and be re-published, running a ``guard_result_ttl = 0`` task again.
        """
        now = db_epoch_now()
        expired: tuple[Any, ...] = (keys.c.state == COMPLETED, keys.c.expires_at <= now)
        if keep_tracked:
            expired += (~exists().where(published.c.key == keys.c.key),)
        batch = select(keys.c.fencing_token).where(*expired).limit(limit).subquery()
        highest = select(func.max(batch.c.fencing_token).label("highest"))
        rows = self._call(lambda: self._execute_single(highest, read_only=True))[0]
        if _only_row(rows)["highest"] is None:
            return 0
        raise_floor = self._upsert(leaders).values(
            name=TOKEN_FLOOR, holder="", term=int(_only_row(rows)["highest"]), expires_at=0.0
        )
        new = raise_floor.excluded
        statement = raise_floor.on_conflict_do_update(
            index_elements=[leaders.c.name],
            set_={"term": case((new.term > leaders.c.term, new.term), else_=leaders.c.term)},
        ).returning(leaders.c.term)
        floor = int(_only_row(self._call(lambda: self._execute_single(statement))[0])["term"])
        doomed = (
            select(keys.c.key)
            .where(*expired, keys.c.fencing_token <= floor)
            .limit(limit)
            .scalar_subquery()
        )
        statement = delete(keys).where(keys.c.key.in_(doomed))
        return self._call(lambda: self._execute_single(statement))[1]

    def token_floor(self) -> int:
        """The highest fencing token of any pruned row (0 when none was pruned)."""
        leader = self.leader(TOKEN_FLOOR)
        return 0 if leader is None else leader[1]

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
        rows = self._call(
            lambda: self._execute_single(select(db_epoch_now().label("now")), read_only=True)
        )[0]
        return float(_only_row(rows)["now"])

    def get(self, key: str) -> KeyRecord | None:
        """The key's row, or ``None``."""
        parameters = {"p_key": key}
        rows = self._call(lambda: self._execute_single(_GET, parameters, read_only=True))[0]
        return KeyRecord.from_mapping(rows[0]) if rows else None

    def commit(self, transaction: RootTransaction) -> None:
        """Commit a task's transaction; failures are store errors (never resent: not idempotent)."""

        def commit() -> None:
            try:
                with self._watchdog.watching(_dbapi_connection(transaction)):
                    transaction.commit()
            except sa_exc.DBAPIError as exc:
                raise _wrap(exc, self.config) from exc

        self._observed(commit)

    def transaction_failed(self, connection: Connection) -> bool:
        """True when a statement failed in the open transaction on ``connection`` and the
        transaction can now only roll back (PostgreSQL's "current transaction is aborted"); a
        failed SQLite statement leaves its transaction usable."""
        if self.dialect_name != "postgresql" or connection.closed:
            return False
        try:
            driver = connection.connection.dbapi_connection
        except sa_exc.SQLAlchemyError:
            return False
        status = getattr(getattr(driver, "info", None), "transaction_status", None)
        return status == psycopg.pq.TransactionStatus.INERROR

    def connect(self, on_boundary: Callable[[str], None] | None = None) -> Connection:
        """A new connection for a task's own transaction; the caller closes it.

        ``on_boundary`` is called with ``"commit"`` or ``"rollback"`` before SQLAlchemy ends a
        transaction on this connection, however it is asked to (``Connection.commit()``, an ORM
        ``Session`` that controls it, ``close()``); an exception it raises stops the statement
        from being sent. ``Execution`` uses it so a task body cannot end the transaction that
        must commit with the key's COMPLETED marker. Savepoints are not reported.
        """
        engine = self._ready_engine()
        connection = self._call(engine.connect)
        if on_boundary is not None:
            connection.execution_options(**{_BOUNDARY_HOOK: on_boundary})
        return connection

    # -- internals ----------------------------------------------------------------------------

    def _upsert(self, table: Any) -> Any:
        return _upsert(self.dialect_name, table)

    def _execute_single(
        self, statement: Any, parameters: dict[str, Any] | None = None, read_only: bool = False
    ) -> tuple[list[dict[str, Any]], int]:
        """Run one statement as its own transaction, in as few round trips as the dialect allows.

        Returns the rows (as dicts) and the rowcount, read before the connection is returned.
        """
        engine = self._ready_engine()
        if self.dialect_name == "postgresql":
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                return _read(connection.execute(statement, parameters))
        options = {_SQLITE_READ_ONLY: read_only}
        with engine.connect().execution_options(**options) as connection, connection.begin():
            return _read(connection.execute(statement, parameters))

    def _execute_hot(
        self, statement: Any, parameters: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], int]:
        """The per-delivery statements (claim, complete, release): one autocommitted round trip.

        On PostgreSQL they skip SQLAlchemy's per-execution work (compiling the cache key,
        building result metadata for 20-odd columns, switching the connection to autocommit
        and back through the dialect): the SQL is compiled once per statement and runs on a
        psycopg connection kept in autocommit for them (one per process, :class:`_HotConnection`),
        which psycopg prepares server-side after a few executions. The pool's checkout, reset
        and checkin and the autocommit switches were a third of what remained of celery_guard's
        own CPU per task (bench/overhead.py). Errors are re-raised as SQLAlchemy's, so
        :meth:`_call` treats both paths alike.
        """
        if self.dialect_name != "postgresql":
            return self._execute_single(statement, parameters)
        engine = self._ready_engine()
        sql, defaults = self._compiled(engine, statement)
        values = {**defaults, **parameters}
        hot = self._hot
        if hot.try_acquire():
            try:
                return self._run_hot(engine, hot.connection(engine), statement, sql, values)
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated:
                    hot.drop()
                raise
            finally:
                hot.lock.release()
        # Another thread of this process (a thread or gevent pool) holds the hot connection:
        # borrow one from the pool for this statement, and give it back as it was lent.
        pooled = _raw_connection(engine)
        try:
            connection: Any = pooled.driver_connection
            connection.autocommit = True
            try:
                return self._run_hot(engine, connection, statement, sql, values)
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated:
                    pooled.invalidate(exc.orig)
                raise
            finally:
                # Left in autocommit, a task's own transaction() on it would commit each write.
                if not connection.closed:
                    try:
                        connection.autocommit = False
                    except psycopg.Error as exc:
                        pooled.invalidate(exc)
        finally:
            pooled.close()

    def _execute_in_transaction(
        self, connection: Connection, statement: Any, parameters: dict[str, Any]
    ) -> int:
        """The completion marker inside a task's open transaction; returns the rowcount.

        Run on the driver connection under SQLAlchemy's transaction, like :meth:`_execute_hot`
        (SQLAlchemy's own execute was most of the marker's client cost). Never resent: after a
        lost connection the transaction is gone, and the delivery is deferred instead.
        """
        engine = connection.engine
        sql, defaults = self._compiled(engine, statement)
        values = {**defaults, **parameters}
        try:
            return self._run_hot(
                engine, connection.connection.dbapi_connection, statement, sql, values
            )[1]
        except sa_exc.DBAPIError as exc:
            if exc.connection_invalidated:
                connection.invalidate(exc.orig)
            raise _wrap(exc, self.config) from exc

    def _run_hot(
        self, engine: Engine, connection: Any, statement: Any, sql: str, values: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], int]:
        """One statement on a psycopg connection (autocommit, or inside a task's transaction);
        driver errors re-raised as SQLAlchemy's, flagged when the connection is gone."""
        try:
            with connection.cursor() as cursor, self._watchdog.watching(connection):
                cursor.execute(sql, values)
                rows: list[dict[str, Any]] = []
                names = self._column_names(statement, cursor)
                if names is not None:
                    rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
                return rows, int(cursor.rowcount)
        except psycopg.Error as exc:
            error: Any = exc
            raise sa_exc.DBAPIError.instance(
                sql,
                values,
                exc,
                psycopg.Error,
                connection_invalidated=engine.dialect.is_disconnect(error, connection, None),
                dialect=engine.dialect,
            ) from exc

    def _column_names(self, statement: Any, cursor: Any) -> list[str] | None:
        """The result's column names, read once per statement: psycopg builds a Column object
        per column on every ``description`` access (21 of them for the claim's RETURNING)."""
        result = cursor.pgresult
        if result is None or result.nfields == 0:
            return None
        names = self._names_cache.get(id(statement))
        if names is None or len(names) != result.nfields:
            names = [column.name for column in cursor.description]
            self._names_cache[id(statement)] = names
        return names

    def _compiled(self, engine: Engine, statement: Any) -> tuple[str, dict[str, Any]]:
        """``statement`` as the driver's SQL and its fixed parameters, compiled once."""
        cached = self._compiled_cache.get(id(statement))
        if cached is None or cached[0] is not statement:
            compiled = statement.compile(dialect=engine.dialect)
            # The statement's own values (``last_error=None``...); a call's parameters win.
            defaults = dict(compiled.construct_params(_check=False))
            cached = (statement, compiled.string, defaults)
            self._compiled_cache[id(statement)] = cached
        return cached[1], cached[2]

    def _call(self, operation: Callable[[], T]) -> T:
        """Run a store operation, once more after a dropped connection; wrap driver errors."""
        return self._observed(lambda: self._call_unobserved(operation))

    def _observed(self, operation: Callable[[], T]) -> T:
        """Run ``operation``, telling :attr:`observer` (if any) how it went and how long it took.

        A store error is a failure; any other exception (Fenced: the store answered) is not
        counted at all. Calls made inside it (creating the tables on first use) are part of it.
        """
        observer = self.observer
        if observer is None or getattr(self._observing, "active", False):
            return operation()
        started = time.monotonic()
        self._observing.active = True
        try:
            value = operation()
        except StoreError as exc:
            _tell(observer, time.monotonic() - started, exc)
            raise
        finally:
            self._observing.active = False
        _tell(observer, time.monotonic() - started, None)
        return value

    def _call_unobserved(self, operation: Callable[[], T]) -> T:
        for attempt in (1, 2):
            try:
                return operation()
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated and attempt == 1:
                    # The pool has dropped the dead connection; a fresh one may work (a restarted
                    # server). Every primitive here is safe to send twice.
                    logger.info("celery_guard: store connection lost, retrying once")
                    continue
                raise _wrap(exc, self.config) from exc
            except sa_exc.TimeoutError as exc:
                raise StoreUnavailable(
                    f"no store connection free within {self.config.store_timeout}s "
                    f"({self.config.safe_store_url()})"
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # -- worker heartbeats ---------------------------------------------------------------------

    def beat_worker(
        self,
        hostname: str,
        *,
        pid: int,
        state: str,
        running: int,
        fenced: int,
        circuit: str | None,
        ttl: float,
    ) -> None:
        """Record that ``hostname`` is alive for ``ttl`` more seconds, and its state."""
        now = db_epoch_now()
        insert = self._upsert(workers).values(
            hostname=hostname,
            pid=pid,
            state=state,
            running=running,
            fenced=fenced,
            circuit=circuit,
            started_at=now,
            seen_at=now,
            expires_at=now + ttl,
        )
        new = insert.excluded
        statement = insert.on_conflict_do_update(
            index_elements=[workers.c.hostname],
            set_={
                # A restarted worker (new pid) starts a new life.
                "started_at": case(
                    (workers.c.pid == new.pid, workers.c.started_at), else_=new.started_at
                ),
                **{
                    name: getattr(new, name)
                    for name in (
                        "pid",
                        "state",
                        "running",
                        "fenced",
                        "circuit",
                        "seen_at",
                        "expires_at",
                    )
                },
            },
        )
        self._call(lambda: self._execute_single(statement))

    def remove_worker(self, hostname: str, pid: int) -> None:
        """Forget a worker that shut down cleanly (a killed one just stops beating)."""
        statement = delete(workers).where(workers.c.hostname == hostname, workers.c.pid == pid)
        self._call(lambda: self._execute_single(statement))

    def list_workers(self, seen_within: float = 3600.0) -> list[WorkerRecord]:
        """Workers seen in the last ``seen_within`` seconds, alive or not, by hostname."""
        now = db_epoch_now()
        statement = (
            select(workers, (workers.c.expires_at > now).label("alive"))
            .where(workers.c.seen_at > now - seen_within)
            .order_by(workers.c.hostname)
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [WorkerRecord(**{**row, "alive": bool(row["alive"])}) for row in rows]

    def prune_workers(self, older_than: float = 86400.0) -> int:
        """Delete heartbeats not renewed for ``older_than`` seconds (workers long gone)."""
        statement = delete(workers).where(workers.c.seen_at < db_epoch_now() - older_than)
        return self._call(lambda: self._execute_single(statement))[1]

    # -- operator queries (cli) ---------------------------------------------------------------
    # Read-only and maintenance queries for ``celery -A app guard ...``; bounded, one statement
    # each (``insert_dead_letter`` is one transaction).

    def count_keys_by_state(self) -> dict[str, int]:
        """How many keys are in each state (states without keys are absent)."""

        statement = select(keys.c.state, func.count().label("n")).group_by(keys.c.state)
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return {str(row["state"]): int(row["n"]) for row in rows}

    def oldest_running(self) -> KeyRecord | None:
        """The RUNNING key claimed longest ago (a claim sets ``updated_at``), or ``None``."""
        statement = (
            select(keys)
            .where(keys.c.state == RUNNING)
            .order_by(keys.c.updated_at, keys.c.key)
            .limit(1)
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return KeyRecord.from_mapping(rows[0]) if rows else None

    def count_expired_leases(self) -> int:
        """RUNNING keys whose row lease has expired (what the reaper treats as orphans)."""

        statement = (
            select(func.count().label("n"))
            .select_from(keys)
            .where(
                keys.c.state == RUNNING,
                or_(keys.c.lease_expires_at.is_(None), keys.c.lease_expires_at <= db_epoch_now()),
            )
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return int(_only_row(rows)["n"])

    def running_keys(
        self, *, expired_only: bool = False, after: str | None = None, limit: int = 1000
    ) -> list[KeyRecord]:
        """RUNNING keys in key order, after ``after`` (keyset paging); ``expired_only`` keeps
        those whose row lease has expired."""
        statement = select(keys).where(keys.c.state == RUNNING).order_by(keys.c.key).limit(limit)
        if expired_only:
            statement = statement.where(
                or_(keys.c.lease_expires_at.is_(None), keys.c.lease_expires_at <= db_epoch_now())
            )
        if after is not None:
            statement = statement.where(keys.c.key > after)
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [KeyRecord.from_mapping(row) for row in rows]

    def get_many(self, key_names: list[str]) -> dict[str, KeyRecord]:
        """The rows of ``key_names`` that exist, by key (one statement; pass a bounded list)."""
        if not key_names:
            return {}
        statement = select(keys).where(keys.c.key.in_(key_names))
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return {str(row["key"]): KeyRecord.from_mapping(row) for row in rows}

    def leader(self, name: str) -> tuple[str, int, float] | None:
        """The named leader lease as (holder, term, expires_at), or ``None`` if never taken."""
        statement = select(leaders).where(leaders.c.name == name)
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        if not rows:
            return None
        return str(rows[0]["holder"]), int(rows[0]["term"]), float(rows[0]["expires_at"])

    def count_dead_letters(self) -> tuple[int, int]:
        """(all dead letters, those not replayed yet)."""

        statement = select(
            func.count().label("total"),
            func.count(case((dead_letters.c.replayed_at.is_(None), 1))).label("pending"),
        ).select_from(dead_letters)
        row = _only_row(self._call(lambda: self._execute_single(statement, read_only=True))[0])
        return int(row["total"]), int(row["pending"])

    def dead_letter_index(self, limit: int) -> list[tuple[int, str, str, float]]:
        """(id, key, task name, created_at) of the newest ``limit`` dead letters, newest first."""
        statement = (
            select(
                dead_letters.c.id,
                dead_letters.c.key,
                dead_letters.c.task_name,
                dead_letters.c.created_at,
            )
            .order_by(dead_letters.c.id.desc())
            .limit(limit)
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [
            (int(row["id"]), str(row["key"]), str(row["task_name"]), float(row["created_at"]))
            for row in rows
        ]

    def pending_dead_letter_ids(
        self, task_name: str, *, after_id: int = 0, limit: int = 1000
    ) -> list[int]:
        """Ids of ``task_name``'s dead letters not replayed yet, ascending, after ``after_id``."""
        statement = (
            select(dead_letters.c.id)
            .where(
                dead_letters.c.task_name == task_name,
                dead_letters.c.replayed_at.is_(None),
                dead_letters.c.id > after_id,
            )
            .order_by(dead_letters.c.id)
            .limit(limit)
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [int(row["id"]) for row in rows]

    def insert_dead_letter(self, letter: DeadLetter) -> DeadLetter | None:
        """Record a dead letter found only in the broker's queue, under its own id.

        Returns the stored letter, or ``None`` when that id is already taken (nothing written).
        The key's row is not touched. On PostgreSQL the id sequence is moved past the id, so
        later letters cannot collide with it.
        """
        if letter.id is None:
            raise StoreError("a dead letter from the queue needs its id")
        engine = self._ready_engine()
        values = letter.as_dict()
        if values["created_at"] is None:
            values["created_at"] = db_epoch_now()
        statement = (
            self._upsert(dead_letters)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[dead_letters.c.id])
            .returning(*dead_letters.c)
        )

        def write() -> DeadLetter | None:
            with engine.begin() as connection:
                row = connection.execute(statement).one_or_none()
                if row is None:
                    return None
                if self.dialect_name == "postgresql":
                    connection.execute(
                        text(
                            "SELECT setval(s.seq, :p_id) FROM (SELECT CAST("
                            "pg_get_serial_sequence('celery_guard_dead_letters', 'id') AS regclass"
                            ") AS seq) AS s WHERE s.seq IS NOT NULL"
                            " AND COALESCE(pg_sequence_last_value(s.seq), 0) < :p_id"
                        ).bindparams(bindparam("p_id", type_=BigInteger)),
                        {"p_id": letter.id},
                    )
                return DeadLetter.from_mapping(row._mapping)

        return self._call(write)

    # -- publish tracking (guard_track_publishes) -----------------------------------------------
    # ``celery_guard_published``: written by producers before each message is sent, read and
    # trimmed by the reaper's holder. Only called when tracking is on, so a schema migrated
    # without that table keeps working while it is off.

    def track_publish(
        self,
        *,
        key: str,
        task_name: str,
        task_id: str,
        message: str,
        publisher_stamp: float | None,
        countdown: float,
        expires_in: float | None,
    ) -> bool:
        """Record a publish before its message is sent: one autocommitted INSERT.

        ``countdown`` (seconds until the message is due: its ETA) and ``expires_in`` are added
        to the database's clock here, so the reaper compares them with that clock alone. False
        when the key has a record already (an earlier publish not forgotten yet): one record per
        key is all the reaper needs.
        """
        parameters = {
            "p_key": key,
            "p_task_name": task_name,
            "p_task_id": task_id,
            "p_message": message,
            "p_stamp": publisher_stamp,
            "p_countdown": max(0.0, countdown),
            "p_expires_in": expires_in,
        }
        statement = _track_publish_statement(self.dialect_name)
        return self._call(lambda: self._execute_hot(statement, parameters))[1] == 1

    def forget_publish(self, key: str, task_id: str) -> bool:
        """Delete the record of one publish: its message was never sent, was revoked, or names
        a task the worker does not know (then it is a dead letter, and no key row will come)."""
        statement = delete(published).where(published.c.key == key, published.c.task_id == task_id)
        return self._call(lambda: self._execute_single(statement))[1] == 1

    def forget_claimed_publishes(self, after_key: str, limit: int) -> tuple[int, str | None]:
        """Examine up to ``limit`` records in key order after ``after_key``, and delete those
        whose key has a row (claimed at least once: the keys table owns it now) or whose
        message has expired.

        Returns (deleted, the last key examined), or (deleted, ``None``) once the end of the
        table was reached; pass that key back to go on, ``""`` to start over. The work per call
        is bounded whatever the table's size (a long backlog), with no full scan.
        """
        window = (
            select(published.c.key)
            .where(published.c.key > after_key)
            .order_by(published.c.key)
            .limit(limit)
            .subquery()
        )
        bounds = select(func.count().label("n"), func.max(window.c.key).label("last"))
        row = _only_row(self._call(lambda: self._execute_single(bounds, read_only=True))[0])
        examined, last = int(row["n"]), row["last"]
        if not examined:
            return 0, None
        statement = delete(published).where(
            published.c.key > after_key, published.c.key <= last, _publish_done()
        )
        deleted = self._call(lambda: self._execute_single(statement))[1]
        return deleted, (str(last) if examined >= limit else None)

    def due_publishes(self, after: float, limit: int) -> list[PublishRecord]:
        """Records whose delay is over: ``after`` seconds since they were due (or since their
        last re-publish), oldest first, each flagged ``claimed`` / ``expired``."""
        now = db_epoch_now()
        statement = (
            select(
                published,
                exists().where(keys.c.key == published.c.key).label("claimed"),
                (published.c.expires_at <= now).label("expired"),
            )
            .where(published.c.waiting_since <= now - after)
            .order_by(published.c.waiting_since)
            .limit(limit)
        )
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return [PublishRecord.from_mapping(row) for row in rows]

    def forget_done_publishes(self, record_keys: list[str]) -> int:
        """Delete those of ``record_keys``' records that are claimed or expired (only those)."""
        if not record_keys:
            return 0
        statement = delete(published).where(published.c.key.in_(record_keys), _publish_done())
        return self._call(lambda: self._execute_single(statement))[1]

    def mark_publish_republished(
        self, key: str, task_id: str, publisher_stamp: float, after: float
    ) -> bool:
        """Take the right to re-publish a record now, before publishing; False when its key was
        claimed or another reaper re-published it meanwhile (two holders after a stall)."""
        now = db_epoch_now()
        statement = (
            update(published)
            .where(
                published.c.key == key,
                published.c.task_id == task_id,
                published.c.waiting_since <= now - after,
                ~exists().where(keys.c.key == published.c.key),
            )
            .values(
                republished_at=now,
                waiting_since=now,
                republishes=published.c.republishes + 1,
                publisher_stamp=publisher_stamp,
            )
        )
        return self._call(lambda: self._execute_single(statement))[1] == 1

    def unmark_publish_republished(self, before: PublishRecord) -> None:
        """Undo :meth:`mark_publish_republished` after the broker refused the copy; the delay
        still restarts, so a broker outage is not retried at every pass."""
        statement = (
            update(published)
            .where(
                published.c.key == before.key,
                published.c.task_id == before.task_id,
                published.c.republishes == before.republishes + 1,
            )
            .values(
                republished_at=before.republished_at,
                republishes=before.republishes,
                publisher_stamp=before.publisher_stamp,
            )
        )
        self._call(lambda: self._execute_single(statement))

    def postpone_publishes(self, record_keys: list[str]) -> int:
        """Restart the delay of records whose message still waits in its queue (a backlog)."""
        if not record_keys:
            return 0
        statement = (
            update(published)
            .where(published.c.key.in_(record_keys))
            .values(waiting_since=db_epoch_now())
        )
        return self._call(lambda: self._execute_single(statement))[1]

    def unclaimed_publishes(self) -> tuple[int, float | None]:
        """(tracked publishes whose key has no row yet, seconds since the oldest was published)."""
        now = db_epoch_now()
        statement = select(
            func.count().label("n"),
            func.min(published.c.published_at).label("oldest"),
            now.label("now"),
        ).where(~exists().where(keys.c.key == published.c.key))
        row = _only_row(self._call(lambda: self._execute_single(statement, read_only=True))[0])
        oldest = row["oldest"]
        age = None if oldest is None else max(0.0, float(row["now"]) - float(oldest))
        return int(row["n"]), age


def _dbapi_connection(transaction: RootTransaction) -> Any:
    """The driver's connection under ``transaction``, or None when there is none to watch."""
    try:
        return transaction.connection.connection.dbapi_connection
    except sa_exc.SQLAlchemyError:
        return None


def _tell(observer: StoreObserver, seconds: float, error: StoreError | None) -> None:
    """Counting a call must never change its outcome."""
    try:
        observer(seconds, error)
    except Exception:
        logger.exception("celery_guard: the store call observer failed")


def _upsert(dialect_name: str, table: Any) -> Any:
    """The dialect's INSERT with ON CONFLICT support."""
    return (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(table)


def _classify(record: KeyRecord, request: ClaimRequest, claim_id: str) -> ClaimOutcome:
    if record.claim_id == claim_id and record.state == RUNNING:
        return ClaimOutcome.CLAIMED
    if record.state == DEAD:
        return ClaimOutcome.DEAD
    if (
        request.check_fingerprint
        and record.fingerprint is not None
        and record.fingerprint != request.fingerprint
    ):
        return ClaimOutcome.CONFLICT
    if record.state == COMPLETED:
        return ClaimOutcome.DUPLICATE
    return ClaimOutcome.IN_FLIGHT


def _read(result: Any) -> tuple[list[dict[str, Any]], int]:
    rows = [dict(row) for row in result.mappings()] if result.returns_rows else []
    return rows, int(result.rowcount)


def _only_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if len(rows) != 1:
        raise StoreError(f"expected one row from the store, got {len(rows)}")
    return rows[0]


def _wrap(exc: sa_exc.DBAPIError, config: GuardConfig) -> StoreError:
    where = config.safe_store_url()
    text = str(exc.orig) if exc.orig is not None else str(exc)
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "no such table" in text or "UndefinedTable" in type(exc.orig).__name__:
        return StoreError(
            f"celery_guard tables are missing in {where}: run `celery -A <app> guard migrate` "
            f"or set guard_create_tables = True ({first_line})"
        )
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        return StoreUnavailable(f"store {where} unavailable: {first_line}")
    return StoreError(f"store {where} error: {first_line}")


#: Execution option naming the callable :meth:`SqlStore.connect` was given as ``on_boundary``.
_BOUNDARY_HOOK = "celery_guard_on_boundary"


def _report_boundaries(engine: Engine) -> None:
    """Tell a connection's ``on_boundary`` hook before a transaction on it ends.

    Engine-wide listeners that look the hook up on the connection (instead of listeners added
    per connection): adding and removing a listener costs more than one dictionary lookup per
    commit. SQLAlchemy calls ``commit``/``rollback`` listeners before it sends COMMIT/ROLLBACK,
    and an exception raised there propagates to the caller with nothing sent (ConnectionEvents,
    sqlalchemy/engine/base.py ``_commit_impl``/``_rollback_impl``).
    """

    def on_commit(connection: Connection) -> None:
        hook = connection.get_execution_options().get(_BOUNDARY_HOOK)
        if hook is not None:
            hook("commit")

    def on_rollback(connection: Connection) -> None:
        hook = connection.get_execution_options().get(_BOUNDARY_HOOK)
        if hook is not None:
            hook("rollback")

    event.listen(engine, "commit", on_commit)
    event.listen(engine, "rollback", on_rollback)


def _configure_sqlite(engine: Engine, timeout: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Driver-level autocommit: SQLAlchemy's "begin" event below issues BEGIN itself.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={max(1, int(timeout * 1000))}")
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        # IMMEDIATE takes the write lock up front, so the busy timeout applies; a deferred
        # transaction that upgrades from read to write fails at once with SQLITE_BUSY.
        read_only = connection.get_execution_options().get(_SQLITE_READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


_owned_by_token = and_(
    keys.c.key == bindparam("p_key"),
    keys.c.fencing_token == bindparam("p_token", type_=BigInteger),
    keys.c.state == RUNNING,
)


def _end_ownership(state: str) -> Any:
    """The token-checked end of an execution that did not complete (RELEASED or DEAD)."""
    return (
        update(keys)
        .where(_owned_by_token)
        .values(
            state=state,
            lease_expires_at=None,
            last_error=bindparam("p_error"),
            updated_at=db_epoch_now(),
        )
    )


_RELEASE = _end_ownership(RELEASED)

_GET = select(keys).where(keys.c.key == bindparam("p_key"))

_MARK_DEAD = _end_ownership(DEAD)

# A replayed key starts over: attempts count again from the replay.
_REVIVE_KEY = (
    update(keys)
    .where(keys.c.key == bindparam("p_key"), keys.c.state == DEAD)
    .values(state=RELEASED, attempts=0, updated_at=db_epoch_now())
)

_GENERATED = frozenset({"id", "created_at", "replayed_at"})

_EXPIRE_LEASE = (
    update(keys)
    .where(_owned_by_token, keys.c.lease_expires_at > db_epoch_now())
    .values(lease_expires_at=db_epoch_now())
)

# A session-level advisory lock on a bigint shows in pg_locks as classid (high 32 bits) and
# objid (low 32 bits) with objsubid 1; lock ids are positive, so the shift cannot overflow.
_DEAD_OWNERS = text(
    """
SELECT k.key, k.fencing_token,
       k.lease_expires_at > CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)
           AS live
FROM celery_guard_keys AS k
WHERE k.state = 'RUNNING' AND k.owner_lock IS NOT NULL
  -- Claimed before the server (re)started: every session's lock died with it, the owner's
  -- proves nothing. The lease decides.
  AND k.updated_at > CAST(EXTRACT(EPOCH FROM pg_postmaster_start_time()) AS DOUBLE PRECISION)
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks AS l
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND ((l.classid::bigint << 32) | l.objid::bigint) = k.owner_lock)
LIMIT :p_limit
""".strip()
)


@functools.cache
def _complete_statement(expires: bool) -> Any:
    """The completion marker, token-checked; built once per retention kind."""
    now = db_epoch_now()
    return (
        update(keys)
        .where(_owned_by_token)
        .values(
            state=COMPLETED,
            result=bindparam("p_result"),
            last_error=None,
            lease_expires_at=None,
            completed_at=now,
            updated_at=now,
            expires_at=now + bindparam("p_retention", type_=Double) if expires else None,
        )
    )


# The claim: one statement, one round trip, whatever the outcome. The inner SELECT decides once
# what kind of claim this is; every column then reads that decision. ``k`` is the existing row,
# ``excluded`` the row this claim proposed, whose updated_at is "now" by the database's clock.
# A claim that does not own the key rewrites the row with its own values (a no-op) but for the
# duplicates counter, so the RETURNING row always answers: owned (claim_id is ours), COMPLETED,
# in flight or a payload conflict.
_CLAIM_SQL = """
INSERT INTO celery_guard_keys AS k (
    key, task_name, state, attempts, fencing_token, lease_expires_at, owner, owner_lock,
    claim_id, claim_reason, fingerprint, message, duplicates, created_at, updated_at)
VALUES (
    :p_key, :p_task_name, 'RUNNING', 1, {first_token}, {now} + :p_lease_ttl, :p_owner,
    :p_owner_lock, :p_claim_id, 'NEW', :p_fingerprint, :p_message, 0, {now}, {now})
ON CONFLICT (key) DO UPDATE SET (
    state, attempts, fencing_token, lease_expires_at, owner, owner_lock, claim_id, claim_reason,
    task_name, fingerprint, message, result, completed_at, expires_at, created_at,
    updated_at, republished_at, duplicates
) = (
    SELECT
        CASE WHEN d.claim THEN 'RUNNING' ELSE k.state END,
        CASE WHEN d.expired THEN 1 WHEN d.claim THEN k.attempts + 1 ELSE k.attempts END,
        CASE WHEN d.claim THEN {next_token} ELSE k.fencing_token END,
        CASE WHEN d.claim THEN excluded.lease_expires_at ELSE k.lease_expires_at END,
        CASE WHEN d.claim THEN excluded.owner ELSE k.owner END,
        CASE WHEN d.claim THEN excluded.owner_lock ELSE k.owner_lock END,
        CASE WHEN d.claim THEN excluded.claim_id ELSE k.claim_id END,
        CASE WHEN d.resent THEN k.claim_reason WHEN d.expired THEN 'NEW'
             WHEN d.lapsed THEN 'TAKEOVER' WHEN d.released THEN 'RETRY'
             ELSE k.claim_reason END,
        CASE WHEN d.claim THEN excluded.task_name ELSE k.task_name END,
        CASE WHEN d.claim THEN excluded.fingerprint ELSE k.fingerprint END,
        CASE WHEN d.claim THEN excluded.message ELSE k.message END,
        CASE WHEN d.claim THEN NULL ELSE k.result END,
        CASE WHEN d.claim THEN NULL ELSE k.completed_at END,
        CASE WHEN d.claim THEN NULL ELSE k.expires_at END,
        CASE WHEN d.expired THEN excluded.created_at ELSE k.created_at END,
        CASE WHEN d.claim THEN excluded.updated_at ELSE k.updated_at END,
        CASE WHEN d.claim THEN NULL ELSE k.republished_at END,
        CASE WHEN d.replay THEN k.duplicates + 1 ELSE k.duplicates END
    FROM (
        SELECT c.resent, c.expired, c.lapsed, c.released,
               (c.resent OR c.expired OR c.lapsed OR c.released) AS claim,
               (k.state = 'COMPLETED' AND NOT c.expired AND c.same) AS replay
        FROM (
            SELECT
                COALESCE(k.claim_id = excluded.claim_id, FALSE) AS resent,
                (k.state = 'COMPLETED'
                 AND COALESCE(k.expires_at <= excluded.updated_at, FALSE)) AS expired,
                (k.state = 'RUNNING' AND {lapsed} AND {same}) AS lapsed,
                (k.state = 'RELEASED' AND {same}) AS released,
                {same} AS same
        ) AS c
    ) AS d
)
RETURNING *, lease_expires_at - {now} AS lease_remaining
"""

#: A new row's first token: above every token of the key's pruned rows (see prune_completed).
_FIRST_TOKEN = (
    f"(COALESCE((SELECT f.term FROM celery_guard_leaders AS f WHERE f.name = '{TOKEN_FLOOR}'), 0)"
    " + 1)"
)

#: Same payload: the fingerprints match (a row without one accepts any).
_SAME_PAYLOAD = "COALESCE(k.fingerprint = excluded.fingerprint OR k.fingerprint IS NULL, FALSE)"

_CLOCKS = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


def _raw_connection(engine: Engine) -> Any:
    """A pooled DBAPI connection; a refused connect raised as SQLAlchemy's DBAPIError."""
    try:
        return engine.raw_connection()
    except psycopg.Error as exc:
        # The pool's own connect: SQLAlchemy wraps this only on its Connection path.
        raise sa_exc.DBAPIError.instance(
            None, None, exc, psycopg.Error, dialect=engine.dialect
        ) from exc


class _HotConnection:
    """One PostgreSQL connection per process, kept in autocommit for claim, complete, release.

    It is checked out of the engine's pool once and detached from it, so it does not count
    against ``pool_size`` (a task's own ``transaction()`` still borrows from the pool) and is
    not reset on every statement. A thread that finds it busy uses the pool instead, so a
    threaded or gevent pool never holds more than one extra connection per process. A forked
    child forgets its parent's without closing it: psycopg does not end a connection from a
    process other than the one that opened it.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self.lock = threading.Lock()
        self._connection: Any = None

    def try_acquire(self) -> bool:
        """Take the hot connection for one statement; False while another thread has it."""
        if self._pid != os.getpid():
            self.forget()
        return self.lock.acquire(blocking=False)

    def connection(self, engine: Engine) -> Any:
        """This process's hot psycopg connection (after :meth:`try_acquire`)."""
        connection = self._connection
        if connection is None or connection.closed:
            pooled = _raw_connection(engine)
            try:
                connection = pooled.dbapi_connection
                pooled.detach()  # from now on ours to close, outside the pool's count
            except BaseException:
                pooled.close()
                raise
            try:
                connection.autocommit = True
            except BaseException:
                connection.close()
                raise
            self._connection = connection
        return connection

    def drop(self) -> None:
        """Close and forget the connection (it failed); the next call opens a new one."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()

    def forget(self) -> None:
        """After fork: the parent's connection (and a lock it may have held) are not ours."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self.lock = threading.Lock()
            self._connection = None

    def close(self) -> None:
        """Close this process's hot connection (dispose)."""
        if self._pid != os.getpid():
            self.forget()
            return
        with self.lock:
            self.drop()


@functools.cache
def _claim_statement(dialect_name: str, check_fingerprint: bool, external_lease: bool) -> Any:
    """The claim SQL for one variant, built once (SQLAlchemy then reuses its compiled form).

    A short text matters: psycopg parses queries over 4 KB on every execution, and a claim built
    from SQLAlchemy expressions repeated its condition in every column (13 KB).
    """
    if external_lease:
        # The claimant holds the external (Redis) lease, so the previous owner's has lapsed;
        # the row's token must still rise even if the lease store's counter went backwards.
        first_token = (
            f"CASE WHEN {_FIRST_TOKEN} > :p_external_token THEN {_FIRST_TOKEN} "
            "ELSE :p_external_token END"
        )
        lapsed = "TRUE"
        next_token = (
            "CASE WHEN k.fencing_token + 1 > :p_external_token "
            "THEN k.fencing_token + 1 ELSE :p_external_token END"
        )
    else:
        first_token = _FIRST_TOKEN
        lapsed = "COALESCE(k.lease_expires_at <= excluded.updated_at, FALSE)"
        next_token = "k.fencing_token + 1"
    sql = _CLAIM_SQL.strip().format(
        now=_CLOCKS[dialect_name],
        first_token=first_token,
        next_token=next_token,
        lapsed=lapsed,
        same=_SAME_PAYLOAD if check_fingerprint else "TRUE",
    )
    typed = [bindparam("p_lease_ttl", type_=Double), bindparam("p_owner_lock", type_=BigInteger)]
    if external_lease:
        typed.append(bindparam("p_external_token", type_=BigInteger))
    return text(sql).bindparams(*typed)


def _publish_done() -> Any:
    """A tracked publish the reaper has nothing left to do for: its key has a row (claimed at
    least once, in any state), or its message expired (a worker would discard it unrun)."""
    return or_(
        exists().where(keys.c.key == published.c.key),
        published.c.expires_at <= db_epoch_now(),
    )


@functools.cache
def _track_publish_statement(dialect_name: str) -> Any:
    """The producer's INSERT, built once per dialect (``_execute_hot`` caches its SQL)."""
    now = db_epoch_now()
    due = now + bindparam("p_countdown", type_=Double)
    return (
        _upsert(dialect_name, published)
        .values(
            key=bindparam("p_key"),
            task_name=bindparam("p_task_name"),
            task_id=bindparam("p_task_id"),
            message=bindparam("p_message"),
            published_at=now,
            publisher_stamp=bindparam("p_stamp", type_=Double),
            due_at=due,
            expires_at=now + bindparam("p_expires_in", type_=Double),
            waiting_since=due,
            republishes=0,
        )
        .on_conflict_do_nothing(index_elements=[published.c.key])
    )
