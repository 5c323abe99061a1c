"""What GuardedTask costs per task: plain Celery, the floor, GuardedTask, GuardedTask with options.

Run from the repository root (``--help`` lists the options)::

    .venv/bin/python bench/overhead.py --tasks 2000 --concurrency 2 --output docs/benchmarks.md

Four variants (bench/overhead_app.py) on two tasks (*noop*; *credit*: a start row in its own
transaction, then the ledger row in the guarded transaction):

- ``plain``: plain Celery (acks_late, reject_on_worker_lost), every write its own transaction;
- ``floor``: bench/floor.py, the least a durable two-statement claim costs (a prepared
  ``INSERT ... ON CONFLICT ... RETURNING`` on a kept connection, the COMPLETED ``UPDATE`` in
  the body's transaction), without anything else the guard does;
- ``guarded``: ``GuardedTask`` with the default settings (metrics included);
- ``guarded_full``: ``GuardedTask`` with every option that costs something on: Redis leases
  (``guard_lease_url``) and publish tracking (``guard_track_publishes``) besides the metrics.

The floor's claim and GuardedTask's commit without waiting for their WAL flush (the default
``guard_claim_synchronous_commit = "off"``); ``--variants`` adds ``floor_flush`` and
``guarded_flush``, whose claims wait for it (two flushes per task instead of one), and
``floor1``: the floor with its claim inside the body's transaction (one
commit per task), the ceiling of that design; and ``guarded_quiet``: ``GuardedTask`` with the
metrics off (``guard_metrics_port = None``), what recording the metrics costs.
``--without-indexes`` drops the keys table's two partial indexes (the reaper's and pruning's)
before the runs, leaving its primary key as the floor's table has: a bound on what those
indexes cost the hot path, written to a section of its own (the self-healing needs them).

Each runs against two PostgreSQL servers in turn (``--settings``): ``durable``, as production
runs it (fsync, synchronous_commit and full_page_writes on: every commit waits for its WAL
flush), and ``fast``, the test rig's (all three off). One private Redis is the broker and the
completion counter. For each server, variant, task and repeat: N messages are published to a
fresh queue, then ONE real prefork worker drains it. The time measured runs from the first
``task_prerun`` to the last ``task_postrun`` (both stamped inside the pool processes), so worker
start-up is excluded; the median over the repeats is reported. Commits per task are
``pg_stat_database.xact_commit`` deltas over the whole worker's life (its start-up and
background statements included), WAL syncs ``pg_stat_wal.wal_sync`` deltas.

Statements per task are counted in-process with ``task.apply()`` (eager) against the fast
server: SQLAlchemy ``before_cursor_execute`` / ``commit`` events on the engines, cross-checked
with the statements the server itself logs (``log_statement = 'all'``), which also shows the
``BEGIN`` the psycopg driver sends on its own and the floor's statements on its own connection.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib
import itertools
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import kombu  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402
import sqlalchemy  # noqa: E402
from sqlalchemy import create_engine, event, text  # noqa: E402

import celery_guard  # noqa: E402
from bench import floor  # noqa: E402
from bench.cpu import PART_TITLES, CpuSnapshot  # noqa: E402
from celery_guard import get_runtime  # noqa: E402
from celery_guard.store.schema import PRUNABLE_INDEX, RUNNING_INDEX  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.ports import free_port  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Overhead (bench/overhead.py)"
DEFAULT_CONCURRENCY = 2


def heading_for(concurrency: int, without_indexes: bool = False) -> str:
    """The section a run writes: another pool size gets its own, beside the default's, and so
    does a run without the keys table's partial indexes (never the headline figures)."""
    if without_indexes:
        return (
            "## Overhead without the reaper's and pruning's indexes "
            "(bench/overhead.py --without-indexes)"
        )
    if concurrency == DEFAULT_CONCURRENCY:
        return HEADING
    return f"## Overhead at concurrency {concurrency} (bench/overhead.py --concurrency N)"


#: What ``--without-indexes`` drops after migrating: the keys table's partial indexes
#: (celery_guard/store/schema.py), so that only its primary key is left, as the floor's table.
PARTIAL_KEY_INDEXES = (RUNNING_INDEX, PRUNABLE_INDEX)


KINDS = ("noop", "credit")
ALL_VARIANTS = (
    "plain",
    "floor",
    "floor_flush",
    "floor1",
    "guarded",
    "guarded_flush",
    "guarded_quiet",
    "guarded_full",
)
DEFAULT_VARIANTS = ("plain", "floor", "guarded", "guarded_full")
SETTINGS = ("durable", "fast")
#: Redis database the full variant's leases live in (0: broker, 1: completion counter).
LEASE_DB = 2
VARIANT_TITLES = {
    "plain": "plain Celery",
    "floor": "floor (bench/floor.py)",
    "floor_flush": "floor, its claim's commit waiting for the WAL flush",
    "floor1": "floor, claim in the body's transaction",
    "guarded_flush": "GuardedTask, guard_claim_synchronous_commit None (the claim waits)",
    "guarded": "GuardedTask, defaults",
    "guarded_quiet": "GuardedTask, metrics off (guard_metrics_port None)",
    "guarded_full": "GuardedTask, Redis leases + publish tracking + metrics",
}


def task_name(variant: str, kind: str) -> str:
    """The bench task (bench/overhead_app.py TASKS) a variant runs for a task kind."""
    family = variant if variant == "floor1" else variant.split("_")[0]
    return f"{family}_{kind}"


def variant_env(variant: str, redis_server: RedisServer) -> dict[str, str]:
    """What a variant's worker gets on top of the common environment."""
    if variant == "floor_flush":
        return {"BENCH_GUARD_CONF": "", "BENCH_FLOOR_CLAIM_COMMIT": ""}
    if variant == "guarded_quiet":
        return {"BENCH_GUARD_CONF": json.dumps({"guard_metrics_port": None})}
    if variant == "guarded_flush":
        return {"BENCH_GUARD_CONF": json.dumps({"guard_claim_synchronous_commit": None})}
    if variant != "guarded_full":
        return {"BENCH_GUARD_CONF": ""}
    conf = {"guard_lease_url": redis_server.url_for(LEASE_DB), "guard_track_publishes": True}
    return {"BENCH_GUARD_CONF": json.dumps(conf)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="messages per run (default 2000)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"prefork pool size ({DEFAULT_CONCURRENCY}; others write their own section)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant; median (5)")
    parser.add_argument("--prefetch", type=int, default=4, help="worker_prefetch_multiplier (4)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=(
            f"comma-separated, of {', '.join(ALL_VARIANTS)} "
            f"(default: {', '.join(DEFAULT_VARIANTS)})"
        ),
    )
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help="PostgreSQL settings to run: durable,fast"
    )
    parser.add_argument(
        "--without-indexes",
        action="store_true",
        help=(
            "drop the reaper's and pruning's partial indexes after migrating: a bound on what "
            "they cost the hot path (its own section; never a setting to run celery_guard with)"
        ),
    )
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    args.variants = _choices(parser, "--variants", args.variants, ALL_VARIANTS)
    args.settings = _choices(parser, "--settings", args.settings, SETTINGS)
    if "plain" not in args.variants:
        parser.error("--variants must include plain (every ratio is to it)")
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])

    started, load_at_start = time.monotonic(), os.getloadavg()
    port = free_port()  # both servers in turn on one port, so the app's store URL holds
    redis_server = RedisServer()
    results: dict[str, SettingResult] = {}
    info: dict[str, str] = {}
    try:
        redis_server.start()
        for setting in args.settings:
            postgres = PostgresServer(port=port, durable=setting == "durable")
            try:
                postgres.start()
                results[setting] = run_setting(args, setting, postgres, redis_server)
                info = machine_info(postgres, redis_server, load_at_start)
            finally:
                postgres.stop()  # by PID; a server that never started is a no-op
    finally:
        redis_server.stop()
    wall = time.monotonic() - started
    info["PostgreSQL"] = info.get("PostgreSQL", "").split(" (rig")[0] + (
        " (durable: fsync, synchronous_commit, full_page_writes on; fast: all three off)"
    )

    section = render(args, results, info, command, wall)
    print("\n" + section)
    write_section(args.output, section, heading_for(args.concurrency, args.without_indexes))
    print(f"written to {args.output}; total wall time {wall:.0f} s")


def _choices(
    parser: argparse.ArgumentParser, option: str, value: str, allowed: tuple[str, ...]
) -> list[str]:
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in allowed]
    if unknown or not chosen:
        parser.error(f"{option}: {', '.join(unknown) or 'nothing'} not among {', '.join(allowed)}")
    return [name for name in allowed if name in chosen]  # in the documented order


class SettingResult:
    """What one PostgreSQL setting's runs measured, by run name (``<variant>_<kind>``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self.cpu: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        self.counts: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        self.statements: dict[str, dict[str, float]] = {}


def run_setting(
    args: argparse.Namespace, setting: str, postgres: PostgresServer, redis_server: RedisServer
) -> SettingResult:
    env = {
        "BENCH_BROKER_URL": redis_server.url_for(0),
        "BENCH_REDIS_URL": redis_server.url_for(1),
        "BENCH_STORE_URL": postgres.url,
        "BENCH_PREFETCH": str(args.prefetch),
    }
    os.environ.update(env)  # read by bench.overhead_app when it is imported
    bench = importlib.import_module("bench.overhead_app")
    forget_connections(bench)  # a previous setting's server is gone
    bench.metadata.create_all(create_engine(postgres.url, poolclass=sqlalchemy.NullPool))
    get_runtime(bench.app).migrate()
    if args.without_indexes:
        drop_partial_key_indexes(postgres.url)
    get_runtime(bench.app).store.dispose()

    result = SettingResult()
    names = [f"{variant}_{kind}" for kind in KINDS for variant in args.variants]
    for repeat in range(args.repeats):  # interleaved, so drift hits every variant alike
        # Every other round runs backwards: a variant run first in one round runs last in the
        # next, so a machine that speeds up or slows down during a round favours no variant.
        for name in names if repeat % 2 == 0 else names[::-1]:
            variant, kind = name.rsplit("_", 1)
            seconds = run_once(
                bench,
                task_name(variant, kind),
                repeat,
                args,
                {**env, **variant_env(variant, redis_server)},
                postgres,
                redis_server,
                result.cpu[name],
                counts=result.counts[name],
                label=name,
            )
            result.seconds[name].append(seconds)
            print(
                f"{setting} run {repeat + 1}/{args.repeats} {name:20s} "
                f"{args.tasks / seconds:8.1f}/s",
                flush=True,
            )
    if args.without_indexes:
        left = key_indexes(postgres.url)
        if set(left) & set(PARTIAL_KEY_INDEXES):  # a worker's schema check put one back
            raise RuntimeError(f"--without-indexes: the keys table has {left} after the runs")
    if setting == "fast":
        result.statements = measure_in_process(bench, postgres, args.variants)
    forget_connections(bench)
    return result


def forget_connections(bench: ModuleType) -> None:
    """Drop this process's connections to the store (before its server goes away)."""
    get_runtime(bench.app).store.dispose()
    bench.plain_engine().dispose()
    floor.forget_connection()


# -- throughput ---------------------------------------------------------------------------------


def run_once(
    bench: ModuleType,
    name: str,
    repeat: int,
    args: argparse.Namespace,
    env: dict[str, str],
    postgres: PostgresServer,
    redis_server: RedisServer,
    cpu: list[dict[str, float]] | None = None,
    *,
    counts: list[dict[str, float]] | None = None,
    label: str | None = None,
) -> float:
    """Publish ``args.tasks`` messages, drain them with one worker; seconds first start→last end.

    With ``cpu``, appends the CPU µs per task each part of the machine spent while the middle
    80% of the messages were processed (start-up and the tail left out). With ``counts``,
    appends the commits and WAL syncs per task PostgreSQL counted over the worker's life.
    """
    queue = f"bench.{label or name}.{repeat}"  # a fresh queue per run: nothing left over
    reset_database(postgres.url)
    stats_before = server_counters(postgres) if counts is not None else None
    with redis_server.client(1) as counter, redis_server.client(0) as broker:
        counter.delete(bench.DONE_KEY, bench.FIRST_START_KEY, bench.LAST_END_KEY)
        task = bench.TASKS[name]
        with bench.app.producer_or_acquire() as producer:
            for row_id in range(args.tasks):
                task.apply_async((row_id,), queue=queue, producer=producer)
        if broker.llen(queue) != args.tasks:
            raise RuntimeError(f"{queue}: {broker.llen(queue)} messages queued, not {args.tasks}")

        worker = WorkerProcess(
            bench.__name__,  # bench.overhead_app, or bench.peers_app for bench/peers.py
            env=env,
            cwd=ROOT,
            concurrency=args.concurrency,
            queues=queue,
            loglevel="WARNING",  # INFO would log two lines per task
        )
        try:
            worker.start(wait_ready=False)

            marks: list[tuple[int, CpuSnapshot]] = []  # (tasks done, CPU) at 10% and 90%

            def all_done() -> bool:
                if not worker.is_alive():
                    raise RuntimeError(f"worker exited with code {worker.returncode}")
                done = int(counter.get(bench.DONE_KEY) or 0)
                if cpu is not None and done >= args.tasks * (0.1, 0.9, 2)[len(marks)]:
                    marks.append((done, CpuSnapshot.take(worker.pid, worker.child_pids())))
                return bool(done >= args.tasks)

            try:
                procs.wait_until(all_done, args.timeout, f"{args.tasks} {name} tasks", 0.02)
            except Exception as exc:
                done = int(counter.get(bench.DONE_KEY) or 0)
                raise RuntimeError(
                    f"{name}: {done}/{args.tasks} tasks done: {exc}\n--- worker log tail ---\n"
                    + procs.log_tail(worker.log_path)
                ) from None
            if cpu is not None and len(marks) == 2:
                (done_before, before), (done_after, after) = marks
                cpu.append(before.per_task_micros(after, done_after - done_before))
            first = float(counter.get(bench.FIRST_START_KEY) or "nan")
            last = float(counter.get(bench.LAST_END_KEY) or "nan")
        finally:
            worker.cleanup()  # warm shutdown by PID, SIGKILL after 20 s; removes its log dir
    if counts is not None and stats_before is not None:
        stats_after = server_counters(postgres, settle=True)
        counts.append(
            {kind: (stats_after[kind] - stats_before[kind]) / args.tasks for kind in stats_after}
        )
    check_effects(postgres.url, name, args.tasks)
    return last - first


def drop_partial_key_indexes(url: str) -> None:
    engine = create_engine(url, poolclass=sqlalchemy.NullPool)
    with engine.begin() as connection:
        for name in PARTIAL_KEY_INDEXES:
            connection.execute(text(f"DROP INDEX {name}"))


def key_indexes(url: str) -> list[str]:
    """The keys table's indexes, by name."""
    engine = create_engine(url, poolclass=sqlalchemy.NullPool)
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT indexname FROM pg_indexes WHERE tablename = 'celery_guard_keys'")
        ).all()
    return sorted(row[0] for row in rows)


def reset_database(url: str) -> None:
    engine = create_engine(url, poolclass=sqlalchemy.NullPool)
    with engine.begin() as connection:
        tables = "bench_rows, bench_starts, bench_floor_keys, celery_guard_keys"
        connection.execute(text(f"TRUNCATE {tables}"))


def server_counters(postgres: PostgresServer, settle: bool = False) -> dict[str, float]:
    """The database's committed transactions and the server's WAL syncs so far.

    With ``settle``, first waits (bounded) for the worker's sessions to end: a backend reports
    its counts when it exits, a moment after its client has gone.
    """
    dbname = postgres.url.rsplit("/", 1)[1]
    with psycopg.connect(postgres.dsn_for(), autocommit=True) as connection:
        if settle:

            def others_gone() -> bool:
                row = connection.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                    "AND pid <> pg_backend_pid()",
                    (dbname,),
                ).fetchone()
                return row is not None and row[0] == 0

            procs.wait_until(others_gone, 30, "the worker's PostgreSQL sessions to end", 0.05)
            connection.execute("SELECT pg_stat_clear_snapshot()")
        row = connection.execute(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = %s), "
            "wal_sync, wal_bytes, wal_fpi FROM pg_stat_wal",
            (dbname,),
        ).fetchone()
    assert row is not None
    return {
        "commits": float(row[0]),
        "WAL syncs": float(row[1]),
        "WAL bytes": float(row[2]),
        "full-page images": float(row[3]),
    }


#: Rows each task kind writes, by table.
WRITES = {"noop": {}, "insert": {"bench_rows": 1}, "credit": {"bench_rows": 1, "bench_starts": 1}}


def check_effects(url: str, name: str, tasks: int) -> None:
    """Every task left its rows; every guarded or floor task left a COMPLETED key."""
    kind = name.rsplit("_", 1)[-1]
    expected = {
        table: tasks * WRITES.get(kind, {}).get(table, 0)
        for table in ("bench_rows", "bench_starts")
    }
    expected["celery_guard_keys"] = tasks if "guarded" in name else 0
    expected["bench_floor_keys"] = tasks if name.startswith("floor") else 0
    engine = create_engine(url, poolclass=sqlalchemy.NullPool)
    with engine.connect() as connection:
        found = {
            table: connection.scalar(
                text(
                    f"SELECT count(*) FROM {table}"
                    + (" WHERE state = 'COMPLETED'" if "keys" in table else "")
                )
            )
            for table in expected
        }
    if found != expected:
        raise RuntimeError(f"{name}: found {found}, not {expected}")


# -- round trips --------------------------------------------------------------------------------


def measure_in_process(
    bench: ModuleType,
    postgres: PostgresServer,
    variants: list[str],
    tasks: int = 500,
    warmup: int = 20,
) -> dict[str, dict[str, float]]:
    """Eager ``task.apply()`` in this process: time per task, then statements per task.

    The full variant's options are the worker's (``BENCH_GUARD_CONF``), not this process's:
    it is left out here (its statements in PostgreSQL are the defaults').
    """
    reset_database(postgres.url)
    row_ids = itertools.count(1)
    # The worker-only variants' options are the worker's; in-process they are the defaults'.
    names = [
        f"{v}_{k}" for k in KINDS for v in variants if v in ("plain", "floor", "floor1", "guarded")
    ]

    def apply(name: str, count: int) -> None:
        variant, kind = name.rsplit("_", 1)
        task = bench.TASKS[task_name(variant, kind)]
        for _ in range(count):
            task.apply((next(row_ids),), throw=True)

    results: dict[str, dict[str, float]] = {name: {} for name in names}
    for name in names:  # timing pass, before the server logs every statement
        apply(name, warmup)
        started = time.perf_counter()
        apply(name, tasks)
        results[name]["eager µs/task (no broker)"] = (time.perf_counter() - started) / tasks * 1e6

    forget_connections(bench)
    store = get_runtime(bench.app).store
    dbname = postgres.url.rsplit("/", 1)[1]
    admin = create_engine(postgres.url, poolclass=sqlalchemy.NullPool)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        # Applies to sessions opened from now on: every engine has just dropped its own.
        connection.execute(text(f"ALTER DATABASE \"{dbname}\" SET log_statement = 'all'"))

    client: collections.Counter[str] = collections.Counter()

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        client[classify(statement)] += 1

    def on_commit(_conn: Any) -> None:
        client["commit() calls"] += 1

    for engine in (store.engine, bench.plain_engine()):
        event.listen(engine, "before_cursor_execute", on_execute)
        event.listen(engine, "commit", on_commit)

    for name in names:  # counting pass
        apply(name, warmup)
        client.clear()
        marker = f"bench-mark-{name}"
        log_marker(postgres, f"{marker}-start")
        apply(name, tasks)
        log_marker(postgres, f"{marker}-end")
        server = server_statements(postgres, marker)
        results[name].update({f"client: {k}": v / tasks for k, v in client.items()})
        results[name].update({f"server: {k}": v / tasks for k, v in server.items()})
    forget_connections(bench)
    return results


def log_marker(postgres: PostgresServer, label: str) -> None:
    with psycopg.connect(postgres.dsn_for(), autocommit=True) as connection:
        connection.execute(f"SELECT '{label}'")


_LOGGED = re.compile(r"LOG:\s+(?:statement|execute [^:]*):\s*(.*)")


def server_statements(postgres: PostgresServer, marker: str) -> collections.Counter[str]:
    """Statements the server logged between the two markers, by kind."""
    lines = postgres.log_path.read_text(errors="replace").splitlines()
    start = max(i for i, line in enumerate(lines) if f"{marker}-start" in line)
    end = max(i for i, line in enumerate(lines) if f"{marker}-end" in line)
    kinds: collections.Counter[str] = collections.Counter()
    for line in lines[start + 1 : end]:
        match = _LOGGED.search(line)
        if match:
            kinds[classify(match.group(1))] += 1
    return kinds


def classify(sql: str) -> str:
    """Who sent a statement and what it is: celery_guard's claim/complete, the task's, or other."""
    words = sql.split()
    if not words:
        return "other"
    verb = words[0].upper()
    if floor.FLOOR_KEYS in sql:
        return "floor claim (INSERT ON CONFLICT)" if verb == "INSERT" else f"floor {verb}"
    if "celery_guard_" in sql:
        if verb == "INSERT":
            return "guard claim (INSERT ON CONFLICT)"
        if verb == "UPDATE" and "completed_at" in sql:
            return "guard complete (UPDATE)"
        return f"guard other {verb}"  # e.g. a heartbeat's lease renewal
    if "bench_rows" in sql or "bench_starts" in sql:
        return f"user {verb}"
    return verb  # BEGIN, COMMIT, ...


# -- report -------------------------------------------------------------------------------------


def machine_info(
    postgres: PostgresServer, redis_server: RedisServer, load_at_start: tuple[float, ...]
) -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    mem_kb = re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), re.M)

    def load(values: tuple[float, ...]) -> str:
        return "/".join(f"{value:.2f}" for value in values)

    nproc = subprocess.run(["nproc"], capture_output=True, text=True, timeout=10, check=True)
    with psycopg.connect(postgres.dsn_for()) as connection:
        row = connection.execute("SHOW server_version").fetchone()
    with redis_server.client() as client:
        redis_version = client.info("server")["redis_version"]
    return {
        "celery_guard": code_revision(),
        "CPU": f"{model.group(1) if model else 'unknown'}, nproc {nproc.stdout.strip()}",
        "RAM": f"{int(mem_kb.group(1)) / 2**20:.1f} GiB" if mem_kb else "unknown",
        "OS": platform.platform(),
        "Load average (1, 5, 15 min)": f"{load(load_at_start)} at start, "
        f"{load(os.getloadavg())} at end",
        "Python": platform.python_version(),
        "Celery": celery.__version__,
        "kombu": kombu.__version__,
        "SQLAlchemy": sqlalchemy.__version__,
        "psycopg": f"{psycopg.__version__} (libpq {psycopg.pq.version()})",
        "redis-py": redis.__version__,
        "redis-server": redis_version,
        "PostgreSQL": f"{row[0] if row else 'unknown'} (rig: "
        + (
            "fsync, synchronous_commit, full_page_writes on)"
            if postgres.durable
            else "fsync=off, synchronous_commit=off)"
        ),
    }


def code_revision() -> str:
    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", "--no-optional-locks", *argv], cwd=ROOT, capture_output=True, text=True
        )
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", "celery_guard")
    changes = " with uncommitted changes in celery_guard/" if dirty else ""
    return f"{celery_guard.__version__} at commit {git('rev-parse', '--short', 'HEAD')}{changes}"


def render(
    args: argparse.Namespace,
    results: dict[str, SettingResult],
    info: dict[str, str],
    command: str,
    wall: float,
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        heading_for(args.concurrency, args.without_indexes),
        "",
        f"Measured {today} with `{command}` (total wall time {wall:.0f} s).",
        "",
        f"One real `celery worker` (prefork, concurrency {args.concurrency}, "
        f"prefetch multiplier {args.prefetch}, acks_late and reject_on_worker_lost on every "
        f"task, results ignored) drains {args.tasks} messages published beforehand to its own "
        "queue on a private Redis; tasks write to a private PostgreSQL on the same machine. "
        "Time runs from the first `task_prerun` to the last `task_postrun` (stamped in the pool "
        "processes; the postrun handler also does one Redis INCR per task for every variant), "
        "so worker start-up is excluded but each pool process's first connection to PostgreSQL "
        f"is included. Median of {args.repeats} interleaved runs.",
        "",
        "Variants: " + "; ".join(f"*{v}*: {VARIANT_TITLES[v]}" for v in args.variants) + ". "
        "Tasks: *noop* returns; *credit* inserts a start row in its own transaction, then its "
        "ledger row in the guarded transaction (plain Celery: in a second transaction of its "
        "own). The floor (bench/floor.py) is the least a durable two-statement claim costs: one "
        "prepared `INSERT ... ON CONFLICT ... RETURNING` on a kept connection before the body, "
        "the COMPLETED `UPDATE` in the body's transaction, nothing else (no fencing beyond the "
        "token, no renewal, retries, recovery, metrics). The claims of *floor* and *guarded* "
        "commit without waiting for their WAL flush (`synchronous_commit` off for the claim's "
        "transaction: celery_guard's default `guard_claim_synchronous_commit`); the "
        "completion's commit waits for it, and WAL is flushed in order, so it flushes the claim "
        "too. *floor_flush* and *guarded_flush* wait at the claim as well.",
        "",
        "*Commits/task*: `pg_stat_database.xact_commit` deltas over each worker's whole life "
        "(its start-up and background statements included, read-only transactions too), "
        "divided by the tasks; *WAL syncs/task*: `pg_stat_wal.wal_sync` deltas (zero with "
        "fsync off; below the commits when concurrent commits share a flush); *WAL bytes/task*: "
        "`pg_stat_wal.wal_bytes` deltas, and in brackets the full-page images among them "
        "(`wal_fpi`: 8 kB each, the first change to a page after a checkpoint).",
    ]
    for setting, result in results.items():
        out += render_setting(args, setting, result)
    targets = render_targets(args, results)
    if targets:
        out += ["", "### Targets", "", *targets]
    statements = next((r.statements for r in results.values() if r.statements), None)
    if statements:
        out += render_statements(statements)
    out += ["", "### Machine and versions", ""]
    out += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(out) + "\n"


SETTING_TITLES = {
    "durable": "PostgreSQL as production runs it (fsync, synchronous_commit, full_page_writes on)",
    "fast": "the test rig's PostgreSQL (fsync, synchronous_commit, full_page_writes off)",
}


def rates(args: argparse.Namespace, result: SettingResult) -> dict[str, float]:
    return {name: args.tasks / statistics.median(s) for name, s in result.seconds.items() if s}


def paired_ratios(result: SettingResult, name: str, base: str) -> list[float]:
    """``name``'s throughput over ``base``'s, round by round: the two ran minutes apart in
    the same round, so a slow phase of the machine that spans a round cancels out, where a
    ratio of the medians compares runs from different rounds."""
    runs, base_runs = result.seconds.get(name) or [], result.seconds.get(base) or []
    return [b / s for s, b in zip(runs, base_runs, strict=False) if s > 0 and b > 0]


def _paired(result: SettingResult, name: str, base: str) -> str:
    """The median of :func:`paired_ratios` and their range, as a table cell."""
    ratios = paired_ratios(result, name, base)
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def render_setting(args: argparse.Namespace, setting: str, result: SettingResult) -> list[str]:
    rate = rates(args, result)
    out = [
        "",
        f"### {setting.capitalize()}: {SETTING_TITLES[setting]}",
        "",
        "| Task | Variant | Tasks/s | To plain | To floor | To plain, paired | "
        "To floor, paired | Commits/task | WAL syncs/task | WAL bytes/task (full-page images) | "
        "All runs (tasks/s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind in KINDS:
        for variant in args.variants:
            name = f"{variant}_{kind}"
            if name not in rate:
                continue
            plain, base = rate.get(f"plain_{kind}"), rate.get(f"floor_{kind}")
            to_plain = f"{rate[name] / plain:.2f}" if plain else ""
            to_floor = f"{rate[name] / base:.2f}" if base and variant != "plain" else ""
            counts = result.counts.get(name) or []
            commits = _median(counts, "commits")
            syncs = _median(counts, "WAL syncs")
            wal = _median(counts, "WAL bytes", "{:.0f}")
            images = _median(counts, "full-page images")
            wal_cell = f"{wal} ({images})" if wal else ""
            every = ", ".join(f"{args.tasks / s:.0f}" for s in result.seconds[name])
            paired_plain = _paired(result, name, f"plain_{kind}") if variant != "plain" else ""
            paired_floor = (
                _paired(result, name, f"floor_{kind}") if variant not in ("plain", "floor") else ""
            )
            out.append(
                f"| {kind} | {variant} | {rate[name]:.0f} | {to_plain} | {to_floor} | "
                f"{paired_plain} | {paired_floor} | {commits} | {syncs} | {wal_cell} | {every} |"
            )
    out += [
        "",
        "*To plain* and *to floor* divide the medians; the *paired* columns give the median "
        "(and the range) of the ratios within each round, whose runs were minutes apart.",
    ]
    out += render_cpu(args, result.cpu)
    return out


def _median(rows: list[dict[str, float]], key: str, form: str = "{:.2f}") -> str:
    values = [row[key] for row in rows if key in row]
    return form.format(statistics.median(values)) if values else ""


def render_targets(args: argparse.Namespace, results: dict[str, SettingResult]) -> list[str]:
    """The issue's targets, met or not, from this run's medians."""
    out = []
    for setting, result in results.items():
        rate = rates(args, result)
        for kind in KINDS:
            guarded, base, plain = (rate.get(f"{v}_{kind}") for v in ("guarded", "floor", "plain"))
            if guarded and base:
                out.append(
                    _target(
                        f"{setting}, {kind}: GuardedTask (defaults) / floor",
                        guarded / base,
                        paired_ratios(result, f"guarded_{kind}", f"floor_{kind}"),
                        0.9,
                    )
                )
            if setting == "durable" and kind == "credit" and guarded and plain:
                out.append(
                    _target(
                        "durable, credit: GuardedTask (defaults) / plain Celery",
                        guarded / plain,
                        paired_ratios(result, "guarded_credit", "plain_credit"),
                        0.8,
                    )
                )
    return out


def _target(what: str, ratio: float, paired: list[float], least: float) -> str:
    """One target's line: the ratio of the medians and the median of the paired ratios, each
    met or not."""

    def verdict(value: float) -> str:
        return "met" if value >= least else "NOT met"

    line = f"- {what} {ratio:.2f} ({verdict(ratio)})"
    if paired:
        median = statistics.median(paired)
        line += f", paired {median:.2f} ({verdict(median)})"
    return f"{line}; target at least {least}"


def render_statements(trips: dict[str, dict[str, float]]) -> list[str]:
    names = list(trips)
    kinds = sorted(
        {kind for counts in trips.values() for kind in counts},
        key=lambda kind: (not kind.startswith("eager"), kind),
    )
    out = [
        "",
        "### Statements per happy-path task",
        "",
        "Measured in-process with eager `task.apply()` against the fast PostgreSQL (no broker, "
        "no worker), 500 tasks per variant after 20 warm-up tasks. *eager µs/task*: wall time "
        "per task. *client*: SQLAlchemy `before_cursor_execute` events on the celery_guard and "
        "the bench's engine (the floor's kept psycopg connection has none), split into "
        "celery_guard's own statements and the task's (`user`), and `commit` events. "
        "*server*: statements PostgreSQL logged (`log_statement = 'all'`, a second pass), which "
        "include the `BEGIN` psycopg sends before the first statement of a transaction; each "
        "one is a network round trip. The full variant is not measured here (its options are "
        "the worker's; its PostgreSQL statements are the defaults').",
        "",
        "| Counter | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for kind in kinds:
        shown = "{:.0f}" if kind.startswith("eager") else "{:g}"
        cells = " | ".join(shown.format(trips[name].get(kind, 0)) for name in names)
        out.append(f"| {kind} | {cells} |")
    total = {
        name: sum(v for k, v in trips[name].items() if k.startswith("server:")) for name in names
    }
    commits = {name: trips[name].get("server: COMMIT", 0) for name in names}
    out += [
        "| **server: round trips** | " + " | ".join(f"{total[n]:g}" for n in names) + " |",
        "| **server: round trips beyond plain** | "
        + " | ".join(f"{total[n] - total.get('plain_' + n.rsplit('_', 1)[1], 0):g}" for n in names)
        + " |",
        "| **server: explicit COMMITs** (autocommitted statements commit too) | "
        + " | ".join(f"{commits[n]:g}" for n in names)
        + " |",
    ]
    return out


def render_cpu(args: argparse.Namespace, cpu: dict[str, list[dict[str, float]]]) -> list[str]:
    """Where the CPU went, per task, by process (median over the runs)."""
    if not cpu or not all(cpu.values()):
        return []
    parts = list(PART_TITLES)
    out = [
        "",
        "CPU time (user + system, from /proc) per task while the middle 80% of each run's "
        "messages were processed, median over the runs, in µs. Every part shares the same "
        "cores: *whole machine* is all CPUs' busy time (/proc/stat), so it also holds the "
        "benchmark's own polling and anything else running.",
        "",
        "| Task | Variant | " + " | ".join(PART_TITLES[part] for part in parts) + " |",
        "|---|---|" + "---:|" * len(parts),
    ]
    medians = {
        name: {part: statistics.median(run[part] for run in runs) for part in parts}
        for name, runs in cpu.items()
    }
    for kind in KINDS:
        for variant in args.variants:
            name = f"{variant}_{kind}"
            if name in medians:
                cells = " | ".join(f"{medians[name][part]:.0f}" for part in parts)
                out.append(f"| {kind} | {variant} | {cells} |")
        plain = medians.get(f"plain_{kind}")
        for variant in args.variants:
            name = f"{variant}_{kind}"
            if variant == "plain" or name not in medians or plain is None:
                continue
            added = " | ".join(f"{medians[name][part] - plain[part]:+.0f}" for part in parts)
            out.append(f"| {kind} | *{variant} minus plain* | {added} |")
    return out


def settings_phrase(settings: str) -> str:
    """How a section names the PostgreSQL settings it ran against (``--settings``)."""
    if settings == "durable":
        return "fsync, synchronous_commit and full_page_writes on"
    return "the test rig's fast settings (all three off)"


def publish_section(output: Path | None, section: str, heading: str) -> None:
    """Print a benchmark's section and, with ``output``, write it there."""
    print("\n" + section)
    if output is not None:
        write_section(output, section, heading)
        print(f"written to {output}")


def write_section(path: Path, section: str, heading: str = HEADING) -> None:
    """Replace a benchmark's section of ``path`` (up to the next ``## `` heading) or add it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: section + "\n", old, count=1).rstrip("\n") + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


if __name__ == "__main__":
    main()
