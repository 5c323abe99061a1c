"""The core scenarios again, with the workers' store behind PgBouncer in transaction pooling.

The tests are the ones of test_idempotency.py, test_self_healing.py, test_failure_policy.py and
test_cli.py, imported here: pytest runs each imported test with this module's fixtures, which
point the shop (a copy of tests/apps/shop.py in this process, its workers, the CLI) at
PgBouncer with ``guard_store_pooling = "transaction"``. The shop copy has a broker and result
database of its own, so the session's direct-PostgreSQL shop workers never take part.
Self-healing runs in both ways docs/pgbouncer.md describes: the liveness locks held through a
direct ``guard_liveness_url``, and no liveness locks (the reaper waits out the lease TTL).
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from celery import Celery
from celery import _state as celery_state

import celery_guard
from celery_guard import GuardConfig
from celery_guard.store.sql import SqlStore
from tests.acceptance.conftest import (
    ROOT,
    environment,
    new_store_database,
    open_gates,
    running_workers,
    wait_owner,
    worker_running,
)
from tests.acceptance.test_cli import test_replay_after_the_bug_is_fixed_runs_the_task_once
from tests.acceptance.test_failure_policy import (
    test_a_permanent_error_is_dead_lettered_after_one_attempt,
    test_a_poison_pill_is_dead_lettered_without_stopping_other_work,
)
from tests.acceptance.test_idempotency import (
    test_one_key_delivered_50_times_across_two_workers_runs_once,
)
from tests.acceptance.test_self_healing import (
    REAPER_INTERVAL,
    Cluster,
    test_a_dead_workers_keys_are_taken_over_without_waiting_for_the_lease,
    test_a_frozen_worker_is_taken_over_and_its_late_commit_is_refused,
    test_a_whole_worker_sigkilled_mid_task_is_recovered_by_the_reaper,
)
from tests.rig.servers import PgBouncerServer, PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

__all__ = [
    "test_a_dead_workers_keys_are_taken_over_without_waiting_for_the_lease",
    "test_a_frozen_worker_is_taken_over_and_its_late_commit_is_refused",
    "test_a_permanent_error_is_dead_lettered_after_one_attempt",
    "test_a_poison_pill_is_dead_lettered_without_stopping_other_work",
    "test_a_whole_worker_sigkilled_mid_task_is_recovered_by_the_reaper",
    "test_one_key_delivered_50_times_across_two_workers_runs_once",
    "test_replay_after_the_bug_is_fixed_runs_the_task_once",
]

SHOP_FILE = ROOT / "tests" / "apps" / "shop.py"


def pooled_env(pgbouncer: PgBouncerServer, direct_url: str, liveness: bool) -> dict[str, str]:
    """The store settings of a worker behind PgBouncer, with or without a direct liveness URL."""
    return {
        "CG_STORE_URL": pgbouncer.serve(direct_url),
        "CG_STORE_POOLING": "transaction",
        "CG_LIVENESS_URL": direct_url if liveness else "",
    }


@pytest.fixture(scope="module")
def shop_env(
    postgres: PostgresServer,
    pgbouncer: PgBouncerServer,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    """The shop's environment behind PgBouncer (liveness through a direct URL), for this module."""
    direct = postgres.create_database(f"pgb_shop_{uuid.uuid4().hex[:8]}")
    env = {
        "CG_BROKER_URL": redis_server.url_for(5),
        "CG_RESULT_URL": redis_server.url_for(6),
        "CG_MARKER_DIR": str(tmp_path_factory.mktemp("pgb-markers")),
        "CG_LEASE_TTL": "10",
        **pooled_env(pgbouncer, direct, liveness=True),
    }
    with environment(env):  # the CLI subprocesses of test_cli.py read it
        yield env


@pytest.fixture(scope="module")
def shop(shop_env: dict[str, str]) -> Iterator[ModuleType]:
    """A copy of the shop module built from this module's environment (the session's own shop
    module keeps pointing at PostgreSQL directly); it reads the store through PgBouncer too."""
    spec = importlib.util.spec_from_file_location("tests.apps.shop_behind_pgbouncer", SHOP_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # The shop's tasks are shared (Celery's default): every app finalized later would take
    # the copy's too, beside the session's shop module's, under the same names. The copy
    # keeps its own tasks; no other app gets them.
    shared_before = set(celery_state._on_app_finalizers)
    spec.loader.exec_module(module)
    celery_state._on_app_finalizers.intersection_update(shared_before)
    assert module.app.conf.guard_store_pooling == "transaction"
    runtime = celery_guard.get_runtime(module.app)
    runtime.migrate()
    module.metadata.create_all(runtime.store.engine)
    try:
        yield module
    finally:
        runtime.store.dispose()
        module.app.close()


@pytest.fixture(scope="module")
def shop_workers(shop: ModuleType, shop_env: dict[str, str]) -> Iterator[list[WorkerProcess]]:
    """Two prefork workers, concurrency 2 each, behind PgBouncer."""
    with running_workers(2, shop_env) as workers:
        yield workers


def test_the_workers_reach_the_store_through_pgbouncer(
    shop: ModuleType,
    shop_env: dict[str, str],
    shop_workers: list[WorkerProcess],
    pgbouncer: PgBouncerServer,
    tag: str,
) -> None:
    """What the imported tests run on: the workers' store connections are PgBouncer's clients."""
    assert shop.record.delay(tag).get(timeout=60)["tag"] == tag
    dbname = shop_env["CG_STORE_URL"].rsplit("/", 1)[1]
    assert f":{pgbouncer.port}/" in shop_env["CG_STORE_URL"]
    celery_guard.get_runtime(shop.app).store.dispose()  # what is left is the workers'
    # Named "celery_guard <main pid>/<pid>" in a prefork worker (docs/operations.md).
    assert any(
        str(client.get("application_name") or "").startswith("celery_guard")
        for client in pgbouncer.clients(dbname)
    )


#: test_self_healing.py's LEASE_TTL: the no-liveness recovery waits it out.
LEASE_TTL = 2.0


#: The liveness modes each self-healing test runs in behind PgBouncer (both, unless named here).
CLUSTER_MODES = ("liveness-url", "no-liveness")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test that uses ``cluster`` runs in the modes it is about: taking a dead worker's
    keys over at once needs the liveness URL; waiting out the lease is the mode without."""
    if "cluster" not in metafunc.fixturenames:
        return
    modes: tuple[str, ...] = CLUSTER_MODES
    if metafunc.function is test_a_dead_workers_keys_are_taken_over_without_waiting_for_the_lease:
        modes = ("liveness-url",)
    elif (
        metafunc.function.__name__ == "test_without_liveness_a_dead_workers_key_waits_out_the_lease"
    ):
        modes = ("no-liveness",)
    metafunc.parametrize("cluster", modes, indirect=True)


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    postgres: PostgresServer,
    pgbouncer: PgBouncerServer,
    redis_server: RedisServer,
    tmp_path: Path,
) -> Iterator[Cluster]:
    """test_self_healing.py's cluster, its workers behind PgBouncer; the test reads directly."""
    liveness = request.param == "liveness-url"
    direct = new_store_database(postgres, "pgbheal")
    env = {
        "CG_BROKER_URL": redis_server.url_for(7),
        "CG_RESULT_URL": redis_server.url_for(8),
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_LEASE_URL": "",
        "CG_MARKER_DIR": str(tmp_path),
        **pooled_env(pgbouncer, direct, liveness=liveness),
    }
    client = Celery("pgb-heal-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    store = SqlStore(GuardConfig(store_url=direct))
    running = Cluster(env, f"pgbheal-{uuid.uuid4().hex[:8]}", client, store, [], "sql-leases")
    try:
        yield running
    finally:
        for worker in running.workers:
            worker.kill()
        store.dispose()
        client.close()


def test_without_liveness_a_dead_workers_key_waits_out_the_lease(cluster: Cluster) -> None:
    """No liveness URL: the claim records no lock, and only the lease's end frees the key."""
    assert not cluster.env["CG_LIVENESS_URL"]
    cluster.start(2)
    tag = uuid.uuid4().hex[:12]
    key = f"gated:{tag}"
    result = cluster.send("shop.gated", tag)
    owner = wait_owner(cluster.store, key)
    record = cluster.store.keys.get(key)
    assert record is not None and record.owner_lock is None
    worker_running(cluster.workers, owner).kill()
    killed_at = time.monotonic()
    open_gates(cluster.env["CG_MARKER_DIR"], tag, 2)
    assert result.get(timeout=60)["fencing_token"] == 2
    # The lease was renewed at most a renewal interval (a third of the TTL) before the kill.
    assert time.monotonic() - killed_at >= LEASE_TTL * 2 / 3
    assert cluster.effects(tag) == 1
