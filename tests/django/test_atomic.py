"""``self.guard.atomic()`` in one process (eager tasks), on Django's PostgreSQL and SQLite
backends: the ORM's writes and the key's COMPLETED marker commit together or not at all."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.conf import settings
from django.core import checks
from django.db import IntegrityError, transaction
from django.test import override_settings
from sqlalchemy import update

import celery_guard
import celery_guard.contrib.django
from celery_guard import (
    ConfigurationError,
    GuardedTask,
    GuardError,
    InFlightElsewhere,
    TransactionMisuse,
)
from celery_guard.contrib.django import DjangoTransactionMisuse, GuardedDjangoTask
from celery_guard.contrib.django.checks import check_database
from celery_guard.store.schema import keys
from example_project.django_shop.orders.models import Charge, Order

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, databases=["default", "sqlite"]),
]


def eager_app(alias: str, **conf: Any) -> Celery:
    app = Celery(f"shop-{alias}-{uuid.uuid4().hex[:6]}", task_cls=GuardedDjangoTask)
    app.conf.update(
        task_always_eager=True,
        broker_url="memory://",  # dead letters are published to the broker too
        guard_liveness_locks=False,
        guard_database=alias,
        guard_metrics_port=None,
        guard_lease_ttl=5.0,
        guard_backoff_base=0.01,
        guard_backoff_max=0.02,
        guard_max_attempts=3,
        **conf,
    )
    celery_guard.contrib.django.install(app)
    return app


@pytest.fixture(params=["default", "sqlite"], ids=["postgresql", "sqlite"])
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def app(alias: str) -> Iterator[Celery]:
    app = eager_app(alias)
    yield app
    celery_guard.get_runtime(app).store.dispose()


def order(alias: str, amount: int = 100) -> Order:
    return Order.objects.using(alias).create(amount=amount)


def charges(alias: str, order: Order) -> list[Charge]:
    return list(Charge.objects.using(alias).filter(order_id=order.id).order_by("id"))


def write_charge(task: Any, alias: str, order_id: int) -> None:
    Charge.objects.using(alias).create(
        order_id=order_id,
        amount=1,
        fencing_token=task.guard.fencing_token or 0,  # None in a direct call
        attempt=task.guard.attempts,
    )


def test_the_writes_and_the_marker_commit_together_and_a_duplicate_runs_nothing(
    app: Celery, alias: str
) -> None:
    nonce = uuid.uuid4().hex

    @app.task(shared=False, bind=True, idempotency_key="charge:{order_id}:{nonce}")
    def charge(self: Any, order_id: int, nonce: str) -> int:
        with self.guard.atomic():
            write_charge(self, alias, order_id)
        return order_id

    placed = order(alias)
    assert charge.delay(placed.id, nonce).get() == placed.id
    assert charge.delay(placed.id, nonce).get() == placed.id
    assert len(charges(alias, placed)) == 1
    record = celery_guard.get_runtime(app).store.keys.get(f"charge:{placed.id}:{nonce}")
    assert record is not None and record.state == "COMPLETED" and record.duplicates == 1


def test_a_transient_error_after_the_write_leaves_no_row_and_the_retry_writes_one(
    app: Celery, alias: str
) -> None:
    seen: list[int] = []

    @app.task(shared=False, bind=True, idempotency_key="charge:{order_id}")
    def charge(self: Any, order_id: int) -> int:
        with self.guard.atomic():
            write_charge(self, alias, order_id)
        # The block has ended; its writes still wait for the marker.
        seen.append(len(charges(alias, Order(id=order_id))))
        if self.guard.attempts == 1:
            raise ConnectionError("the payment provider timed out")
        return order_id

    placed = order(alias)
    assert charge.delay(placed.id).get() == placed.id
    assert seen == [1, 1], "each attempt saw only its own uncommitted row"
    assert [c.attempt for c in charges(alias, placed)] == [2]


def test_a_nested_atomic_block_is_a_savepoint(app: Celery, alias: str) -> None:
    @app.task(shared=False, bind=True, idempotency_key="charge:{order_id}")
    def charge(self: Any, order_id: int) -> None:
        with self.guard.atomic():
            write_charge(self, alias, order_id)
            try:
                with transaction.atomic(using=alias):
                    Charge.objects.using(alias).create(
                        order_id=order_id, amount=2, fencing_token=0, attempt=0
                    )
                    raise IntegrityError("declined")
            except IntegrityError:
                pass  # only the nested block's row is undone
        with self.guard.atomic():  # the same transaction again
            Order.objects.using(alias).filter(id=order_id).update(status="paid")

    placed = order(alias)
    charge.delay(placed.id).get()
    assert [c.amount for c in charges(alias, placed)] == [1]
    assert Order.objects.using(alias).get(id=placed.id).status == "paid"


@pytest.mark.parametrize(
    "end",
    [
        transaction.commit,
        transaction.rollback,
        lambda using: transaction.set_autocommit(True, using),
    ],
)
def test_ending_the_transaction_behind_the_guards_back_fails_clearly_and_commits_nothing(
    app: Celery, alias: str, end: Any
) -> None:
    caught: list[BaseException] = []

    @app.task(shared=False, bind=True, idempotency_key="charge:{order_id}")
    def charge(self: Any, order_id: int) -> None:
        with self.guard.atomic():
            write_charge(self, alias, order_id)
            try:
                end(using=alias)
            except DjangoTransactionMisuse as exc:
                caught.append(exc)  # caught and ignored: the execution fails all the same

    placed = order(alias)
    with pytest.raises(TransactionMisuse, match="tried to end the transaction"):
        charge.delay(placed.id).get()
    assert len(caught) == 1 and isinstance(caught[0], transaction.TransactionManagementError)
    assert charges(alias, placed) == []
    record = celery_guard.get_runtime(app).store.keys.get(f"charge:{placed.id}")
    assert record is not None and record.state == "DEAD", "a programming error: dead-lettered"


def test_a_transaction_marked_for_rollback_commits_nothing(app: Celery, alias: str) -> None:
    @app.task(shared=False, bind=True, idempotency_key="charge:{order_id}")
    def charge(self: Any, order_id: int) -> None:
        with self.guard.atomic():
            write_charge(self, alias, order_id)
        # Inside the block it would undo the block (a savepoint), as in Django; here it marks
        # the guard's own transaction, whose marker would then roll back unseen.
        transaction.set_rollback(True, using=alias)

    placed = order(alias)
    with pytest.raises(TransactionMisuse, match="marked for rollback"):
        charge.delay(placed.id).get()
    assert charges(alias, placed) == []


def test_a_completion_whose_key_was_taken_over_is_refused_and_rolled_back(
    app: Celery, alias: str
) -> None:
    store = celery_guard.get_runtime(app).store

    @app.task(shared=False, bind=True, idempotency_key="charge:{order_id}")
    def charge(self: Any, order_id: int) -> None:
        # Another owner takes the key over (its token rises) before this one completes.
        with store.engine.begin() as connection:
            connection.execute(
                update(keys)
                .where(keys.c.key == f"charge:{order_id}")
                .values(fencing_token=keys.c.fencing_token + 1)
            )
        with self.guard.atomic():
            write_charge(self, alias, order_id)

    placed = order(alias)
    with pytest.raises(InFlightElsewhere):  # eager: the newer owner's result is not there yet
        charge.delay(placed.id).get()
    assert charges(alias, placed) == []


def test_a_direct_call_commits_its_atomic_block(app: Celery, alias: str) -> None:
    @app.task(shared=False, bind=True)
    def charge(self: Any, order_id: int) -> None:
        with self.guard.atomic():
            write_charge(self, alias, order_id)

    placed = order(alias)
    charge(placed.id)
    assert len(charges(alias, placed)) == 1


def test_the_store_lives_on_the_alias_database(app: Celery, alias: str) -> None:
    from django.db import connections

    config = celery_guard.get_runtime(app).config
    assert config.database == alias
    assert config.create_tables is False, "migrations own the schema under Django"
    assert connections[alias].settings_dict["NAME"].rsplit("/", 1)[-1] in config.store_url


# -- bad input: each says what to do ---------------------------------------------------------


def test_an_unknown_alias_is_refused() -> None:
    app = eager_app("nope")
    with pytest.raises(ConfigurationError, match="'nope', which is not in Django's DATABASES"):
        celery_guard.get_runtime(app).load()


def test_a_store_url_beside_the_django_database_is_refused() -> None:
    app = eager_app("default", guard_store_url="sqlite:///elsewhere.sqlite3")
    with pytest.raises(ConfigurationError, match="remove the URL"):
        celery_guard.get_runtime(app).load()


def test_guard_database_without_the_django_integration_is_refused() -> None:
    app = Celery("plain", set_as_current=False)
    app.conf.update(guard_database="default", guard_store_url="sqlite:///x.sqlite3")
    celery_guard.install(app)
    with pytest.raises(ConfigurationError, match=r"contrib\.django\.install"):
        celery_guard.get_runtime(app).load()


def test_installing_twice_with_different_integrations_is_refused() -> None:
    app = Celery("twice", set_as_current=False)
    celery_guard.install(app)
    with pytest.raises(ConfigurationError, match="call one install"):
        celery_guard.contrib.django.install(app)


def test_atomic_without_the_integration_says_what_to_install(tmp_path: Any) -> None:
    app = Celery("core-only", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        broker_url="memory://",
        guard_store_url=f"sqlite:///{tmp_path / 's.sqlite3'}",
        guard_metrics_port=None,
    )
    celery_guard.install(app)

    @app.task(shared=False, base=GuardedTask, bind=True)
    def body(self: Any) -> None:
        with self.guard.atomic():
            pass

    with pytest.raises(GuardError, match=r"celery_guard\.contrib\.django\.install\(app\)"):
        body.delay().get()
    celery_guard.get_runtime(app).store.dispose()


def test_atomic_on_another_alias_is_refused(app: Celery, alias: str) -> None:
    other = "sqlite" if alias == "default" else "default"

    @app.task(shared=False, bind=True, idempotency_key="other:{n}")
    def body(self: Any, n: str) -> None:
        with self.guard.atomic(using=other):
            pass

    with pytest.raises(TransactionMisuse, match="only writes there commit"):
        body.delay(uuid.uuid4().hex).get()


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_the_system_checks_name_a_database_the_store_cannot_use() -> None:
    with override_settings(CELERY_GUARD_DATABASE="missing"):
        assert [m.id for m in check_database()] == ["celery_guard.E001"]
    sqlite = settings.DATABASES["sqlite"]
    in_memory = {**settings.DATABASES, "sqlite": {**sqlite, "NAME": ":memory:"}}
    with override_settings(CELERY_GUARD_DATABASE="sqlite", DATABASES=in_memory):
        found = check_database()
    assert [m.id for m in found] == ["celery_guard.E001"] and "in-memory" in found[0].msg
    deferred = {**settings.DATABASES, "sqlite": {**sqlite, "OPTIONS": {}}}
    with override_settings(CELERY_GUARD_DATABASE="sqlite", DATABASES=deferred):
        found = check_database()
    assert [m.id for m in found] == ["celery_guard.W001"]
    assert all(isinstance(m, checks.CheckMessage) for m in found)
    with override_settings(CELERY_GUARD_DATABASE="sqlite"):
        assert check_database() == [], "the project's own SQLite settings pass"
