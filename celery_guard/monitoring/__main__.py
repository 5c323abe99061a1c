"""``python -m celery_guard.monitoring``: where the shipped rules and dashboard are.

``python -m celery_guard.monitoring metrics-table`` prints the metrics table of
docs/monitoring.md instead.
"""

from __future__ import annotations

import sys

from celery_guard.monitoring import ALERT_RULES, GRAFANA_DASHBOARD, metrics_table


def main(argv: list[str]) -> int:
    if argv == ["metrics-table"]:
        sys.stdout.write(metrics_table())
        return 0
    if argv:
        sys.stderr.write("usage: python -m celery_guard.monitoring [metrics-table]\n")
        return 2
    print(f"alert rules:       {ALERT_RULES}")
    print(f"grafana dashboard: {GRAFANA_DASHBOARD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
