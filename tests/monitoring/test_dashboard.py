"""The Grafana dashboard and the alert rules query only what celery_guard exports, correctly.

Every metric name in a query must be in the catalogue (a typo would be an empty panel or an
alert that never fires), every catalogue family must have a panel (a new metric without one
fails here), and the reaper holder's sampled series must never be summed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_guard.metrics import CATALOGUE, exported_names
from tests.monitoring.assets import (
    alert_rules,
    assert_ok,
    dashboard,
    metric_names,
    panel_exprs,
    panels,
    run_promtool,
    sampled_aggregations,
)

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
#: Families with a ``task`` label: their panels follow the dashboard's task variable.
TASK_FAMILIES = {spec.name for spec in CATALOGUE if "task" in spec.labels}
# A series selector: a metric name and its {matchers}, if any.
SELECTOR = re.compile(r"\b(celery_guard_[a-z_]+)(\{[^}]*\})?")
QUANTILE = re.compile(r"histogram_quantile\(\s*[0-9.]+\s*,\s*(\w+)\s*(by|without)?\s*(\([^)]*\))?")
# What Grafana puts in place of its variables, so promtool can parse the queries.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "6h", "$job": ".*", "$task": ".*"}


def data_panels() -> list[dict[str, Any]]:
    return [panel for panel in panels(dashboard()) if panel["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(panel["title"], expr) for panel in data_panels() for expr in panel_exprs(panel)]


def rule_exprs() -> list[tuple[str, str]]:
    return [(str(rule["alert"]), str(rule["expr"])) for rule in alert_rules()]


def family_of(sample_name: str) -> str:
    for spec in CATALOGUE:
        if sample_name in spec.sample_names:
            return spec.name
    raise AssertionError(f"{sample_name} is not exported")


def test_the_dashboard_has_its_variables_and_a_query_in_every_panel() -> None:
    model = dashboard()
    assert model["uid"] == "celery-guard" and model["title"] == "celery_guard"
    variables = {variable["name"]: variable for variable in model["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "celery_guard_tasks_total" in variables["task"]["definition"]
    assert variables["task"]["multi"] and variables["task"]["includeAll"]
    ids = [panel["id"] for panel in panels(model)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert len(data_panels()) >= 25
    for panel in data_panels():
        assert panel.get("title"), panel
        assert panel.get("description"), f"{panel['title']}: no description"
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel_exprs(panel), f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_panels_fit_the_grid_without_overlapping() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


@pytest.mark.parametrize("source", ["dashboard", "alert rules"])
def test_every_metric_name_queried_is_exported(source: str) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    assert exprs
    exported = exported_names()
    unknown = {
        (where, name)
        for where, expr in exprs
        for name in metric_names(expr)
        if name not in exported
    }
    assert sorted(unknown) == []
    assert all(metric_names(expr) for _, expr in exprs), "a query reads no celery_guard series"


def test_every_catalogue_family_has_a_dashboard_panel() -> None:
    shown = {family_of(name) for _, expr in dashboard_exprs() for name in metric_names(expr)}
    missing = [spec.name for spec in CATALOGUE if spec.name not in shown]
    assert missing == [], f"metrics without a panel: {missing}"


@pytest.mark.parametrize("source", ["dashboard", "alert rules"])
def test_sampled_series_are_taken_with_max_never_summed(source: str) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    checked = [
        (where, name, aggregation)
        for where, expr in exprs
        for name, aggregation in sampled_aggregations(expr)
    ]
    assert checked, "no sampled series queried"
    wrong = [item for item in checked if item[2] not in ("max", "min")]
    assert wrong == [], "sampled series must be aggregated with max (only one worker exports)"


def test_quantiles_aggregate_buckets_by_le() -> None:
    exprs = [expr for _, expr in dashboard_exprs() if "histogram_quantile" in expr]
    with_quantiles = {family_of(name) for expr in exprs for name in metric_names(expr)}
    histograms = {spec.name for spec in CATALOGUE if spec.kind == "histogram"}
    assert with_quantiles == histograms, "every histogram gets p50/p95 panels"
    for expr in exprs:
        for match in QUANTILE.finditer(expr):
            operator, clause, labels = match.groups()
            assert operator == "sum" and clause == "by" and "le" in labels, expr
            assert "_bucket" in expr, expr


def test_dashboard_selectors_follow_the_job_and_task_variables() -> None:
    for title, expr in dashboard_exprs():
        for name, matchers in SELECTOR.findall(expr):
            assert 'job=~"$job"' in matchers, f"{title}: {name} ignores $job"
            if family_of(name) in TASK_FAMILIES:
                assert 'task=~"$task"' in matchers, f"{title}: {name} ignores $task"


def test_dashboard_queries_parse_with_promtool(tmp_path: Path) -> None:
    """promtool checks every panel query (variables filled in) as a recording rule."""
    rules = []
    for panel in data_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            rules.append(
                {"record": f"dashboard:panel_{panel['id']}:{target['refId']}", "expr": expr}
            )
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", path)
    assert_ok(result)
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
