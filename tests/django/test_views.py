"""``delay_on_commit`` (Celery's DjangoTask, which GuardedDjangoTask is): a view publishes its
charge only once its own transaction has committed, and nothing after a rollback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import signals
from django.test import Client

from example_project.django_shop.orders.models import Order
from example_project.django_shop.orders.tasks import charge

pytestmark = [pytest.mark.redis, pytest.mark.postgres]


@pytest.fixture
def published(shop_app: Any) -> Iterator[list[dict[str, Any]]]:
    """Every message this process hands to the broker (sent just before it goes out)."""
    sent: list[dict[str, Any]] = []

    def record(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
        sent.append({"task": sender, "args": list(body[0]) if body else None})

    signals.before_task_publish.connect(record, weak=False)
    try:
        yield sent
    finally:
        signals.before_task_publish.disconnect(record)
        with shop_app.connection_for_write() as connection:
            connection.default_channel.queue_purge(shop_app.conf.task_default_queue)


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_view_transaction_sends_nothing(published: list[dict[str, Any]]) -> None:
    response = Client().post("/orders/", {"amount": "0"})
    assert response.status_code == 400
    assert Order.objects.count() == 0, "the order was rolled back"
    assert published == []


@pytest.mark.django_db(transaction=True)
def test_a_committed_view_transaction_sends_the_charge_once(
    published: list[dict[str, Any]],
) -> None:
    response = Client().post("/orders/", {"amount": "12"})
    assert response.status_code == 201
    order_id = response.json()["order"]
    assert Order.objects.filter(id=order_id).exists()
    assert published == [{"task": charge.name, "args": [order_id]}]
