"""Tests of the rig itself, against real PostgreSQL, Redis and celery worker processes."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
import redis
import sqlalchemy as sa
from kombu import Connection

from . import procs
from .servers import PgBouncerServer, PostgresServer, RabbitMQServer, RedisServer
from .workers import WorkerProcess, stop_all

RIG_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def _no_leaks() -> Iterator[None]:
    """Set up first, torn down last: everything this module started must have been stopped.

    Session-wide servers from a conftest were registered before and are left alone.
    """
    before = {id(obj) for obj in procs.registered()}
    yield
    leaked = [obj for obj in procs.registered() if id(obj) not in before]
    for obj in leaked:
        obj.emergency_kill()
        procs.unregister(obj)
    assert not leaked, f"the rig left processes running: {leaked}"


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def sample_app(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The client side of sample_app, imported fresh so it reads this server's URL."""
    monkeypatch.setenv("RIG_BROKER_URL", redis_server.url)
    name = f"{__package__}.sample_app"
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    yield module
    module.app.close()
    sys.modules.pop(name, None)


def test_postgres_select_and_table(pg: PostgresServer) -> None:
    engine = sa.create_engine(pg.url)
    try:
        with engine.begin() as conn:
            assert conn.execute(sa.text("select 1")).scalar() == 1
            conn.execute(sa.text("create table t (id int primary key, v text)"))
            conn.execute(sa.text("insert into t values (1, 'x')"))
        with engine.connect() as conn:
            assert conn.execute(sa.text("select v from t where id = 1")).scalar() == "x"
    finally:
        engine.dispose()


def test_postgres_create_database_and_restart(pg: PostgresServer) -> None:
    url = pg.create_database("fresh_db")
    assert url.endswith(f":{pg.port}/fresh_db")
    port, old_pid = pg.port, pg.pid
    pg.restart()
    assert (pg.port, procs.pid_alive(old_pid)) == (port, False)
    with psycopg.connect(pg.dsn_for("fresh_db")) as conn:
        assert conn.execute("select current_database()").fetchone() == ("fresh_db",)


def test_postgres_freeze_thaw(pg: PostgresServer) -> None:
    members = [pg.pid, *procs.descendants(pg.pid)]
    assert len(members) > 1  # postmaster plus checkpointer, walwriter, ...
    pg.freeze()
    try:
        # A backend that was just exiting may turn into a zombie or vanish instead.
        procs.wait_until(
            lambda: {procs.process_state(p) for p in members} <= {"T", "Z", None}, 5, "frozen"
        )
    finally:
        pg.thaw()
    with psycopg.connect(pg.dsn_for(), connect_timeout=5) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_redis_set_get_and_restart(redis_server: RedisServer) -> None:
    with redis_server.client() as r:
        r.set("k", "v")
        assert r.get("k") == b"v"
    port = redis_server.port
    redis_server.restart()
    assert redis_server.port == port
    with redis_server.client() as r:
        assert r.ping()
        assert r.get("k") is None  # no persistence
        r.set("k2", "v2")
    redis_server.flushall()
    with redis_server.client() as r:
        assert r.dbsize() == 0


def test_postgres_role_that_must_give_its_password(pg: PostgresServer) -> None:
    url = pg.create_password_role("rig_secret", "p@ss/w:rd", "rig_secret_db")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT current_user")).scalar() == "rig_secret"
    finally:
        engine.dispose()
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(
            f"host=127.0.0.1 port={pg.port} dbname=rig_secret_db user=rig_secret password=x",
            connect_timeout=5,
        )


def test_redis_with_a_password() -> None:
    with RedisServer(password="p@ss/w:rd") as server:
        assert "p%40ss%2Fw%3Ard@" in server.url
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        with (
            redis.Redis(host="127.0.0.1", port=server.port) as anonymous,
            pytest.raises(redis.AuthenticationError),
        ):
            anonymous.ping()
        server.restart()
        with server.client() as client:
            assert client.ping(), "the password survives a restart"


def test_rabbitmq_roundtrip_and_stop_by_pid() -> None:
    """A private node and its own epmd, both gone (by PID) after stop."""
    with RabbitMQServer() as server:
        with Connection(server.url, connect_timeout=10) as connection:
            queue = connection.SimpleQueue(f"rig-{server.port}")
            queue.put({"n": 1})
            message = queue.get(timeout=10)
            assert message.payload == {"n": 1}
            message.ack()
            queue.close()
        assert server._epmd is not None
        pids = [server.pid, server._epmd.pid, *procs.descendants(server.pid)]
        assert len(pids) >= 3, "the start script, the Erlang VM and epmd"
    assert not [pid for pid in pids if procs.pid_alive(pid)]


def test_server_start_failure_reports_log(redis_server: RedisServer) -> None:
    clash = RedisServer(port=redis_server.port)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code.*log tail.*in use"):
        clash.start()


def test_worker_runs_task_then_kill(redis_server: RedisServer, sample_app: ModuleType) -> None:
    worker = WorkerProcess(
        app="sample_app", cwd=RIG_DIR, env={"RIG_BROKER_URL": redis_server.url}, concurrency=2
    )
    try:
        worker.start(timeout=60)
        assert sample_app.add.delay(2, 3).get(timeout=30) == 5
        # The name remote control is addressed to (``%h`` expanded) is the one it runs under.
        assert f"{worker.node_name} ready." in worker.log_text()
        children = worker.child_pids()
        assert len(children) == 2
        worker.kill()
        pids = [worker.pid, *children]
        procs.wait_until(lambda: not any(map(procs.pid_alive, pids)), 10, "worker tree to die")
    finally:
        worker.cleanup()


def test_worker_freeze_kill_child_and_stop(redis_server: RedisServer) -> None:
    with WorkerProcess(
        app="sample_app", cwd=RIG_DIR, env={"RIG_BROKER_URL": redis_server.url}
    ) as worker:
        tree = [worker.pid, *worker.child_pids()]
        worker.freeze()
        procs.wait_until(lambda: all(procs.process_state(p) == "T" for p in tree), 5, "frozen")
        worker.thaw()
        procs.wait_until(lambda: "T" not in map(procs.process_state, tree), 5, "thawed")
        victim = tree[1]
        worker.kill_child(victim)
        procs.wait_until(
            lambda: len(set(worker.child_pids()) - {victim}) == 2, 20, "pool child replaced"
        )
        tree = [worker.pid, *worker.child_pids()]
    assert worker.returncode == 0  # warm shutdown
    assert not any(map(procs.pid_alive, tree))
    assert "worker.log" in str(worker.log_path) and "ready." in worker.log_text()


def test_stop_all_shuts_every_worker_down_warm_and_leaves_no_process(
    redis_server: RedisServer,
) -> None:
    env = {"RIG_BROKER_URL": redis_server.url}
    workers = [WorkerProcess(app="sample_app", cwd=RIG_DIR, env=env) for _ in range(2)]
    try:
        for worker in workers:
            worker.start(timeout=60)
        trees = [[worker.pid, *worker.child_pids()] for worker in workers]
        assert stop_all(workers) == [0, 0]  # warm shutdowns, both
        assert not any(procs.pid_alive(pid) for tree in trees for pid in tree)
        assert stop_all(workers) == [0, 0]  # stopping a stopped worker is harmless
    finally:
        for worker in workers:
            worker.cleanup()


def test_pgbouncer_pools_transactions_in_front_of_postgres_and_stops_by_pid(
    pg: PostgresServer,
) -> None:
    with PgBouncerServer(pg) as bouncer:
        pid = bouncer.pid
        url = bouncer.serve(pg.url)
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            row = conn.execute("SELECT current_database(), inet_server_port()").fetchone()
            assert row == ("celery_guard_test", pg.port), "served by the rig's PostgreSQL"
        with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter"):
            psycopg.connect(dsn, options="-c statement_timeout=1000").close()
    assert not procs.pid_alive(pid)


def test_a_failed_tests_report_names_the_workers_its_fixtures_hand_it() -> None:
    """The report hook (tests/conftest.py) puts these workers' logs first."""
    from types import SimpleNamespace

    from tests.conftest import workers_of

    one, two, three = (WorkerProcess("tests.apps.shop") for _ in range(3))
    item = SimpleNamespace(
        funcargs={
            "shop_workers": [one, two],
            "cluster": SimpleNamespace(workers=[two, three]),
            "worker": one,
            "tag": "not a worker",
        }
    )
    assert workers_of(item) == [one, two, three]  # type: ignore[arg-type]
    assert workers_of(SimpleNamespace()) == []  # type: ignore[arg-type]


def test_side_by_side_runs_two_calls_at_once_and_keeps_their_order() -> None:
    # Each call waits for another at the barrier: one at a time, the first would time out.
    barrier = threading.Barrier(2, timeout=10)

    def call(value: int) -> int:
        barrier.wait()
        return value

    assert procs.side_by_side(
        [lambda: call(1), lambda: call(2), lambda: call(3), lambda: call(4)]
    ) == [1, 2, 3, 4]
