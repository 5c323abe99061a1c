"""A store, lease or broker URL's password never shows: not in logs, exceptions, metrics or CLI.

A private PostgreSQL whose role must give its password (SCRAM) and a private Redis with
``requirepass`` serve as the store, the lease store, the broker and the result backend, all with
one password. Real workers run tasks that succeed, retry and dead-letter; then the test provokes
what makes software print URLs: a wrong password, malformed settings, the store down, the broker
down. Every worker log, every CLI output (``celery -A ... guard ...``, ``celery inspect conf``,
``celery report``), every exception a caller sees (message, repr and traceback) and every metrics
scrape is searched for the password, raw and URL-encoded (both contain a random core). The
worker logs at DEBUG, the most talkative level.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import traceback
import urllib.request
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pytest
from celery import Celery
from celery.result import AsyncResult
from sqlalchemy import create_engine

from celery_guard import GuardConfig
from celery_guard.lease.backends import RedisLeases
from celery_guard.store import ClaimRequest, SqlStore
from celery_guard.store import metadata as guard_metadata
from tests.acceptance.conftest import ROOT, SHOP_APP, start_workers
from tests.apps import shop_tables
from tests.rig.ports import free_port
from tests.rig.procs import log_tail, side_by_side, wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess, stop_all

pytestmark = pytest.mark.workers

#: In every form the password may take (raw, URL-encoded): what the test searches for.
CORE = uuid.uuid4().hex[:16]
#: Characters a URL must encode, so both the raw and the encoded form are in play.
PASSWORD = f"Cg{CORE}@/:+ x"
ENCODED = quote(PASSWORD, safe="")
WRONG = f"Wr{CORE[::-1]}"
RESULT_TIMEOUT = 60


@dataclass
class Evidence:
    """Every text a user or operator could see, by where it came from."""

    texts: list[tuple[str, str]] = field(default_factory=list)

    def add(self, source: str, text: str) -> str:
        self.texts.append((source, text))
        return text

    def exception(self, source: str, exc: BaseException) -> None:
        self.add(source, f"{exc}\n{exc!r}\n{''.join(traceback.format_exception(exc))}")

    def leaks(self) -> list[str]:
        return [
            f"{source}: {line.strip()[:300]}"
            for source, text in self.texts
            for line in text.splitlines()
            if CORE in line or CORE[::-1] in line
        ]


@dataclass
class Scene:
    postgres: PostgresServer
    redis: RedisServer
    env: dict[str, str]
    queue: str
    client: Celery
    evidence: Evidence
    workers: list[WorkerProcess] = field(default_factory=list)
    results: list[AsyncResult] = field(default_factory=list)

    def send(self, name: str, *args: Any, queue: str | None = None) -> AsyncResult:
        result = self.client.send_task(name, args=args, queue=queue or self.queue)
        self.results.append(result)
        return result

    def cli(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``python -m celery -A tests.apps.shop ARGS``; its output goes into the evidence."""
        completed = subprocess.run(
            [sys.executable, "-m", "celery", "-A", SHOP_APP, *args],
            cwd=ROOT,
            env={**os.environ, **self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        label = "celery " + " ".join(args)
        self.evidence.add(f"{label} (stdout)", completed.stdout)
        self.evidence.add(f"{label} (stderr)", completed.stderr)
        return completed

    def cli_each(
        self, calls: Sequence[tuple[Sequence[str], dict[str, str] | None]]
    ) -> list[subprocess.CompletedProcess[str]]:
        """:meth:`cli` for ``(args, env)`` calls that do not depend on each other, side by
        side (:func:`tests.rig.procs.side_by_side`); results in order."""
        return side_by_side(functools.partial(self.cli, *args, env=env) for args, env in calls)

    def scrape(self) -> str:
        port = self.env["CG_METRICS_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return self.evidence.add("metrics", response.read().decode())

    def outcome(self, result: Any, source: str) -> Any:
        """The task's value, or its exception (kept as evidence)."""
        try:
            return result.get(timeout=RESULT_TIMEOUT)
        except Exception as exc:
            self.evidence.exception(source, exc)
            self.evidence.add(f"{source} (traceback)", str(result.traceback))
            return exc


@pytest.fixture
def scene() -> Iterator[Scene]:
    evidence = Evidence()
    with PostgresServer() as postgres, RedisServer(password=PASSWORD) as redis_server:
        store_url = postgres.create_password_role("shopper", PASSWORD, "shop_secrets")
        assert ENCODED in store_url
        engine = create_engine(store_url)
        try:
            guard_metadata.create_all(engine)
            shop_tables.metadata.create_all(engine)
        finally:
            engine.dispose()
        env = {
            "CG_STORE_URL": store_url,
            "CG_BROKER_URL": redis_server.url_for(0),
            "CG_RESULT_URL": redis_server.url_for(1),
            "CG_LEASE_URL": redis_server.url_for(2),
            "CG_METRICS_PORT": str(free_port()),
            "CG_DEAD_LETTER_QUEUE": f"dead-{uuid.uuid4().hex[:8]}",
            "CG_STORE_TIMEOUT": "1",
            "CG_LEASE_TTL": "3",
            "CG_REAPER_INTERVAL": "0.5",
        }
        client = Celery(
            "secrets-producer", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"]
        )
        scene = Scene(
            postgres, redis_server, env, f"secrets-{uuid.uuid4().hex[:8]}", client, evidence
        )
        try:
            yield scene
        finally:
            stop_all(scene.workers)
            # An AsyncResult's __del__ unsubscribes from the result backend. A test that failed
            # with this Redis stopped keeps its results alive in its traceback, past this
            # fixture: each would retry the stopped Redis for 20 s when collected, and fail
            # whichever test runs then. Detached, they never touch it.
            for result in scene.results:
                result.backend = None
            # AsyncResults sit in reference cycles; collected after this Redis is gone, their
            # __del__ would retry it for 20 s and fail whichever test runs then. Collect them
            # now (what else is collected may warn of unclosed client sockets: not ours).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()
            client.close()


def test_no_password_in_logs_exceptions_metrics_or_cli_output(scene: Scene) -> None:
    (worker,) = start_workers(1, scene.env, queues=scene.queue, loglevel="DEBUG")
    scene.workers.append(worker)
    tag = uuid.uuid4().hex[:10]

    # Work that succeeds, retries, and is dead-lettered.
    assert scene.outcome(scene.send("shop.record", tag), "record") == {"tag": tag, "value": None}
    assert scene.outcome(scene.send("shop.flaky", tag, 1), "flaky") == 2
    rejected = scene.outcome(scene.send("shop.reject_order", tag), "reject_order")
    assert isinstance(rejected, Exception)

    # The operator's commands, and Celery's own views of the configuration.
    metrics = scene.scrape()
    assert "celery_guard_tasks_total" in metrics
    commands = [
        ["guard", "status"],
        ["guard", "status", "--json"],
        ["guard", "dlq", "list"],
        ["guard", "dlq", "list", "--json"],
        ["guard", "key", "show", f"record:{tag}"],
        ["guard", "reconcile"],
        ["guard", "reconcile", "--json"],
        # Addressed to the worker, it returns once it answered (a broadcast waits 10 s).
        ["inspect", "conf", "--timeout", "10", "--destination", worker.node_name],
        ["report"],
    ]
    answers = scene.cli_each([(args, None) for args in commands])
    for args, completed in zip(commands, answers, strict=True):
        assert completed.returncode == 0, (args, completed.stderr)
        if args[0] == "inspect":
            # Celery masks our URL settings as it masks its own secrets.
            assert '"guard_store_url": "********"' in completed.stdout
    (letter,) = json.loads(scene.cli("guard", "dlq", "list", "--json").stdout)
    assert scene.cli("guard", "dlq", "show", str(letter["id"])).returncode == 0

    # Wrong passwords: the store's and the lease store's, in the CLI, in-process and in a worker.
    wrong_store = scene.env["CG_STORE_URL"].replace(ENCODED, WRONG)
    wrong_lease = scene.env["CG_LEASE_URL"].replace(ENCODED, WRONG)
    status = ["guard", "status"]
    refused = scene.cli_each(
        [(status, {"CG_STORE_URL": wrong_store}), (status, {"CG_LEASE_URL": wrong_lease})]
    )
    assert [completed.returncode for completed in refused] == [1, 1]
    request = ClaimRequest(
        key=f"probe:{tag}",
        task_name="probe",
        fingerprint=None,
        check_fingerprint=False,
        owner="test/0",
        message=None,
        lease_ttl=5,
    )
    wrong = SqlStore(GuardConfig(store_url=wrong_store, store_timeout=2))
    with pytest.raises(Exception) as caught:
        wrong.keys.claim(request)
    scene.evidence.exception("SqlStore.claim, wrong password", caught.value)
    wrong.dispose()
    leases = RedisLeases(wrong_lease, timeout=2)
    with pytest.raises(Exception) as caught:
        leases.acquire(f"probe:{tag}", 5)
    scene.evidence.exception("RedisLeases.acquire, wrong password", caught.value)
    leases.close()
    scene.evidence.add("repr(GuardConfig)", repr(GuardConfig(store_url=scene.env["CG_STORE_URL"])))
    misconfigured_queue = f"{scene.queue}-wrong"
    (misconfigured,) = start_workers(
        1, {**scene.env, "CG_STORE_URL": wrong_store}, queues=misconfigured_queue
    )
    scene.workers.append(misconfigured)
    deferred = scene.send("shop.record", f"{tag}-w", queue=misconfigured_queue)
    wait_until(lambda: deferred.state == "RETRY", RESULT_TIMEOUT, "the delivery to be deferred")
    assert "password authentication failed" in misconfigured.log_text()
    assert "shopper:***@127.0.0.1" in misconfigured.log_text(), "the URL is shown, masked"
    misconfigured.stop()

    # Malformed settings that carry the password.
    port = scene.postgres.port
    malformed = [
        ("guard_store_url", scene.env["CG_STORE_URL"].replace("://", "//")),
        ("guard_store_url", scene.env["CG_STORE_URL"].replace("postgresql+psycopg", "mysql")),
        ("guard_store_url", scene.env["CG_STORE_URL"].replace(f":{port}/", ":port/")),
        ("guard_lease_url", scene.env["CG_LEASE_URL"].replace("redis://", "http://")),
        ("guard_lease_url", scene.env["CG_LEASE_URL"].replace("://", "//")),
    ]
    answers = scene.cli_each(
        [(status, {"CG_EXTRA_CONF": json.dumps({name: value})}) for name, value in malformed]
    )
    for (name, value), completed in zip(malformed, answers, strict=True):
        assert completed.returncode != 0, (name, value)

    # The store down: deliveries wait, the CLI says so in one line; then it comes back.
    scene.postgres.stop(keep_data=True)
    waiting = scene.send("shop.record", f"{tag}-down")
    wait_until(lambda: waiting.state == "RETRY", RESULT_TIMEOUT, "the delivery to be deferred")
    assert scene.cli("guard", "status").returncode == 1
    scene.scrape()
    scene.postgres.restart()
    assert scene.outcome(waiting, "record after the store outage")["tag"] == f"{tag}-down"

    # The broker (and lease store, and result backend) down, then back.
    scene.redis.stop(keep_dir=True)
    try:
        wait_until(
            lambda: "Cannot connect to redis://:**@" in worker.log_text(),
            RESULT_TIMEOUT,
            "the worker to report the lost broker (its URL masked)",
        )
    except TimeoutError as exc:
        # Seen once in a full run and never alone: what the worker said instead.
        tail = log_tail(worker.log_path, 40)
        raise AssertionError(f"{exc} (worker exit code {worker.returncode}):\n{tail}") from None
    assert scene.cli("guard", "status").returncode == 1
    scene.redis.start()
    later = scene.send("shop.record", f"{tag}-back")
    assert scene.outcome(later, "record after the broker outage")["tag"] == f"{tag}-back"
    scene.scrape()

    worker.stop()
    for process in scene.workers:
        scene.evidence.add(f"worker log {process.hostname}", process.log_text())
    sources = {source.split(" (")[0] for source, _ in scene.evidence.texts}
    assert len(sources) >= 15, sources
    leaks = scene.evidence.leaks()
    assert leaks == [], "the password shows in:\n" + "\n".join(leaks)
