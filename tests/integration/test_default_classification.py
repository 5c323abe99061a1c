"""The built-in classification of programming errors, through a real GuardedTask on SQLite.

Eager execution runs the whole claim → body → dead letter path in this process, against the
embedded SQLite store: a ``NameError`` is dead-lettered on its first execution, and the app's
and the task's own lists still come before the built-ins.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from celery.exceptions import Retry

import celery_guard
from celery_guard import GuardedTask
from celery_guard.policy import ErrorClass


@pytest.fixture
def app(sqlite_url: str) -> Iterator[Celery]:
    celery_app = Celery("classification", broker="memory://", set_as_current=False)
    celery_app.conf.update(
        guard_store_url=sqlite_url,
        task_always_eager=True,
        task_eager_propagates=True,
        guard_backoff_base=0.001,
        guard_backoff_max=0.001,
        # The app wants ImportError retried (a rolling deploy installs a module late).
        guard_transient_errors=["builtins:ImportError"],
    )
    runtime = celery_guard.install(celery_app)
    try:
        yield celery_app
    finally:
        runtime.store.dispose()


def test_a_name_error_is_dead_lettered_on_its_first_execution(app: Celery) -> None:
    runs: list[str] = []

    @app.task(base=GuardedTask, shared=False, idempotency_key="buggy:{order}")
    def buggy(order: str) -> None:
        runs.append(order)
        undefined_helper(order)  # type: ignore[name-defined]  # noqa: F821 - the bug

    with pytest.raises(NameError, match="undefined_helper"):
        buggy.delay("o-1")
    assert runs == ["o-1"], "one execution: a retry runs the same bug again"
    store = celery_guard.get_runtime(app).store
    record = store.keys.get("buggy:o-1")
    assert record is not None and (record.state, record.attempts) == ("DEAD", 1)
    (letter,) = [
        letter for letter in store.dead_letters.list_dead_letters() if letter.key == "buggy:o-1"
    ]
    assert (letter.error_class, letter.error_type) == ("permanent", "NameError")
    assert letter.reason == "permanent error"


def test_the_app_setting_and_the_task_option_come_before_the_built_ins(app: Celery) -> None:
    @app.task(base=GuardedTask, shared=False)
    def plain() -> None: ...

    @app.task(base=GuardedTask, shared=False, transient_errors=[AttributeError])
    def own() -> None: ...

    @app.task(base=GuardedTask, shared=False, permanent_errors=["builtins:ImportError"])
    def strict() -> None: ...

    assert plain.classify_error(NameError()) is ErrorClass.PERMANENT
    assert plain.classify_error(AttributeError()) is ErrorClass.PERMANENT
    assert plain.classify_error(ModuleNotFoundError()) is ErrorClass.TRANSIENT, "app setting"
    assert own.classify_error(AttributeError()) is ErrorClass.TRANSIENT, "task option"
    assert own.classify_error(ModuleNotFoundError()) is ErrorClass.TRANSIENT
    assert strict.classify_error(ModuleNotFoundError()) is ErrorClass.PERMANENT, "task over app"


def test_a_programming_error_listed_transient_is_retried_not_dead_lettered(app: Celery) -> None:
    @app.task(base=GuardedTask, shared=False, idempotency_key="late:{order}")
    def late_import(order: str) -> None:
        raise ModuleNotFoundError("No module named 'not_yet_deployed'")

    # Eager mode raises Celery's Retry where a worker would schedule the retry.
    with pytest.raises(Retry, match="not_yet_deployed"):
        late_import.delay("o-2")
    store = celery_guard.get_runtime(app).store
    record = store.keys.get("late:o-2")
    assert record is not None and (record.state, record.attempts) == ("RELEASED", 1)
    assert not [
        letter for letter in store.dead_letters.list_dead_letters() if letter.key == "late:o-2"
    ]
