"""CPU time by process, read from /proc: where a benchmark's tasks spend the machine.

Throughput alone does not say why one variant is slower: on a small machine the worker, its
pool, PostgreSQL and Redis share the same cores. These readings split the CPU seconds a run
used between them (Linux only; user + system time, in clock ticks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_HZ = os.sysconf("SC_CLK_TCK")


def process_seconds(pid: int) -> float:
    """User + system CPU seconds of one live process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _HZ


def command_seconds(name: str) -> float:
    """CPU seconds of every process whose command name contains ``name``, children included.

    A server's exited children (PostgreSQL's backends) are counted through their parent's
    ``cutime``/``cstime``, so the sum does not drop when a client disconnects.
    """
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as comm:
                if name not in comm.read():
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(value) for value in fields[11:15]) / _HZ
    return total


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        values = [int(value) for value in stat.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / _HZ  # idle and iowait


def steal_ticks() -> tuple[int, int]:
    """Clock ticks since boot, summed over the cores: (stolen, all) (/proc/stat).

    Steal is time a virtual machine's cores were ready to run but the hypervisor ran someone
    else: the share of it over a run says how much the machine's neighbours slowed it.
    """
    with open("/proc/stat") as stat:
        values = [int(value) for value in stat.readline().split()[1:]]
    return values[7], sum(values[:8])  # steal; user..steal (guest time is inside user)


def stolen_share(start: tuple[int, int], end: tuple[int, int]) -> float:
    """The share of the cores' time stolen between two :func:`steal_ticks` readings."""
    total = end[1] - start[1]
    return (end[0] - start[0]) / total if total > 0 else 0.0


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU seconds at one moment, by part of the benchmark."""

    worker_main: float
    pool: float
    postgres: float
    redis: float
    machine: float

    @classmethod
    def take(cls, worker_pid: int, pool_pids: list[int]) -> CpuSnapshot:
        return cls(
            worker_main=process_seconds(worker_pid),
            pool=sum(process_seconds(pid) for pid in pool_pids),
            postgres=command_seconds("postgres"),
            redis=command_seconds("redis-server"),
            machine=machine_busy_seconds(),
        )

    def per_task_micros(self, later: CpuSnapshot, tasks: int) -> dict[str, float]:
        """µs of CPU per task between this snapshot and ``later``, by part."""
        return {
            part: (getattr(later, part) - getattr(self, part)) / tasks * 1e6
            for part in ("worker_main", "pool", "postgres", "redis", "machine")
        }


#: Column titles for :meth:`CpuSnapshot.per_task_micros`'s parts.
PART_TITLES = {
    "worker_main": "worker main process",
    "pool": "pool processes",
    "postgres": "PostgreSQL",
    "redis": "Redis",
    "machine": "whole machine",
}
