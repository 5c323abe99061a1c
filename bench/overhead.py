"""Throughput overhead of GuardedTask over plain Celery tasks, and store round trips per task.

Run from the repository root (``--help`` lists the options)::

    .venv/bin/python bench/overhead.py --tasks 2000 --concurrency 2 --output docs/benchmarks.md

One private Redis (broker + completion counter) and one private PostgreSQL (celery_guard's store
and the table the insert tasks write) are started with the test rig. For each variant of
``bench/overhead_app.py`` and each repeat: N messages are published to a fresh queue, then ONE
real prefork worker is started on that queue. The time measured runs from the first
``task_prerun`` to the last ``task_postrun`` (both stamped inside the pool processes), so worker
start-up and polling are excluded; the median over the repeats is reported.

Round trips are counted in-process with ``task.apply()`` (eager) against the same PostgreSQL:
SQLAlchemy ``before_cursor_execute`` / ``commit`` events on the engines, cross-checked with the
statements the server itself logs (``log_statement = 'all'``), which also shows the ``BEGIN`` the
psycopg driver sends on its own.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib
import itertools
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
from bench.cpu import PART_TITLES, CpuSnapshot  # noqa: E402
from celery_guard import get_runtime  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Overhead (bench/overhead.py)"
DEFAULT_CONCURRENCY = 2


def heading_for(concurrency: int) -> str:
    """The section a run writes: another pool size gets its own, beside the default's."""
    if concurrency == DEFAULT_CONCURRENCY:
        return HEADING
    return f"## Overhead at concurrency {concurrency} (bench/overhead.py --concurrency N)"


PAIRS = [("plain_noop", "guarded_noop"), ("plain_insert", "guarded_insert")]
VARIANTS = [name for pair in PAIRS for name in pair]


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
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])

    started, load_at_start = time.monotonic(), os.getloadavg()
    redis_server, postgres = RedisServer(), PostgresServer()
    try:
        redis_server.start()
        postgres.start()
        env = {
            "BENCH_BROKER_URL": redis_server.url_for(0),
            "BENCH_REDIS_URL": redis_server.url_for(1),
            "BENCH_STORE_URL": postgres.url,
            "BENCH_PREFETCH": str(args.prefetch),
        }
        os.environ.update(env)  # read by bench.overhead_app when it is imported
        bench = importlib.import_module("bench.overhead_app")
        bench.metadata.create_all(create_engine(postgres.url, poolclass=sqlalchemy.NullPool))
        get_runtime(bench.app).migrate()
        get_runtime(bench.app).store.dispose()

        runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name in VARIANTS:
                seconds = run_once(
                    bench, name, repeat, args, env, postgres, redis_server, cpu[name]
                )
                runs[name].append(seconds)
                print(f"run {repeat + 1}/{args.repeats} {name:15s} {args.tasks / seconds:8.1f}/s")
        trips = measure_in_process(bench, postgres)
        info = machine_info(postgres, redis_server, load_at_start)
    finally:
        try:
            postgres.stop()  # by PID; a server that never started is a no-op
        finally:
            redis_server.stop()
    wall = time.monotonic() - started

    section = render(args, runs, cpu, trips, info, command, wall)
    print("\n" + section)
    write_section(args.output, section, heading_for(args.concurrency))
    print(f"written to {args.output}; total wall time {wall:.0f} s")


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
) -> float:
    """Publish ``args.tasks`` messages, drain them with one worker; seconds first start→last end.

    With ``cpu``, appends the CPU µs per task each part of the machine spent while the middle
    80% of the messages were processed (start-up and the tail left out).
    """
    queue = f"bench.{name}.{repeat}"  # a fresh queue per run: nothing left over from another
    reset_database(postgres.url)
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
    check_effects(postgres.url, name, args.tasks)
    return last - first


def reset_database(url: str) -> None:
    engine = create_engine(url, poolclass=sqlalchemy.NullPool)
    with engine.begin() as connection:
        connection.execute(text("TRUNCATE bench_rows, celery_guard_keys"))


def check_effects(url: str, name: str, tasks: int) -> None:
    """Every insert task left its row; every guarded task left a COMPLETED key."""
    engine = create_engine(url, poolclass=sqlalchemy.NullPool)
    with engine.connect() as connection:
        rows = connection.scalar(text("SELECT count(*) FROM bench_rows"))
        completed = connection.scalar(
            text("SELECT count(*) FROM celery_guard_keys WHERE state = 'COMPLETED'")
        )
    expected = (tasks if "insert" in name else 0, tasks if "guarded" in name else 0)
    if (rows, completed) != expected:
        raise RuntimeError(f"{name}: {rows} rows and {completed} COMPLETED keys, not {expected}")


# -- round trips --------------------------------------------------------------------------------


def measure_in_process(
    bench: ModuleType, postgres: PostgresServer, tasks: int = 500, warmup: int = 20
) -> dict[str, dict[str, float]]:
    """Eager ``task.apply()`` in this process: time per task, then statements per task."""
    reset_database(postgres.url)
    row_ids = itertools.count(1)

    def apply(name: str, count: int) -> None:
        for _ in range(count):
            bench.TASKS[name].apply((next(row_ids),), throw=True)

    results: dict[str, dict[str, float]] = {name: {} for name in VARIANTS}
    for name in VARIANTS:  # timing pass, before the server logs every statement
        apply(name, warmup)
        started = time.perf_counter()
        apply(name, tasks)
        results[name]["eager µs/task (no broker)"] = (time.perf_counter() - started) / tasks * 1e6

    store = get_runtime(bench.app).store
    store.dispose()
    bench.plain_engine().dispose()
    dbname = postgres.url.rsplit("/", 1)[1]
    admin = create_engine(postgres.url, poolclass=sqlalchemy.NullPool)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        # Applies to sessions opened from now on: both engines have just dropped theirs.
        connection.execute(text(f"ALTER DATABASE \"{dbname}\" SET log_statement = 'all'"))

    client: collections.Counter[str] = collections.Counter()

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        client[classify(statement)] += 1

    def on_commit(_conn: Any) -> None:
        client["commit() calls"] += 1

    for engine in (store.engine, bench.plain_engine()):
        event.listen(engine, "before_cursor_execute", on_execute)
        event.listen(engine, "commit", on_commit)

    for name in VARIANTS:  # counting pass
        apply(name, warmup)
        client.clear()
        marker = f"bench-mark-{name}"
        log_marker(postgres, f"{marker}-start")
        apply(name, tasks)
        log_marker(postgres, f"{marker}-end")
        server = server_statements(postgres, marker)
        results[name].update({f"client: {k}": v / tasks for k, v in client.items()})
        results[name].update({f"server: {k}": v / tasks for k, v in server.items()})
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
    if "celery_guard_" in sql:
        if verb == "INSERT":
            return "guard claim (INSERT ON CONFLICT)"
        if verb == "UPDATE" and "completed_at" in sql:
            return "guard complete (UPDATE)"
        return f"guard other {verb}"  # e.g. a heartbeat's lease renewal
    if "bench_rows" in sql:
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
        "PostgreSQL": f"{row[0] if row else 'unknown'} (rig: fsync=off, synchronous_commit=off)",
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
    runs: dict[str, list[float]],
    cpu: dict[str, list[dict[str, float]]],
    trips: dict[str, dict[str, float]],
    info: dict[str, str],
    command: str,
    wall: float,
) -> str:
    rate = {name: args.tasks / statistics.median(seconds) for name, seconds in runs.items()}
    ratio = {guarded: rate[guarded] / rate[plain] for plain, guarded in PAIRS}
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        heading_for(args.concurrency),
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
        "| Variant | Tasks | Seconds | Tasks/s | Guarded/plain | All runs (tasks/s) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in VARIANTS:
        seconds = statistics.median(runs[name])
        every = ", ".join(f"{args.tasks / s:.0f}" for s in runs[name])
        shown = f"{ratio[name]:.2f}" if name in ratio else "baseline"
        out.append(
            f"| {name} | {args.tasks} | {seconds:.2f} | {rate[name]:.0f} | {shown} | {every} |"
        )
    out += render_cpu(cpu)
    # The eager timing first, then client counters, then what the server saw.
    kinds = sorted(
        {kind for counts in trips.values() for kind in counts},
        key=lambda kind: (not kind.startswith("eager"), kind),
    )
    out += [
        "",
        "### Statements per happy-path task",
        "",
        "Measured in-process with eager `task.apply()` against the same PostgreSQL (no broker, "
        "no worker), 500 tasks per variant after 20 warm-up tasks. *eager µs/task*: wall time "
        "per task. *client*: SQLAlchemy `before_cursor_execute` events on the celery_guard and "
        "the plain engine, split into celery_guard's own statements and the task's (`user`), "
        "and `commit` events. *server*: statements PostgreSQL logged (`log_statement = 'all'`, "
        "a second pass), which include the `BEGIN` psycopg sends before the first statement of "
        "a transaction; each one is a network round trip.",
        "",
        "| Counter | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---:|" * len(VARIANTS),
    ]
    for kind in kinds:
        shown = "{:.0f}" if kind.startswith("eager") else "{:g}"
        cells = " | ".join(shown.format(trips[name].get(kind, 0)) for name in VARIANTS)
        out.append(f"| {kind} | {cells} |")
    total = {
        name: sum(v for k, v in trips[name].items() if k.startswith("server:")) for name in VARIANTS
    }
    extra = {guarded: total[guarded] - total[plain] for plain, guarded in PAIRS}
    out += [
        "| **server: round trips** | " + " | ".join(f"{total[n]:g}" for n in VARIANTS) + " |",
        "| **server: round trips added by the guard** | "
        + " | ".join(f"{extra[n]:g}" if n in extra else "" for n in VARIANTS)
        + " |",
    ]
    own = max(
        sum(v for k, v in trips[name].items() if k.startswith("client: guard")) for name in extra
    )
    out += [
        "",
        "The project's targets: celery_guard's own statements per guarded task "
        f"{own:g} (target at most 2: {'met' if own <= 2 else 'NOT met'}); guarded/plain "
        f"throughput on the insert task {ratio['guarded_insert']:.2f} (target at least 0.8: "
        f"{'met' if ratio['guarded_insert'] >= 0.8 else 'NOT met'}).",
        "",
        "### Machine and versions",
        "",
    ]
    out += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(out) + "\n"


def render_cpu(cpu: dict[str, list[dict[str, float]]]) -> list[str]:
    """Where the CPU went, per task, by process (median over the runs)."""
    if not all(cpu.values()):
        return []
    parts = list(PART_TITLES)
    out = [
        "",
        "### Where the CPU goes",
        "",
        "CPU time (user + system, from /proc) per task while the middle 80% of each run's "
        "messages were processed, median over the runs, in µs. Every part shares the same "
        "cores: *whole machine* is all CPUs' busy time (/proc/stat), so it also holds the "
        "benchmark's own polling and anything else running. A plain task's worker main "
        "process (kombu reading, acknowledging, dispatching to the pool) is its bottleneck; "
        "a guarded task adds the claim and the completion in the pool process and in "
        "PostgreSQL, on the same cores.",
        "",
        "| Variant | " + " | ".join(PART_TITLES[part] for part in parts) + " |",
        "|---|" + "---:|" * len(parts),
    ]
    medians = {
        name: {part: statistics.median(run[part] for run in runs) for part in parts}
        for name, runs in cpu.items()
    }
    for name in VARIANTS:
        out.append(
            f"| {name} | " + " | ".join(f"{medians[name][part]:.0f}" for part in parts) + " |"
        )
    for plain, guarded in PAIRS:
        added = " | ".join(
            f"{medians[guarded][part] - medians[plain][part]:+.0f}" for part in parts
        )
        out.append(f"| *{guarded} minus {plain}* | {added} |")
    return out


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
