"""``make demo``: orders sent two or three times each, charged exactly once.

Starts a private Redis on a free loopback port, uses the embedded SQLite store (``--postgres``
starts a private PostgreSQL instead), runs two real prefork workers, sends every order's charge
several times in shuffled order, then audits the payments table. Every process it starts is
stopped before it exits.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The demo reuses the test rig: private servers and worker processes, each stopped by PID.
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402


def progress(done: int, total: int, started: float) -> None:
    if not sys.stdout.isatty() and done not in (total // 4, total // 2, 3 * total // 4, total):
        return  # a log file gets four lines, not a redraw per result
    width = 40
    filled = int(width * done / total)
    bar = "#" * filled + "-" * (width - filled)
    end = "" if sys.stdout.isatty() else "\n"
    print(f"\r  [{bar}] {done}/{total} results  {time.monotonic() - started:5.1f}s", end=end)
    sys.stdout.flush()


def run(orders: int, use_postgres: bool, seed: int) -> int:
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="celery-guard-demo-"))
    servers: list[Any] = []
    workers: list[WorkerProcess] = []
    try:
        redis_server = RedisServer()
        redis_server.start()
        servers.append(redis_server)
        if use_postgres:
            postgres = PostgresServer()
            postgres.start()
            servers.append(postgres)
            store_url = postgres.create_database("shop")
        else:
            store_url = f"sqlite:///{workdir / 'shop.sqlite3'}"
        env = {
            "SHOP_BROKER_URL": redis_server.url_for(0),
            "SHOP_RESULT_URL": redis_server.url_for(1),
            "SHOP_STORE_URL": store_url,
        }
        os.environ.update(env)
        import celery_guard
        from example_project import shop  # configured from the environment just set

        runtime = celery_guard.get_runtime(shop.app)
        runtime.migrate()
        shop.metadata.create_all(runtime.store.engine)

        print(f"store: {runtime.config.safe_store_url()}")
        print(f"broker: {redis_server.url_for(0)} (private redis-server, pid {redis_server.pid})")
        workers = [
            WorkerProcess("example_project.shop", env=env, cwd=ROOT, concurrency=2)
            for _ in range(2)
        ]
        for worker in workers:
            worker.start(wait_ready=False)
        for worker in workers:
            worker.wait_ready(timeout=60)
        print(f"workers: {', '.join(f'pid {w.pid} (prefork x2)' for w in workers)}")

        sends = [
            (order_id, 100 * order_id)
            for order_id in range(1, orders + 1)
            for _ in range(rng.choice((2, 3)))
        ]
        rng.shuffle(sends)
        print(f"sending {len(sends)} charge messages for {orders} orders (2-3 each)...")
        started = time.monotonic()
        results = [shop.charge.delay(order_id, amount) for order_id, amount in sends]
        deadline = started + 120
        for done, result in enumerate(results, start=1):
            result.get(timeout=max(1.0, deadline - time.monotonic()))
            progress(done, len(results), started)
        if sys.stdout.isatty():
            print()
        return audit(shop, runtime, orders, len(sends), time.monotonic() - started)
    finally:
        for worker in workers:
            worker.stop()
        for server in reversed(servers):
            server.stop()


def audit(shop: Any, runtime: Any, orders: int, messages: int, seconds: float) -> int:
    from celery_guard.store import keys

    with runtime.store.engine.connect() as connection:
        charges = Counter(
            dict(
                connection.execute(
                    select(shop.payments.c.order_id, func.count()).group_by(
                        shop.payments.c.order_id
                    )
                ).all()
            )
        )
        prevented = connection.execute(select(func.sum(keys.c.duplicates))).scalar_one() or 0
    charged_once = sum(1 for order_id in range(1, orders + 1) if charges[order_id] == 1)
    doubles = sum(1 for count in charges.values() if count > 1)
    missing = orders - len(charges)
    print()
    print("audit (from the payments table and the idempotency store)")
    print(f"  charge messages sent        {messages}")
    print(f"  orders charged exactly once {charged_once} / {orders}")
    print(f"  orders charged twice or more {doubles}")
    print(f"  orders never charged        {missing}")
    print(f"  duplicates prevented        {prevented}")
    print(f"  wall time                   {seconds:.1f}s")
    ok = charged_once == orders and prevented == messages - orders
    print("  result                      " + ("OK: every order charged once" if ok else "FAILED"))
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=50)
    parser.add_argument("--postgres", action="store_true", help="use a private PostgreSQL store")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    return run(args.orders, args.postgres, args.seed)


if __name__ == "__main__":
    sys.exit(main())
