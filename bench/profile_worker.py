"""Where a real worker's pool processes spend their time on one benchmark task (py-spy).

Starts a private PostgreSQL (durable or fast, as bench/overhead.py does) and Redis, publishes
``--tasks`` messages of one bench/overhead_app.py task, starts one prefork worker and samples
each pool process with ``py-spy record --gil --format raw`` for ``--seconds`` while it drains.
Prints the functions with the largest inclusive and exclusive shares of the samples taken
while a task ran, summed over the pool processes, and writes the collapsed stacks to
``--output`` (for a flame graph). Run by hand, not by ``make bench``.

    .venv/bin/python bench/profile_worker.py --task bench.guarded_credit --tasks 6000

py-spy comes with the bench extra (``make bench`` installs it). Sampling with ``--nonblocking``
does not pause the process, so the rate barely changes what it measures. With ``--gil`` (the
default) only moments when a thread holds the GIL are sampled: Python's own CPU, not the waits
for the database (``--all-samples`` counts those too).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import sqlalchemy  # noqa: E402
from sqlalchemy import create_engine  # noqa: E402

from bench.overhead import reset_database  # noqa: E402
from celery_guard import get_runtime  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="bench.guarded_credit", help="a bench/overhead_app task")
    parser.add_argument("--tasks", type=int, default=6000, help="messages published (6000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="py-spy duration (10)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--settings", choices=("durable", "fast"), default="durable")
    parser.add_argument("--conf", default="", help="BENCH_GUARD_CONF for the worker (JSON)")
    parser.add_argument("--top", type=int, default=30, help="rows per table (30)")
    parser.add_argument("--output", default=None, help="where to write the collapsed stacks")
    parser.add_argument(
        "--main",
        action="store_true",
        help="sample the worker's main process (every thread) instead of its pool processes",
    )
    parser.add_argument(
        "--all-samples",
        action="store_true",
        help="sample every moment, not only while the process holds the GIL (py-spy --gil)",
    )
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is missing: .venv/bin/pip install py-spy (the bench extra)")

    durable = args.settings == "durable"
    with PostgresServer(durable=durable) as postgres, RedisServer() as redis_server:
        env = {
            "BENCH_BROKER_URL": redis_server.url_for(0),
            "BENCH_REDIS_URL": redis_server.url_for(1),
            "BENCH_STORE_URL": postgres.url,
            "BENCH_GUARD_CONF": args.conf,
        }
        os.environ.update(env)
        bench = importlib.import_module("bench.overhead_app")
        bench.metadata.create_all(create_engine(postgres.url, poolclass=sqlalchemy.NullPool))
        get_runtime(bench.app).migrate()
        get_runtime(bench.app).store.dispose()
        reset_database(postgres.url)
        task = bench.app.tasks[args.task]
        with bench.app.producer_or_acquire() as producer:
            for row_id in range(args.tasks):
                task.apply_async((row_id,), queue="profile", producer=producer)

        worker = WorkerProcess(
            bench.__name__,
            env=env,
            cwd=ROOT,
            concurrency=args.concurrency,
            queues="profile",
            loglevel="WARNING",
        )
        out_dir = Path(tempfile.mkdtemp(prefix="profile-worker-"))
        try:
            worker.start(wait_ready=False)
            procs.wait_until(
                lambda: len(worker.child_pids()) >= args.concurrency, 60, "pool processes"
            )
            spies = [
                subprocess.Popen(
                    [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200"]
                    + ["--nonblocking", "--duration", str(int(args.seconds))]
                    + (["--idle"] if args.all_samples else ["--gil"])
                    + ["--output", str(out_dir / f"{pid}.txt")],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for pid in ([worker.pid] if args.main else worker.child_pids())
            ]
            for spy in spies:
                spy.wait(timeout=args.seconds + 60)
            with redis_server.client(1) as counter:
                done = int(counter.get(bench.DONE_KEY) or 0)
        finally:
            worker.cleanup()

    stacks: collections.Counter[str] = collections.Counter()
    for path in out_dir.glob("*.txt"):
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack:
                stacks[stack] += int(count)
    shutil.rmtree(out_dir, ignore_errors=True)
    if args.output:
        Path(args.output).write_text(
            "".join(f"{stack} {count}\n" for stack, count in stacks.most_common())
        )
    title = f"{args.task}, {done} tasks done, {args.settings} server"
    report(stacks, args.top, title, frame=None if args.main else TASK_FRAME)


#: The pool process's frame that runs one task: shares are of the samples below it.
TASK_FRAME = "build_tracer.<locals>.trace_task (trace.py)"


def report(
    stacks: collections.Counter[str], top: int, title: str, frame: str | None = TASK_FRAME
) -> None:
    """Inclusive (a function anywhere on the stack) and exclusive (the leaf) shares of the
    samples taken below ``frame``: by default while a task ran (below Celery's
    ``trace_task``; the pool's own loop, the result handling and the heartbeat thread are the
    rest); ``None``: every sample (the main process, all its threads)."""
    in_task = {
        stack: count
        for stack, count in stacks.items()
        if frame is None or any(_short(each) == frame for each in stack.split(";"))
    }
    print(
        f"# {title}: {sum(stacks.values())} samples, "
        f"{sum(in_task.values())} of them in {frame or 'any frame'}"
    )
    stacks = collections.Counter(in_task)
    total = sum(stacks.values()) or 1
    inclusive: collections.Counter[str] = collections.Counter()
    exclusive: collections.Counter[str] = collections.Counter()
    for stack, count in stacks.items():
        frames = [_short(each) for each in stack.split(";")]
        if frame is not None:
            frames = frames[frames.index(frame) :]
        for name in set(frames):
            inclusive[name] += count
        exclusive[frames[-1]] += count
    for name, table in (("inclusive", inclusive), ("exclusive", exclusive)):
        print(f"\n| {name} | share |\n|---|---:|")
        for name, count in table.most_common(top):
            print(f"| `{name}` | {100 * count / total:.1f}% |")


def _short(frame: str) -> str:
    """``function (path/to/module.py:line)`` as ``function (module.py)``: lines differ per
    sample."""
    name, _, where = frame.partition(" (")
    module = where.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({module})" if module else name


if __name__ == "__main__":
    main()
