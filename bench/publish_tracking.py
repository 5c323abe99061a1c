"""What publish tracking (``guard_track_publishes``) costs a producer: time per publish.

Run from the repository root (``make bench`` runs it too)::

    .venv/bin/python bench/publish_tracking.py --publishes 2000 --output docs/benchmarks.md

A private Redis (the broker) and a private PostgreSQL (the store) come from the test rig. A
producer app of ``tests/apps/shop.py``'s tasks publishes ``--publishes`` ``shop.record``
messages with ``apply_async`` (each on a fresh key, one Redis connection reused), with tracking
off, then on with the PostgreSQL store, then on with a SQLite file store; interleaved over
``--repeats`` runs, the median is reported. Tracking adds one autocommitted ``INSERT ... ON
CONFLICT DO NOTHING`` per publish, made before the message is sent; nothing else changes on
the producer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import celery_guard  # noqa: E402
from bench.overhead import machine_info, write_section  # noqa: E402
from tests.apps.shop_producer import producer_app  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402

HEADING = "## Publish tracking (bench/publish_tracking.py)"
VARIANTS = ("untracked", "tracked_postgresql", "tracked_sqlite")


def publish_seconds(variant: str, count: int, broker: str, stores: dict[str, str]) -> float:
    """Seconds to publish ``count`` guarded messages (the store's first use excluded)."""
    store = stores["sqlite" if variant == "tracked_sqlite" else "postgresql"]
    app = producer_app(broker, store, guard_track_publishes=variant != "untracked")
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    task = app.tasks["shop.record"]
    try:
        with app.producer_or_acquire() as producer:
            task.apply_async(("warm-up",), queue=queue, producer=producer)  # connect, tables
            prefix = uuid.uuid4().hex[:8]
            started = time.perf_counter()
            for n in range(count):
                task.apply_async((f"{prefix}-{n}",), queue=queue, producer=producer)
            return time.perf_counter() - started
    finally:
        celery_guard.get_runtime(app).store.dispose()
        app.close()


def render(
    args: argparse.Namespace,
    runs: dict[str, list[float]],
    info: dict[str, str],
    command: str,
) -> str:
    per = {name: statistics.median(values) / args.publishes for name, values in runs.items()}
    base = per["untracked"]
    rows = [
        f"| {name.replace('_', ', ')} | {1e6 * seconds:.0f} | {1 / seconds:.0f} | "
        + ("" if name == "untracked" else f"+{1e6 * (seconds - base):.0f}")
        + " |"
        for name, seconds in per.items()
    ]
    return "\n".join(
        [
            HEADING,
            "",
            f"Measured with `{command}`. {args.publishes} `shop.record` publishes per run "
            f"(`apply_async`, one reused broker connection), median of {args.repeats} "
            "interleaved runs. Tracking adds one autocommitted INSERT per publish, before the "
            "message is sent. The rig's PostgreSQL runs with fsync and synchronous_commit off; "
            "on a durable server each INSERT also waits for its WAL flush.",
            "",
            "| Producer | µs per publish | publishes/s | added by tracking, µs |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            "### Machine and versions",
            "",
            *[f"- {name}: {value}" for name, value in info.items()],
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--publishes", type=int, default=2000, help="per run (2000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant; median (3)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true", help="print, do not write --output")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    load_at_start = os.getloadavg()
    postgres, redis_server = PostgresServer(), RedisServer()
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        try:
            postgres.start()
            redis_server.start()
            stores = {
                "postgresql": postgres.create_database(f"tracking_{uuid.uuid4().hex[:8]}"),
                "sqlite": f"sqlite:///{tmp}/store.sqlite3",
            }
            runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for repeat in range(args.repeats):  # interleaved, so drift hits every variant alike
                for name in VARIANTS:
                    seconds = publish_seconds(name, args.publishes, redis_server.url, stores)
                    runs[name].append(seconds)
                    rate = args.publishes / seconds
                    print(f"run {repeat + 1}/{args.repeats} {name:20s} {rate:8.0f}/s", flush=True)
            info = machine_info(postgres, redis_server, load_at_start)
        finally:
            redis_server.stop()
            postgres.stop()
    section = render(args, runs, info, command)
    print("\n" + section)
    if not args.no_write:
        write_section(args.output, section, HEADING)
        print(f"written to {args.output}")


if __name__ == "__main__":
    main()
