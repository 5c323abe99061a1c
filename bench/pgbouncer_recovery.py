"""Recovery from a whole-worker SIGKILL to the task's re-claim, directly and behind PgBouncer.

Run from the repository root::

    .venv/bin/python bench/pgbouncer_recovery.py --runs 3

Private servers from the test rig: PostgreSQL, PgBouncer 1.18 (``pool_mode = transaction``) in
front of it, and Redis as the broker. Three modes of the store: PostgreSQL directly
(``guard_store_pooling = "session"``, liveness locks on the store's connections); PgBouncer with
``guard_liveness_url`` pointing at PostgreSQL directly; PgBouncer without liveness locks (the
reaper waits out the lease). Per mode and run: a fresh database, two prefork workers
(concurrency 1) of ``tests/apps/shop.py`` with the default lease TTL (10 s) and reaper interval
(2 s), each on a queue of its own. Once one of them leads the reaper, ``shop.gated`` is sent to
the other, and the leader starts consuming that queue too (Celery's ``add_consumer``), so the
surviving worker's reaper is the one that acts (a killed leader adds up to three reaper
intervals, its election lease, to any mode). When the body runs, the whole worker (main process
and pool child) is SIGKILLed; the time is measured from the kill until the key is claimed again
(fencing token 2), polled every 20 ms.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests`` imports when run as a script
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from celery import Celery  # noqa: E402

from tests.acceptance.conftest import new_store_database, open_gates, start_workers  # noqa: E402
from tests.rig.procs import wait_until  # noqa: E402
from tests.rig.servers import PgBouncerServer, PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

MODES = ("direct", "pgbouncer+liveness_url", "pgbouncer, no liveness")
LEASE_TTL = 10.0
REAPER_INTERVAL = 2.0


def dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def store_env(mode: str, direct: str, pgbouncer: PgBouncerServer) -> dict[str, str]:
    if mode == "direct":
        return {"CG_STORE_URL": direct}
    return {
        "CG_STORE_URL": pgbouncer.serve(direct),
        "CG_STORE_POOLING": "transaction",
        "CG_LIVENESS_URL": direct if mode == "pgbouncer+liveness_url" else "",
    }


def leader(db: psycopg.Connection[Any]) -> str | None:
    row = db.execute(
        "SELECT holder FROM celery_guard_leaders WHERE name = 'reaper' "
        "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
    ).fetchone()
    return str(row[0]) if row else None


def key_row(db: psycopg.Connection[Any], key: str) -> tuple[str, int] | None:
    row = db.execute(
        "SELECT state, fencing_token FROM celery_guard_keys WHERE key = %s", (key,)
    ).fetchone()
    return (str(row[0]), int(row[1])) if row else None


def one_run(
    mode: str,
    postgres: PostgresServer,
    pgbouncer: PgBouncerServer,
    redis: RedisServer,
    markers: Path,
) -> float:
    direct = new_store_database(postgres, "pgbrec")
    queues = [f"rec-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    env = {
        "CG_BROKER_URL": redis.url_for(9),
        "CG_RESULT_URL": redis.url_for(10),
        "CG_LEASE_TTL": str(LEASE_TTL),
        "CG_REAPER_INTERVAL": str(REAPER_INTERVAL),
        "CG_MARKER_DIR": str(markers),
        "CG_CIRCUIT_ENABLED": "0",
        "CG_ADAPTIVE_CONCURRENCY": "0",
        **store_env(mode, direct, pgbouncer),
    }
    workers: list[WorkerProcess] = []
    client = Celery("pgb-recovery", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    try:
        for queue in queues:
            workers += start_workers(1, env, queues=queue, concurrency=1)
        with psycopg.connect(dsn(direct), autocommit=True) as db:
            wait_until(lambda: leader(db) is not None, 60, "a reaper leader", 0.02)
            holder = leader(db) or ""
            names = [worker.hostname.split("@", 1)[0] for worker in workers]
            victim_index = 1 if holder.startswith(names[0]) else 0
            victim = workers[victim_index]
            tag = uuid.uuid4().hex[:12]
            key = f"gated:{tag}"
            result = client.send_task("shop.gated", args=(tag,), queue=queues[victim_index])
            wait_until(lambda: key_row(db, key) == ("RUNNING", 1), 60, "the body to run", 0.02)
            # The reaper re-publishes to the task's queue: let the survivor consume it.
            survivor = workers[1 - victim_index].hostname.replace("%h", socket.gethostname())
            replies = client.control.add_consumer(
                queues[victim_index], destination=[survivor], reply=True, timeout=10
            )
            if not any("ok" in (reply.get(survivor) or {}) for reply in replies or []):
                raise RuntimeError(f"{survivor} did not add the queue: {replies!r}")
            victim.kill()
            killed_at = time.monotonic()
            wait_until(
                lambda: (key_row(db, key) or ("", 0))[1] >= 2,
                LEASE_TTL * 4 + 30,
                "the re-claim",
                0.02,
            )
            took = time.monotonic() - killed_at
            open_gates(markers, tag, 2)
            result.get(timeout=60)
            return took
    finally:
        for worker in workers:
            worker.kill()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    args = parser.parse_args()
    markers = Path(tempfile.mkdtemp(prefix="pgb-recovery-"))
    with (
        PostgresServer() as postgres,
        PgBouncerServer(postgres) as pgbouncer,
        RedisServer() as redis,
    ):
        results: dict[str, list[float]] = {mode: [] for mode in MODES}
        for run in range(args.runs):
            for mode in MODES:
                took = one_run(mode, postgres, pgbouncer, redis, markers)
                results[mode].append(took)
                print(f"run {run + 1} {mode}: {took:.2f} s", flush=True)
    print(f"\nlease TTL {LEASE_TTL} s, reaper interval {REAPER_INTERVAL} s; kill -> re-claim:")
    print("| mode | median | min | max | runs |")
    print("|---|---|---|---|---|")
    for mode, values in results.items():
        print(
            f"| {mode} | {statistics.median(values):.2f} s | {min(values):.2f} s | "
            f"{max(values):.2f} s | {len(values)} |"
        )


if __name__ == "__main__":
    main()
