"""Canvas workloads on plain Celery against the same app with every task guarded (``task_cls``).

Run from the repository root (not part of ``make bench`` or CI)::

    .venv/bin/python bench/canvas.py --repeats 3

A private Redis (broker and result backend) and PostgreSQL (celery_guard's store) are started
with the test rig, and one prefork worker per app (``tests/apps/canvas_plain.py`` and
``tests/apps/canvas_guarded.py``, the apps of ``tests/acceptance/test_canvas_dropin.py``), both
running for the whole run. Each workload is timed from ``apply_async()`` to its result, the
variants interleaved per repeat; the median is printed with the guarded/plain ratio of times.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests`` imports when run as a script
    sys.path.insert(0, str(ROOT))

from celery import chain, chord, group  # noqa: E402

import celery_guard  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

Workload = Callable[[Any], Any]


def workloads(width: int, length: int) -> dict[str, tuple[Workload, Any]]:
    """Name -> (build the canvas on an app, its expected result)."""

    def task(app: Any, name: str) -> Any:
        return app.tasks[f"canvas.{name}"]

    return {
        f"chord of {width}": (
            lambda app: chord(
                (task(app, "add").si(i, i) for i in range(width)), task(app, "tsum").s()
            ),
            sum(2 * i for i in range(width)),
        ),
        f"group of {width}": (
            lambda app: group(task(app, "add").si(i, i) for i in range(width)),
            [2 * i for i in range(width)],
        ),
        f"chain of {length}": (
            lambda app: chain(
                task(app, "add").s(0, 1), *(task(app, "add").s(1) for _ in range(length - 1))
            ),
            length,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=200, help="chord and group members")
    parser.add_argument("--length", type=int, default=50, help="chain steps")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    redis_server, postgres = RedisServer(), PostgresServer()
    workers: list[WorkerProcess] = []
    try:
        redis_server.start()
        postgres.start()
        env = {
            "CANVAS_BROKER_URL": redis_server.url_for(0),
            "CANVAS_RESULT_URL": redis_server.url_for(1),
            "CANVAS_STORE_URL": postgres.url,
            "CANVAS_QUEUE_SUFFIX": f"-{uuid.uuid4().hex[:8]}",
        }
        os.environ.update(env)
        apps = {
            name: importlib.import_module(f"tests.apps.canvas_{name}").app
            for name in ("plain", "guarded")
        }
        celery_guard.get_runtime(apps["guarded"]).migrate()
        for name, app in apps.items():
            workers.append(
                WorkerProcess(
                    f"tests.apps.canvas_{name}",
                    env=env,
                    cwd=ROOT,
                    concurrency=args.concurrency,
                    queues=app.conf.task_default_queue,
                )
            )
            workers[-1].start(wait_ready=False)
        for worker in workers:
            worker.wait_ready(timeout=60)
        for app in apps.values():  # warm up: connections, imports, the first claim
            chord(
                [app.tasks["canvas.add"].si(1, 1)], app.tasks["canvas.tsum"].s()
            ).apply_async().get(timeout=60)

        times: dict[tuple[str, str], list[float]] = {}
        for repeat in range(args.repeats):
            for label, (build, expected) in workloads(args.width, args.length).items():
                for name, app in apps.items():
                    started = time.perf_counter()
                    value = build(app).apply_async().get(timeout=300)
                    seconds = time.perf_counter() - started
                    assert value == expected, (label, name, value)
                    times.setdefault((label, name), []).append(seconds)
                    print(f"run {repeat + 1}/{args.repeats} {label:14s} {name:8s} {seconds:6.2f} s")
    finally:
        for worker in workers:
            worker.stop()
        postgres.stop()
        redis_server.stop()

    print(f"\nmedian of {args.repeats}, concurrency {args.concurrency}, load {os.getloadavg()}")
    print(f"{'workload':16s} {'plain':>8s} {'guarded':>8s} {'ratio':>6s}")
    for label in workloads(args.width, args.length):
        plain = statistics.median(times[(label, "plain")])
        guarded = statistics.median(times[(label, "guarded")])
        print(f"{label:16s} {plain:7.2f}s {guarded:7.2f}s {guarded / plain:6.2f}")


if __name__ == "__main__":
    main()
