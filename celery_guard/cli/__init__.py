"""``celery -A proj guard ...``: the operator's commands, a Celery sub-command (click).

Importing the command modules registers their commands on the ``guard`` group.
"""

from celery_guard.cli import dlq, keys, reconcile  # noqa: F401  (registers the commands)
from celery_guard.cli.common import guard

__all__ = ["guard"]
