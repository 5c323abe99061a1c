"""docs/monitoring.md lists every exported metric as the catalogue has it, and every alert."""

from __future__ import annotations

import re
from pathlib import Path

from celery_guard.metrics import CATALOGUE
from celery_guard.monitoring import metrics_table
from tests.monitoring.assets import alert_rules

DOC = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"
TABLE = re.compile(
    r"<!-- metrics-table:start[^>]*-->\n(?P<table>.*?)<!-- metrics-table:end -->", re.DOTALL
)


def test_the_metrics_table_matches_the_catalogue() -> None:
    match = TABLE.search(DOC.read_text())
    assert match, "docs/monitoring.md has no metrics-table markers"
    assert match.group("table") == metrics_table(), (
        "docs/monitoring.md's metrics table is out of date: replace it with the output of "
        "`python -m celery_guard.monitoring metrics-table`"
    )


def test_the_metrics_table_has_a_row_per_family() -> None:
    rows = [line for line in metrics_table().splitlines() if line.startswith("| `")]
    assert len(rows) == len(CATALOGUE)
    for spec, row in zip(CATALOGUE, rows, strict=True):
        assert f"`{spec.name}" in row and f"| {spec.kind} |" in row


def test_every_alert_is_documented() -> None:
    text = DOC.read_text()
    missing = [rule["alert"] for rule in alert_rules() if f"`{rule['alert']}`" not in text]
    assert missing == []
