"""Session-wide servers: private PostgreSQL, PgBouncer, Redis and RabbitMQ on free loopback ports.

They start on first use (a run of unit tests starts neither) and stop, by PID, at session end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_guard import GuardConfig
from celery_guard.store.sql import SqlStore
from tests.rig import procs
from tests.rig.servers import PgBouncerServer, PostgresServer, RabbitMQServer, RedisServer
from tests.rig.workers import WorkerProcess

#: Lines of each live worker's log attached to a failed test's report.
WORKER_LOG_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the log tail of every worker still running.

    Workers are shared by many tests and their logs are deleted with them: without this, a
    failure in CI shows what the client saw and nothing of why a worker did not answer.
    """
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "setup" or not report.failed:
        return
    for managed in procs.registered():
        if isinstance(managed, WorkerProcess) and managed.is_alive():
            report.sections.append(
                (
                    f"worker {managed.hostname} (pid {managed.pid}) log tail",
                    procs.log_tail(managed.log_path, WORKER_LOG_LINES),
                )
            )


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def pgbouncer(postgres: PostgresServer) -> Iterator[PgBouncerServer]:
    """PgBouncer in transaction pooling in front of the session's PostgreSQL."""
    with PgBouncerServer(postgres) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[RabbitMQServer]:
    """One RabbitMQ node for the session (it takes a few seconds to boot)."""
    with RabbitMQServer() as server:
        yield server


def fresh_database_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """A new, empty PostgreSQL database for one test."""
    return postgres.create_database(fresh_database_name())


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.sqlite3'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Every store test runs on the embedded SQLite default and on PostgreSQL."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def store(store_url: str) -> Iterator[SqlStore]:
    sql_store = SqlStore(GuardConfig(store_url=store_url, store_timeout=5.0))
    sql_store.ensure_schema()
    try:
        yield sql_store
    finally:
        sql_store.dispose()
