"""What a task costs a real worker's pool process, GuardedTask beside the floor, from inside.

Run from the repository root::

    .venv/bin/python bench/pool_cost.py --output docs/benchmarks.md

bench/overhead.py's throughput ratios scatter by up to a third between runs on a small shared
machine, and its /proc CPU per process by as much. This reads two steadier figures, in the
same real prefork worker (concurrency 2, prefetch 4) draining the same pre-filled queue of a
bench/overhead_app.py task, against a private PostgreSQL (``--settings durable``, the
default, as production runs it) and Redis: each pool process measures itself
(bench/pool_probe.py, loaded with ``celery worker --include``) over its tasks
``--from`` to ``--to``, so start-up and the drain's tail are left out:

- **CPU per task** of the pool process's main thread (``time.thread_time``): the task's own
  work, Celery's in the pool included, without the other processes and threads that share
  the cores. The median and the least of ``--rounds`` interleaved rounds, one worker per task
  and round: a slow phase of the machine (steal time) inflates a round by up to half.
- **Python function calls per task** (``--calls``, one more round under cProfile, whose own
  cost is left out of the CPU figures): deterministic, so a change of a few calls shows.

Tasks: the floor (bench/floor.py) and GuardedTask with defaults, on the no-op and the credit
task. Ratios are GuardedTask's to the floor's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pstats
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import sqlalchemy  # noqa: E402
from sqlalchemy import create_engine  # noqa: E402

from bench.cpu import steal_ticks, stolen_share  # noqa: E402
from bench.overhead import publish_section, reset_database, settings_phrase  # noqa: E402
from bench.pool_probe import ROWS_KEY  # noqa: E402
from celery_guard import get_runtime  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Pool cost (bench/pool_cost.py)"
KINDS = ("noop", "credit")
VARIANTS = ("floor", "guarded")
CONCURRENCY = 2
#: Seconds a worker may take to drain its queue before the run is called failed.
RUN_TIMEOUT = 600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="first", type=int, default=500, help="window start (500)")
    parser.add_argument("--to", dest="last", type=int, default=2500, help="window end (2500)")
    parser.add_argument("--rounds", type=int, default=3, help="CPU rounds; median (3)")
    parser.add_argument("--calls", action="store_true", help="add a cProfile round for calls")
    parser.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="with --calls: write each pool process's profile to DIR/<task>/<pid>.pstats",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=0,
        help="with --dump: print the N functions with the most calls per task above the floor",
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"tasks to run, of {','.join(KINDS)}"
    )
    parser.add_argument("--settings", choices=("durable", "fast"), default="durable")
    parser.add_argument(
        "--guard-conf",
        default="",
        help="celery_guard settings for the workers, as JSON ('{\"guard_metrics_port\": null}')",
    )
    parser.add_argument("--output", type=Path, default=None, help="markdown file to write to")
    args = parser.parse_args()
    if not 0 < args.first < args.last:
        parser.error("--from must be above 0 and below --to")
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {','.join(KINDS)}")
    if args.dump is not None and not args.calls:
        parser.error("--dump needs --calls")
    if args.top and args.dump is None:
        parser.error("--top needs --dump")
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    load, started = os.getloadavg(), time.monotonic()
    # Each pool process must finish --to tasks; prefetching can give one more than its share.
    tasks = int(CONCURRENCY * args.last * 1.2)
    cpu: dict[tuple[str, str], list[float]] = {}
    system: dict[tuple[str, str], list[float]] = {}
    calls: dict[tuple[str, str], float] = {}
    steal: dict[tuple[str, str], list[float]] = {}
    with PostgresServer(durable=args.settings == "durable") as postgres, RedisServer() as redis:
        env = {
            "BENCH_BROKER_URL": redis.url_for(0),
            "BENCH_REDIS_URL": redis.url_for(1),
            "BENCH_STORE_URL": postgres.url,
            "BENCH_GUARD_CONF": args.guard_conf,
            "BENCH_PROBE_FROM": str(args.first),
            "BENCH_PROBE_TO": str(args.last),
        }
        os.environ.update(env)
        bench = importlib.import_module("bench.overhead_app")
        bench.metadata.create_all(create_engine(postgres.url, poolclass=sqlalchemy.NullPool))
        get_runtime(bench.app).migrate()
        get_runtime(bench.app).store.dispose()
        rounds = [False] * args.rounds + ([True] if args.calls else [])
        for profiled in rounds:  # interleaved, so drift hits every variant alike
            for kind in kinds:
                for variant in VARIANTS:
                    name = f"{variant}_{kind}"
                    dump = None
                    if profiled and args.dump is not None:
                        dump = args.dump / name
                        dump.mkdir(parents=True, exist_ok=True)
                    rows, stolen = run(
                        bench, postgres, redis, env, f"bench.{name}", tasks, profiled, dump
                    )
                    if profiled:
                        calls[kind, variant] = statistics.fmean(row["calls"] for row in rows)
                        print(f"{variant}_{kind:7s} calls {calls[kind, variant]:7.0f}/task")
                    else:
                        per_task = statistics.fmean(row["cpu_us"] for row in rows)
                        kernel = statistics.fmean(row["system_us"] for row in rows)
                        cpu.setdefault((kind, variant), []).append(per_task)
                        system.setdefault((kind, variant), []).append(kernel)
                        steal.setdefault((kind, variant), []).append(stolen)
                        print(
                            f"{variant}_{kind:7s} pool CPU {per_task:7.0f} µs/task "
                            f"(system {kernel:5.0f}; {stolen:.0%} of the machine stolen)",
                            flush=True,
                        )
    if args.top:
        for kind in kinds:
            print_top(args.dump, kind, args.last - args.first, args.top)
    if not cpu:  # --rounds 0: the calls (and dumps) were all that was asked for
        return
    section = render(
        args, kinds, command, cpu, system, steal, calls, load, time.monotonic() - started
    )
    publish_section(args.output, section, HEADING)


def run(
    bench: Any,
    postgres: PostgresServer,
    redis: RedisServer,
    env: dict[str, str],
    task_name: str,
    tasks: int,
    profiled: bool,
    dump: Path | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """One worker drains ``tasks`` messages of ``task_name``: the pool processes' probe rows,
    and the share of the machine's time stolen by the hypervisor meanwhile."""
    reset_database(postgres.url)
    for db in (0, 1):
        with redis.client(db) as client:
            client.flushdb()
    task = bench.app.tasks[task_name]
    with bench.app.producer_or_acquire() as producer:
        for row_id in range(tasks):
            task.apply_async((row_id,), queue="pool_cost", producer=producer)
    worker = WorkerProcess(
        bench.__name__,
        env={
            **env,
            "BENCH_PROBE_CALLS": "1" if profiled else "",
            "BENCH_PROBE_DUMP": "" if dump is None else str(dump.resolve()),
        },
        cwd=ROOT,
        concurrency=CONCURRENCY,
        queues="pool_cost",
        loglevel="WARNING",
        extra_args=["--include", "bench.pool_probe"],
    )
    stolen_from = steal_ticks()
    try:
        worker.start(wait_ready=False)
        with redis.client(1) as client:

            def reported() -> bool:
                if worker.returncode is not None:
                    raise RuntimeError(f"the {task_name} worker exited ({worker.returncode})")
                if int(client.llen(ROWS_KEY)) >= CONCURRENCY:
                    return True
                if int(client.get(bench.DONE_KEY) or 0) >= tasks:
                    raise RuntimeError(
                        f"{task_name}: the queue drained before every pool process reached its "
                        "window's end (one took most of the tasks): lower --to"
                    )
                return False

            procs.wait_until(reported, RUN_TIMEOUT, f"{task_name}'s pool processes to report")
            rows = [json.loads(row) for row in client.lrange(ROWS_KEY, 0, -1)]
            return rows, stolen_share(stolen_from, steal_ticks())
    finally:
        worker.cleanup()


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def calls_by_function(directory: Path, tasks: int) -> dict[str, float]:
    """Calls per task of each function, over the profiles one worker's processes dumped."""
    totals: dict[str, float] = {}
    profiles = sorted(directory.glob("*.pstats"))
    for path in profiles:
        for (filename, line, function), entry in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
            # A built-in's name carries its object's address, which differs between workers.
            where = (
                f"{Path(filename).name}:{line}({function})" if line else _ADDRESS.sub("", function)
            )
            totals[where] = totals.get(where, 0.0) + entry[1]
    return {where: count / (tasks * len(profiles)) for where, count in totals.items()}


def print_top(directory: Path, kind: str, tasks: int, top: int) -> None:
    """The functions GuardedTask calls most often per task more than the floor does."""
    floor = calls_by_function(directory / f"floor_{kind}", tasks)
    guarded = calls_by_function(directory / f"guarded_{kind}", tasks)
    above = sorted(
        ((count - floor.get(where, 0.0), count, where) for where, count in guarded.items()),
        reverse=True,
    )
    print(f"{kind}: calls per task, GuardedTask above the floor (GuardedTask's own count)")
    for extra, count, where in above[:top]:
        print(f"  {extra:+7.1f} {count:7.1f}  {where}")


def render(
    args: argparse.Namespace,
    kinds: tuple[str, ...],
    command: str,
    cpu: dict[tuple[str, str], list[float]],
    system: dict[tuple[str, str], list[float]],
    steal: dict[tuple[str, str], list[float]],
    calls: dict[tuple[str, str], float],
    load: tuple[float, ...],
    wall: float,
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        HEADING,
        "",
        f"Measured {when} with `{command}` (total wall time {wall:.0f} s, load average at "
        f"start {load[0]:.2f}), PostgreSQL with {settings_phrase(args.settings)}.",
        "",
        f"One prefork worker (concurrency {CONCURRENCY}) per task and round drains a queue "
        "filled beforehand; each pool process measures its own main thread's CPU "
        f"(`time.thread_time`) over its tasks {args.first} to {args.last} "
        "(bench/pool_probe.py). Median of the rounds' means over the pool processes, and the "
        "least round (the machine's noise only ever adds CPU); *all rounds* lists them. "
        "*Of it, system*: the kernel's share of the same thread's time (median; from "
        "/proc, in clock ticks). *Calls/task*: Python function calls per task over the same "
        "window, from one more round under cProfile (deterministic; blank without `--calls`). "
        "*All rounds*: each round's CPU, and in brackets the share of the machine's time the "
        "hypervisor stole during it (/proc/stat): the neighbours' load, which inflates a round.",
        "",
        "| Task | Variant | Pool CPU µs/task | Of it, system | To floor | Least round | To floor "
        "| Calls/task | Calls above floor | All rounds (µs) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind in kinds:
        floor_cpu = statistics.median(cpu[kind, "floor"])
        floor_least = min(cpu[kind, "floor"])
        for variant in VARIANTS:
            median = statistics.median(cpu[kind, variant])
            least = min(cpu[kind, variant])
            count = calls.get((kind, variant))
            above = None if count is None else count - calls[kind, "floor"]
            lines.append(
                f"| {kind} | {variant} | {median:.0f} | "
                f"{statistics.median(system[kind, variant]):.0f} | {median / floor_cpu:.2f} | "
                f"{least:.0f} | {least / floor_least:.2f} | "
                + ("" if count is None else f"{count:.0f}")
                + " | "
                + ("" if above is None or variant == "floor" else f"+{above:.0f}")
                + " | "
                + ", ".join(
                    f"{value:.0f} ({stolen:.0%})"
                    for value, stolen in zip(cpu[kind, variant], steal[kind, variant], strict=True)
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
