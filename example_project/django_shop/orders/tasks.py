"""The charge task: its ORM writes commit with the key's COMPLETED marker, or not at all."""

import os
import time
from pathlib import Path

from celery import shared_task

from .models import Charge, Order


@shared_task(bind=True, idempotency_key="charge:{order_id}")
def charge(self, order_id: int, mode: str = "plain") -> dict[str, int]:
    """Charge an order once, however often its message is delivered.

    ``mode`` exists for the tests: ``"gate"`` waits after the writes until the test lets this
    execution go (to kill or freeze its worker there), ``"fail_once"`` fails its first attempt
    after the writes with a transient error.
    """
    order = Order.objects.get(id=order_id)
    with self.guard.atomic():
        Charge.objects.create(
            order=order,
            amount=order.amount,
            fencing_token=self.guard.fencing_token,
            attempt=self.guard.attempts,
        )
        Order.objects.filter(id=order_id).update(status="paid")
    if mode == "gate":
        _hold(f"{order_id}.{self.guard.fencing_token}")
    if mode == "fail_once" and self.guard.attempts == 1:
        raise ConnectionError("the payment provider timed out")  # transient: retried
    return {"order": order_id, "charged": order.amount}


def _hold(name: str, timeout: float = 120.0) -> None:
    """Say this execution has written, then wait until the test opens its gate."""
    markers = Path(os.environ["DJANGO_SHOP_MARKER_DIR"])
    (markers / f"{name}.reached").touch()
    deadline = time.monotonic() + timeout
    while not (markers / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {name} never opened")
        time.sleep(0.05)
