"""Switching a whole app to ``task_cls="celery_guard:GuardedTask"`` keeps Celery's canvas working.

Every case runs on a plain Celery app and on the same tasks with every task guarded, each in
a real prefork worker, and compares what the caller sees: results, errors, callbacks and
errbacks. The differences that remain on purpose (retrying unclassified exceptions) are
asserted as such and documented in docs/celery-compat.md.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult, GroupResult, result_from_tuple

import celery_guard
from tests.apps import canvas_tasks
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess, stop_all

pytestmark = pytest.mark.workers

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 20.0
#: guard_max_attempts of the guarded app (the default): an unclassified error runs this often.
MAX_ATTEMPTS = 5


@dataclass
class Side:
    """One app (plain or guarded) with its worker."""

    name: str
    module: ModuleType
    worker: WorkerProcess

    @property
    def app(self) -> Any:
        return self.module.app

    def task(self, name: str) -> Any:
        return self.app.tasks[f"canvas.{name}"]

    def sig(self, name: str, *args: Any, **options: Any) -> Any:
        return self.task(name).si(*args, **options)


@dataclass
class Rig:
    env: dict[str, str]
    plain: Side
    guarded: Side

    def both(self) -> list[Side]:
        return [self.plain, self.guarded]


@pytest.fixture(scope="module")
def rig(postgres: PostgresServer, redis_server: RedisServer) -> Iterator[Rig]:
    env = {
        "CANVAS_BROKER_URL": redis_server.url_for(15),
        "CANVAS_RESULT_URL": redis_server.url_for(15),
        "CANVAS_STORE_URL": postgres.create_database(f"canvas_{uuid.uuid4().hex[:8]}"),
        "CANVAS_QUEUE_SUFFIX": f"-{uuid.uuid4().hex[:8]}",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    workers: list[WorkerProcess] = []
    try:
        plain = importlib.import_module("tests.apps.canvas_plain")
        guarded = importlib.import_module("tests.apps.canvas_guarded")
        assert guarded.app.conf.broker_url == env["CANVAS_BROKER_URL"], "imported too early"
        celery_guard.get_runtime(guarded.app).migrate()
        for module, name in ((plain, "plain"), (guarded, "guarded")):
            workers.append(
                WorkerProcess(
                    module.__name__,
                    env=env,
                    cwd=ROOT,
                    concurrency=2,
                    hostname=f"{name}-{uuid.uuid4().hex[:6]}@%h",
                    queues=module.app.conf.task_default_queue,
                )
            )
        for worker in workers:
            worker.start(wait_ready=False)
        for worker in workers:
            worker.wait_ready(timeout=60)
        yield Rig(
            env,
            Side("plain", plain, workers[0]),
            Side("guarded", guarded, workers[1]),
        )
    finally:
        stop_all(workers)
        # Results still referenced would otherwise unsubscribe from a stopped Redis at exit.
        gc.collect()
        for name in ("tests.apps.canvas_plain", "tests.apps.canvas_guarded"):
            if name in sys.modules:
                sys.modules[name].app.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:12]


def on_both(rig: Rig, case: Callable[[Side], Any]) -> Any:
    """Run ``case`` on the plain and the guarded app; they must give the same outcome."""
    plain, guarded = (case(side) for side in rig.both())
    assert guarded == plain, f"guarded {guarded!r} != plain {plain!r}"
    return plain


def outcome(result: Any) -> tuple[str, Any]:
    """What a caller sees: ("ok", value) or ("error", exception type name)."""
    try:
        return "ok", result.get(timeout=TIMEOUT)
    except Exception as exc:
        return "error", type(exc).__name__


def count(side: Side, what: str, tag: str) -> int:
    return canvas_tasks.count(f"{what}:{side.name}-{tag}")


# -- results through the backend --------------------------------------------------------------


def test_chain(rig: Rig) -> None:
    def case(side: Side) -> Any:
        add = side.task("add")
        return outcome(chain(add.s(1, 2), add.s(3), add.s(4)).apply_async())

    assert on_both(rig, case) == ("ok", 10)


def test_a_long_chain(rig: Rig) -> None:
    def case(side: Side) -> Any:
        add = side.task("add")
        return outcome(chain(add.s(0, 1), *(add.s(1) for _ in range(24))).apply_async())

    assert on_both(rig, case) == ("ok", 25)


def test_group(rig: Rig) -> None:
    def case(side: Side) -> Any:
        add = side.task("add")
        return outcome(group(add.s(i, i) for i in range(10)).apply_async())

    assert on_both(rig, case) == ("ok", [2 * i for i in range(10)])


def test_chord(rig: Rig) -> None:
    def case(side: Side) -> Any:
        add, tsum = side.task("add"), side.task("tsum")
        return outcome(chord((add.s(i, i) for i in range(20)), tsum.s()).apply_async())

    assert on_both(rig, case) == ("ok", sum(2 * i for i in range(20)))


def test_nested_chord_and_a_group_in_a_chain(rig: Rig) -> None:
    def case(side: Side) -> Any:
        add, tsum = side.task("add"), side.task("tsum")
        inner = chord([add.si(1, 1), add.si(2, 2)], tsum.s())
        outer = chord([inner, add.si(3, 3)], tsum.s())
        flow = chain(add.si(0, 1), group(add.s(1), add.s(2)), tsum.s(), add.s(10))
        return outcome(outer.apply_async()), outcome(flow.apply_async())

    assert on_both(rig, case) == (("ok", 12), ("ok", 15))


def test_link_callback_runs_once_with_the_parent_value(rig: Rig, tag: str) -> None:
    def case(side: Side) -> Any:
        mark = side.task("mark").s(f"{side.name}-{tag}")
        result = side.task("add").apply_async((1, 2), link=mark)
        value = outcome(result)
        wait_until(lambda: count(side, "mark", tag) >= 1, TIMEOUT, "the link to run")
        return value, count(side, "mark", tag)

    assert on_both(rig, case) == (("ok", 3), 1)


# -- replace() and retry() --------------------------------------------------------------------


def test_replace(rig: Rig, tag: str) -> None:
    def case(side: Side) -> Any:
        mine = f"{side.name}-{tag}"
        alone = outcome(side.task("replace_with_add").delay(1, mine))
        by_chord = outcome(side.task("replace_with_chord").delay(4, mine + "c"))
        return alone, by_chord, count(side, "run", tag), count(side, "run", tag + "c")

    assert on_both(rig, case) == (("ok", 101), ("ok", 12), 1, 1)


def test_chord_members_that_replace_themselves_or_retry(rig: Rig, tag: str) -> None:
    def case(side: Side) -> Any:
        mine = f"{side.name}-{tag}"
        members = [
            side.sig("add", 1, 1),
            side.sig("replace_with_add", 5, mine + "r"),
            side.sig("retry_then_add", 7, mine + "t", 2),
        ]
        value = outcome(chord(members, side.task("tsum").s()).apply_async())
        return value, count(side, "run", tag + "r"), count(side, "run", tag + "t")

    assert on_both(rig, case) == (("ok", 2 + 105 + 8), 1, 3)


def test_retry_more_often_than_guard_max_attempts(rig: Rig, tag: str) -> None:
    """Celery's own retries are Celery's to bound (max_retries), not guard_max_attempts'."""

    def case(side: Side) -> Any:
        mine = f"{side.name}-{tag}"
        return outcome(side.task("retry_then_add").delay(1, mine, MAX_ATTEMPTS + 2)), count(
            side, "run", tag
        )

    assert on_both(rig, case) == (("ok", 2), MAX_ATTEMPTS + 3)


def test_retry_with_max_retries_exhausted(rig: Rig, tag: str) -> None:
    def case(side: Side) -> Any:
        mine = f"{side.name}-{tag}"
        return outcome(side.task("retry_forever").delay(mine)), count(side, "run", tag)

    assert on_both(rig, case) == (("error", "LookupError"), 3)


# -- results a task may return ----------------------------------------------------------------


def test_a_task_returning_an_async_result_or_a_group_result(rig: Rig) -> None:
    def case(side: Side) -> Any:
        one = side.task("start_one").delay(21).get(timeout=TIMEOUT)
        many = side.task("start_group").delay(3).get(timeout=TIMEOUT)
        # Celery's backend stores them as their as_tuple(); result_from_tuple reads them back.
        child, children = result_from_tuple(one, side.app), result_from_tuple(many, side.app)
        assert isinstance(child, AsyncResult) and isinstance(children, GroupResult)
        return child.get(timeout=TIMEOUT), children.get(timeout=TIMEOUT)

    assert on_both(rig, case) == (42, [0, 2, 4])


def test_a_duplicate_returns_the_stored_async_result(rig: Rig, tag: str) -> None:
    """The second call of a key runs nothing and answers what the first returned."""
    start_one = rig.guarded.task("start_one")
    first = start_one.apply_async((5,), idempotency_key=f"one:{tag}").get(timeout=TIMEOUT)
    second = start_one.apply_async((5,), idempotency_key=f"one:{tag}").get(timeout=TIMEOUT)
    assert second == first
    assert result_from_tuple(second, rig.guarded.app).get(timeout=TIMEOUT) == 10
    start_group = rig.guarded.task("start_group")
    first = start_group.apply_async((2,), idempotency_key=f"many:{tag}").get(timeout=TIMEOUT)
    second = start_group.apply_async((2,), idempotency_key=f"many:{tag}").get(timeout=TIMEOUT)
    assert second == first


# -- failures, errbacks and the chord's error path ---------------------------------------------


def test_a_failing_chord_member_runs_the_errbacks_once(rig: Rig, tag: str) -> None:
    """Retried by default under GuardedTask (the documented difference), failed once in the end."""

    def case(side: Side) -> Any:
        mine = f"{side.name}-{tag}"
        member = side.sig("fail", mine).on_error(side.task("on_error").s(mine + "m"))
        body = side.task("tsum").s().on_error(side.task("on_error").s(mine + "b"))
        result = chord([side.sig("add", 1, 1), member], body).apply_async()
        assert outcome(result) == ("error", "RuntimeError")
        wait_until(
            lambda: count(side, "errback", tag + "m") and count(side, "errback", tag + "b"),
            TIMEOUT,
            "both errbacks",
        )
        return (
            count(side, "run", tag),
            count(side, "errback", tag + "m"),
            count(side, "errback", tag + "b"),
        )

    plain, guarded = (case(side) for side in rig.both())
    assert plain == (1, 1, 1)
    assert guarded == (MAX_ATTEMPTS, 1, 1)


def test_a_dead_keys_redelivery_runs_no_errback_again(rig: Rig, tag: str) -> None:
    side = rig.guarded
    mine = f"{side.name}-{tag}"
    errback = side.task("on_error").s(mine)
    task_id = str(uuid.uuid4())
    first = side.task("fail").apply_async((mine,), task_id=task_id, link_error=errback)
    assert outcome(first) == ("error", "RuntimeError")
    wait_until(lambda: count(side, "errback", tag) == 1, TIMEOUT, "the errback")
    # The same message again (a redelivery, or a client re-sending it with its id).
    side.task("fail").apply_async((mine,), task_id=task_id, link_error=errback)
    wait_until(
        lambda: f"canvas.fail[{task_id}] ignored" in side.worker.log_text(),
        TIMEOUT,
        "the copy to be ignored",
    )
    assert count(side, "errback", tag) == 1 and count(side, "run", tag) == MAX_ATTEMPTS
    assert side.app.AsyncResult(task_id).state == "FAILURE"


def test_one_setting_restores_fail_at_once_on_the_sqlite_store(
    rig: Rig, tag: str, tmp_path: Path
) -> None:
    """guard_default_error_class = "permanent": an unclassified error fails at once and runs its
    errback at once, as in plain Celery (here on the embedded SQLite store)."""
    queue = f"failfast-{tag}"
    env = {
        **rig.env,
        "CANVAS_STORE_URL": f"sqlite:///{tmp_path / 'store.sqlite3'}",
        "CANVAS_GUARD_CONF": json.dumps({"guard_default_error_class": "permanent"}),
    }
    worker = WorkerProcess(
        "tests.apps.canvas_guarded", env=env, cwd=ROOT, concurrency=1, queues=queue
    )
    worker.start(timeout=60)
    try:
        side = Side("failfast", rig.guarded.module, worker)

        def case(on: Side, kind: str) -> Any:
            mine = f"{on.name}-{tag}{kind}"
            errback = on.task("on_error").s(mine)
            options = {"queue": queue} if on is side else {}
            result = on.task("fail_with").apply_async((mine, kind), link_error=errback, **options)
            value = outcome(result)
            wait_until(lambda: count(on, "errback", tag + kind) == 1, TIMEOUT, "the errback")
            return value, count(on, "run", tag + kind), count(on, "errback", tag + kind)

        assert (
            case(side, "runtime")
            == case(rig.plain, "runtime")
            == (
                ("error", "RuntimeError"),
                1,
                1,
            )
        )
        # The built-in transient classes keep being retried (docs/celery-compat.md).
        assert case(side, "connection") == (("error", "ConnectionError"), MAX_ATTEMPTS, 1)
    finally:
        worker.stop()


# -- revocation and remote control -------------------------------------------------------------


def _celery(module: str, *argv: str, env: dict[str, str]) -> str:
    """A celery command in a subprocess: remote control leaves after-fork hooks in the caller
    that hang a later fork (tests/acceptance/test_publish_tracking.py)."""
    done = subprocess.run(
        [sys.executable, *argv]
        if argv[0] == "-c"
        else [sys.executable, "-m", "celery", "-A", module, *argv],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_task_revoked_before_it_runs(rig: Rig, tag: str) -> None:
    ids = {side.name: str(uuid.uuid4()) for side in rig.both()}
    _celery(rig.guarded.module.__name__, "control", "revoke", *ids.values(), env=rig.env)
    for side in rig.both():
        wait_until(
            lambda side=side: ids[side.name] in side.worker.log_text(),  # type: ignore[misc]
            TIMEOUT,
            f"the revoke to reach the {side.name} worker",
        )

    def case(side: Side) -> Any:
        result = side.task("sleep").apply_async((0, f"{side.name}-{tag}"), task_id=ids[side.name])
        return outcome(result), count(side, "run", tag)

    assert on_both(rig, case) == (("error", "TaskRevokedError"), 0)


INSPECT = """
import importlib, json, sys
app = importlib.import_module(sys.argv[1]).app
# A broadcast waits out its whole timeout; with ``limit`` it returns once both workers answered.
inspect = app.control.inspect(timeout=10, limit=int(sys.argv[2]))
answers = {"registered": inspect.registered(), "stats": inspect.stats(), "active": inspect.active()}
print(json.dumps({kind: {host: bool(value) if kind == "stats" else value
                         for host, value in (answer or {}).items()}
                  for kind, answer in answers.items()}))
"""


def test_inspect_answers(rig: Rig, tag: str) -> None:
    running = {side.name: side.task("sleep").delay(8, f"{side.name}-{tag}") for side in rig.both()}
    for side in rig.both():
        wait_until(lambda side=side: count(side, "run", tag) == 1, TIMEOUT, "the sleep to start")  # type: ignore[misc]
    answers = json.loads(
        _celery("", "-c", INSPECT, rig.guarded.module.__name__, str(len(rig.both())), env=rig.env)
    )
    for side in rig.both():
        host = next(name for name in answers["stats"] if name.startswith(f"{side.name}-"))
        assert answers["stats"][host] is True
        assert "canvas.add" in answers["registered"][host]
        assert [task["id"] for task in answers["active"][host]] == [running[side.name].id], (
            side.name
        )
    assert [outcome(result) for result in running.values()] == [
        ("ok", f"{name}-{tag}") for name in running
    ]
