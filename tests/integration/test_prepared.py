"""The hot statements through libpq's calls (celery_guard/store/prepared.py), on a real server.

Each test compares with what psycopg's cursor answers for the same statement, or reads the
server's own view (``pg_prepared_statements``), so what the path promises is checked where it
matters: the same rows and counts, the same errors, and nothing prepared behind a pooler.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from celery_guard.store.prepared import PreparedStatements, convert
from celery_guard.store.watchdog import CallWatchdog

TABLE = """
CREATE TABLE prepared_probe (
    key text PRIMARY KEY, token bigint NOT NULL, ttl double precision, note text,
    flag boolean, amount numeric
)
"""
INSERT = (
    "INSERT INTO prepared_probe AS p (key, token, ttl, note, flag, amount) "
    "VALUES (%(key)s, %(token)s, extract(epoch from clock_timestamp()) + %(ttl)s, %(note)s, "
    "%(flag)s, %(amount)s) ON CONFLICT (key) DO NOTHING "
    "RETURNING token, ttl > 0 AS live, note, flag, amount, '100%%' AS percent"
)
UPDATE = "UPDATE prepared_probe SET token = token + 1 WHERE key = %(key)s AND token = %(token)s"


@pytest.fixture
def connection(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)
        yield conn


def _prepared_names(connection: psycopg.Connection[Any]) -> list[str]:
    rows = connection.execute("SELECT name FROM pg_prepared_statements ORDER BY name").fetchall()
    return [str(row[0]) for row in rows if str(row[0]).startswith("celery_guard_")]


def _through_cursor(connection: psycopg.Connection[Any], sql: str, values: dict[str, Any]) -> Any:
    cursor = connection.execute(sql, values)
    names = [column.name for column in cursor.description or []]
    rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()] if names else []
    return rows, cursor.rowcount


def test_placeholders_become_numbered_and_a_doubled_percent_stays_one() -> None:
    sql, names = convert("SELECT %(a)s, %(b)s, %(a)s, '5%%'")
    assert sql == b"SELECT $1, $2, $1, '5%'"
    assert names == ("a", "b")


def test_rows_and_counts_are_the_ones_the_cursor_gives(
    connection: psycopg.Connection[Any],
) -> None:
    runner = PreparedStatements(CallWatchdog(5.0))
    values = {"key": "a", "token": 7, "ttl": 30.5, "note": "é ünïcode", "flag": True}
    ran = runner.run(connection, INSERT, {**values, "amount": None})
    expected = _through_cursor(connection, INSERT, {**values, "key": "b", "amount": None})
    assert ran == expected
    assert ran[0][0]["token"] == 7 and ran[0][0]["percent"] == "100%"
    # A conflict: no row, and a count of 0, as the cursor says.
    assert runner.run(connection, INSERT, {**values, "amount": None}) == ([], 0)
    assert runner.run(connection, UPDATE, {"key": "a", "token": 7}) == ([], 1)
    assert runner.run(connection, UPDATE, {"key": "a", "token": 7}) == ([], 0)  # fenced
    # Prepared once per combination of parameter types: None and a float are two.
    runner.run(connection, INSERT, {**values, "key": "c", "ttl": None, "amount": None})
    assert len(_prepared_names(connection)) == 3


def test_values_are_adapted_as_psycopg_adapts_them(
    connection: psycopg.Connection[Any],
) -> None:
    """psycopg's own adaptation: a Decimal, an integer beyond bigint (numeric), a small one
    (smallint), each typed as the cursor types it."""
    runner = PreparedStatements(CallWatchdog(5.0))
    values = {"key": "d", "token": 1, "ttl": 1.0, "note": None, "flag": None}
    ran = runner.run(connection, INSERT, {**values, "amount": Decimal("1.5")})
    assert ran is not None and ran[0][0]["amount"] == Decimal("1.5")
    ran = runner.run(connection, INSERT, {**values, "key": "e", "amount": 2**70})
    assert ran is not None and ran[0][0]["amount"] == Decimal(2**70)
    narrow = "SELECT extract(day FROM make_interval(days => %(d)s))::int AS days"
    assert runner.run(connection, narrow, {"d": 3}) == ([{"days": 3}], 1)
    with pytest.raises(psycopg.ProgrammingError):
        runner.run(connection, INSERT, {**values, "key": "f", "amount": object()})


def test_errors_are_psycopgs_and_a_statement_deallocated_elsewhere_is_prepared_again(
    connection: psycopg.Connection[Any],
) -> None:
    runner = PreparedStatements(CallWatchdog(5.0))
    values = {"key": "g0", "token": 1, "ttl": 1.0, "note": None, "flag": None, "amount": None}
    assert runner.run(connection, INSERT, values) is not None
    connection.execute("DEALLOCATE ALL")
    assert runner.run(connection, UPDATE, {"key": "g0", "token": 1}) == ([], 1)
    assert runner.run(connection, INSERT, {**values, "key": "g"}) is not None
    with pytest.raises(psycopg.errors.UndefinedTable):
        runner.run(connection, "SELECT * FROM no_such_table WHERE x = %(x)s", {"x": 1})
    with pytest.raises(psycopg.errors.NotNullViolation):
        runner.run(connection, INSERT, {**values, "key": "h", "token": None})


def test_a_statement_the_server_cannot_prepare_goes_to_the_cursor(
    connection: psycopg.Connection[Any],
) -> None:
    """Left to the cursor, which reports the server's error as it always did."""
    runner = PreparedStatements(CallWatchdog(5.0))
    untypable = "SELECT %(x)s IS NULL AS missing"
    assert runner.run(connection, untypable, {"x": None}) is None
    with pytest.raises(psycopg.errors.IndeterminateDatatype):
        _through_cursor(connection, untypable, {"x": None})
    assert runner.run(connection, untypable, {"x": None}) is None  # remembered
    assert _prepared_names(connection) == []


def test_inside_a_transaction_the_cursor_runs_the_statement(
    connection: psycopg.Connection[Any],
) -> None:
    """A statement inside a transaction is left to psycopg's cursor (which also sends the
    BEGIN a transaction not yet begun needs): a prepared statement dropped behind our back
    would abort the transaction there, with the body's writes."""
    runner = PreparedStatements(CallWatchdog(5.0))
    values = {"key": "i", "token": 1, "ttl": 1.0, "note": None, "flag": None, "amount": None}
    connection.autocommit = False
    assert runner.run(connection, INSERT, values) is None  # not begun
    connection.execute("SELECT 1")  # BEGIN
    assert runner.run(connection, INSERT, {**values, "key": "j"}) is None  # in a transaction
    connection.rollback()
    connection.autocommit = True
    assert _prepared_names(connection) == []


def test_psycopgs_deallocate_all_after_a_rollback_is_survived(pg_url: str) -> None:
    """psycopg drops every prepared statement of the session (DEALLOCATE ALL) when a
    connection on which it prepared its own rolls back: the next autocommitted statement
    prepares again and runs once."""
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        conn.execute(TABLE)
        runner = PreparedStatements(CallWatchdog(5.0))
        values = {"key": "m", "token": 1, "ttl": 1.0, "note": None, "flag": None}
        assert runner.run(conn, INSERT, {**values, "amount": None}) is not None
        assert len(_prepared_names(conn)) == 1
        conn.autocommit = False
        conn.execute("SELECT count(*) FROM prepared_probe WHERE key = %s", ("m",))  # psycopg's
        conn.rollback()
        conn.autocommit = True
        assert _prepared_names(conn) == []  # ours went with psycopg's
        ran = runner.run(conn, INSERT, {**values, "key": "n", "amount": None})
        assert ran is not None and ran[1] == 1
        assert len(_prepared_names(conn)) == 1
        rows = conn.execute("SELECT key FROM prepared_probe ORDER BY key").fetchall()
        assert [row[0] for row in rows] == ["m", "n"]


def test_a_closed_connection_raises_what_the_cursor_would(
    connection: psycopg.Connection[Any],
) -> None:
    runner = PreparedStatements(CallWatchdog(5.0))
    backend = connection.info.backend_pid
    dsn = connection.info.dsn
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    with pytest.raises(psycopg.OperationalError):
        runner.run(connection, UPDATE, {"key": "k", "token": 1})
    assert connection.closed  # what SQLAlchemy's dialect reads as a disconnect


def test_behind_a_transaction_pooler_nothing_is_prepared(
    connection: psycopg.Connection[Any],
) -> None:
    runner = PreparedStatements(CallWatchdog(5.0), prepare=False)
    values = {"key": "l", "token": 1, "ttl": 1.0, "note": "x", "flag": False, "amount": None}
    ran = runner.run(connection, INSERT, values)
    assert ran is not None and ran[0][0]["flag"] is False
    assert _prepared_names(connection) == []
