"""The SQL store: every statement celery_guard runs against the database is in this module.

One engine per process, created on first use after fork (a pooled connection shared across a
prefork fork loses writes). The guard's own single statements run in autocommit on PostgreSQL so
that a claim is exactly one round trip; on SQLite every transaction starts ``BEGIN IMMEDIATE`` so a
writer waits for the lock (``busy_timeout``) instead of failing on a read-to-write upgrade.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    RootTransaction,
    and_,
    case,
    create_engine,
    delete,
    event,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.sql.elements import ColumnElement

from celery_guard.config import GuardConfig
from celery_guard.errors import Fenced, StoreError, StoreUnavailable
from celery_guard.store.base import ClaimOutcome, ClaimRequest, ClaimResult, KeyRecord
from celery_guard.store.schema import (
    ClaimReason,
    KeyState,
    db_epoch_now,
    keys,
    leaders,
    metadata,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Execution option: this SQLite transaction only reads, so it need not wait for the write lock.
_SQLITE_READ_ONLY = "celery_guard_read_only"

RUNNING = KeyState.RUNNING.value
COMPLETED = KeyState.COMPLETED.value
RELEASED = KeyState.RELEASED.value


class SqlStore:
    """The durable idempotency table on PostgreSQL or SQLite."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._engine_pid: int | None = None
        self._schema_ready = False
        self.dialect_name = make_url(config.store_url).get_backend_name()

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
            if self._engine is not None and self._engine_pid != os.getpid():
                self._engine.dispose(close=False)
                self._engine = None
                self._schema_ready = False

    def dispose(self) -> None:
        """Close this process's connections (before a fork, or at shutdown)."""
        with self._lock:
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
        return create_engine(url, connect_args=connect_args, pool_timeout=timeout)

    def ensure_schema(self) -> None:
        """Create the tables if they are missing (when ``guard_create_tables`` is on)."""
        if self._schema_ready:
            return
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
        statement = self._claim_statement(request, claim_id)
        row = _only_row(self._call(lambda: self._execute_single(statement))[0])
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
        now = db_epoch_now()
        expires = None if retention is None else now + retention
        statement = (
            update(keys)
            .where(keys.c.key == key, keys.c.fencing_token == token, keys.c.state == RUNNING)
            .values(
                state=COMPLETED,
                result=result,
                last_error=None,
                lease_expires_at=None,
                completed_at=now,
                updated_at=now,
                expires_at=expires,
            )
        )
        if connection is not None:
            rowcount = self._call(lambda: connection.execute(statement).rowcount)
        else:
            rowcount = self._call(lambda: self._execute_single(statement))[1]
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
        now = db_epoch_now()
        statement = (
            update(keys)
            .where(keys.c.key == key, keys.c.fencing_token == token, keys.c.state == RUNNING)
            .values(state=RELEASED, lease_expires_at=None, last_error=error, updated_at=now)
        )
        return self._call(lambda: self._execute_single(statement))[1] == 1

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

    def prune_completed(self, limit: int) -> int:
        """Delete up to ``limit`` COMPLETED keys whose retention ended; return how many."""
        now = db_epoch_now()
        expired = (
            select(keys.c.key)
            .where(keys.c.state == COMPLETED, keys.c.expires_at <= now)
            .limit(limit)
            .scalar_subquery()
        )
        statement = delete(keys).where(keys.c.key.in_(expired))
        return self._call(lambda: self._execute_single(statement))[1]

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
        rows = self._call(
            lambda: self._execute_single(select(db_epoch_now().label("now")), read_only=True)
        )[0]
        return float(_only_row(rows)["now"])

    def get(self, key: str) -> KeyRecord | None:
        """The key's row, or ``None``."""
        statement = select(keys).where(keys.c.key == key)
        rows = self._call(lambda: self._execute_single(statement, read_only=True))[0]
        return KeyRecord.from_mapping(rows[0]) if rows else None

    def commit(self, transaction: RootTransaction) -> None:
        """Commit a task's transaction; failures are store errors (never resent: not idempotent)."""
        try:
            transaction.commit()
        except sa_exc.DBAPIError as exc:
            raise _wrap(exc, self.config) from exc

    def connect(self) -> Connection:
        """A new connection for a task's own transaction; the caller closes it."""
        engine = self._ready_engine()
        return self._call(engine.connect)

    # -- internals ----------------------------------------------------------------------------

    def _claim_statement(self, request: ClaimRequest, claim_id: str) -> Any:
        now = db_epoch_now()
        statement = self._upsert(keys).values(
            key=request.key,
            task_name=request.task_name,
            state=RUNNING,
            attempts=1,
            fencing_token=request.external_token or 1,
            lease_expires_at=now + request.lease_ttl,
            owner=request.owner,
            claim_id=claim_id,
            claim_reason=ClaimReason.NEW.value,
            fingerprint=request.fingerprint,
            message=request.message,
            result=None,
            last_error=None,
            duplicates=0,
            created_at=now,
            updated_at=now,
            completed_at=None,
            expires_at=None,
            republished_at=None,
        )
        new = statement.excluded
        if request.check_fingerprint:
            same_payload: ColumnElement[bool] = or_(
                keys.c.fingerprint == new.fingerprint,
                keys.c.fingerprint.is_(None),
            )
        else:
            same_payload = literal(True)
        result_expired = and_(
            keys.c.state == COMPLETED, keys.c.expires_at.is_not(None), keys.c.expires_at <= now
        )
        if request.external_token is None:
            lease_expired = and_(
                keys.c.state == RUNNING, keys.c.lease_expires_at <= now, same_payload
            )
            next_token: Any = keys.c.fencing_token + 1
        else:
            # The claimant holds the external lease, so the previous owner's has lapsed.
            lease_expired = and_(keys.c.state == RUNNING, same_payload)
            next_token = case(
                (keys.c.fencing_token + 1 > request.external_token, keys.c.fencing_token + 1),
                else_=request.external_token,
            )
        released = and_(keys.c.state == RELEASED, same_payload)
        # The same claim sent again after a lost reply must find itself the owner.
        resent = keys.c.claim_id == new.claim_id
        claimable = or_(resent, result_expired, lease_expired, released)
        replay = and_(keys.c.state == COMPLETED, ~result_expired, same_payload)

        def when_claimed(value: Any, otherwise: Any) -> Any:
            return case((claimable, value), else_=otherwise)

        statement = statement.on_conflict_do_update(
            index_elements=[keys.c.key],
            set_={
                "state": when_claimed(RUNNING, keys.c.state),
                "attempts": case(
                    (result_expired, 1),
                    (claimable, keys.c.attempts + 1),
                    else_=keys.c.attempts,
                ),
                "fencing_token": when_claimed(next_token, keys.c.fencing_token),
                "lease_expires_at": when_claimed(new.lease_expires_at, keys.c.lease_expires_at),
                "owner": when_claimed(new.owner, keys.c.owner),
                "claim_id": when_claimed(new.claim_id, keys.c.claim_id),
                "claim_reason": case(
                    (resent, keys.c.claim_reason),
                    (result_expired, ClaimReason.NEW.value),
                    (lease_expired, ClaimReason.TAKEOVER.value),
                    (released, ClaimReason.RETRY.value),
                    else_=keys.c.claim_reason,
                ),
                "task_name": when_claimed(new.task_name, keys.c.task_name),
                "fingerprint": when_claimed(new.fingerprint, keys.c.fingerprint),
                "message": when_claimed(new.message, keys.c.message),
                "result": when_claimed(None, keys.c.result),
                "completed_at": when_claimed(None, keys.c.completed_at),
                "expires_at": when_claimed(None, keys.c.expires_at),
                "updated_at": when_claimed(new.updated_at, keys.c.updated_at),
                "created_at": case((result_expired, new.created_at), else_=keys.c.created_at),
                "duplicates": case((replay, keys.c.duplicates + 1), else_=keys.c.duplicates),
                "republished_at": when_claimed(None, keys.c.republished_at),
            },
        )
        return statement.returning(
            *keys.c, (keys.c.lease_expires_at - now).label("lease_remaining")
        )

    def _upsert(self, table: Any) -> Any:
        """The dialect's INSERT with ON CONFLICT support."""
        return (postgresql.insert if self.dialect_name == "postgresql" else sqlite.insert)(table)

    def _execute_single(
        self, statement: Any, read_only: bool = False
    ) -> tuple[list[dict[str, Any]], int]:
        """Run one statement as its own transaction, in as few round trips as the dialect allows.

        Returns the rows (as dicts) and the rowcount, read before the connection is returned.
        """
        engine = self._ready_engine()
        if self.dialect_name == "postgresql":
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                return _read(connection.execute(statement))
        options = {_SQLITE_READ_ONLY: read_only}
        with engine.connect().execution_options(**options) as connection, connection.begin():
            return _read(connection.execute(statement))

    def _call(self, operation: Callable[[], T]) -> T:
        """Run a store operation, once more after a dropped connection; wrap driver errors."""
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


def _classify(record: KeyRecord, request: ClaimRequest, claim_id: str) -> ClaimOutcome:
    if record.claim_id == claim_id and record.state == RUNNING:
        return ClaimOutcome.CLAIMED
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
