"""The per-delivery statements through libpq's own calls, under psycopg's connection.

A claim and a completion are two statements per task, always the same few. psycopg's cursor
runs each through several layers of Python on every execution (the query's conversion and
its parameters' reordering, the prepare manager, the result set's bookkeeping) before libpq
sends it. :class:`PreparedStatements` sends them through the connection's ``pgconn``
(``psycopg.pq``, psycopg's public libpq wrapper) instead: each statement is prepared once per
connection under its own name, executed with its parameters as text, and its rows loaded by
psycopg's own ``Transformer``, so the values read back are the ones the cursor gave. What it
saves per task: docs/performance.md, "The hot statements go to libpq past the cursor".

The parameters are adapted by psycopg itself (``Transformer.dump_sequence``, as text): the
same texts and types its cursor sends, so a statement is prepared once for each combination of
types it meets, as psycopg's prepare manager does. What this path does not run (a statement
the server cannot prepare, a connection in pipeline mode, a statement inside a transaction: the
completion marker in a body's ``transaction()``) answers ``None``, and the caller runs it
through the cursor as before. With a transaction pooler (``guard_store_pooling =
'transaction'``) nothing is prepared: each statement goes as one unnamed ``PQexecParams``.

libpq's calls block with the GIL released; the store's watchdog (:mod:`.watchdog`) bounds them
as it bounds the cursor's, by shutting the socket at the deadline.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import adapt, pq
from psycopg.abc import Buffer
from psycopg.adapt import PyFormat
from psycopg.errors import error_from_result

from celery_guard.store.watchdog import CallWatchdog

#: Rows as dicts, and the rowcount: what one statement answers (as ``engine.Rows``).
Rows = tuple[list[dict[str, Any]], int]

_PLACEHOLDER = re.compile(rb"%%|%\((\w+)\)s|%")
_SESSION_ATTRIBUTE = "_celery_guard_prepared"
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
# Read once: each is two attribute lookups on an enum class, per statement.
_CONNECTION_OK = pq.ConnStatus.OK
_IDLE = pq.TransactionStatus.IDLE
_PIPELINE_OFF = pq.PipelineStatus.OFF
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_UNDEFINED_PREPARED_STATEMENT = b"26000"
#: indeterminate_datatype, datatype_mismatch, undefined_function (an operator for "unknown").
_UNTYPABLE = (b"42P18", b"42804", b"42883")


class _Unsupported(Exception):
    """A statement or a value this path does not send; the cursor does."""


def convert(sql: str) -> tuple[bytes, tuple[str, ...]]:
    """psycopg's ``%(name)s`` placeholders as libpq's ``$n``, with the names in ``$n`` order."""
    names: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        if match.group(0) == b"%%":
            return b"%"
        if match.group(1) is None:
            raise _Unsupported("a lone %")
        name = match.group(1).decode()
        if name not in names:
            names.append(name)
        return b"$%d" % (names.index(name) + 1)

    return _PLACEHOLDER.sub(number, sql.encode()), tuple(names)


class _Statement:
    """One statement's libpq form, and its prepared names by parameter types."""

    __slots__ = ("arguments", "columns", "formats", "names", "prepared", "sql")

    def __init__(self, sql: bytes, names: tuple[str, ...]) -> None:
        self.sql = sql
        self.names = names
        #: The parameters' values in ``$n`` order from a statement's values by name, in C
        #: (``KeyError`` for a missing one).
        self.arguments: Callable[[dict[str, Any]], Sequence[Any]] = (
            operator.itemgetter(*names) if len(names) > 1 else _one_or_none(names)
        )
        self.formats = [PyFormat.TEXT] * len(names)
        #: Parameter types -> the name it is prepared under on this connection.
        self.prepared: dict[tuple[int, ...], bytes] = {}
        self.columns: list[str] | None = None


def _one_or_none(names: tuple[str, ...]) -> Callable[[dict[str, Any]], Sequence[Any]]:
    """For a statement of one parameter or none: itemgetter of one name gives a bare value."""
    if not names:
        return lambda values: ()
    name = names[0]
    return lambda values: (values[name],)


class _Session:
    """What one connection has prepared, and the transformer that loads its results."""

    __slots__ = ("connection", "count", "encoding", "statements", "transformer")

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection
        self.statements: dict[str, _Statement | None] = {}
        self.transformer = adapt.Transformer(connection)
        self.encoding = connection.info.encoding
        self.count = 0

    def forget_prepared(self) -> None:
        for statement in self.statements.values():
            if statement is not None:
                statement.prepared.clear()


class PreparedStatements:
    """Runs the hot statements on a psycopg connection through ``pgconn`` (module docstring)."""

    def __init__(self, watchdog: CallWatchdog, *, prepare: bool = True) -> None:
        self.watchdog = watchdog
        #: False behind a transaction pooler: unnamed statements only.
        self.prepare = prepare
        self._last: _Session | None = None

    def run(self, connection: Any, sql: str, values: dict[str, Any]) -> Rows | None:
        """Run ``sql`` with ``values`` on ``connection``; ``None`` when the cursor must.

        Raises psycopg's errors as its cursor would (the caller maps them).
        """
        if type(connection) is not psycopg.Connection:
            return None
        pgconn = connection.pgconn
        if pgconn.status != _CONNECTION_OK:
            raise psycopg.OperationalError("the connection is closed")
        if (
            pgconn.transaction_status != _IDLE
            or pgconn.pipeline_status != _PIPELINE_OFF
            or not connection.autocommit
        ):
            # Autocommitted statements only. psycopg sends DEALLOCATE ALL after a ROLLBACK
            # once it has prepared statements of its own on the connection (its prepare
            # manager), which drops ours too: in autocommit the failed execution changed
            # nothing and is sent again after preparing anew; inside a transaction it would
            # have aborted the body's writes. psycopg's cursor runs those, as it always did.
            return None
        session = self._last
        if session is None or session.connection is not connection:
            # Kept on the connection, so it goes when the connection does (a cycle the
            # collector ends: the session's transformer refers to its connection).
            session = getattr(connection, _SESSION_ATTRIBUTE, None)
            if session is None:
                session = _Session(connection)
                setattr(connection, _SESSION_ATTRIBUTE, session)
            self._last = session  # the hot connection, nearly always
        statements = session.statements
        if sql in statements:
            statement = statements[sql]
        else:
            try:
                statement = _Statement(*convert(sql))
            except _Unsupported:
                statement = None
            statements[sql] = statement
        if statement is None:
            return None
        try:
            arguments = statement.arguments(values)
        except KeyError:
            return None  # a parameter missing: the cursor says which
        # psycopg's own adaptation, in C: the texts and types its cursor would send.
        transformer = session.transformer
        params = transformer.dump_sequence(arguments, statement.formats)
        types = tuple(transformer.types or ())
        fd = self.watchdog.arm_connection(connection)
        try:
            result = self._execute(pgconn, session, sql, statement, params, types)
        finally:
            if fd is not None:
                self.watchdog.disarm(fd)
        if result is None:
            return None
        return self._rows(session, statement, result)

    def _execute(
        self,
        pgconn: Any,
        session: _Session,
        sql: str,
        statement: _Statement,
        params: Sequence[Buffer | None],
        types: tuple[int, ...],
    ) -> Any:
        if not self.prepare:
            result = pgconn.exec_params(statement.sql, params, types)
            if result.status not in _OK:
                raise _error(pgconn, session, result)
            return result
        for attempt in (1, 2):
            name = statement.prepared.get(types)
            if name is None:
                session.count += 1
                name = b"celery_guard_%d" % session.count
                prepared = pgconn.prepare(name, statement.sql, types)
                if prepared.status != pq.ExecStatus.COMMAND_OK:
                    state = prepared.error_field(pq.DiagnosticField.SQLSTATE)
                    if state in _UNTYPABLE and pgconn.status == pq.ConnStatus.OK:
                        # The server cannot type the statement from these parameters (one
                        # it cannot infer): the cursor, which types them all, runs it.
                        session.statements[sql] = None
                        return None
                    raise _error(pgconn, session, prepared)
                statement.prepared[types] = name
            result = pgconn.exec_prepared(name, params)
            if (
                attempt == 1
                and result.status not in _OK
                and result.error_field(pq.DiagnosticField.SQLSTATE) == _UNDEFINED_PREPARED_STATEMENT
                and pgconn.transaction_status != pq.TransactionStatus.INERROR
            ):
                # Deallocated behind our back (DISCARD ALL, DEALLOCATE ALL): prepare again.
                session.forget_prepared()
                continue
            if result.status not in _OK:
                raise _error(pgconn, session, result)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _rows(session: _Session, statement: _Statement, result: Any) -> Rows:
        if result.status != _TUPLES_OK:
            return [], int(result.command_tuples or 0)
        columns = statement.columns
        if columns is None or len(columns) != result.nfields:
            columns = statement.columns = [
                result.fname(index).decode(session.encoding) for index in range(result.nfields)
            ]
        transformer = session.transformer
        transformer.set_pgresult(result)
        count = result.ntuples
        loaded = transformer.load_rows(0, count, tuple)
        rows = [dict(zip(columns, row, strict=True)) for row in loaded]
        transformer.set_pgresult(None)
        affected = result.command_tuples
        return rows, count if affected is None else int(affected)


def _error(pgconn: Any, session: _Session, result: Any) -> psycopg.Error:
    """The error psycopg's cursor raises for ``result``: the server's, or, when the connection
    is gone, an OperationalError (which SQLAlchemy's dialect reads as a disconnect)."""
    if pgconn.status != pq.ConnStatus.OK:
        message = pgconn.error_message.decode(session.encoding, "replace").strip()
        return psycopg.OperationalError(f"consuming input failed: {message}")
    return error_from_result(result, session.encoding)
