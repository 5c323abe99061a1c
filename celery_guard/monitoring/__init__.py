"""What operators load next to celery_guard: Prometheus alert rules and a Grafana dashboard.

Both files ship inside the package; ``python -m celery_guard.monitoring`` prints their paths.
They use only the names in :data:`celery_guard.metrics.CATALOGUE` (the tests check it), and
``docs/monitoring.md`` explains them; its metrics table is :func:`metrics_table`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from celery_guard.metrics import CATALOGUE, MetricSpec

__all__ = ["ALERT_RULES", "DIRECTORY", "GRAFANA_DASHBOARD", "metrics_table"]

DIRECTORY: Final = Path(__file__).resolve().parent
#: Prometheus rules file (``rule_files:`` in prometheus.yml).
ALERT_RULES: Final = DIRECTORY / "alerts.yml"
#: Grafana dashboard JSON model (Dashboards > New > Import).
GRAFANA_DASHBOARD: Final = DIRECTORY / "grafana-dashboard.json"

_SCOPES: Final = {
    "process": "per worker, its pool processes summed; `sum` across workers",
    "worker": "per worker (main process); `sum` across workers, or per instance",
    "sampled": "the reaper's holder only; `max`, never `sum`",
}
_PROCESS_MAX: Final = "per worker, the max over its pool processes; `max` across workers"


def _name_cell(spec: MetricSpec) -> str:
    if spec.kind == "histogram":
        return f"`{spec.name}` (`_bucket`, `_count`, `_sum`)"
    return f"`{spec.sample_names[0]}`"


def _scope_cell(spec: MetricSpec) -> str:
    if spec.scope == "process" and spec.kind == "gauge" and "max" in spec.multiprocess_mode:
        return _PROCESS_MAX
    return _SCOPES[spec.scope]


def metrics_table() -> str:
    """The Markdown table of every exported metric, as docs/monitoring.md shows it."""
    lines = [
        "| Metric | Type | Labels | Scope | Meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in CATALOGUE:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "none"
        meaning = spec.help.replace("|", "\\|")
        lines.append(
            f"| {_name_cell(spec)} | {spec.kind} | {labels} | {_scope_cell(spec)} | {meaning} |"
        )
    return "\n".join(lines) + "\n"
