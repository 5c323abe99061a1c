"""Machine instructions per task, GuardedTask beside the floor and plain Celery (callgrind).

Run from the repository root (valgrind from Debian: ``apt-get install valgrind``)::

    .venv/bin/python bench/instructions.py --output docs/benchmarks.md

bench/overhead.py's throughput ratios and bench/pool_cost.py's CPU per task move by several
percent between sittings on a shared machine (steal time, frequency, neighbours), which is
as large as any one cut left on the hot path. This counts what does not move: the
instructions a process executes per task, under valgrind's callgrind, with string hashing
fixed (``PYTHONHASHSEED=0``), so a change of a few thousand instructions shows and the same
tree gives the same figure run after run.

Each task runs in a pool process made as a prefork worker makes one: ``worker_init`` sent in
its parent (celery_guard's metrics recorders, connection budget, renewal relay and liveness
lock), then a fork, Celery's stack protection (as the worker's ``setup_worker_optimizations``
installs it) and ``worker_process_init`` in the child; the key in the message's headers, as
``apply_async`` stamps it; ``task.apply()`` then traces it (Celery's ``build_tracer``)
against a private PostgreSQL and Redis. Only the pool process's instructions count. Two runs
per task and variant, of ``--low`` and ``--high`` tasks after the same warm-up, and the
difference divided by the tasks between: the interpreter's start-up, the imports and the
first connections cancel out.

What it does not count: the worker's main process (Redis and the message's decoding, the same
for every variant), the kernel, PostgreSQL and Redis, and time spent waiting. Instructions
are not time (no cache misses, no waits): read the ratio with bench/pool_cost.py's CPU. The
server's durability changes only waits, so the fast server serves (``--settings``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

HEADING = "## Instructions per task (bench/instructions.py)"
KINDS = ("noop", "credit")
VARIANTS = ("plain", "floor", "guarded")
WARM_UP = 30
#: Seconds one run under valgrind may take (about fifty times slower than without).
RUN_TIMEOUT = 900.0

T = TypeVar("T")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--low", type=int, default=20, help="tasks in the short run (20)")
    parser.add_argument("--high", type=int, default=120, help="tasks in the long run (120)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--settings", choices=("durable", "fast"), default="fast")
    parser.add_argument(
        "--guard-conf",
        default="",
        help="celery_guard settings for the runs, as JSON ('{\"guard_lease_ttl\": 600}')",
    )
    parser.add_argument("--output", type=Path, default=None, help="markdown file to write to")
    parser.add_argument(
        "--child", nargs=3, metavar=("TASK", "TASKS", "FIRST_ROW"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        name, tasks, first_row = args.child
        start_worker()
        in_pool_process(lambda: run_tasks(name, int(tasks), int(first_row)))
        return
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    variants = tuple(variant for variant in args.variants.split(",") if variant)
    if not kinds or set(kinds) - set(KINDS) or not variants or set(variants) - set(VARIANTS):
        parser.error("unknown --kinds or --variants")
    if not 0 < args.low < args.high:
        parser.error("--low must be above 0 and below --high")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is missing: apt-get install valgrind")
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    started = time.monotonic()
    counts = measure(
        kinds, variants, args.low, args.high, args.settings == "durable", args.guard_conf
    )
    section = render(counts, kinds, variants, args, command, time.monotonic() - started)

    from bench.overhead import publish_section

    publish_section(args.output, section, HEADING)


def measure(
    kinds: tuple[str, ...],
    variants: tuple[str, ...],
    low: int,
    high: int,
    durable: bool,
    guard_conf: str = "",
) -> dict[tuple[str, str], float]:
    """Instructions per task by (kind, variant)."""
    import sqlalchemy
    from sqlalchemy import create_engine

    from celery_guard import get_runtime
    from tests.rig.servers import PostgresServer, RedisServer

    counts: dict[tuple[str, str], float] = {}
    with PostgresServer(durable=durable) as postgres, RedisServer() as redis:
        env = {
            **os.environ,
            "BENCH_BROKER_URL": redis.url_for(0),
            "BENCH_REDIS_URL": redis.url_for(1),
            "BENCH_STORE_URL": postgres.url,
            "BENCH_GUARD_CONF": guard_conf,
            "PYTHONHASHSEED": "0",
        }
        os.environ.update(env)
        import bench.overhead_app as bench

        bench.metadata.create_all(create_engine(postgres.url, poolclass=sqlalchemy.NullPool))
        get_runtime(bench.app).migrate()
        get_runtime(bench.app).store.dispose()
        # Every run gets rows of its own, with as many digits as the others' (the stored
        # message and the key are as long in every run).
        first_row = 10_000_000
        for kind in kinds:
            for variant in variants:
                name = f"bench.{variant}_{kind}"
                runs = []
                for tasks in (low, high):
                    runs.append(instructions(name, tasks, first_row, env))
                    first_row += 100_000
                counts[kind, variant] = (runs[1] - runs[0]) / (high - low)
                print(f"{variant}_{kind:7s} {counts[kind, variant] / 1000:9.1f} k/task", flush=True)
    return counts


def instructions(name: str, tasks: int, first_row: int, env: dict[str, str]) -> int:
    """Instructions one child process executes to run ``tasks`` tasks (after the warm-up)."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    argv += [sys.executable, str(Path(__file__).resolve()), "--child", name, str(tasks)]
    argv.append(str(first_row))
    done = subprocess.run(
        argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    # The pool process's count, not its parent's (each process valgrind follows reports one).
    pool = re.search(r"^pool process (\d+)$", done.stdout, re.MULTILINE)
    found = pool and re.search(rf"^=={pool.group(1)}== Collected : (\d+)", done.stderr, re.M)
    if done.returncode != 0 or not found:
        raise SystemExit(
            f"{name} under valgrind failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return int(found.group(1))


class _PreforkWorker:
    """What ``worker_init``'s receivers read of Celery's ``WorkController``: a prefork worker
    of ``app`` (its pool class decides celery_guard's connection budget and renewal relay)."""

    def __init__(self, app: Any) -> None:
        from celery.concurrency.prefork import TaskPool

        self.app = app
        self.hostname = "bench@instructions"
        self.pool_cls = TaskPool


def start_worker() -> None:
    """What a prefork worker's main process does before its pool forks: ``worker_init``
    (celery_guard's metrics recorders, the connection budget and the renewal relay, the
    worker's liveness lock, the circuit's shared block). Once per process, before
    :func:`in_pool_process`."""
    from celery import signals

    import bench.overhead_app as bench

    signals.worker_init.send(sender=_PreforkWorker(bench.app))


def in_pool_process(work: Callable[[], T]) -> T:
    """Run ``work`` in a process forked as a prefork pool process is, after
    :func:`start_worker`: Celery's stack protection (the worker's
    ``setup_worker_optimizations``) and ``worker_process_init`` first. Returns what ``work``
    returned (pickled back through a pipe); raises ``SystemExit`` if the process failed.

    A task run in the benchmark's own process instead missed what a worker sets up for its
    pool: the metrics recorders (on by default), the lent connection of a body's transaction,
    the worker's liveness lock read from shared memory.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the pool process
        os.close(read_end)
        code = 1
        try:
            from celery import signals
            from celery.app.trace import _install_stack_protection

            print(f"pool process {os.getpid()}", flush=True)
            _install_stack_protection()
            signals.worker_process_init.send(sender=None)
            answer = pickle.dumps(work())
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(answer)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # nothing of the parent's (servers, atexit) is the child's to end
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the pool process {pid} failed (status {status})")
    return cast(T, pickle.loads(answer))


def run_tasks(name: str, tasks: int, first_row: int, *, warm_up: int = WARM_UP) -> None:
    """Run ``warm_up`` and then ``tasks`` tasks as a pool process runs them (in
    :func:`in_pool_process`)."""
    import bench.overhead_app as bench
    from celery_guard import GuardedTask
    from celery_guard.keys import HEADER_KEY, HEADER_KEY_SOURCE, KeySource

    task = bench.app.tasks[name]
    guarded = isinstance(task, GuardedTask)
    # What GuardedTask.apply_async stamps at the producer, formatted here without its binding
    # of the arguments: that is the producer's work, not the pool process's, and counting it
    # charged GuardedTask some 30k instructions a no-op task that no worker pays.
    option = task.idempotency_key if guarded else None
    if guarded and task._key_from_option((first_row,), {}) != option.format(row_id=first_row):
        raise SystemExit(f"{name}: its idempotency_key is not a format of row_id")
    source = KeySource.OPTION.value
    for row_id in range(first_row - warm_up, first_row + tasks):
        # Never None: Celery's Context derives its headers from the whole request when none
        # are given (``Context._get_custom_headers``, ~590 bytecodes), and only the variants
        # without a key header paid it, while a worker's request pays it for every variant.
        headers: dict[str, str] = {}
        if guarded:
            headers = {HEADER_KEY: option.format(row_id=row_id), HEADER_KEY_SOURCE: source}
        result = task.apply((row_id,), headers=headers)
        if result.failed():
            raise SystemExit(f"{name}({row_id}) failed: {result.result!r}")


def render(
    counts: dict[tuple[str, str], float],
    kinds: tuple[str, ...],
    variants: tuple[str, ...],
    args: argparse.Namespace,
    command: str,
    wall: float,
) -> str:
    from bench.overhead import settings_phrase

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        HEADING,
        "",
        f"Measured {when} with `{command}` (total wall time {wall:.0f} s), PostgreSQL with "
        f"{settings_phrase(args.settings)}.",
        "",
        "Instructions the process running the task executes per task (valgrind's callgrind, "
        f"`PYTHONHASHSEED=0`): the difference between a run of {args.high} and one of "
        f"{args.low} tasks after the same {WARM_UP} warm-up tasks, divided by the "
        f"{args.high - args.low} tasks between. In a pool process made as a prefork worker "
        "makes one (`worker_init` sent in its parent, then a fork, Celery's stack protection "
        "and `worker_process_init`), the key in the headers as `apply_async` stamps it, "
        "Celery's tracer; only the pool process counts: not the worker's main process, the "
        "kernel, the servers or any wait. Deterministic: in runs of the same lengths the "
        "same tree gives the same figure to about 0.1% for GuardedTask (no-op 1159.8 and "
        "1160.6, credit 2591.2 and 2594.0 thousand) and 0.4% for the floor (972.5 and "
        "976.2); compare runs of the same lengths.",
        "",
        "| Task | Variant | k instructions/task | To plain | To floor | Above floor (k) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for kind in kinds:
        plain = counts.get((kind, "plain"))
        floor = counts.get((kind, "floor"))
        for variant in variants:
            value = counts[kind, variant]
            to_plain = f"{value / plain:.2f}" if plain else ""
            to_floor = f"{value / floor:.2f}" if floor else ""
            above = f"{(value - floor) / 1000:+.1f}" if floor and variant != "floor" else ""
            lines.append(
                f"| {kind} | {variant} | {value / 1000:.1f} | {to_plain} | {to_floor} | {above} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
