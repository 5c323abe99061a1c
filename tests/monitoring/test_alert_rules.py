"""The shipped alert rules pass promtool, and each alert has a firing and a quiet unit test.

promtool is Debian's (package "prometheus"); ``make test`` installs it through
scripts/install-deps.sh. A missing promtool fails these tests: the rules would go unchecked.
"""

from __future__ import annotations

import pytest
import yaml

from celery_guard.monitoring import ALERT_RULES
from tests.monitoring.assets import (
    ALERT_TESTS,
    alert_rules,
    alert_tests,
    assert_ok,
    run_promtool,
)

SEVERITIES = {"warning", "critical"}


def test_promtool_check_rules_accepts_the_rules_file() -> None:
    result = run_promtool("check", "rules", ALERT_RULES)
    assert_ok(result)
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    assert_ok(run_promtool("test", "rules", ALERT_TESTS))


def test_the_unit_tests_load_the_shipped_rules_file() -> None:
    rule_files = yaml.safe_load(ALERT_TESTS.read_text())["rule_files"]
    assert [(ALERT_TESTS.parent / name).resolve() for name in rule_files] == [ALERT_RULES]


def test_every_alert_has_a_firing_and_a_quiet_test_case() -> None:
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for group in alert_tests():
        for case in group.get("alert_rule_test", []):
            counts = firing if case.get("exp_alerts") else quiet
            counts[case["alertname"]] = counts.get(case["alertname"], 0) + 1
    names = {rule["alert"] for rule in alert_rules()}
    assert set(firing) | set(quiet) <= names, "unit tests name alerts that do not exist"
    assert sorted(names - set(firing)) == [], "alerts without a firing test case"
    assert sorted(names - set(quiet)) == [], "alerts without a not-firing test case"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: str(rule["alert"]))
def test_every_alert_tells_the_operator_what_to_do(rule: dict[str, object]) -> None:
    assert str(rule["alert"]).startswith("CeleryGuard")
    labels = rule.get("labels")
    assert isinstance(labels, dict) and labels.get("severity") in SEVERITIES
    annotations = rule.get("annotations")
    assert isinstance(annotations, dict)
    assert annotations.get("summary"), "no summary"
    description = str(annotations.get("description", ""))
    assert "celery -A proj " in description, "the description names no command to run"
