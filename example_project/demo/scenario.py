"""The demo's scenario: who orders what and when, each task's copies, when the faults strike.

Both legs run the very same scenario, made from the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from example_project import domain

#: The repository's root (the demo runs workers from it, and imports the test rig from it).
ROOT = Path(__file__).resolve().parents[2]

TASKS = ("charge", "reserve", "invoice")
#: Orders the checkout places per second; the run's length follows from it.
ORDER_RATE = 12.5
MIN_SEND_WINDOW = 8.0


@dataclass(frozen=True)
class DemoOptions:
    orders: int = 300
    seed: int = 7
    postgres: bool = False
    plain: bool = True
    workers: int = 4
    concurrency: int = 3
    poison: int | None = None  # default: one order in a hundred, at least one
    failure_rate: float = 0.15
    lease_ttl: float = 3.0
    reaper_interval: float = 0.5
    max_attempts: int = 3
    output: Path = ROOT / "demo-output"
    json_path: Path | None = None
    png: bool = True


# -- the scenario: who orders what, when, and when things break ---------------------------------


@dataclass(frozen=True)
class Order:
    id: int
    customer_email: str
    sku: str
    quantity: int
    amount_cents: int
    vat_number: str

    @property
    def poison(self) -> bool:
        return len(self.vat_number) > domain.VAT_NUMBER_BUFFER


@dataclass(frozen=True)
class Send:
    at: float
    task: str
    order_id: int
    copy: int


@dataclass
class Scenario:
    orders: dict[int, Order]
    sends: list[Send]
    send_window: float
    kill_at: float
    freeze_at: float
    thaw_at: float

    @property
    def poison_ids(self) -> list[int]:
        return [order.id for order in self.orders.values() if order.poison]


def make_scenario(options: DemoOptions) -> Scenario:
    """The same orders, copies and fault times for both legs, from the seed."""
    rng = random.Random(options.seed)
    count = options.orders
    poison = options.poison if options.poison is not None else max(1, count // 100)
    poison_ids = {1 + int((k + 0.5) * count / poison) for k in range(poison)} if poison else set()
    window = max(MIN_SEND_WINDOW, count / ORDER_RATE)
    orders: dict[int, Order] = {}
    sends: list[Send] = []
    for order_id in range(1, count + 1):
        vat = "DE" + "".join(rng.choice("0123456789") for _ in range(9))
        if order_id in poison_ids:
            vat = "DE" + "7" * 30  # longer than the renderer's buffer: crashes its process
        order = Order(
            id=order_id,
            customer_email=f"customer{order_id}@example.com",
            sku=rng.choice(domain.SKUS),
            quantity=rng.randint(1, 3),
            amount_cents=rng.randint(5, 500) * 100 - 1,
            vat_number=vat,
        )
        orders[order_id] = order
        placed = (order_id - 1) * window / count
        for task in TASKS:
            # The checkout publishes each task, then publishes it again once or twice: it timed
            # out waiting for the broker, or the customer pressed "pay" twice.
            copies = rng.choice((2, 3))
            offsets = [0.0, *sorted(rng.uniform(0.05, 3.0) for _ in range(copies - 1))]
            sends += [Send(placed + offset, task, order_id, n) for n, offset in enumerate(offsets)]
    sends.sort(key=lambda send: send.at)
    freeze_for = 2 * options.lease_ttl + 1
    return Scenario(
        orders=orders,
        sends=sends,
        send_window=window,
        kill_at=0.25 * window,
        freeze_at=0.5 * window,
        thaw_at=0.5 * window + freeze_for,
    )
