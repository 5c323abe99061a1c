"""The example Django project under real ``celery worker`` processes (prefork) on the rig's
PostgreSQL and Redis: one ORM row per key, whatever happens to the deliveries and workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

import celery_guard
from celery_guard.store import KeyRecord
from example_project.django_shop.orders import tasks as shop_tasks
from example_project.django_shop.orders.models import Charge, Order
from tests.acceptance.conftest import worker_running
from tests.rig.procs import wait_until
from tests.rig.workers import WorkerProcess, stop_all

pytestmark = [pytest.mark.workers, pytest.mark.postgres, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60


@pytest.fixture(scope="module")
def worker_env(
    django_db_setup: None, broker: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """What the project's workers need to find the test database, the broker and the gates."""
    database = connections["default"].settings_dict  # the test database by now
    return {
        "DJANGO_SHOP_DATABASE_URL": (
            f"postgresql://{database['USER']}@{database['HOST']}:{database['PORT']}/"
            f"{database['NAME']}"
        ),
        "DJANGO_SHOP_BROKER_URL": broker["broker"],
        "DJANGO_SHOP_RESULT_URL": broker["results"],
        "DJANGO_SHOP_MARKER_DIR": str(tmp_path_factory.mktemp("django-gates")),
        "DJANGO_SHOP_LEASE_TTL": "3",
        "DJANGO_SHOP_BACKOFF_BASE": "0.2",
        "DJANGO_SHOP_REAPER_INTERVAL": "0.5",
    }


@pytest.fixture
def workers(worker_env: dict[str, str]) -> Iterator[list[WorkerProcess]]:
    """Two prefork workers of the project (``celery -A example_project.django_shop worker``)."""
    started = [
        WorkerProcess("example_project.django_shop", env=worker_env, cwd=ROOT, concurrency=2)
        for _ in range(2)
    ]
    try:
        for worker in started:
            worker.start(wait_ready=False)
        for worker in started:
            worker.wait_ready(timeout=90)
        yield started
    finally:
        for worker in started:
            worker.thaw()
        stop_all(started)


@pytest.fixture
def charge(shop_app: Any) -> Any:
    return shop_app.tasks[shop_tasks.charge.name]


def key_of(order: Order) -> str:
    return f"charge:{order.id}"


def record(shop_app: Any, order: Order) -> KeyRecord | None:
    return celery_guard.get_runtime(shop_app).store.keys.get(key_of(order))


def reached(env: dict[str, str], order: Order, exclude: frozenset[int] = frozenset()) -> int:
    """Wait until an execution for ``order`` has written and waits at its gate; its token."""
    found: list[int] = []

    def arrived() -> bool:
        for marker in Path(env["DJANGO_SHOP_MARKER_DIR"]).glob(f"{order.id}.*.reached"):
            token = int(marker.name.split(".")[1])
            if token not in exclude:
                found.append(token)
                return True
        return False

    wait_until(arrived, TIMEOUT, f"an execution of order {order.id} at its gate")
    return found[-1]


def open_gate(env: dict[str, str], order: Order, token: int) -> None:
    (Path(env["DJANGO_SHOP_MARKER_DIR"]) / f"{order.id}.{token}").touch()


def completed(shop_app: Any, order: Order) -> KeyRecord:
    done: list[KeyRecord] = []

    def check() -> bool:
        found = record(shop_app, order)
        if found is not None and found.state == "COMPLETED":
            done.append(found)
            return True
        return False

    wait_until(check, TIMEOUT, f"{key_of(order)} to complete")
    return done[-1]


@pytest.mark.django_db(transaction=True)
def test_one_key_delivered_20_times_across_two_workers_writes_one_row(
    workers: list[WorkerProcess], charge: Any
) -> None:
    order = Order.objects.create(amount=100)
    results = [charge.apply_async((order.id,)) for _ in range(20)]
    values = [result.get(timeout=TIMEOUT) for result in results]
    assert values == [{"order": order.id, "charged": 100}] * 20
    assert Charge.objects.filter(order=order).count() == 1
    assert Order.objects.get(id=order.id).status == "paid"


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_after_the_orm_write_and_before_the_ack_leaves_one_row(
    workers: list[WorkerProcess], worker_env: dict[str, str], charge: Any, shop_app: Any
) -> None:
    order = Order.objects.create(amount=7)
    charge.apply_async((order.id, "gate"))
    first = reached(worker_env, order)  # written, not committed, not acknowledged
    current = record(shop_app, order)
    assert current is not None and current.owner
    worker_running(workers, current.owner).kill()  # the whole worker, main process and children
    second = reached(worker_env, order, exclude=frozenset({first}))  # taken over by the survivor
    assert second > first
    open_gate(worker_env, order, second)
    done = completed(shop_app, order)
    assert done.fencing_token == second
    assert [c.fencing_token for c in Charge.objects.filter(order=order)] == [second]


@pytest.mark.django_db(transaction=True)
def test_a_frozen_worker_resumed_after_a_takeover_has_its_commit_refused(
    workers: list[WorkerProcess], worker_env: dict[str, str], charge: Any, shop_app: Any
) -> None:
    order = Order.objects.create(amount=9)
    charge.apply_async((order.id, "gate"))
    first = reached(worker_env, order)
    current = record(shop_app, order)
    assert current is not None and current.owner
    frozen = worker_running(workers, current.owner)
    frozen.freeze()  # SIGSTOP: its lease lapses while its transaction stays open

    def taken_over() -> bool:
        found = record(shop_app, order)
        return found is not None and found.fencing_token > first

    wait_until(taken_over, TIMEOUT, f"{key_of(order)} to be taken over")
    # The frozen body still holds its row locks: resume it and let it try to complete first.
    frozen.thaw()
    open_gate(worker_env, order, first)
    wait_until(
        lambda: "completion refused (fenced)" in frozen.log_text(),
        TIMEOUT,
        "the resumed worker's completion to be refused",
    )
    second = reached(worker_env, order, exclude=frozenset({first}))
    open_gate(worker_env, order, second)
    done = completed(shop_app, order)
    assert done.fencing_token == second
    assert [c.fencing_token for c in Charge.objects.filter(order=order)] == [second]


@pytest.mark.django_db(transaction=True)
def test_a_transient_error_after_the_orm_write_leaves_no_row_and_the_retry_writes_one(
    workers: list[WorkerProcess], charge: Any, shop_app: Any
) -> None:
    order = Order.objects.create(amount=3)
    assert charge.apply_async((order.id, "fail_once")).get(timeout=TIMEOUT) == {
        "order": order.id,
        "charged": 3,
    }
    # The first attempt wrote its row, then failed: had it committed, its row would be here.
    assert [c.attempt for c in Charge.objects.filter(order=order)] == [2]
    done = record(shop_app, order)
    assert done is not None and done.state == "COMPLETED" and done.attempts == 2
