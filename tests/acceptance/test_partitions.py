"""Partial failures: a worker alive but cut off, slow or flapping; servers restarted.

Real workers, a Redis broker and PostgreSQL; the worker under test reaches its server through
:class:`tests.rig.faultproxy.FaultProxy`, the others connect directly. Each test has its own
queue and store database, and short TTLs. ``shop.gated`` lets a test decide when each owner of
a key (by fencing token) finishes its body.
"""

from __future__ import annotations

import datetime
import glob
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select

import celery_guard
from celery_guard import GuardConfig
from celery_guard.store import KeyRecord
from celery_guard.store.sql import SqlStore
from tests.acceptance.conftest import empty_redis_databases, new_store_database, start_workers
from tests.acceptance.test_metrics import scrape, value
from tests.apps import shop_tables
from tests.apps.shop_producer import producer_app
from tests.rig.faultproxy import FaultProxy
from tests.rig.ports import free_port
from tests.rig.procs import log_tail, wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

LEASE_TTL = 2.0
REAPER_INTERVAL = 0.5
BROKER_DB, RESULT_DB = 12, 13


def via(url: str, server_port: int, proxy: FaultProxy) -> str:
    """``url`` with the server's port replaced by the proxy's."""
    needle = f"127.0.0.1:{server_port}"
    assert needle in url, url
    return url.replace(needle, f"127.0.0.1:{proxy.port}")


@dataclass
class Scene:
    """A test's own queue, store database, gates and proxies; workers started by the test."""

    env: dict[str, str]
    queue: str
    client: Celery
    store: SqlStore
    gates: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    proxies: list[FaultProxy] = field(default_factory=list)

    def start(
        self, count: int = 1, concurrency: int = 1, queue: str | None = None, **overrides: str
    ) -> list[WorkerProcess]:
        started = start_workers(
            count, {**self.env, **overrides}, queues=queue or self.queue, concurrency=concurrency
        )
        self.workers.extend(started)
        return started

    def proxy(self, server_port: int) -> FaultProxy:
        proxy = FaultProxy(server_port).start()
        self.proxies.append(proxy)
        return proxy

    def send(self, name: str, *args: object, **options: object):  # type: ignore[no-untyped-def]
        return self.client.send_task(name, args=args, **{"queue": self.queue, **options})

    def open_gate(self, tag: str, token: int) -> None:
        (self.gates / f"{tag}.{token}").touch()

    def effects(self, tag: str) -> list[dict[str, Any]]:
        with self.store.engine.connect() as connection:
            rows = connection.execute(
                select(shop_tables.effects).where(shop_tables.effects.c.tag == tag)
            )
            return [dict(row._mapping) for row in rows]

    def effect_counts(self, prefix: str) -> dict[str, int]:
        effects = shop_tables.effects
        with self.store.engine.connect() as connection:
            rows = connection.execute(
                select(effects.c.tag, func.count())
                .where(effects.c.tag.like(f"{prefix}%"))
                .group_by(effects.c.tag)
            )
            return {tag: int(count) for tag, count in rows}

    def record(self, key: str) -> KeyRecord | None:
        return self.store.keys.get(key)

    def wait_record(
        self, key: str, check: Callable[[KeyRecord], bool], what: str, timeout: float = 60
    ) -> KeyRecord:
        found: list[KeyRecord] = []

        def reached() -> bool:
            record = self.store.keys.get(key)
            if record is not None and check(record):
                found.append(record)
                return True
            return False

        wait_until(reached, timeout, f"{key}: {what}")
        return found[-1]

    def worker_of(self, owner: str | None) -> WorkerProcess:
        assert owner, "no owner"
        pid = int(owner.rsplit("/", 1)[1])
        for worker in self.workers:
            if pid == worker.pid or pid in worker.child_pids():
                return worker
        raise AssertionError(f"no worker runs pid {pid}")


def make_scene(
    store_url: str, redis_server: RedisServer, gates: Path, **env: str
) -> Iterator[Scene]:
    empty_redis_databases(redis_server, BROKER_DB, RESULT_DB)
    full_env = {
        "CG_BROKER_URL": redis_server.url_for(BROKER_DB),
        "CG_RESULT_URL": redis_server.url_for(RESULT_DB),
        "CG_STORE_URL": store_url,
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_STORE_TIMEOUT": "1",
        "CG_MARKER_DIR": str(gates),
        **env,
    }
    client = Celery(
        "partitions-client", broker=full_env["CG_BROKER_URL"], backend=full_env["CG_RESULT_URL"]
    )
    store = SqlStore(GuardConfig(store_url=store_url))
    scene = Scene(full_env, f"part-{uuid.uuid4().hex[:8]}", client, store, gates)
    try:
        yield scene
    finally:
        for worker in scene.workers:
            worker.kill()
        for proxy in scene.proxies:
            proxy.stop()
        store.dispose()
        client.close()


@pytest.fixture
def scene(postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Scene]:
    yield from make_scene(new_store_database(postgres, "part"), redis_server, tmp_path)


@pytest.mark.parametrize("fault", ["blackhole", "cut"])
def test_a_worker_cut_off_from_the_store_is_taken_over_and_its_commit_refused(
    scene: Scene, postgres: PostgresServer, fault: str
) -> None:
    """One worker loses PostgreSQL mid-task for longer than the TTL (``blackhole``: its
    connections hang; ``cut``: refused and reset), then gets it back. Another worker, connected
    directly, takes the key over; the cut-off worker's late commit is refused; one effect.
    """
    proxy = scene.proxy(postgres.port)
    (cut_off,) = scene.start(1, CG_STORE_URL=via(scene.env["CG_STORE_URL"], postgres.port, proxy))
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    result = scene.send("shop.gated", tag)
    first = scene.wait_record(key, lambda r: r.state == "RUNNING", "claimed")
    assert scene.worker_of(first.owner) is cut_off and first.fencing_token == 1
    assert proxy.stats.accepted > 0, "the worker reaches PostgreSQL through the proxy"
    (direct,) = scene.start(1)

    getattr(proxy, fault)()
    cut_at = time.monotonic()
    second = scene.wait_record(
        key, lambda r: r.fencing_token == 2 and r.state == "RUNNING", "taken over", timeout=60
    )
    taken_over_after = time.monotonic() - cut_at
    assert second.claim_reason == "TAKEOVER"
    assert scene.worker_of(second.owner) is direct
    # Past the TTL without a renewal, the cut-off worker knows it lost the lease.
    wait_until(lambda: "lease lost" in cut_off.log_text(), 30, "the cut-off worker to notice")

    proxy.heal()
    scene.open_gate(tag, 2)
    done = scene.wait_record(key, lambda r: r.state == "COMPLETED", "completed", timeout=60)
    assert done.fencing_token == 2
    scene.open_gate(tag, 1)  # the cut-off owner finishes its body now, store reachable again
    assert result.get(timeout=60)["fencing_token"] == 2
    wait_until(
        lambda: "completion refused (fenced)" in cut_off.log_text(),
        timeout=30,
        what="the cut-off worker's late commit to be refused",
    )
    effects = scene.effects(tag)
    assert [row["fencing_token"] for row in effects] == [2], effects
    assert taken_over_after < 60


def test_an_ack_lost_with_the_broker_redelivers_and_nothing_runs_twice(
    scene: Scene, redis_server: RedisServer
) -> None:
    """The body finished and committed; the worker's broker connection goes silent before its
    ack gets through, then drops. The message comes back, and its claim finds COMPLETED.
    """
    proxy = scene.proxy(redis_server.port)
    broker = via(scene.env["CG_BROKER_URL"], redis_server.port, proxy)
    # The result backend stays direct: the result is stored (by the pool child) before the ack.
    (worker,) = scene.start(1, CG_BROKER_URL=broker, CG_VISIBILITY_TIMEOUT="10")
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    result = scene.send("shop.gated", tag)
    scene.wait_record(key, lambda r: r.state == "RUNNING", "claimed")
    assert proxy.stats.accepted > 0, "the worker reaches its broker through the proxy"

    proxy.blackhole()
    scene.open_gate(tag, 1)
    scene.wait_record(key, lambda r: r.state == "COMPLETED", "completed")
    wait_until(lambda: result.state == "SUCCESS", 30, "the result, stored just before the ack")
    proxy.cut()  # the silent connections drop, with the ack that never reached Redis
    proxy.heal()
    # Restored when the worker's channel closes, or at the latest by the visibility timeout.
    done = scene.wait_record(
        key, lambda r: r.duplicates >= 1, "the redelivery to be answered from the store", 90
    )
    assert "Couldn't ack" in worker.log_text()
    assert (done.state, done.attempts, done.fencing_token) == ("COMPLETED", 1, 1)
    assert len(scene.effects(tag)) == 1
    assert worker.is_alive()


#: How long the store connection flaps (outages flap for minutes; 24 s keeps the suite short and
#: still spans six down phases).
FLAP_SECONDS = 24.0


def test_a_flapping_store_connection_under_load_loses_nothing_and_runs_nothing_twice(
    scene: Scene, postgres: PostgresServer
) -> None:
    """One worker's PostgreSQL connection goes up and down every 2 s (refused and reset when
    down) while tasks stream in, each sent twice; another worker is connected directly.
    Every task ends with exactly one effect, and the flapping worker's metrics show it.
    """
    proxy = scene.proxy(postgres.port)
    metrics_port = free_port()
    scene.start(
        1,
        concurrency=2,
        CG_STORE_URL=via(scene.env["CG_STORE_URL"], postgres.port, proxy),
        CG_METRICS_PORT=str(metrics_port),
    )
    scene.start(1, concurrency=2)
    prefix = f"flap-{uuid.uuid4().hex[:8]}-"
    sent: list[str] = []
    proxy.flap(period=4.0, down="cut")
    flap_until = time.monotonic() + FLAP_SECONDS
    while time.monotonic() < flap_until:
        for _ in range(2):
            tag = f"{prefix}{len(sent)}"
            # Half of them hold a lease across a down phase (renewed every TTL/3).
            name, args = (
                ("shop.long_write", (tag, 1.5)) if len(sent) % 2 else ("shop.record", (tag,))
            )
            scene.send(name, *args)
            scene.send(name, *args)  # every task is delivered twice
            sent.append(tag)
        time.sleep(0.5)  # a steady stream, not a burst: the flapping meets work in every state
    proxy.heal()
    wait_until(
        lambda: len(scene.effect_counts(prefix)) == len(sent),
        timeout=180,
        what=f"an effect for each of the {len(sent)} tasks",
    )
    # One effect commits with its key's COMPLETED marker, so once every key is COMPLETED no
    # second effect can land; the counts are final.
    counts = scene.effect_counts(prefix)
    assert counts == dict.fromkeys(sent, 1), {t: n for t, n in counts.items() if n != 1}
    samples = scrape(metrics_port)
    assert value(samples, "celery_guard_lease_renewal_failures_total") > 0
    store_errors = value(samples, "celery_guard_store_calls_total", result="error") + value(
        samples, "celery_guard_store_calls_total", result="timeout"
    )
    assert store_errors > 0
    assert proxy.stats.resets > 0


#: What kombu's Redis transport raises when a worker's broker connection breaks while its
#: channel still holds unacknowledged messages: closing the channel restores them through a
#: connection whose parameters were already cleared (kombu/transport/redis.py, _connparams;
#: celery/kombu#582). Celery calls it unrecoverable and the worker exits, warm, whatever its
#: tasks are. docs/operations.md: run workers under a supervisor.
KOMBU_LOST_CONNECTION_EXIT = (
    "Unrecoverable error: AttributeError(\"'NoneType' object has no attribute 'hostname'\")"
)


def supervise(scene: Scene, replaced: list[WorkerProcess], most: int = 3) -> None:
    """Do what a worker's supervisor does (systemd's ``Restart=on-failure``): start a new worker
    for one that exited on kombu's lost-connection error (at most ``most`` times). Any other
    exit fails the test with the worker's story."""
    for worker in list(scene.workers):
        if worker.is_alive() or worker in replaced:
            continue
        log = worker.log_text()
        if KOMBU_LOST_CONNECTION_EXIT not in log or len(replaced) >= most:
            raise AssertionError(
                f"worker {worker.hostname} exited with {worker.returncode}:\n"
                + worker_story(worker)
            )
        replaced.append(worker)
        scene.start(1, concurrency=2)


def stuck_report(scene: Scene, counts: dict[str, int], keys: dict[str, str]) -> str:
    """What a wait for every task saw: the keys (by tag) without an effect, their rows, the
    workers."""
    lines = [f"{len(counts)} of {len(keys)} tasks completed; without an effect:"]
    for tag, key in keys.items():
        if tag in counts:
            continue
        record = scene.record(key)
        lines.append(
            f"  {key}: "
            + (
                "no row"
                if record is None
                else f"{record.state} attempts={record.attempts} token={record.fencing_token} "
                f"owner={record.owner} reason={record.claim_reason} error={record.last_error}"
            )
        )
    for worker in scene.workers:
        lines.append(
            f"worker {worker.hostname} alive={worker.is_alive()} rc={worker.returncode}:\n"
            + worker_story(worker)
        )
    return "\n".join(lines)


def worker_story(worker: WorkerProcess) -> str:
    """A worker's warnings and errors (the first 40), the 120 lines after its first CRITICAL
    line (an unrecoverable error's traceback), then the log's last 60 lines."""
    lines = worker.log_text().splitlines()
    starts = [n for n, line in enumerate(lines) if _LOG_LEVEL.match(line)]
    critical = [n for n in starts if "CRITICAL/" in lines[n]]
    story = ["warnings and errors:", *[lines[n] for n in starts[:40]]]
    if critical:
        story += ["after the first CRITICAL line:", *lines[critical[0] : critical[0] + 120]]
    return "\n".join([*story, "last lines:", log_tail(worker.log_path, 60)])


_LOG_LEVEL = re.compile(r"^\[[^]]*: (WARNING|ERROR|CRITICAL)/")


@pytest.fixture
def own_servers(tmp_path: Path) -> Iterator[tuple[PostgresServer, RedisServer]]:
    """Servers of this test's own: it restarts them (Redis keeps its data on disk)."""
    with PostgresServer() as postgres, RedisServer(persistent=True) as redis_server:
        yield postgres, redis_server


def test_redis_and_postgresql_restarted_mid_run_every_task_completes_once(
    own_servers: tuple[PostgresServer, RedisServer], tmp_path: Path
) -> None:
    """Redis (broker, results and the leases) restarts, then PostgreSQL does, while tasks run.

    Every task completes once, and no live owner is mistaken for a dead one after PostgreSQL
    restarted (its liveness lock died with the server, not with the owner).

    Publish tracking is on, as docs/publish-tracking.md asks of a Redis broker that may
    restart: kombu's Redis transport pops a message (BRPOP) before it records it as
    unacknowledged (celery/celery#7950, kombu#305), so a restart landing between the two loses
    that message for good, and only the reaper's re-publish of its record brings it back.
    """
    postgres, redis_server = own_servers
    store_url = new_store_database(postgres, "restart")
    scene_iter = make_scene(
        store_url,
        redis_server,
        tmp_path,
        CG_LEASE_URL=redis_server.url_for(11),
        CG_LEASE_TTL="3",
        CG_VISIBILITY_TIMEOUT="20",
        CG_TRACK_PUBLISHES="1",
        CG_UNCLAIMED_REPUBLISH_AFTER="10",
    )
    scene = next(scene_iter)
    producer = producer_app(
        scene.env["CG_BROKER_URL"],
        store_url,
        guard_track_publishes=True,
        guard_unclaimed_republish_after=10,
    )
    try:
        scene.start(2, concurrency=2)
        prefix = f"restart-{uuid.uuid4().hex[:8]}-"
        tags = [f"{prefix}{n}" for n in range(40)]
        keys: dict[str, str] = {}  # by tag, as the shop's key options make them
        for n, tag in enumerate(tags):
            if n % 2:
                name, args, keys[tag] = "shop.long_write", (tag, 1.0), f"long:{tag}"
            else:
                name, args, keys[tag] = "shop.record", (tag,), f"record:{tag}"
            producer.send_task(name, args=args, queue=scene.queue, ignore_result=True)

        replaced: list[WorkerProcess] = []

        def done() -> int:
            supervise(scene, replaced)
            return len(scene.effect_counts(prefix))

        wait_until(lambda: done() >= 6, 60, "the first tasks to complete")
        redis_server.restart()
        at_redis_restart = done()
        wait_until(lambda: done() >= at_redis_restart + 6, 90, "progress after Redis restarted")
        at_postgres_restart = done()
        postgres.restart()
        scene.store.engine.dispose()  # the test's own pooled connections died with the server
        try:
            wait_until(lambda: done() == len(tags), 180, "every task to complete")
        except TimeoutError as timeout:
            raise AssertionError(
                stuck_report(scene, scene.effect_counts(prefix), keys)
            ) from timeout
        supervise(scene, replaced)
        assert at_postgres_restart < len(tags), "both restarts happened while work was left"
        # No owner was taken for dead: every liveness lock vanishes with a PostgreSQL restart,
        # and that alone proves no death. (A worker that exited on kombu's error stopped warm:
        # its pool finished its bodies first, so it left no key to take over either.)
        assert not [w for w in scene.workers if "is dead (liveness lock gone)" in w.log_text()]
        counts = scene.effect_counts(prefix)
        assert counts == dict.fromkeys(tags, 1), {t: n for t, n in counts.items() if n != 1}
    finally:
        scene_iter.close()
        celery_guard.get_runtime(producer).store.dispose()
        producer.close()


LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
FAKETIME_SITE = Path(__file__).resolve().parents[1] / "rig" / "faketime_site"
#: The skew each side of the real clock: 150 times the TTL.
SKEW = 300


def skewed(seconds: int) -> dict[str, str]:
    """Environment that runs a process with its wall clock ``seconds`` off (libfaketime).

    Only the wall clock moves, as on a host whose NTP is off; the monotonic clock is untouched.
    ``faketime_site/sitecustomize.py`` works around libfaketime's broken ``time.sleep`` there.
    """
    return {
        "LD_PRELOAD": LIBFAKETIME[0],
        "FAKETIME": f"{seconds:+d}s",
        "DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": str(FAKETIME_SITE),
    }


_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+: ")


def wall_clock_offset(worker: WorkerProcess) -> float:
    """How far the worker's wall clock is from ours, by the time on its newest log line
    (written moments ago: a lower bound, good to the line's age).
    """
    now = time.time()
    stamps = [m.group(1) for m in map(_LOG_TIME.match, worker.log_text().splitlines()) if m]
    assert stamps, "the worker logged nothing with a time"
    logged = datetime.datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S").timestamp()
    return logged - now


@pytest.mark.parametrize(
    ("runner_skew", "rival_skew", "lease_backend"),
    [(-SKEW, +SKEW, "sql-leases"), (+SKEW, -SKEW, "redis-leases")],
)
def test_workers_whose_clocks_are_minutes_apart_agree_on_every_lease(
    scene: Scene, redis_server: RedisServer, runner_skew: int, rival_skew: int, lease_backend: str
) -> None:
    """The key's owner runs with its clock 5 minutes behind (or ahead), a rival 5 minutes the
    other way. Leases are measured by the database's clock (SQL leases) or by Redis TTLs: the
    rival neither takes over a live lease nor waits 5 minutes for a dead one; one effect.
    """
    # make test installs libfaketime (scripts/install-deps.sh): missing, the test fails.
    assert LIBFAKETIME, "libfaketime is not installed: run scripts/install-deps.sh"
    lease_env = (
        {"CG_LEASE_URL": redis_server.url_for(11)} if lease_backend == "redis-leases" else {}
    )
    rival_queue = f"{scene.queue}-rival"
    (runner,) = scene.start(1, **skewed(runner_skew), **lease_env)
    (rival,) = scene.start(1, queue=rival_queue, **skewed(rival_skew), **lease_env)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    first = scene.send("shop.gated", tag)
    claimed = scene.wait_record(key, lambda r: r.state == "RUNNING", "claimed by the runner")
    assert scene.worker_of(claimed.owner) is runner
    # The workers' wall clocks really are off (their log lines carry them); ours is not.
    assert abs(wall_clock_offset(runner) - runner_skew) < 30
    assert abs(wall_clock_offset(rival) - rival_skew) < 30

    # Well past the claim-time lease, the runner still holds it: its renewals count.
    wait_until(
        lambda: scene.store.now() > (claimed.lease_expires_at or 0) + 2 * LEASE_TTL,
        30,
        "two TTLs past the claim's lease",
    )
    second = scene.send("shop.gated", tag, queue=rival_queue)
    wait_until(lambda: second.state == "RETRY", 30, "the rival to defer (key in flight)")
    record = scene.record(key)
    assert record is not None and (record.state, record.fencing_token) == ("RUNNING", 1)

    runner.freeze()  # now its lease must end after one TTL by the shared clock, not in 5 min
    frozen_at = time.monotonic()
    try:
        taken = scene.wait_record(
            key, lambda r: r.fencing_token == 2, "taken over by the rival", timeout=60
        )
        taken_over_after = time.monotonic() - frozen_at
        assert scene.worker_of(taken.owner) is rival and taken.claim_reason == "TAKEOVER"
        assert taken_over_after < SKEW / 10, "the lease ended by the shared clock"
        scene.open_gate(tag, 2)
        assert second.get(timeout=60)["fencing_token"] == 2
    finally:
        runner.thaw()
    scene.open_gate(tag, 1)
    assert first.get(timeout=60)["fencing_token"] == 2, "the runner's late commit was refused"
    assert [row["fencing_token"] for row in scene.effects(tag)] == [2]
