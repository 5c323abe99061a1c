"""The store on Django's database: its URL made from ``DATABASES``, and ``self.guard.atomic()``.

Claims, releases, the reaper and the CLI run on celery_guard's own SQLAlchemy engine, made from
the alias's settings (no second connection string). The body's ORM writes and the key's
COMPLETED marker run on Django's own connection for the alias, in one transaction that
celery_guard opens with ``transaction.atomic(using=alias)`` the first time the body enters
``self.guard.atomic()`` and ends when the body returns: committed with the marker, or rolled
back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.transaction import TransactionManagementError
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Dialect

from celery_guard.errors import (
    ConfigurationError,
    Fenced,
    GuardError,
    StoreError,
    StoreUnavailable,
    TransactionMisuse,
)
from celery_guard.execution import Execution
from celery_guard.store.keys import completion

#: The alias the store lives on when ``CELERY_GUARD_DATABASE`` is not set.
DEFAULT_ALIAS = "default"

#: Django's own keys of a PostgreSQL alias's ``OPTIONS``; every other scalar one is a libpq
#: connection parameter (``sslmode``, ``service``...) the store's engine is given as well.
_DJANGO_ONLY_OPTIONS = frozenset(
    {"isolation_level", "assume_role", "server_side_binding", "pool", "cursor_factory"}
    | {"prepare_threshold", "context"}
)

#: The vendors (``connection.vendor``) the store runs on, and the dialect its SQL compiles
#: for there, in the "pyformat" style Django's cursors take with a dict of parameters (the
#: SQLite backend turns it into sqlite3's named style: django/db/backends/sqlite3/base.py).
_DIALECTS: dict[str, Dialect] = {
    "postgresql": postgresql.psycopg.dialect(paramstyle="pyformat"),  # type: ignore[no-untyped-call]
    "sqlite": sqlite.pysqlite.dialect(paramstyle="pyformat"),
}


class DjangoTransactionMisuse(TransactionMisuse, TransactionManagementError):  # type: ignore[misc]
    """The body tried to end the transaction of ``self.guard.atomic()`` itself.

    Both celery_guard's :class:`~celery_guard.TransactionMisuse` (a permanent error: nothing
    commits, the key is dead-lettered) and Django's ``TransactionManagementError``, which
    ``transaction.commit()`` inside an atomic block raises anyway.
    """


def check_alias(alias: str) -> None:
    """Raise ``ConfigurationError`` unless ``alias`` is a database the store can live on."""
    try:
        databases = settings.DATABASES
    except ImproperlyConfigured as exc:
        raise ConfigurationError(
            "celery_guard.contrib.django reads Django's DATABASES, but Django's settings are "
            "not configured: set DJANGO_SETTINGS_MODULE before the Celery app is created, as "
            f"Celery's Django guide does ({exc})"
        ) from None
    if alias not in databases:
        raise ConfigurationError(
            f"CELERY_GUARD_DATABASE is {alias!r}, which is not in Django's DATABASES "
            f"({', '.join(sorted(databases)) or 'none'}): name one of them"
        )
    vendor = connections[alias].vendor
    if vendor not in _DIALECTS:
        raise ConfigurationError(
            f"Django database {alias!r} is {vendor}; celery_guard's store runs on PostgreSQL "
            "and SQLite: point CELERY_GUARD_DATABASE at an alias of one of them"
        )
    if vendor == "sqlite" and _in_memory(str(databases[alias].get("NAME") or "")):
        raise ConfigurationError(
            f"Django database {alias!r} is an in-memory SQLite database, which each connection "
            "sees empty: celery_guard's store needs a file (set NAME to a path; in tests, "
            "TEST: {'NAME': <path>})"
        )


def _in_memory(name: str) -> bool:
    return not name or name == ":memory:" or "mode=memory" in name


def store_url(alias: str) -> str:
    """The SQLAlchemy URL of the database Django's ``alias`` connects to, as it connects now
    (a test run's database once the test runner has switched to it)."""
    check_alias(alias)
    connection = connections[alias]
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return URL.create("sqlite", database=os.path.abspath(str(params["NAME"]))).render_as_string(
            hide_password=False
        )
    options = params.get("OPTIONS") or {}
    query = {
        str(name): str(value)
        for name, value in options.items()
        if name not in _DJANGO_ONLY_OPTIONS and isinstance(value, (str, int, float))
    }
    port = params.get("PORT")
    url = URL.create(
        "postgresql+psycopg",
        username=params.get("USER") or None,
        password=params.get("PASSWORD") or None,
        host=params.get("HOST") or None,
        port=int(port) if port else None,
        database=params.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


class DjangoTransaction:
    """The transaction of ``self.guard.atomic()``: an outermost ``transaction.atomic`` on the
    store's alias, held open from the body's first ``self.guard.atomic()`` until the body
    returns, then committed with the COMPLETED marker (celery_guard's ``JoinedTransaction``).

    While it is open, ending it any other way (``transaction.commit()``, ``rollback()``,
    ``set_autocommit()``) raises :class:`DjangoTransactionMisuse`, and the execution fails
    without committing anything, even if the body caught the error.
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.connection = connections[alias]
        self._outer = transaction.atomic(using=alias)
        self._open = False
        self._misuse: str | None = None

    @property
    def misuse(self) -> TransactionMisuse | None:
        """The error for the body's attempt to end this transaction itself, if it made one."""
        return None if self._misuse is None else DjangoTransactionMisuse(self._misuse)

    def begin(self) -> None:
        """Open the outermost atomic block (a savepoint when the caller is in one already: a
        task called eagerly or directly inside a view's or a test's transaction)."""
        self._outer.__enter__()
        self._open = True
        # Django checks every commit(), rollback() and set_autocommit() with this method
        # (django/db/backends/base/base.py): an instance attribute shadows it while the
        # transaction is the guard's, so the attempt is recorded even if the body catches it.
        self.connection.validate_no_atomic_block = self._refuse_boundary

    def _refuse_boundary(self) -> None:
        try:
            type(self.connection).validate_no_atomic_block(self.connection)
        except TransactionManagementError:
            self._misuse = _ENDED_BY_BODY
            raise DjangoTransactionMisuse(_ENDED_BY_BODY) from None

    def _restore(self) -> None:
        self.connection.__dict__.pop("validate_no_atomic_block", None)

    def complete(self, key: str, token: int, result: str, retention: float | None) -> None:
        """The token-checked completion marker on Django's connection, inside this transaction."""
        connection = self.connection
        if connection.closed_in_transaction:
            self._misuse = _CLOSED
            raise DjangoTransactionMisuse(_CLOSED)
        if connection.atomic_blocks and connection.atomic_blocks[-1] is not self._outer:
            raise GuardError(
                "an atomic block entered in the task body is still open when it returned; "
                "use transaction.atomic() as a context manager or decorator"
            )
        if connection.needs_rollback:
            raise TransactionMisuse(_MARKED_FOR_ROLLBACK)
        if _failed_statement(connection):
            raise TransactionMisuse(_FAILED_STATEMENT)
        statement, parameters = completion(key, token, result, retention)
        sql, defaults = _compiled(statement, connection.vendor)
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, {**defaults, **parameters})
                rowcount = cursor.rowcount
        except (OperationalError, InterfaceError) as exc:
            raise StoreUnavailable(f"Django database {self.alias!r} unavailable: {exc}") from exc
        except DatabaseError as exc:
            raise StoreError(f"Django database {self.alias!r} error: {exc}") from exc
        if rowcount != 1:
            raise Fenced(key, token)

    def commit(self) -> None:
        """Leave the outermost atomic block normally: Django commits (or releases the
        savepoint, inside a caller's transaction)."""
        self._open = False
        self._restore()
        try:
            self._outer.__exit__(None, None, None)
        except (OperationalError, InterfaceError) as exc:
            # The commit may or may not have landed: the next delivery finds out from the store.
            raise StoreUnavailable(
                f"Django database {self.alias!r}: the commit did not answer ({exc})"
            ) from exc

    def rollback(self) -> None:
        """Leave the outermost atomic block by rolling back; nothing once it has ended."""
        if not self._open:
            return
        self._open = False
        self._restore()
        self._outer.__exit__(_Aborted, _Aborted(), None)


class _Aborted(Exception):
    """Handed to ``Atomic.__exit__`` to have it roll back."""


def _failed_statement(connection: Any) -> bool:
    """PostgreSQL: a statement failed in the open transaction, which can only roll back now."""
    if connection.vendor != "postgresql" or connection.connection is None:
        return False
    info = getattr(connection.connection, "info", None)
    status = getattr(info, "transaction_status", None)
    return status is not None and getattr(status, "name", "") == "INERROR"


_COMPILED: dict[tuple[int, str], tuple[Any, str, dict[str, Any]]] = {}


def _compiled(statement: Any, vendor: str) -> tuple[str, dict[str, Any]]:
    """``statement`` as SQL for Django's cursor on ``vendor``, and its fixed parameters."""
    cached = _COMPILED.get((id(statement), vendor))
    if cached is None or cached[0] is not statement:
        compiled = statement.compile(dialect=_DIALECTS[vendor])
        defaults = dict(compiled.construct_params(_check=False))
        cached = (statement, compiled.string, defaults)
        _COMPILED[(id(statement), vendor)] = cached
    return cached[1], cached[2]


class AtomicBlocks:
    """``self.guard.atomic()`` for one app: Django's ``transaction.atomic`` on the store's alias,
    inside the execution's :class:`DjangoTransaction` (opened on first use)."""

    def __init__(self) -> None:
        #: Set from the settings when the runtime is built (``CELERY_GUARD_DATABASE``).
        self.alias = DEFAULT_ALIAS

    def __call__(self, execution: Execution, options: dict[str, Any]) -> Any:
        return self._block(execution, **options)

    @contextmanager
    def _block(
        self, execution: Execution, *, using: str | None = None, savepoint: bool = True
    ) -> Iterator[None]:
        alias = self.alias
        if using is not None and using != alias:
            raise TransactionMisuse(
                f"self.guard.atomic(using={using!r}): the store lives on {alias!r} "
                "(CELERY_GUARD_DATABASE), and only writes there commit with the COMPLETED "
                "marker; use transaction.atomic(using=...) for other databases, outside the "
                "guarantee"
            )
        joined = execution.joined
        if joined is None:
            joined = DjangoTransaction(alias)
            joined.begin()
            try:
                execution.join(joined)
            except BaseException:
                joined.rollback()
                raise
        elif not isinstance(joined, DjangoTransaction):
            raise GuardError("this execution has joined another kind of transaction already")
        # Django's own block inside the guard's: a savepoint, so an error caught outside it
        # undoes only its writes, as a nested atomic() does.
        with transaction.atomic(using=alias, savepoint=savepoint):
            yield


_ENDED_BY_BODY = (
    "the task body tried to end the transaction of self.guard.atomic() (transaction.commit(), "
    "rollback() or set_autocommit()); not allowed, nothing of this execution is committed. "
    "celery_guard commits the body's writes together with the key's COMPLETED marker when the "
    "body returns: remove the call (to undo part of the work, raise inside a nested "
    "transaction.atomic() block and catch the error outside it)"
)
_CLOSED = (
    "the task body closed Django's database connection inside self.guard.atomic(); its "
    "writes are rolled back and nothing of this execution is committed"
)
_MARKED_FOR_ROLLBACK = (
    "the transaction of self.guard.atomic() was marked for rollback (transaction."
    "set_rollback(True), or an error caught inside an atomic(savepoint=False) block), so "
    "nothing of this execution is committed; to give up the execution, raise from the body"
)
_FAILED_STATEMENT = (
    "a statement failed inside self.guard.atomic() and the body caught its error: PostgreSQL "
    "has aborted the transaction, so nothing of this execution can commit. Run a statement "
    "that may fail in a nested transaction.atomic() block and catch the error outside it"
)
