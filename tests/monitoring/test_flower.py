"""Flower runs beside a guarded worker and sees its tasks: real worker, Redis, PostgreSQL, Flower.

Flower answers "which tasks ran, where, with what result"; it cannot tell that a second
delivery of the same key changed nothing (both are SUCCESS there), which is what celery_guard's
metrics answer. The test starts Flower as an operator would (``celery -A app flower``) on a
free loopback port, with basic auth, and stops it by PID.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, func, select

from tests.acceptance.conftest import ROOT, SHOP_APP, new_store_database, start_workers
from tests.apps import shop_tables
from tests.rig import procs
from tests.rig.ports import free_port
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

# Redis databases no other test uses: Flower sees every event of its broker database.
BROKER_DB = 14
RESULT_DB = 15
START_TIMEOUT = 60.0
RESULT_TIMEOUT = 60.0
SEEN_TIMEOUT = 30.0
HTTP_TIMEOUT = 5.0


class FlowerProcess:
    """``celery -A app flower`` in its own process group, logging to a temp file."""

    def __init__(self, app: str, env: dict[str, str], port: int) -> None:
        self.app = app
        self.env = env
        self.port = port
        self.user = "guard"
        self.password = secrets.token_hex(8)
        self._tmp = Path(tempfile.mkdtemp(prefix="rig-flower-"))
        procs.remove_at_exit(self._tmp)
        self.log_path = self._tmp / "flower.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app,
            "flower",
            "--address=127.0.0.1",
            f"--port={self.port}",
            f"--basic_auth={self.user}:{self.password}",
        ]

    def start(self) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv(),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.register(self)
        self.wait(lambda: self.get("/healthcheck", raw=True) == b"OK", "Flower to answer")

    def stop(self) -> None:
        if self._proc is not None:
            procs.terminate_tree(self._proc, signal.SIGTERM, timeout=10)
        procs.unregister(self)

    def emergency_kill(self) -> None:
        procs.kill_tree_now(self._proc)

    def get(self, path: str, raw: bool = False) -> Any:
        """GET ``path`` (JSON unless ``raw``); None for 404 or a connection not yet accepted."""
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Basic {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
                body: bytes = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        except (ConnectionError, urllib.error.URLError):
            return None
        return body if raw else json.loads(body)

    def wait(self, predicate: Any, what: str, timeout: float = START_TIMEOUT) -> None:
        """Wait for ``predicate``; fail with Flower's log if it times out or Flower exits."""

        def check() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"flower exited with code {self._proc.returncode}")
            return bool(predicate())

        try:
            procs.wait_until(check, timeout, what, interval=0.2)
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError(
                f"{exc}\n--- flower log tail ---\n{procs.log_tail(self.log_path)}"
            ) from None


@pytest.fixture
def guarded_env(postgres: PostgresServer, redis_server: RedisServer) -> dict[str, str]:
    return {
        "CG_BROKER_URL": redis_server.url_for(BROKER_DB),
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": new_store_database(postgres, "flower"),
    }


@pytest.fixture
def queue() -> str:
    return f"flower-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def worker(guarded_env: dict[str, str], queue: str) -> Iterator[WorkerProcess]:
    """One prefork worker sending task events (-E), as Flower needs."""
    (started,) = start_workers(1, guarded_env, queues=queue, concurrency=1, extra_args=["-E"])
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def flower(guarded_env: dict[str, str]) -> Iterator[FlowerProcess]:
    running = FlowerProcess(SHOP_APP, guarded_env, free_port())
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture
def client(guarded_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery(
        "flower-client",
        broker=guarded_env["CG_BROKER_URL"],
        backend=guarded_env["CG_RESULT_URL"],
        set_as_current=False,
    )
    try:
        yield app
    finally:
        app.close()


def effect_rows(store_url: str, tag: str) -> int:
    engine = create_engine(store_url)
    try:
        with engine.connect() as connection:
            query = select(func.count()).select_from(shop_tables.effects)
            return int(
                connection.execute(query.where(shop_tables.effects.c.tag == tag)).scalar_one()
            )
    finally:
        engine.dispose()


def test_flower_sees_guarded_tasks_succeed(
    worker: WorkerProcess,
    flower: FlowerProcess,
    client: Celery,
    queue: str,
    guarded_env: dict[str, str],
) -> None:
    # Flower keeps no history: it must be receiving the worker's events before the task runs.
    prefix = worker.hostname.split("@", 1)[0] + "@"

    def worker_seen() -> bool:
        listed = flower.get("/workers?json=1")
        names = [item.get("hostname", "") for item in (listed or {}).get("data", [])]
        return any(name.startswith(prefix) for name in names)

    flower.wait(worker_seen, f"Flower to receive events from {worker.hostname}")

    tag = uuid.uuid4().hex[:12]
    first = client.send_task("shop.record", args=(tag,), kwargs={"value": 7}, queue=queue)
    assert first.get(timeout=RESULT_TIMEOUT) == {"tag": tag, "value": 7}
    # The same key again: celery_guard returns the stored result without running the body.
    second = client.send_task("shop.record", args=(tag,), kwargs={"value": 7}, queue=queue)
    assert second.get(timeout=RESULT_TIMEOUT) == {"tag": tag, "value": 7}

    infos: dict[str, dict[str, Any]] = {}

    def both_succeeded() -> bool:
        for task_id in (first.id, second.id):
            info = flower.get(f"/api/task/info/{task_id}")
            if info is not None:
                infos[task_id] = info
        return all(infos.get(i, {}).get("state") == "SUCCESS" for i in (first.id, second.id))

    flower.wait(both_succeeded, "Flower to show both tasks SUCCESS", timeout=SEEN_TIMEOUT)
    for task_id in (first.id, second.id):
        info = infos[task_id]
        assert info["name"] == "shop.record"
        assert info["uuid"] == task_id
        assert str(info["worker"]).startswith(prefix)
        assert tag in str(info["result"])

    listed = flower.get("/api/tasks?taskname=shop.record")
    assert {first.id, second.id} <= set(listed)
    assert {listed[first.id]["state"], listed[second.id]["state"]} == {"SUCCESS"}
    # What Flower cannot show: the body ran once.
    assert effect_rows(guarded_env["CG_STORE_URL"], tag) == 1
