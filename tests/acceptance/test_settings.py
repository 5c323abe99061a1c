"""Settings where Celery reads them, with real workers on a Redis broker.

``tests/apps/namespaced.py`` reads its settings the Django way,
``config_from_object(obj, namespace="CELERY")``, with ``celery_guard.install(app)`` before or
after it. Each worker runs in an empty directory of its own, so a store that fell back to the
embedded SQLite default would show there as a file.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_guard import GuardConfig
from celery_guard.store import SqlStore
from tests.acceptance.conftest import ROOT, effects_in, new_store_database
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess, stop_all

pytestmark = pytest.mark.workers

APP = "tests.apps.namespaced"
TIMEOUT = 60
EMBEDDED_WARNING = "celery_guard store is the embedded SQLite default"


@dataclass
class Scene:
    broker_url: str
    queue: str
    cwd: Path
    client: Celery
    workers: list[WorkerProcess] = field(default_factory=list)

    def worker(self, **env: str) -> WorkerProcess:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        worker = WorkerProcess(
            APP,
            # Empty values hide what other tests' session fixtures put in os.environ (the
            # shop's CG_STORE_URL): the worker inherits the test process's environment.
            env={
                "CG_BROKER_URL": self.broker_url,
                "PYTHONPATH": path,
                "CG_STORE_URL": "",
                "CG_EXTRA_SETTINGS": "",
                "CG_INSTALL_FIRST": "",
                **env,
            },
            cwd=self.cwd,
            queues=self.queue,
        )
        self.workers.append(worker)
        return worker

    def send(self, name: str, tag: str) -> None:
        self.client.send_task(name, args=(tag,), queue=self.queue)

    def queued_messages(self) -> int:
        client = redis.Redis.from_url(self.broker_url)
        try:
            return int(client.llen(self.queue))
        finally:
            client.close()

    def sqlite_files(self) -> list[str]:
        return sorted(p.name for p in self.cwd.iterdir() if ".sqlite" in p.name)


@pytest.fixture
def scene(redis_server: RedisServer, tmp_path: Path) -> Iterator[Scene]:
    cwd = tmp_path / "worker-cwd"
    cwd.mkdir()
    broker_url = redis_server.url_for(13)
    client = Celery("settings-producer", broker=broker_url, set_as_current=False)
    scene = Scene(broker_url, f"settings-{uuid.uuid4().hex[:8]}", cwd, client)
    try:
        yield scene
    finally:
        stop_all(scene.workers)
        client.close()


def wait_completed(store: SqlStore, key: str) -> None:
    def completed() -> bool:
        record = store.keys.get(key)
        return record is not None and record.state == "COMPLETED"

    wait_until(completed, TIMEOUT, f"key {key!r} to be COMPLETED")


@pytest.mark.parametrize("install_first", ["1", "0"], ids=["install-first", "configure-first"])
def test_a_worker_reads_the_namespaced_store_url_in_either_order(
    scene: Scene, postgres: PostgresServer, install_first: str
) -> None:
    url = new_store_database(postgres, "settings")
    worker = scene.worker(CG_STORE_URL=url, CG_INSTALL_FIRST=install_first)
    worker.start()
    tag = uuid.uuid4().hex[:12]
    scene.send("namespaced.record", tag)
    store = SqlStore(GuardConfig(store_url=url))
    try:
        wait_completed(store, f"ns:{tag}")
        assert effects_in(store, tag) == 1
    finally:
        store.dispose()
    assert scene.sqlite_files() == [], "the worker fell back to the embedded SQLite store"
    assert EMBEDDED_WARNING not in worker.log_text()


def test_a_misspelled_namespaced_setting_stops_the_worker_before_it_consumes(
    scene: Scene, postgres: PostgresServer
) -> None:
    url = new_store_database(postgres, "settings")
    tag = uuid.uuid4().hex[:12]
    scene.send("namespaced.record", tag)
    bad = scene.worker(
        CG_STORE_URL=url,
        CG_INSTALL_FIRST="1",  # the settings are first read by the worker, not at import
        CG_EXTRA_SETTINGS=json.dumps({"CELERY_GUARD_LEASE_TLL": 3}),
    )
    bad.start(wait_ready=False)
    wait_until(lambda: bad.returncode is not None, TIMEOUT, "the worker to refuse to start")
    assert bad.returncode != 0
    assert (
        "ConfigurationError: unknown celery_guard setting 'CELERY_GUARD_LEASE_TLL'; "
        "did you mean 'CELERY_GUARD_LEASE_TTL'?"
    ) in bad.log_text()
    assert scene.queued_messages() == 1, "the message waits in the broker"
    assert scene.sqlite_files() == []


def test_a_worker_on_the_embedded_default_says_so_once_naming_the_file(scene: Scene) -> None:
    worker = scene.worker()  # no CELERY_GUARD_STORE_URL
    worker.start()
    path = scene.cwd / "celery_guard.sqlite3"
    tag = uuid.uuid4().hex[:12]
    scene.send("namespaced.ping", tag)
    wait_until(path.exists, TIMEOUT, "the embedded store's file")
    store = SqlStore(GuardConfig(store_url=f"sqlite:///{path}"))
    try:
        wait_completed(store, f"ping:{tag}")  # a pool process has used the store too
    finally:
        store.dispose()
    lines = [line for line in worker.log_text().splitlines() if EMBEDDED_WARNING in line]
    assert len(lines) == 1, lines
    assert "WARNING/MainProcess" in lines[0]
    assert f"{EMBEDDED_WARNING}, {path}:" in lines[0]
    assert "deduplication holds only among processes sharing that file" in lines[0]
