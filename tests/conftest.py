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

#: Lines of the log of each worker a failed test uses, attached to its report.
WORKER_LOG_LINES = 150
#: Lines of every other live worker's log (the session's shared workers, another module's).
OTHER_WORKER_LOG_LINES = 15


def workers_of(item: pytest.Item) -> list[WorkerProcess]:
    """The workers a test's fixtures hand it: a worker, a list of them, or a cluster's."""
    found: list[WorkerProcess] = []
    for value in getattr(item, "funcargs", {}).values():
        candidates = getattr(value, "workers", value)
        if isinstance(candidates, WorkerProcess):
            candidates = [candidates]
        if isinstance(candidates, (list, tuple)):
            found.extend(w for w in candidates if isinstance(w, WorkerProcess) and w not in found)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the log tails of its workers, then of every other
    worker still running (shorter).

    Workers are shared by many tests and their logs are deleted with them: without this, a
    failure in CI shows what the client saw and nothing of why a worker did not answer. The
    test's own workers come first and longest: CI folds a long report in the middle, and the
    session's shared workers' logs would otherwise push them out.
    """
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "setup" or not report.failed:
        return
    own = workers_of(item)
    others = [
        managed
        for managed in procs.registered()
        if isinstance(managed, WorkerProcess) and managed.is_alive() and managed not in own
    ]
    for worker, lines, whose in [
        *((w, WORKER_LOG_LINES, "the test's worker") for w in own),
        *((w, OTHER_WORKER_LOG_LINES, "another live worker") for w in others),
    ]:
        state = "running" if worker.is_alive() else "exited"
        report.sections.append(
            (
                f"{whose} {worker.hostname} (pid {worker.pid}, {state}) log tail",
                procs.log_tail(worker.log_path, lines),
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
