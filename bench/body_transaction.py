"""What a task's own transaction costs the client, beside the floor's.

Run from the repository root::

    .venv/bin/python bench/body_transaction.py --output docs/benchmarks.md

The credit task of bench/overhead.py writes its ledger row in ``self.guard.transaction()``,
which commits with the key's COMPLETED marker. This measures that part alone, in one process
against a private PostgreSQL from the test rig (``--settings durable``, the default), after
every key has been claimed (untimed): open the task's connection, begin, one INSERT through
SQLAlchemy, the completion marker in the transaction, COMMIT, close. Ways:

- ``floor``: bench/floor.py's transaction: a connection from a plain engine's pool, the marker
  through the driver, prepared;
- ``lent``: celery_guard's, as a prefork pool process runs it (the store's hot connection lent
  to the body, ``StoreEngine.lend``) through ``Keys.connect``, ``Keys.complete`` and
  ``Keys.commit``, as ``Execution`` calls them;
- ``pooled``: the same from the store engine's pool, as any other process runs it;
- ``lent_events``: ``lent`` on a store engine with do-nothing SQLAlchemy connection event
  listeners (``before_cursor_execute``, ``after_cursor_execute``, ``commit``, ``rollback``),
  as the statement watchdog and the transaction-boundary check were built before they moved
  into the driver's cursor and ``TaskConnection`` (celery_guard/store/engine.py): what any
  connection event on the store engine costs each task.

Per way, the median over the repeats (interleaved) of this process's CPU per transaction, the
PostgreSQL backends' CPU and the wall time, and the least run's client CPU.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

from sqlalchemy import (  # noqa: E402
    Column,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    insert,
)

from bench import floor  # noqa: E402
from bench.claim_cost import request, server_seconds  # noqa: E402
from bench.overhead import publish_section, settings_phrase  # noqa: E402
from celery_guard import GuardConfig  # noqa: E402
from celery_guard.store import SqlStore  # noqa: E402
from tests.rig.servers import PostgresServer  # noqa: E402

WAYS = ("floor", "lent", "pooled", "lent_events")
HEADING = "## A task's own transaction (bench/body_transaction.py)"
COLUMNS = ("client CPU", "server CPU", "wall")

metadata = MetaData()
ledger = Table(
    "bench_ledger",
    metadata,
    Column("row_id", Integer, primary_key=True),
    Column("note", String(32), nullable=False),
)
floor_keys = floor.define_table(metadata)

#: One transaction: (key, token, row id).
Transaction = Callable[[str, int, int], None]


def guard_transaction(store: SqlStore) -> Transaction:
    keys = store.keys
    statement = insert(ledger)

    def on_boundary(action: str) -> None:
        return None  # Execution's hook, as it runs when celery_guard itself ends the transaction

    def run(key: str, token: int, row_id: int) -> None:
        connection = keys.connect(on_boundary=on_boundary)
        try:
            transaction = connection.begin()
            connection.execute(statement, {"row_id": row_id, "note": "guard"})
            assert not keys.transaction_failed(connection)
            keys.complete(key, token, "null", 3600.0, connection=connection)
            keys.commit(transaction)
        finally:
            connection.close()

    return run


def floor_transaction(url: str) -> Transaction:
    engine = create_engine(url)
    statement = insert(ledger)

    def run(key: str, token: int, row_id: int) -> None:
        with engine.connect() as connection:
            transaction = connection.begin()
            connection.execute(statement, {"row_id": row_id, "note": "floor"})
            driver = connection.connection.driver_connection
            assert driver is not None
            driver.execute(floor.COMPLETE, {"key": key, "token": token}, prepare=True)
            transaction.commit()

    return run


def claim_all(way: str, store: SqlStore, url: str, names: list[str]) -> list[int]:
    """Claim every key, untimed: the floor's claim for the floor, celery_guard's for the rest."""
    if way == "floor":
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True) as connection:
            sql = floor.claim_sql("off")
            rows = [
                connection.execute(sql, {"key": key, "lease": floor.LEASE_SECONDS}).fetchone()
                for key in names
            ]
        return [int(row[0]) for row in rows if row is not None]
    return [store.keys.claim(request(key)).record.fencing_token for key in names]


def with_events(store: SqlStore) -> SqlStore:
    """``store`` with do-nothing connection event listeners on its engine."""

    def nothing(*_: Any, **__: Any) -> None:
        return None

    for name in ("before_cursor_execute", "after_cursor_execute", "commit", "rollback"):
        event.listen(store.engine, name, nothing)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="transactions per run (2000)")
    parser.add_argument("--repeats", type=int, default=9, help="runs per way; median (9)")
    parser.add_argument("--settings", choices=("durable", "fast"), default="durable")
    parser.add_argument("--output", type=Path, default=None, help="markdown file to write to")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    load, started = os.getloadavg(), time.monotonic()
    measured: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    row_ids = iter(range(1, 10**9))
    with PostgresServer(durable=args.settings == "durable") as postgres:
        url = postgres.url
        metadata.create_all(create_engine(url))
        stores = {name: SqlStore(GuardConfig(store_url=url)) for name in WAYS if name != "floor"}
        for store in stores.values():
            store.ensure_schema()
        for name in ("lent", "lent_events"):
            stores[name].db.budget = "child"  # as worker_process_init sets it in a pool process
        with_events(stores["lent_events"])
        runners: dict[str, Transaction] = {"floor": floor_transaction(url)}
        runners.update({name: guard_transaction(store) for name, store in stores.items()})
        try:
            for _ in range(args.repeats):  # interleaved, so drift hits every way alike
                for name in WAYS:
                    store = stores.get(name, stores["lent"])
                    prefix = uuid.uuid4().hex[:8]
                    names = [f"{prefix}-{n}" for n in range(args.tasks + 20)]
                    tokens = claim_all(name, store, url, names)
                    run = runners[name]
                    for key, token in zip(names[:20], tokens[:20], strict=True):  # warm up
                        run(key, token, next(row_ids))
                    server0, client0 = server_seconds(postgres), time.process_time()
                    wall0 = time.perf_counter()
                    for key, token in zip(names[20:], tokens[20:], strict=True):
                        run(key, token, next(row_ids))
                    wall1, client1 = time.perf_counter(), time.process_time()
                    server1 = server_seconds(postgres)
                    per_task = 1e6 / args.tasks
                    result = {
                        "client CPU": (client1 - client0) * per_task,
                        "server CPU": (server1 - server0) * per_task,
                        "wall": (wall1 - wall0) * per_task,
                    }
                    measured[name].append(result)
                    print(
                        f"{name:12s} "
                        + "  ".join(f"{c} {result[c]:6.0f}" for c in COLUMNS)
                        + " µs/task",
                        flush=True,
                    )
        finally:
            for store in stores.values():
                store.dispose()
    section = render(args, command, measured, load, time.monotonic() - started)
    publish_section(args.output, section, HEADING)


def render(
    args: argparse.Namespace,
    command: str,
    measured: dict[str, list[dict[str, float]]],
    load: tuple[float, float, float],
    wall: float,
) -> str:
    setting = settings_phrase(args.settings)
    medians = {
        way: {c: statistics.median(r[c] for r in runs) for c in COLUMNS}
        for way, runs in measured.items()
    }
    lines = [
        HEADING,
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}` "
        f"({wall:.0f} s; load average {load[0]:.2f} at start on {os.cpu_count()} CPUs).",
        "",
        f"PostgreSQL with {setting}. {args.tasks} claimed keys per run (claims untimed), each "
        "then given the credit task's transaction: connect, begin, one INSERT through "
        "SQLAlchemy, the completion marker inside the transaction, COMMIT, close. Median of "
        f"{args.repeats} interleaved runs, µs per transaction, and the least run's client CPU "
        "(steal and other load only ever add CPU time, so the least run is the closest to the "
        "work itself on a shared machine). *client CPU*: this process; "
        "*server CPU*: every PostgreSQL process (`/proc`). Ways: *floor*: bench/floor.py's "
        "transaction (a plain engine's pooled connection, the marker through the driver); "
        "*lent*: celery_guard's as a prefork pool process runs it (the hot connection lent to "
        "the body); *pooled*: the same from the store engine's pool; *lent_events*: *lent* with "
        "do-nothing SQLAlchemy connection event listeners on the store engine, as the "
        "statement watchdog and the boundary check were built before.",
        "",
        "| Way | " + " | ".join(COLUMNS) + " | client CPU to floor | client CPU, least run | "
        "to floor | all runs, client CPU |",
        "|---|" + "---:|" * (len(COLUMNS) + 3) + "---|",
    ]
    floor_cpu = medians["floor"]["client CPU"]
    floor_least = min(r["client CPU"] for r in measured["floor"])
    for way in WAYS:
        runs = ", ".join(f"{r['client CPU']:.0f}" for r in measured[way])
        least = min(r["client CPU"] for r in measured[way])
        lines.append(
            f"| {way} | "
            + " | ".join(f"{medians[way][c]:.0f}" for c in COLUMNS)
            + f" | {medians[way]['client CPU'] / floor_cpu:.2f} | {least:.0f}"
            + f" | {least / floor_least:.2f} | {runs} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
