"""Real ``celery worker`` processes (prefork) running ``tests/apps/shop.py`` on private servers."""

from __future__ import annotations

import contextlib
import importlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select

import celery_guard
from celery_guard.store import KeyRecord, SqlStore
from celery_guard.store import metadata as guard_metadata
from tests.apps import shop_tables
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess, stop_all

ROOT = Path(__file__).resolve().parents[2]
SHOP_APP = "tests.apps.shop"


@pytest.fixture(scope="session")
def shop_env(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    env = {
        "CG_BROKER_URL": redis_server.url_for(1),
        "CG_RESULT_URL": redis_server.url_for(2),
        "CG_STORE_URL": postgres.create_database(f"shop_{uuid.uuid4().hex[:8]}"),
        "CG_MARKER_DIR": str(tmp_path_factory.mktemp("markers")),
        "CG_LEASE_TTL": "10",
    }
    with environment(env):
        yield env


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment (the shop module and the CLI subprocesses read
    it), and what was there before put back afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def shop(shop_env: dict[str, str]) -> ModuleType:
    """The shop app as the test process sees it (publishing, reading results and tables)."""
    module = importlib.import_module(SHOP_APP)
    # The app reads the environment at import; an earlier import would point it elsewhere.
    assert module.app.conf.broker_url == shop_env["CG_BROKER_URL"], "shop imported too early"
    runtime = celery_guard.get_runtime(module.app)
    runtime.migrate()
    module.metadata.create_all(runtime.store.engine)
    return module


def new_store_database(postgres: PostgresServer, prefix: str) -> str:
    """A fresh PostgreSQL database holding the guard's and the shop's tables; its URL."""
    url = postgres.create_database(f"{prefix}_{uuid.uuid4().hex[:8]}")
    engine = create_engine(url)
    try:
        guard_metadata.create_all(engine)
        shop_tables.metadata.create_all(engine)
    finally:
        engine.dispose()
    return url


def empty_redis_databases(redis_server: RedisServer, *dbs: int) -> None:
    """Start a test's broker (and result) databases empty of what earlier tests left there.

    kombu's Redis transport restores unacknowledged messages under one mutex per database
    (``unacked_mutex``, kept up to 300 s: kombu/transport/redis.py, ``QoS.restore_visible``).
    A worker that an earlier test SIGKILLed during a restore sweep leaves it held, and no
    message of the next test on that database would be restored for five minutes.
    """
    for db in dbs:
        with redis_server.client(db) as client:
            client.flushdb()


def start_workers(count: int, env: dict[str, str], **options: Any) -> list[WorkerProcess]:
    workers = [
        WorkerProcess(SHOP_APP, env=env, cwd=ROOT, **{"concurrency": 2, **options})
        for _ in range(count)
    ]
    try:
        for worker in workers:
            worker.start(wait_ready=False)
        for worker in workers:
            worker.wait_ready(timeout=60)
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    return workers


@pytest.fixture(scope="session")
def shop_workers(shop: ModuleType, shop_env: dict[str, str]) -> Iterator[list[WorkerProcess]]:
    """Two prefork workers, concurrency 2 each, consuming the shop's queue."""
    with running_workers(2, shop_env) as workers:
        yield workers


@contextlib.contextmanager
def running_workers(count: int, env: dict[str, str]) -> Iterator[list[WorkerProcess]]:
    """``count`` started workers (:func:`start_workers`), each stopped by PID afterwards."""
    workers = start_workers(count, env)
    try:
        yield workers
    finally:
        stop_all(workers)


@pytest.fixture
def tag() -> str:
    """A fresh tag per test, so tests sharing the workers and tables never see each other."""
    return uuid.uuid4().hex[:12]


def effect_count(shop: ModuleType, tag: str) -> int:
    engine = celery_guard.get_runtime(shop.app).store.engine
    with engine.connect() as connection:
        return int(
            connection.execute(
                select(func.count()).select_from(shop.effects).where(shop.effects.c.tag == tag)
            ).scalar_one()
        )


def key_record(shop: ModuleType, key: str) -> KeyRecord | None:
    return celery_guard.get_runtime(shop.app).store.keys.get(key)


def wait_for_key_state(shop: ModuleType, key: str, state: str, timeout: float = 30) -> KeyRecord:
    found: list[KeyRecord] = []

    def reached() -> bool:
        record = key_record(shop, key)
        if record is not None and record.state == state:
            found.append(record)
            return True
        return False

    wait_until(reached, timeout, f"key {key!r} to reach {state}")
    return found[-1]


def open_gates(marker_dir: str | os.PathLike[str], tag: str, *tokens: int) -> None:
    """Let the ``shop.gated`` executions of ``tag`` holding these fencing tokens finish.

    A test that observes a body while it runs holds it at the gate until it has seen what it
    waits for, rather than racing a fixed-length body on a loaded machine.
    """
    for token in tokens:
        (Path(marker_dir) / f"{tag}.{token}").touch()


def effects_in(store: SqlStore, tag: str) -> int:
    """How many effect rows the shop's tasks wrote for ``tag`` (one per completed body)."""
    with store.engine.connect() as connection:
        return int(
            connection.execute(
                select(func.count())
                .select_from(shop_tables.effects)
                .where(shop_tables.effects.c.tag == tag)
            ).scalar_one()
        )


def wait_owner(store: SqlStore, key: str, timeout: float = 30) -> str:
    """Wait until some worker runs ``key``; return its owner (``hostname/pid``)."""
    owners: list[str] = []

    def running() -> bool:
        record = store.keys.get(key)
        if record is not None and record.state == "RUNNING" and record.owner:
            owners.append(record.owner)
            return True
        return False

    wait_until(running, timeout, f"{key} to be running")
    return owners[-1]


def worker_running(workers: list[WorkerProcess], owner: str) -> WorkerProcess:
    """The worker whose main process or pool child is the ``owner`` (``hostname/pid``)."""
    pid = int(owner.rsplit("/", 1)[1])
    for worker in workers:
        if pid == worker.pid or pid in worker.child_pids():
            return worker
    raise AssertionError(f"no worker runs pid {pid}")
