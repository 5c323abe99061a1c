"""What every part of the SQL store shares: the per-process engine and how a call is run.

One engine per process, created on first use after fork (a pooled connection shared across a
prefork fork loses writes). The guard's own single statements run in autocommit on PostgreSQL so
that a claim is exactly one round trip; on SQLite every transaction starts ``BEGIN IMMEDIATE`` so a
writer waits for the lock (``busy_timeout``) instead of failing on a read-to-write upgrade.

Every call goes through :meth:`StoreEngine.call`: driver errors become ``StoreError`` /
``StoreUnavailable`` (:func:`wrap_error`), a dropped connection is retried once, and the
observer (the circuit breaker's counts) is told how the call went. The table modules beside
this one (``keys``, ``dead_letters``, ``recovery``, ``publishes``, ``workers``) hold the
statements; this module holds none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select as io_select
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, RootTransaction, create_engine, event, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from celery_guard import forks
from celery_guard.config import GuardConfig
from celery_guard.errors import StoreError, StoreUnavailable
from celery_guard.store.prepared import PreparedStatements
from celery_guard.store.schema import db_epoch_now, metadata
from celery_guard.store.watchdog import CallWatchdog

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Told about every store call: (seconds it took, the StoreError it ended with or ``None``).
StoreObserver = Callable[[float, StoreError | None], None]

#: Execution option: this SQLite transaction only reads, so it need not wait for the write lock.
SQLITE_READ_ONLY = "celery_guard_read_only"

#: Called with ``"commit"`` or ``"rollback"`` before a transaction on a task's connection ends.
BoundaryHook = Callable[[str], None]

#: Rows as dicts, and the rowcount: what one statement answers.
Rows = tuple[list[dict[str, Any]], int]


class StoreEngine:
    """This process's engine on PostgreSQL or SQLite, and the one way store calls are run."""

    #: Told the outcome and latency of every call (the circuit breaker's counts); ``None``: none.
    observer: StoreObserver | None = None

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._engine_pid: int | None = None
        self._engine_generation: int | None = None
        self._schema_ready = False
        #: PostgreSQL: this process's connection for the per-delivery statements (see hot()).
        self.hot = HotConnection()
        self.dialect_name = make_url(config.store_url).get_backend_name()
        self._observing = _Observing()  # a call inside a call is not counted twice
        #: id(statement) -> (statement, driver SQL, fixed parameters); statements are built once.
        self._compiled_cache: dict[int, tuple[Any, str, dict[str, Any]]] = {}
        self._names_cache: dict[int, list[str]] = {}
        #: PostgreSQL: closes a call's connection when the server never answers (watchdog.py).
        self.watchdog = CallWatchdog(config.store_timeout + max(1.0, config.store_timeout / 2))
        # Behind a transaction pooler a prepared statement would not outlive the transaction.
        self.prepared = PreparedStatements(
            self.watchdog, prepare=config.store_pooling != "transaction"
        )
        #: How this process may use connections (docs/operations.md, "The connection budget"):
        #: ``"process"`` (the default: a hot connection and a pool), ``"child"`` (a prefork pool
        #: process: the hot connection carries everything, including the body's transaction,
        #: and anything that finds it busy opens a connection for that call only) or
        #: ``"main"`` (a prefork worker's main process: no hot connection, a pool of one).
        self.budget = "process"
        #: Shown as the connections' ``application_name`` after ``celery_guard``: the worker's
        #: main process id, so ``pg_stat_activity`` tells whose connections they are.
        self.worker_tag: str | None = None
        #: Driver connections opened outside the pool that live as long as the engine (the
        #: liveness session), with the pid that opened each: dispose() closes that pid's.
        self._kept: list[tuple[int, Any]] = []

    # -- engine lifecycle ---------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This process's engine; a forked child builds its own instead of reusing the parent's."""
        engine = self._engine
        if engine is not None and self._engine_generation == forks.current:
            return engine
        pid = os.getpid()
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
            self._engine_generation = forks.current
            return self._engine

    def reset_after_fork(self, budget: str | None = None) -> None:
        """Forget the parent's engine; called from ``worker_process_init`` (``budget``: this
        process's connection mode, see :attr:`budget`)."""
        with self._lock:
            if budget is not None:
                self.budget = budget
            self.hot.forget()
            if self._engine is not None and self._engine_pid != os.getpid():
                self._engine.dispose(close=False)
                self._engine = None
                self._schema_ready = False

    def keep(self, connection: Any) -> None:
        """Close ``connection`` (a driver connection taken out of the pool) with the engine."""
        with self._lock:
            self._kept.append((os.getpid(), connection))

    def forget_kept(self, connection: Any) -> None:
        """``connection`` was closed by its user: :meth:`dispose` need not close it."""
        with self._lock:
            self._kept = [(pid, kept) for pid, kept in self._kept if kept is not connection]

    def dispose(self) -> None:
        """Close this process's connections (before a fork, or at shutdown)."""
        with self._lock:
            mine = [kept for pid, kept in self._kept if pid == os.getpid()]
            # Another process's (inherited across fork) stay referenced and open: closing them
            # here would end the parent's session.
            self._kept = [(pid, kept) for pid, kept in self._kept if pid != os.getpid()]
            for connection in mine:
                with contextlib.suppress(Exception):
                    connection.close()
            self.hot.close()
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
            "application_name": _application_name(self.worker_tag),
        }
        if self.config.store_pooling == "transaction":
            # A transaction pooler (PgBouncer) refuses startup options and would not keep a
            # session setting past the transaction: the timeouts are set on the role instead
            # (docs/pgbouncer.md). A statement psycopg prepared lives in one server session,
            # which the next transaction may not get: prepare none.
            del connect_args["options"]
            connect_args["prepare_threshold"] = None
        engine = create_engine(url, connect_args=connect_args, **_pool(self.budget, timeout))
        if self.config.store_pooling == "transaction":
            _warn_without_role_timeouts(engine)
        self.watchdog.install(engine)
        return engine

    def ensure_schema(self) -> None:
        """Create the tables if they are missing (when ``guard_create_tables`` is on)."""
        if self._schema_ready:
            return
        try:
            self.call(lambda: metadata.create_all(self.engine, checkfirst=True))
        except StoreError:
            # Several processes starting at once race between "does it exist?" and CREATE;
            # the loser's CREATE fails on the winner's table. Look again: it is there now.
            self.call(lambda: metadata.create_all(self.engine, checkfirst=True))
        self._schema_ready = True

    def ready_engine(self) -> Engine:
        """The engine, with the tables created first when ``guard_create_tables`` is on."""
        engine = self.engine
        if self.config.create_tables and not self._schema_ready:
            self.ensure_schema()
        return engine

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
        rows = self.call(
            lambda: self.execute_single(select(db_epoch_now().label("now")), read_only=True)
        )[0]
        return float(only_row(rows)["now"])

    def upsert(self, table: Any) -> Any:
        """The dialect's INSERT with ON CONFLICT support, for ``table``."""
        return upsert(self.dialect_name, table)

    # -- running statements -------------------------------------------------------------------

    def execute_single(
        self, statement: Any, parameters: dict[str, Any] | None = None, read_only: bool = False
    ) -> Rows:
        """Run one statement as its own transaction, in as few round trips as the dialect allows.

        Returns the rows (as dicts) and the rowcount, read before the connection is returned.
        """
        engine = self.ready_engine()
        if self.dialect_name == "postgresql":
            lent = self.lend(engine) if self.budget == "child" else None
            if lent is not None:
                # Already in autocommit: the statement commits as it runs.
                with lent as connection:
                    return _read(connection.execute(statement, parameters))
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                return _read(connection.execute(statement, parameters))
        options = {SQLITE_READ_ONLY: read_only}
        with engine.connect().execution_options(**options) as connection, connection.begin():
            return _read(connection.execute(statement, parameters))

    def execute_hot(self, statement: Any, parameters: dict[str, Any]) -> Rows:
        """The per-delivery statements (claim, complete, release): one autocommitted round trip.

        On PostgreSQL they skip SQLAlchemy's per-execution work (compiling the cache key,
        building result metadata for 20-odd columns, switching the connection to autocommit
        and back through the dialect): the SQL is compiled once per statement and runs on a
        psycopg connection kept in autocommit for them (one per process, :class:`HotConnection`),
        prepared there at first use and sent through libpq past psycopg's cursor
        (:mod:`celery_guard.store.prepared`). The pool's checkout, reset
        and checkin and the autocommit switches were a third of what remained of celery_guard's
        own CPU per task (bench/overhead.py). Errors are re-raised as SQLAlchemy's, so
        :meth:`call` treats both paths alike.
        """
        if self.dialect_name != "postgresql" or self.budget == "main":
            # The main process keeps to its pool of one (docs/operations.md).
            return self.execute_single(statement, parameters)
        engine = self._engine
        if (
            engine is None
            or self._engine_generation != forks.current
            or not (self._schema_ready or not self.config.create_tables)
        ):
            engine = self.ready_engine()
        sql, defaults = self._compiled(engine, statement)
        values = {**defaults, **parameters}
        hot = self.hot
        if hot.try_acquire():
            try:
                cursor = hot.cursor(engine)
                return self._run_hot(engine, cursor.connection, statement, sql, values, cursor)
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

    def lend(
        self,
        engine: Engine,
        *,
        transaction: bool = False,
        on_boundary: BoundaryHook | None = None,
    ) -> Connection | None:
        """The hot connection as a SQLAlchemy ``Connection``, or ``None`` while it is busy.

        A prefork pool process runs its body's ``transaction()`` and its other statements on
        the connection its claims use, so that it holds one connection in all
        (docs/design.md, "One connection per pool process"). With ``transaction`` the driver
        leaves autocommit, so the body's writes stay in one transaction until celery_guard
        commits them; closing the ``Connection`` ends the loan: whatever is still open rolls
        back and the connection returns to autocommit. Invalidating it closes the connection
        and the next claim opens another. ``on_boundary``: as for :meth:`connect`.
        """
        hot = self.hot
        if not hot.try_acquire():
            return None
        try:
            if transaction and hot.heard_from_server():
                # An idle connection the server spoke on was ended (a restart, a reset): the
                # body's transaction cannot be sent again, so start it on a new one.
                hot.drop()
            pooled = hot.pooled(engine)
            if transaction:
                pooled.dbapi_connection.autocommit = False
            lent: Any = _Lent(pooled, hot)  # stands for the pool's proxy (duck-typed)
            return TaskConnection(engine, connection=lent, on_boundary=on_boundary)
        except BaseException:
            hot.drop()
            hot.lock.release()
            raise

    def connect(self, engine: Engine, on_boundary: BoundaryHook | None = None) -> Connection:
        """A connection from ``engine``'s pool for a task's own transaction; ``on_boundary`` is
        told before a transaction on it ends (:class:`TaskConnection`)."""
        return TaskConnection(engine, on_boundary=on_boundary)

    def execute_in_transaction(
        self, connection: Connection, statement: Any, parameters: dict[str, Any]
    ) -> int:
        """The completion marker inside a task's open transaction; returns the rowcount.

        Run on the driver connection under SQLAlchemy's transaction, like :meth:`execute_hot`
        (SQLAlchemy's own execute was most of the marker's client cost). Never resent: after a
        lost connection the transaction is gone, and the delivery is deferred instead.
        """
        engine = connection.engine
        sql, defaults = self._compiled(engine, statement)
        values = {**defaults, **parameters}
        dbapi_connection = connection.connection.dbapi_connection
        try:
            return self._run_hot(
                engine,
                dbapi_connection,
                statement,
                sql,
                values,
                self.hot.kept_cursor(dbapi_connection),
            )[1]
        except sa_exc.DBAPIError as exc:
            if exc.connection_invalidated:
                connection.invalidate(exc.orig)
            raise wrap_error(exc, self.config) from exc

    def commit(self, transaction: RootTransaction) -> None:
        """Commit a task's transaction under the watchdog; failures are store errors (never
        resent: a commit is not idempotent)."""

        watchdog = self.watchdog

        def commit() -> None:
            fd = watchdog.arm_connection(_dbapi_connection(transaction))
            try:
                transaction.commit()
            except sa_exc.DBAPIError as exc:
                raise wrap_error(exc, self.config) from exc
            finally:
                if fd is not None:
                    watchdog.disarm(fd)

        self.call(commit, retry=False)

    def _run_hot(
        self,
        engine: Engine,
        connection: Any,
        statement: Any,
        sql: str,
        values: dict[str, Any],
        cursor: Any = None,
    ) -> Rows:
        """One statement on a psycopg connection (autocommit, or inside a task's transaction);
        driver errors re-raised as SQLAlchemy's, flagged when the connection is gone. The
        watchdog arms itself around the execute (the store engine's cursors are
        :meth:`CallWatchdog.cursor_class`'s). ``cursor``: the connection's kept cursor
        (:meth:`HotConnection.cursor`); without it one is opened and closed for the statement.
        Both serve only what :attr:`prepared` leaves to the cursor (its module docstring).
        """
        own = cursor is None
        try:
            ran = self.prepared.run(connection, sql, values)
            if ran is not None:
                return ran
            if own:
                cursor = connection.cursor()
            try:
                cursor.execute(sql, values)
                rows: list[dict[str, Any]] = []
                names = self._column_names(statement, cursor)
                if names is not None:
                    rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
                return rows, int(cursor.rowcount)
            finally:
                if own:
                    cursor.close()
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

    # -- the call wrappers --------------------------------------------------------------------

    def call(self, operation: Callable[[], T], *, retry: bool = True) -> T:
        """Run a store operation, telling :attr:`observer` (if any) how it went and how long it
        took. With ``retry`` (the default) it runs once more after a dropped connection and
        driver errors come out as store errors; without it (a commit, a statement inside a
        task's transaction: neither can be sent twice) ``operation`` wraps its own errors.

        A store error is a failure; any other exception (Fenced: the store answered) is not
        counted at all. Calls made inside it (creating the tables on first use) are part of it.
        One method, not a retrying wrapper around an observing one: it runs for every store
        call of every delivery.
        """
        observer = self.observer
        observing = self._observing
        if observer is None or observing.active:
            return self._call_unobserved(operation) if retry else operation()
        started = time.monotonic()
        observing.active = True
        try:
            value = self._call_unobserved(operation) if retry else operation()
        except StoreError as exc:
            _tell(observer, time.monotonic() - started, exc)
            raise
        finally:
            observing.active = False
        try:  # _tell's guard, inline: this runs after every store call
            observer(time.monotonic() - started, None)
        except Exception:
            logger.exception("celery_guard: the store call observer failed")
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
                raise wrap_error(exc, self.config) from exc
            except sa_exc.TimeoutError as exc:
                raise StoreUnavailable(
                    f"no store connection free within {self.config.store_timeout}s "
                    f"({self.config.safe_store_url()})"
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover


class _Observing(threading.local):
    """Per thread: whether a store call is being observed (:meth:`StoreEngine.call`). A
    class default, so that the check before every store call is an attribute read."""

    active = False


def _dbapi_connection(transaction: RootTransaction) -> Any:
    """The driver's connection under ``transaction``, or None when there is none to watch."""
    try:
        return transaction.connection.connection.dbapi_connection
    except sa_exc.SQLAlchemyError:
        return None


def _application_name(worker_tag: str | None) -> str:
    """``celery_guard``, or ``celery_guard <worker's main pid>/<pid>`` in a worker."""
    if worker_tag is None:
        return "celery_guard"
    return f"celery_guard {worker_tag}/{os.getpid()}"


def _pool(budget: str, timeout: float) -> dict[str, Any]:
    """The pool that keeps this process within its connection budget (StoreEngine.budget)."""
    if budget == "child":
        # Everything runs on the hot connection; what finds it busy (a statement inside the
        # body's transaction) opens a connection for that call and closes it after.
        return {"poolclass": NullPool}
    if budget == "main":
        # The reaper, the sampler, the worker heartbeat and the renewal relay take turns.
        return {"pool_size": 1, "max_overflow": 0, "pool_timeout": timeout}
    return {"pool_timeout": timeout}


def _tell(observer: StoreObserver, seconds: float, error: StoreError | None) -> None:
    """Counting a call must never change its outcome."""
    try:
        observer(seconds, error)
    except Exception:
        logger.exception("celery_guard: the store call observer failed")


def upsert(dialect_name: str, table: Any) -> Any:
    """The dialect's INSERT with ON CONFLICT support."""
    return (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(table)


def _read(result: Any) -> Rows:
    rows = [dict(row) for row in result.mappings()] if result.returns_rows else []
    return rows, int(result.rowcount)


def only_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The one row a statement must answer with; a ``StoreError`` otherwise."""
    if len(rows) != 1:
        raise StoreError(f"expected one row from the store, got {len(rows)}")
    return rows[0]


def wrap_error(exc: sa_exc.DBAPIError, config: GuardConfig) -> StoreError:
    """A driver error as celery_guard's: missing tables say what to run, an unreachable server
    is ``StoreUnavailable``; the message names the store without its password."""
    where = config.safe_store_url()
    text = str(exc.orig) if exc.orig is not None else str(exc)
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "no such table" in text or "UndefinedTable" in type(exc.orig).__name__:
        return StoreError(
            f"celery_guard tables are missing in {where}: run `celery -A <app> guard migrate` "
            "(in a Django project with celery_guard.contrib.django: `python manage.py migrate`) "
            f"or set guard_create_tables = True ({first_line})"
        )
    if "unsupported startup parameter" in text:
        # PgBouncer's answer to the engine's startup options (its ignore_startup_parameters).
        return StoreUnavailable(
            f"store {where} unavailable: {first_line}; behind PgBouncer, set "
            "guard_store_pooling = 'transaction' (docs/pgbouncer.md)"
        )
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        return StoreUnavailable(f"store {where} unavailable: {first_line}")
    return StoreError(f"store {where} error: {first_line}")


def _warn_without_role_timeouts(engine: Engine) -> None:
    """Once per engine, behind a transaction pooler: say so when the server bounds no statement.

    Without startup ``options`` the server's own settings apply; with ``statement_timeout``
    or ``lock_timeout`` left at 0 (not set on the role or database), a statement stuck on a
    lock is bounded only by the client's watchdog (watchdog.py), which closes the client's
    socket but does not end the server's statement or free its locks.
    """

    @event.listens_for(engine, "first_connect")
    def _check(dbapi_connection: Any, _record: Any) -> None:
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
                )
                row = cursor.fetchone()
            if not dbapi_connection.autocommit:
                dbapi_connection.rollback()
        except psycopg.Error as exc:  # the connection's own use will report it
            logger.debug("celery_guard: could not read the server's timeouts: %s", exc)
            return
        names = ("statement_timeout", "lock_timeout")
        unset = [name for name, value in zip(names, row or ("0", "0"), strict=True) if value == "0"]
        if unset:
            logger.warning(
                "celery_guard: guard_store_pooling is 'transaction' and the server runs with "
                "%s: set them on the role (ALTER ROLE ... SET statement_timeout = '5s', "
                "docs/pgbouncer.md)",
                ", ".join(f"{name} = 0" for name in unset),
            )


class TaskConnection(Connection):
    """A task's connection, which tells ``on_boundary`` before a transaction on it ends.

    However the body asks for the end (``Connection.commit()``, an ORM ``Session`` that controls
    the transaction, ``close()``), SQLAlchemy ends a root transaction through ``_commit_impl``
    or ``_rollback_impl`` (sqlalchemy/engine/base.py), where it also fires the ``commit`` and
    ``rollback`` events: an exception raised here propagates to the caller with nothing sent,
    as from those events. Not those events themselves: any connection event listener on an
    engine sends every statement on it through SQLAlchemy's event dispatch (a tenth or more of
    the client CPU of a task's own transaction, bench/body_transaction.py), and the store
    engine on PostgreSQL has none. Savepoints are not reported.
    """

    def __init__(
        self, engine: Engine, connection: Any = None, on_boundary: BoundaryHook | None = None
    ) -> None:
        self._on_boundary = on_boundary
        super().__init__(engine, connection)

    def _commit_impl(self) -> None:
        if self._on_boundary is not None:
            self._on_boundary("commit")
        super()._commit_impl()

    def _rollback_impl(self) -> None:
        if self._on_boundary is not None:
            self._on_boundary("rollback")
        super()._rollback_impl()


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
        read_only = connection.get_execution_options().get(SQLITE_READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def _raw_connection(engine: Engine) -> Any:
    """A pooled DBAPI connection; a refused connect raised as SQLAlchemy's DBAPIError."""
    try:
        return engine.raw_connection()
    except psycopg.Error as exc:
        # The pool's own connect: SQLAlchemy wraps this only on its Connection path.
        raise sa_exc.DBAPIError.instance(
            None, None, exc, psycopg.Error, dialect=engine.dialect
        ) from exc


class _Lent:
    """The hot connection while a SQLAlchemy ``Connection`` borrows it (StoreEngine.lend).

    Stands where SQLAlchemy expects a pooled connection: closing it ends the loan instead of
    returning anything to a pool, and invalidating it closes the driver connection for good.
    Everything else is the detached pool proxy's.
    """

    def __init__(self, pooled: Any, hot: HotConnection) -> None:
        self._pooled = pooled
        self._hot = hot
        self._lent = True
        # What a task's transaction reads on every statement and at its commit, as plain
        # attributes rather than through __getattr__ (the driver's, fixed for the loan).
        self.dbapi_connection = pooled.dbapi_connection
        self.cursor = pooled.cursor
        self.commit = pooled.commit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pooled, name)

    def close(self) -> None:
        self._give_back()

    def _close_special(self, transaction_reset: bool = False) -> None:
        self._give_back()

    def invalidate(self, e: BaseException | None = None, soft: bool = False) -> None:
        if self._lent:
            self._lent = False
            self._hot.drop()
            self._hot.lock.release()

    def _give_back(self) -> None:
        if not self._lent:
            return
        self._lent = False
        hot = self._hot
        try:
            connection = self._pooled.dbapi_connection
            if connection is not None and not connection.closed:
                if connection.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    connection.rollback()
                connection.autocommit = True
        except Exception:
            # A connection that cannot return to a clean autocommit is not reused.
            hot.drop()
        finally:
            hot.lock.release()


class HotConnection:
    """One PostgreSQL connection per process, kept in autocommit for claim, complete, release.

    It is checked out of the engine's pool once and detached from it, so it does not count
    against ``pool_size`` (a task's own ``transaction()`` still borrows from the pool) and is
    not reset on every statement. A thread that finds it busy uses the pool instead, so a
    threaded or gevent pool never holds more than one extra connection per process. A forked
    child forgets its parent's without closing it: psycopg does not end a connection from a
    process other than the one that opened it.
    """

    def __init__(self) -> None:
        self._generation = forks.current
        self.lock = threading.Lock()
        self._connection: Any = None
        self._pooled: Any = None
        self._cursor: Any = None

    def try_acquire(self) -> bool:
        """Take the hot connection for one statement; False while another thread has it."""
        if self._generation != forks.current:
            self.forget()
        return self.lock.acquire(blocking=False)

    def connection(self, engine: Engine) -> Any:
        """This process's hot psycopg connection (after :meth:`try_acquire`)."""
        return self.pooled(engine).dbapi_connection

    def cursor(self, engine: Engine) -> Any:
        """A cursor on the hot connection, kept with it (after :meth:`try_acquire`).

        One cursor serves every claim and completion: psycopg cursors run any number of
        statements one after another, and opening and closing one per statement was a tenth
        of the store layer's Python calls. It goes with the connection (:meth:`drop`).
        """
        cursor = self._cursor
        if cursor is not None and not self._connection.closed:
            return cursor
        cursor = self._cursor = self.pooled(engine).dbapi_connection.cursor()
        return cursor

    def kept_cursor(self, dbapi_connection: Any) -> Any:
        """The kept cursor when ``dbapi_connection`` is the hot connection (lent to a body's
        transaction, whose completion marker runs on it), else ``None``."""
        if dbapi_connection is self._connection and dbapi_connection is not None:
            return self._cursor
        return None

    def pooled(self, engine: Engine) -> Any:
        """The detached pool proxy of the hot connection (after :meth:`try_acquire`)."""
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
            self._pooled = pooled
            self._cursor = None
        return self._pooled

    def heard_from_server(self) -> bool:
        """Whether the idle connection has something to read: on an idle session that is the
        server ending it, or the network resetting it (one ``select`` call, no round trip)."""
        connection = self._connection
        if connection is None or connection.closed:
            return False
        try:
            return bool(io_select.select([connection.fileno()], [], [], 0)[0])
        except (OSError, ValueError, psycopg.Error):
            return True

    def drop(self) -> None:
        """Close and forget the connection (it failed); the next call opens a new one."""
        connection, self._connection, self._pooled = self._connection, None, None
        self._cursor = None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()

    def forget(self) -> None:
        """After fork: the parent's connection (and a lock it may have held) are not ours."""
        if self._generation != forks.current:
            self._generation = forks.current
            self.lock = threading.Lock()
            self._connection = None
            self._pooled = None
            self._cursor = None

    def close(self) -> None:
        """Close this process's hot connection (dispose)."""
        if self._generation != forks.current:
            self.forget()
            return
        with self.lock:
            self.drop()
