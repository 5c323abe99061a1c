"""The dead-letter sink: a durable table in the store and a durable queue in the broker.

The table is the record an operator lists, shows and replays from; the queue lets other
systems watch dead letters with the broker's own tools. Nothing consumes the queue by default.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.entity import Exchange, Queue

from celery_guard import serialization
from celery_guard.errors import StoreError
from celery_guard.messages import from_kombu_message, republish
from celery_guard.store.base import DeadLetter, DeadLetterStore

logger = logging.getLogger("celery_guard.deadletters")


def dead_letter_queue(name: str) -> Queue:
    """The durable queue (and its direct exchange) dead letters are published to."""
    exchange = Exchange(name, type="direct", durable=True)  # type: ignore[no-untyped-call]
    return Queue(name, exchange, routing_key=name, durable=True)  # type: ignore[no-untyped-call]


class DeadLetterSink:
    """Writes dead letters to the store, then publishes them to the broker's queue."""

    def __init__(self, app: Any, store: DeadLetterStore, queue_name: str) -> None:
        self.app = app
        self.store = store
        self.queue = dead_letter_queue(queue_name)

    def send(self, token: int, letter: DeadLetter) -> DeadLetter:
        """Mark the key DEAD and record the letter (atomically), then publish it.

        The store write comes first: it is what makes the state final. A failed publish is
        logged and left for ``celery -A app guard reconcile`` to find.
        """
        stored = self.store.dead_letter(token, letter)
        try:
            self.publish(stored)
        except Exception as exc:  # the broker is down: the table still has the letter
            logger.error(
                "celery_guard dead letter %s for key=%s stored but not published: %s",
                stored.id,
                stored.key,
                exc,
            )
        return stored

    def keep(self, letter: DeadLetter) -> DeadLetter:
        """Record a dead letter for a delivery that never owned a key, then publish it.

        For messages Celery or celery_guard refuse before any claim (an unknown task name, an
        idempotency key the store cannot hold): they would otherwise be acknowledged and gone.
        Replaying one re-publishes its message; no key is revived.
        """
        stored = self.store.add_dead_letter(letter)
        try:
            self.publish(stored)
        except Exception as exc:  # the broker is down: the table still has the letter
            logger.error(
                "celery_guard dead letter %s for task id %s stored but not published: %s",
                stored.id,
                stored.task_id,
                exc,
            )
        return stored

    def keep_unknown_task(self, name: str, task_id: str, message: Any) -> DeadLetter | None:
        """Keep the message of a task this worker does not know, which Celery discards.

        Deploy the task, then ``celery -A app guard dlq replay ID`` sends it again.
        """
        letter = DeadLetter(
            key=task_id,
            task_name=name,
            task_id=task_id,
            message=from_kombu_message(name, task_id, message),
            error_class="permanent",
            error_type="NotRegistered",
            error=f"task {name!r} is not registered in this worker",
            traceback=None,
            reason=(
                "unknown task: Celery discarded the message; deploy the task to the workers "
                "of this queue, then replay this dead letter"
            ),
            attempts=0,
        )
        try:
            stored = self.keep(letter)
        except StoreError as exc:
            logger.error(
                "celery_guard could not keep the message of unknown task %s: %s", name, exc
            )
            return None
        logger.warning(
            "celery_guard kept the message of unknown task %s (id %s) as dead letter %s",
            name,
            task_id,
            stored.id,
        )
        return stored

    def publish(self, letter: DeadLetter) -> None:
        with self.app.producer_or_acquire() as producer:
            producer.publish(
                serialization.dumps(letter.as_dict()),
                exchange=self.queue.exchange,
                routing_key=self.queue.routing_key,
                declare=[self.queue],
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
                headers={"guard_dead_letter_id": letter.id, "guard_idempotency_key": letter.key},
                retry=True,
                retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
            )

    def replay(self, letter_id: int) -> tuple[str, DeadLetter | None]:
        """Revive a dead letter and publish its message again.

        Returns ("replayed", letter), ("already", letter) or ("unknown", None). Replaying twice
        runs the task once: only the first call revives the key and publishes.
        """
        letter = self.store.get_dead_letter(letter_id)
        if letter is None:
            return "unknown", None
        if letter.message is None:
            raise StoreError(f"dead letter {letter_id} has no stored message to replay")
        revived = self.store.revive(letter_id)
        if revived is None:
            return "already", letter
        try:
            republish(self.app, serialization.loads(revived.message or letter.message))
        except Exception:
            # Nothing was sent: put the letter and its key back as they were, so the next
            # replay tries again instead of answering "already replayed".
            self.store.unrevive(letter_id)
            raise
        return "replayed", revived
