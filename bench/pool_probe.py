"""Measures a pool process from inside: its CPU and Python calls per task (bench/pool_cost.py).

Imported by a benchmark worker through ``celery worker --include bench.pool_probe`` (before the
pool forks). In each pool process it counts finished tasks (``task_postrun``); at the
``BENCH_PROBE_FROM``-th it notes the main thread's CPU time (``time.thread_time``: this
thread alone, so the heartbeat and watchdog threads are left out, as are other processes on
the same cores), and at the ``BENCH_PROBE_TO``-th it pushes one JSON row per process to the
bench Redis list :data:`ROWS_KEY`: ``pid``, ``tasks`` (the window), ``cpu_us`` (per task),
``user_us`` and ``system_us`` (the same thread's user and kernel time per task, from
``/proc/thread-self/stat``, in clock ticks: coarse, fine over a window of seconds) and,
with ``BENCH_PROBE_CALLS=1``, ``calls`` (Python function calls per task: cProfile runs over
the window, timed by thread CPU; its own cost inflates ``cpu_us`` then, the call count is
exact). With ``BENCH_PROBE_DUMP`` set to a directory too, each process also writes its
profile there as ``<pid>.pstats``, for ``python -m pstats`` or bench/pool_cost.py's
``--top``.

Throughput on a small shared machine moves by a third between runs; the CPU one process's
main thread spends per task moves far less, and a function-call count not at all.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import time
from typing import Any

from celery import signals

ROWS_KEY = "bench:probe"

_FROM = int(os.environ.get("BENCH_PROBE_FROM", "500"))
_TO = int(os.environ.get("BENCH_PROBE_TO", "2500"))
_CALLS = os.environ.get("BENCH_PROBE_CALLS") == "1"
_DUMP = os.environ.get("BENCH_PROBE_DUMP", "")
_HZ = os.sysconf("SC_CLK_TCK")


def _user_system() -> tuple[float, float]:
    """This thread's user and system CPU seconds (Linux)."""
    with open("/proc/thread-self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _HZ, int(fields[12]) / _HZ


class _Window:
    """This process's count and the readings taken at the window's start."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.done = 0
        self.cpu_at_start = 0.0
        self.user_system_at_start = (0.0, 0.0)
        self.profile: cProfile.Profile | None = None


_window: _Window | None = None


@signals.task_postrun.connect
def _count(**_: Any) -> None:
    global _window
    window = _window
    if window is None or window.pid != os.getpid():  # first task of this pool process
        window = _window = _Window()
    window.done += 1
    if window.done == _FROM:
        if _CALLS:
            window.profile = cProfile.Profile(time.thread_time)
            window.profile.enable()
        window.cpu_at_start = time.thread_time()
        window.user_system_at_start = _user_system()
    elif window.done == _TO:
        cpu = time.thread_time() - window.cpu_at_start
        user, system = _user_system()
        tasks = _TO - _FROM
        row: dict[str, Any] = {
            "pid": window.pid,
            "tasks": tasks,
            "cpu_us": cpu / tasks * 1e6,
            "user_us": (user - window.user_system_at_start[0]) / tasks * 1e6,
            "system_us": (system - window.user_system_at_start[1]) / tasks * 1e6,
        }
        if window.profile is not None:
            window.profile.disable()
            stats = pstats.Stats(window.profile)
            calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
            row["calls"] = calls / tasks
            if _DUMP:
                stats.dump_stats(os.path.join(_DUMP, f"{window.pid}.pstats"))
        # Imported here: bench/pool_cost.py imports this module before it has configured the
        # app through the environment (the worker imported the app long before).
        from bench.overhead_app import counter

        counter().rpush(ROWS_KEY, json.dumps(row))
