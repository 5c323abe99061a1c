"""A producer of the shop's tasks with a config of its own (a web process, say).

``tests/apps/shop.py`` builds its app from the environment once, at import, for the workers
and the session's fixtures; importing it early (a test module's import, at collection) would
pin it to the wrong servers. This module does not import it. It declares the names,
signatures and key options of the shop tasks producers send; their bodies run only in the
shop's workers. Once ``tests.apps.shop`` is imported, Celery adds its (shared) tasks to every
new app, this one included, and those are used instead: the same names, keys and signatures
(``tests/acceptance/test_publish_tracking.py`` checks that the declarations match).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

import celery_guard
from celery_guard import BY_ARGUMENTS


def _never(task: Any) -> None:
    raise RuntimeError(f"{task.name} runs in the shop's workers, not in a producer")


def record(self: Any, tag: str, value: Any = None) -> None:
    _never(self)


def record_by_id(self: Any, tag: str) -> None:
    _never(self)


def by_args(self: Any, tag: str, n: int) -> None:
    _never(self)


def long_write(self: Any, tag: str, seconds: float) -> None:
    _never(self)


def poison(self: Any, tag: str) -> None:
    _never(self)


#: (task name, function, key option) as tests/apps/shop.py declares them.
TASKS: tuple[tuple[str, Any, Any], ...] = (
    ("shop.record", record, "record:{tag}"),
    ("shop.record_by_id", record_by_id, None),
    ("shop.by_args", by_args, BY_ARGUMENTS),
    ("shop.long_write", long_write, "long:{tag}"),
    ("shop.poison", poison, "poison:{tag}"),
)


def producer_app(broker_url: str, store_url: str, **conf: Any) -> Celery:
    """A new app sending the shop's tasks, installed with ``conf`` (``guard_*`` and others)."""
    app = Celery(
        "shop-producer",
        broker=broker_url,
        set_as_current=False,
        task_cls="celery_guard:GuardedTask",
    )
    app.conf.update(guard_store_url=store_url, guard_metrics_port=None, **conf)
    app.finalize(auto=True)  # the shop's shared tasks join here, if tests.apps.shop is imported
    for name, function, key in TASKS:
        if name not in app.tasks:
            # shared=False: Celery would otherwise add them to every app made later.
            app.task(name=name, shared=False, bind=True, idempotency_key=key)(function)
    celery_guard.install(app)
    return app
