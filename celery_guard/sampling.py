"""What the reaper's holder samples for everyone: the store's key states and the broker's queues.

One worker at a time samples (the one holding the reaper's lease), so the cluster-wide series
are computed once and exported once. Store and broker are read independently: a broker that
does not answer leaves the store's figures standing, and the reverse.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import amqp.exceptions

from celery_guard import redis_queues
from celery_guard.errors import StoreError
from celery_guard.store.base import SampleSource, WorkerRecord

logger = logging.getLogger("celery_guard.sampling")


@dataclass
class Sample:
    """One sampling pass."""

    taken_at: float
    keys_by_state: dict[str, int] = field(default_factory=dict)
    expired_leases: int = 0
    oldest_running_seconds: float = 0.0
    dead_letters_pending: int = 0
    #: queue name -> (messages waiting, age of the oldest in seconds or ``None`` if unknown).
    queues: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    workers: list[WorkerRecord] = field(default_factory=list)


class Sampler:
    """Reads the store and the broker; called by the reaper's holder once per pass."""

    def __init__(self, app: Any, store: SampleSource, queues: list[str]) -> None:
        self.app = app
        self.store = store
        self.queues = queues
        self._connection: Any = None
        self._channel: Any = None
        #: Queues already reported missing (logged once, not on every pass).
        self._missing: set[str] = set()

    def sample(self) -> Sample:
        now = time.time()
        sample = Sample(taken_at=now)
        try:
            sample.keys_by_state = self.store.keys.count_keys_by_state()
            sample.expired_leases = self.store.keys.count_expired_leases()
            oldest = self.store.keys.oldest_running()
            if oldest is not None:
                sample.oldest_running_seconds = max(0.0, self.store.now() - oldest.updated_at)
            sample.dead_letters_pending = self.store.dead_letters.count_dead_letters()[1]
            sample.workers = self.store.workers.list_workers()
        except StoreError as exc:
            logger.warning("celery_guard sampling: store did not answer: %s", exc)
        try:
            sample.queues = self.queue_stats(now)
        except Exception as exc:  # a broker hiccup must not end sampling
            logger.warning("celery_guard sampling: broker did not answer: %s", exc)
            self.close()
        return sample

    def queue_stats(self, now: float) -> dict[str, tuple[int, float | None]]:
        """Depth of each queue and, on Redis, the age of its oldest message.

        A queue that does not exist has no messages waiting: depth 0, so the series reads 0
        instead of vanishing when a queue drains.
        """
        if self._connection is None:
            self._connection = self.app.connection_for_read()
            self._channel = None
        if self._channel is None:
            self._channel = self._connection.channel()
        channel = self._channel
        stats: dict[str, tuple[int, float | None]] = {}
        for queue in self.queues:
            lists = redis_queues.channel_lists(channel, queue)
            if lists is not None:
                # kombu's Redis transport answers a passive declare of a queue whose lists are
                # empty, so deleted by Redis, with 404 (virtual/base.py ``queue_declare``,
                # redis.py ``_has_queue``): count the lists instead.
                depth = redis_queues.depth(channel.client, lists)
                stats[queue] = (depth, _oldest_age(channel.client, lists, now))
                continue
            try:
                declared = channel.queue_declare(queue=queue, passive=True)
            except amqp.exceptions.NotFound:
                # Not declared yet (no worker has consumed it): nothing can wait in it. The
                # broker closed the channel; the next queue gets a new one.
                if queue not in self._missing:
                    self._missing.add(queue)
                    logger.info("celery_guard sampling: queue %r does not exist (yet)", queue)
                stats[queue] = (0, None)
                self._channel = channel = self._connection.channel()
                continue
            self._missing.discard(queue)
            stats[queue] = (int(declared.message_count), None)
        return stats

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.release()
            except Exception:  # closing a broken connection may fail too
                logger.debug("celery_guard sampling: closing the broker connection failed")
            self._connection = self._channel = None


def _oldest_age(client: Any, lists: list[str], now: float) -> float | None:
    """Age of the oldest message in a kombu Redis queue, from its publish-time header.

    Other transports never get here: AMQP cannot peek without taking the message.
    """
    known = [stamp for stamp in redis_queues.oldest_stamps(client, lists) if stamp is not None]
    if not known:
        return None
    return max(0.0, now - min(known))
