"""The connection budget: a prefork worker holds at most N + 2 PostgreSQL connections.

Real workers at ``--concurrency`` 2 and 4, with leases in the store's rows and in Redis, and
every feature on (liveness locks, publish tracking, metrics, the reaper and its sampler, worker
heartbeats, the circuit breaker). They run short tasks that write through
``self.guard.transaction()`` and tasks that keep their transaction open across several lease
renewals; meanwhile the test counts the worker's server connections in ``pg_stat_activity``,
by the ``application_name`` the engine gives them (``celery_guard <main pid>/<pid>``,
celery_guard/store/engine.py). docs/operations.md states the budget this checks.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from types import ModuleType
from typing import Any

import psycopg
import pytest

from celery_guard import GuardConfig
from celery_guard.store import KeyRecord, SqlStore
from tests.acceptance.conftest import new_store_database, open_gates, start_workers
from tests.rig.ports import free_port
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers]

#: Seconds: short, so that a 4-second body needs several renewals (every TTL / 3).
LEASE_TTL = 3.0
HOLD_SECONDS = 4.0
SHORT_TASKS = 40


def _connections(dsn: str, worker_pid: int) -> Counter[int]:
    """The worker's server connections now, by the client process id its name carries."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        names = admin.execute(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"celery_guard {worker_pid}/%",),
        ).fetchall()
    return Counter(int(name.rsplit("/", 1)[1]) for (name,) in names)


class _Sampler:
    """Counts the worker's connections every 50 ms in a thread until stopped; keeps the most."""

    def __init__(self, dsn: str, worker_pid: int) -> None:
        self.dsn = dsn
        self.worker_pid = worker_pid
        self.most: Counter[int] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = _connections(self.dsn, self.worker_pid)
            self.samples += 1
            if sum(now.values()) > sum(self.most.values()):
                self.most = now


@pytest.mark.parametrize("concurrency", [2, 4])
@pytest.mark.parametrize("leases", ["sql", "redis"])
def test_a_worker_holds_at_most_n_plus_two_connections(
    shop: ModuleType,
    postgres: PostgresServer,
    redis_server: RedisServer,
    shop_env: dict[str, str],
    concurrency: int,
    leases: str,
) -> None:
    url = new_store_database(postgres, "budget")
    dsn = postgres.dsn_for(url.rsplit("/", 1)[1])
    queue = f"budget-{uuid.uuid4().hex[:8]}"
    env = {
        **shop_env,
        "CG_STORE_URL": url,
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": "1",
        "CG_TRACK_PUBLISHES": "1",
        "CG_METRICS_PORT": str(free_port()),
        "CG_LEASE_URL": redis_server.url_for(5) if leases == "redis" else "",
    }
    (worker,) = start_workers(1, env, concurrency=concurrency, queues=queue)
    try:
        with _Sampler(dsn, worker.pid) as sampler:
            tag = uuid.uuid4().hex[:8]
            held = [
                shop.write_and_hold.apply_async((f"{tag}-hold-{n}", HOLD_SECONDS), queue=queue)
                for n in range(concurrency)
            ]
            short = [
                shop.record.apply_async((f"{tag}-short-{n}",), queue=queue)
                for n in range(SHORT_TASKS)
            ]
            for result in held + short:
                result.get(timeout=60)
            during = sampler.most
        after = _connections(dsn, worker.pid)
    finally:
        worker.stop()
    children = [pid for pid in during if pid != worker.pid]
    print(
        f"\nconnection budget, {leases} leases, concurrency {concurrency}: "
        f"most at once {sum(during.values())} (main {during.get(worker.pid, 0)}, "
        f"pool processes {sorted(during[pid] for pid in children)}), "
        f"after {sum(after.values())}; limit {concurrency + 2}; {sampler.samples} samples"
    )
    assert sampler.samples > 10, "the sampler did not run while the tasks ran"
    assert sum(during.values()) <= concurrency + 2, during
    assert sum(after.values()) <= concurrency + 2, after
    assert during.get(worker.pid, 0) <= 2, "the main process keeps to two connections"
    assert all(during[pid] <= 1 for pid in children), "a pool process keeps to one"
    # Every held body outlived its first lease and committed once: its renewals went through
    # while its transaction held the pool process's connection.
    with psycopg.connect(dsn, autocommit=True) as admin:
        for n in range(concurrency):
            assert held[n].result["tag"] == f"{tag}-hold-{n}"
            (count,) = admin.execute(
                "SELECT count(*) FROM effects WHERE tag = %s", (f"{tag}-hold-{n}",)
            ).fetchone() or (0,)
            assert count == 1


def test_a_pool_process_killed_alone_loses_its_lease_at_once(
    shop: ModuleType, postgres: PostgresServer, shop_env: dict[str, str]
) -> None:
    """The worker's one liveness lock outlives a pool process SIGKILLed alone; the main
    process sees it go (its presence connection closes) and ends its leases at once, so the
    key is taken over long before its 60 s lease would have ended."""
    lease_ttl = 60.0
    url = new_store_database(postgres, "budget_kill")
    queue = f"budget-kill-{uuid.uuid4().hex[:8]}"
    env = {**shop_env, "CG_STORE_URL": url, "CG_LEASE_TTL": str(lease_ttl)}
    env["CG_REAPER_INTERVAL"] = "1"
    (worker,) = start_workers(1, env, queues=queue)
    store = SqlStore(GuardConfig(store_url=url))
    try:
        tag = uuid.uuid4().hex[:12]
        key = f"gated:{tag}"
        result = shop.gated.apply_async((tag,), queue=queue)

        def record() -> KeyRecord | None:
            return store.keys.get(key)

        wait_until(lambda: (r := record()) is not None and r.state == "RUNNING", 30, "a claim")
        first = record()
        assert first is not None and first.owner is not None
        child = int(first.owner.rsplit("/", 1)[1])
        assert child in worker.child_pids()
        assert first.owner_lock is not None, "claimed under the worker's lock"
        worker.kill_child(child)
        killed_at = time.monotonic()
        wait_until(
            lambda: (r := record()) is not None and r.fencing_token == 2,
            30,
            "the key to be taken over",
        )
        taken_over_after = time.monotonic() - killed_at
        open_gates(shop_env["CG_MARKER_DIR"], tag, 2)
        value = result.get(timeout=60)
        print(f"\npool process killed alone: taken over after {taken_over_after:.1f} s")
        assert value["fencing_token"] == 2 and value["pid"] != child
        assert taken_over_after < lease_ttl / 2
        assert "pool process" in worker.log_text() and "died; ended the leases" in (
            worker.log_text()
        )
    finally:
        worker.stop()
        store.dispose()
