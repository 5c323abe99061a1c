"""A real worker warns at start about a beat_schedule entry whose key outlives its period."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.acceptance.conftest import start_workers
from tests.rig.procs import wait_until

pytestmark = pytest.mark.workers


def test_the_worker_warns_once_per_constant_key_entry_naming_task_key_and_period(
    shop_env: dict[str, str],
) -> None:
    schedule = {
        # shop.by_args keys BY_ARGUMENTS: the same key every minute, kept for guard_result_ttl.
        "minutely-by-args": {"task": "shop.by_args", "schedule": 60, "args": ["beat", 1]},
        # shop.tick is keyed by its task id: a new key at every run, nothing to warn about.
        "minutely-tick": {"task": "shop.tick", "schedule": 60},
    }
    extra = {"beat_schedule": schedule, "guard_result_ttl": 3600}
    (worker,) = start_workers(
        1,
        {**shop_env, "CG_EXTRA_CONF": json.dumps(extra)},
        queues=f"beat-check-{uuid.uuid4().hex[:8]}",
    )
    try:
        wait_until(
            lambda: "beat entry 'minutely-by-args'" in worker.log_text(),
            timeout=30,
            what="the worker to warn about the constant key",
        )
        lines = [line for line in worker.log_text().splitlines() if "beat entry" in line]
        assert len(lines) == 1, lines
        (line,) = lines
        assert "WARNING" in line and "shop.by_args" in line and "every 1 min (60 s)" in line
        assert "'shop.by_args:" in line, "names the key itself"
        assert "for 1 h (3600 s) after it completes (guard_result_ttl)" in line
        assert "minutely-tick" not in worker.log_text()
    finally:
        worker.stop()
