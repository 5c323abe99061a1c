"""The shop app plus ``CG_MANY_TASKS`` (default 200) trivial guarded tasks, ``many.t000``...

For the metrics cardinality budget: a worker of an app with many task names must keep its
``/metrics`` small. The shop's own tasks are registered too (importing it configures the app).
"""

from __future__ import annotations

import os
from typing import Any

from tests.apps.shop import app

__all__ = ["app", "many_task_names"]


def many_task_names() -> list[str]:
    return [f"many.t{index:03d}" for index in range(int(os.environ.get("CG_MANY_TASKS", "200")))]


def _define(name: str) -> None:
    @app.task(name=name, shared=False)
    def body(value: Any = None) -> Any:
        return value


for _name in many_task_names():
    _define(_name)
