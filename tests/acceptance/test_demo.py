"""``make demo``'s chaos scenario, small: its audit holds, and it leaves no process behind.

The demo runs as the README runs it (``python -m example_project.demo``), with 30 orders
instead of 300: every fault still strikes (a SIGKILLed worker, a frozen one resumed after its
lease, a poison pill, the provider's 503s), and the plain-Celery leg runs beside it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.rig.procs import pid_alive

pytestmark = pytest.mark.workers

ROOT = Path(__file__).resolve().parents[2]
ORDERS = 30
Audit = dict[str, Any]


@pytest.fixture(scope="module")
def audit(tmp_path_factory: pytest.TempPathFactory) -> Audit:
    out = tmp_path_factory.mktemp("demo")
    argv = [sys.executable, "-m", "example_project.demo", "--orders", str(ORDERS)]
    argv += ["--output", str(out), "--json", str(out / "audit.json")]
    completed = subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    summary: Audit = json.loads((out / "audit.json").read_text())
    summary["stdout"] = completed.stdout
    return summary


def test_guarded_tasks_charge_every_order_exactly_once(audit: Audit) -> None:
    guarded = audit["guarded"]
    assert audit["ok"] is True
    assert guarded["charged"] == {"once": ORDERS, "twice_or_more": 0, "never": 0}
    assert guarded["ledger"] == {"once": ORDERS, "twice_or_more": 0, "never": 0}
    assert guarded["money_charged_twice_cents"] == 0
    assert guarded["charged_not_recorded"] == 0
    assert guarded["reserved"] == {"once": ORDERS, "twice_or_more": 0, "never": 0}
    assert guarded["units_reserved"] == guarded["units_ordered"]
    poison = guarded["poison"]["orders"]
    assert guarded["invoiced"]["once"] == ORDERS - len(poison)
    assert guarded["invoiced"]["twice_or_more"] == 0
    assert guarded["not_done"] == []
    assert guarded["executions"] == 3 * ORDERS - len(poison)
    assert "RESULT: OK" in audit["stdout"]


def test_only_the_planted_poison_pills_are_dead_lettered(audit: Audit) -> None:
    guarded = audit["guarded"]
    poison = guarded["poison"]["orders"]
    assert poison, "the scenario plants at least one poison pill"
    assert guarded["guard"]["poison_dead_lettered"] == sorted(f"invoice:{o}" for o in poison)
    assert guarded["guard"]["other_dead_letters"] == []
    assert guarded["poison"]["invoiced"] == 0
    # Each of guard_max_attempts (3) executions killed its pool process, then the 4th claim
    # dead-lettered the message without running it.
    assert guarded["poison"]["processes_killed"] == 3 * len(poison)


def test_the_faults_struck_and_were_healed(audit: Audit) -> None:
    guarded = audit["guarded"]
    kinds = [fault["kind"] for fault in guarded["faults"]]
    assert kinds == ["SIGKILL", "SIGSTOP", "SIGCONT"]
    assert guarded["provider"]["unavailable"] > 0, "the provider failed transiently"
    assert guarded["guard"]["duplicates_prevented"] > 0
    for recovery in guarded["guard"]["recoveries"]:
        # Each task a fault interrupted completed, within a few lease TTLs (3 s) of the fault.
        assert recovery["state"] == "COMPLETED", recovery
        assert recovery["seconds"] is not None and recovery["seconds"] < 20, recovery


def test_plain_celery_charges_twice_under_the_same_scenario(audit: Audit) -> None:
    plain = audit["plain"]
    assert plain["charged"]["twice_or_more"] > 0
    assert plain["ledger"]["twice_or_more"] > 0
    assert plain["money_charged_twice_cents"] > 0
    assert plain["poison"]["processes_killed"] > 3 * len(plain["poison"]["orders"])


def test_the_timeline_is_drawn(audit: Audit) -> None:
    # make test installs the demo extra: a missing matplotlib is a broken install, not a skip.
    assert importlib.util.find_spec("matplotlib"), "matplotlib (the demo extra) is not installed"
    png = Path(audit["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_process_outlives_the_demo(audit: Audit) -> None:
    assert audit["pids"], "the demo reports the processes it started"
    assert [pid for pid in audit["pids"] if pid_alive(pid)] == []
