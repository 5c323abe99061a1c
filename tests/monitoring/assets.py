"""Reading the shipped monitoring files, and the few PromQL facts the tests check in them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_guard.metrics import CATALOGUE
from celery_guard.monitoring import ALERT_RULES, GRAFANA_DASHBOARD

HERE = Path(__file__).resolve().parent
#: promtool unit tests of ALERT_RULES (their rule_files path is relative to this file).
ALERT_TESTS = HERE / "alerts_test.yml"

PROMTOOL_TIMEOUT = 120
METRIC_NAME = re.compile(r"\bcelery_guard_[a-z_]+")
#: Sample names of series only the reaper's holder exports: never summed.
SAMPLED = {name for spec in CATALOGUE if spec.scope == "sampled" for name in spec.sample_names}
# An aggregation operator, optionally with its by/without clause, right before "(".
_AGGREGATION = re.compile(
    r"\b(sum|min|max|avg|group|stddev|stdvar|count|count_values|bottomk|topk|quantile)\s*"
    r"(?:(?:by|without)\s*\([^()]*\)\s*)?$"
)


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERT_RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def alert_tests() -> list[dict[str, Any]]:
    return list(yaml.safe_load(ALERT_TESTS.read_text())["tests"])


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(GRAFANA_DASHBOARD.read_text())
    return loaded


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for panel in model.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_exprs(panel: dict[str, Any]) -> list[str]:
    return [str(target["expr"]) for target in panel.get("targets", []) if target.get("expr")]


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def enclosing_aggregation(expr: str, position: int) -> str | None:
    """The innermost aggregation operator whose argument contains ``expr[position]``."""
    depth = 0
    for index in range(position - 1, -1, -1):
        char = expr[index]
        if char == ")":
            depth += 1
        elif char == "(":
            if depth:
                depth -= 1
                continue
            match = _AGGREGATION.search(expr[:index])
            if match:
                return match.group(1)
    return None


def sampled_aggregations(expr: str) -> list[tuple[str, str | None]]:
    """(sampled metric, its innermost aggregation) for each sampled series ``expr`` reads."""
    found = []
    for match in METRIC_NAME.finditer(expr):
        if match.group(0) in SAMPLED:
            found.append((match.group(0), enclosing_aggregation(expr, match.start())))
    return found


def promtool() -> str:
    """promtool's path; a missing promtool fails the test (``make test`` installs it)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH: install Debian's prometheus package "
            "(`make deps`, i.e. scripts/install-deps.sh, does it as root)",
            pytrace=False,
        )
    return path


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT,
        check=False,
    )


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    """Fail with promtool's whole output unless it exited 0."""
    assert result.returncode == 0, (
        f"{' '.join(result.args)} exited {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )
