"""A pool process adds its deliveries' metric values up in memory and writes them in batches.

Each case runs in a fresh interpreter: multiprocess mode changes prometheus_client's value class
for the whole process, which the rest of the suite must not inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Durations and lags on both sides of bucket bounds (0.005 is one; so are 900 and +Inf).
VALUES = [0.0, 0.004, 0.005, 0.0051, 0.3, 1.0, 2.5, 899.0, 900.0, 901.0, 1e6]

_SCRIPT = """
import json, os, sys, time
from prometheus_client import multiprocess
from celery_guard import metrics

mode, values = sys.argv[1], json.loads(sys.argv[2])
metrics.enable_multiprocess()
recorder = metrics.process_metrics()


class Task:
    name = "t"


task = Task()


def record(value):
    if mode == "direct":
        recorder.child("celery_guard_tasks", "t", "completed").inc()
        recorder.child("celery_guard_task_duration_seconds", "t", "completed").observe(value)
        recorder.child("celery_guard_lease_acquisitions", "t", "new").inc()
        recorder.child("celery_guard_queue_lag_seconds", "t").observe(value)
    elif mode == "recorders":
        # What a delivery's two signals call (celery_guard.signals' recorders).
        metrics.record_claim(sender=task, reason="NEW", queue_lag=value)
        metrics.record_outcome(sender=task, outcome="completed", seconds=value)
    else:
        recorder.count("celery_guard_tasks", "t", "completed")
        recorder.observe("celery_guard_task_duration_seconds", value, "t", "completed")
        recorder.count("celery_guard_lease_acquisitions", "t", "new")
        recorder.observe("celery_guard_queue_lag_seconds", value, "t")


def samples():
    collector = multiprocess.MultiProcessCollector(None, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    return {
        sample.name + json.dumps(sorted(sample.labels.items())): sample.value
        for family in collector.collect()
        for sample in family.samples
    }


if mode == "fork":
    # Recorded, not written yet, when the process forks: the child must not write the
    # parent's pending values again (the parent writes them itself).
    for value in values:
        record(value)
    pid = os.fork()
    if pid == 0:
        record(7.0)
        recorder.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    recorder.flush()
elif mode == "periodic":
    for value in values:
        record(value)
    deadline = time.monotonic() + 10  # the flusher writes every metrics.FLUSH_EVERY seconds
    while time.monotonic() < deadline:
        if samples().get('celery_guard_tasks_total[["outcome", "completed"], ["task", "t"]]'):
            break
        time.sleep(0.05)
else:
    for value in values:
        record(value)
    if mode in ("batched", "recorders"):
        recorder.flush()
print(json.dumps(samples()))
"""


def _samples(mode: str, values: list[float], directory: Path) -> dict[str, float]:
    directory.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), mode, json.dumps(values)],
        cwd=ROOT,
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    samples: dict[str, float] = json.loads(done.stdout)
    return samples


def _value(samples: dict[str, float], name: str, **labels: str) -> float:
    wanted = json.dumps(sorted({"task": "t", "outcome": "completed", **labels}.items()))
    return samples.get(name + wanted, 0.0)


def test_a_flush_writes_what_observing_each_value_would_have(tmp_path: Path) -> None:
    direct = _samples("direct", VALUES, tmp_path / "direct")
    batched = _samples("batched", VALUES, tmp_path / "batched")
    assert _value(direct, "celery_guard_tasks_total") == len(VALUES)
    assert _value(direct, "celery_guard_task_duration_seconds_bucket", le="0.005") == 3
    assert batched == direct


def test_the_delivery_recorders_write_what_observing_each_value_would_have(
    tmp_path: Path,
) -> None:
    direct = _samples("direct", VALUES, tmp_path / "direct")
    recorded = _samples("recorders", VALUES, tmp_path / "recorders")
    lag_bucket = json.dumps(sorted({"task": "t", "le": "0.005"}.items()))
    claims = json.dumps(sorted({"task": "t", "reason": "new"}.items()))
    assert recorded["celery_guard_queue_lag_seconds_bucket" + lag_bucket] == 3
    assert recorded["celery_guard_lease_acquisitions_total" + claims] == len(VALUES)
    assert recorded == direct


def test_the_flusher_thread_writes_without_being_asked(tmp_path: Path) -> None:
    written = _samples("periodic", VALUES, tmp_path / "periodic")
    assert _value(written, "celery_guard_tasks_total") == len(VALUES)
    assert _value(written, "celery_guard_task_duration_seconds_count") == len(VALUES)


def test_a_forked_child_writes_only_its_own_values(tmp_path: Path) -> None:
    summed = _samples("fork", VALUES, tmp_path / "fork")
    # The parent's values once (written by the parent), and the child's one.
    assert _value(summed, "celery_guard_tasks_total") == len(VALUES) + 1
    assert _value(summed, "celery_guard_task_duration_seconds_sum") == sum(VALUES) + 7.0
