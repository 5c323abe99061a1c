"""Publish tracking (``guard_track_publishes``, opt-in): re-publish what no worker ever claimed.

The reaper recovers keys whose owner died, but a message lost *before* any claim leaves no key
row to recover: kombu's Redis transport takes a message with BRPOP and only afterwards records
it as unacknowledged (celery/celery#7950, kombu#305), so a worker SIGKILLed in between takes
the message with it; a message prefetched by a worker SIGKILLed whole comes back only after
the visibility timeout (an hour by default). With tracking on:

- a producer records each guarded publish in ``celery_guard_published`` before the message
  leaves (``before_task_publish``): the key, computed as the worker will compute it, and the
  JSON the reaper needs to send it again;
- the reaper's holder forgets records whose key has a row in the keys table (claimed once: the
  keys table owns it from there), and re-publishes those still unclaimed
  ``guard_unclaimed_republish_after`` seconds after they were due. On a Redis broker it first
  checks that the queue has moved past the message, so a backlog is not duplicated.

A duplicate copy is never a double effect (the key table answers it), only a cost.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from celery import signals
from celery._state import get_current_task

from celery_guard import messages, redis_queues, serialization
from celery_guard.errors import StoreError
from celery_guard.keys import HEADER_KEY, HEADER_KEY_SOURCE, KeySource, resolve_key
from celery_guard.messages import PUBLISHED_AT_HEADER
from celery_guard.store.base import PublishLog, PublishRecord, PublishRecovery

logger = logging.getLogger("celery_guard.outbox")

#: After a publish could not be recorded (the store did not answer within
#: ``guard_store_timeout``), this process sends its publishes untracked for this many seconds
#: before trying the store again, so an outage delays one publish per period, not every one.
TRACKING_PAUSE: float = 10.0
#: Re-publishes of one record without any claim before the reaper gives up on it (logged at
#: ERROR, record deleted): a message lost that many times in a row is no broker accident but a
#: worker that never claims it (the task is not a GuardedTask there).
MAX_UNCLAIMED_REPUBLISHES: Final = 3
#: Records the reaper's holder examines per pass for cleanup (in batches), and re-publishes at
#: most per pass.
CLEANUP_BATCH: Final = 1000
CLEANUP_BATCHES: Final = 5
DUE_BATCH: Final = 200

# -- what a publish is part of ----------------------------------------------------------------


#: Whether a task is one this app guards (``isinstance(task, GuardedTask)``), and the key its
#: task option gives a call's arguments (``None``: no key option): passed in by ``install()``,
#: so publish tracking never imports the task class.
IsGuarded = Callable[[Any], bool]
KeyFor = Callable[[Any, Any, Any], str | None]


@dataclass
class _Context:
    """One publish through a tracking app's ``send_task``."""

    #: The tracking app's tracker (the signal does not say which app publishes, and two apps
    #: in one process may name the same task).
    tracker: PublishTracker
    #: Records written for this publish: forgotten again if the publish raises.
    written: list[tuple[str, str]] = field(default_factory=list)


_CONTEXT: contextvars.ContextVar[_Context | None] = contextvars.ContextVar(
    "celery_guard_publish", default=None
)


# -- the producer's side ----------------------------------------------------------------------


class PublishTracker:
    """One app's publish tracking: a record per guarded publish, in the app's store."""

    def __init__(
        self,
        app: Any,
        store: PublishLog,
        *,
        max_payload_bytes: int | None,
        is_guarded: IsGuarded,
        key_for: KeyFor,
    ) -> None:
        self.app = app
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        self.is_guarded = is_guarded
        self.key_for = key_for
        self._lock = threading.Lock()
        self._paused_until = 0.0
        #: Publishes sent untracked since the store last failed.
        self._untracked = 0

    def publish(self, send_task: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Publish through the app's original ``send_task``, tracked.

        Every publish of the app goes through its ``send_task`` (``apply_async`` calls it too),
        which ``install()`` wraps to call this: it says which app publishes and forgets the
        record of a publish that raised, so the caller's error means "not sent" and the reaper
        sends nothing.
        """
        if messages.republishing():
            return send_task(*args, **kwargs)
        context = _Context(tracker=self)
        token = _CONTEXT.set(context)
        try:
            return send_task(*args, **kwargs)
        except BaseException:
            for key, task_id in context.written:
                self.forget(key, task_id, why="its publish failed")
            raise
        finally:
            _CONTEXT.reset(token)

    def guarded_task(self, name: str) -> Any | None:
        """The app's GuardedTask of this name, or ``None`` (not registered, or not guarded)."""
        task = self.app.tasks.get(name)
        return task if task is not None and self.is_guarded(task) else None

    def track(
        self,
        task: Any,
        *,
        body: Any,
        headers: dict[str, Any],
        exchange: Any,
        routing_key: str | None,
        properties: dict[str, Any],
        context: _Context | None,
    ) -> None:
        entry = publish_entry(
            task,
            body,
            headers,
            exchange,
            routing_key,
            properties,
            self.max_payload_bytes,
            key_for=self.key_for,
        )
        if entry is None or self._paused():
            return
        try:
            self.store.track_publish(**entry)
        except StoreError as exc:
            self._pause(entry, exc)
            return
        with self._lock:
            untracked, self._untracked = self._untracked, 0
        if untracked:
            logger.warning(
                "celery_guard publish tracking resumed; %d publish(es) were sent untracked "
                "while the store did not answer",
                untracked,
            )
        if context is not None:
            context.written.append((entry["key"], entry["task_id"]))

    def forget(self, key: str, task_id: str, *, why: str) -> None:
        """Delete one publish's record, if it has one; store errors are logged, not raised."""
        try:
            forgotten = self.store.forget_publish(key, task_id)
        except StoreError as exc:
            logger.warning(
                "celery_guard could not delete the tracked publish of key=%s id=%s (%s): %s; "
                "the reaper may publish it again",
                key,
                task_id,
                why,
                exc,
            )
            return
        if forgotten:
            logger.info(
                "celery_guard forgot the tracked publish of key=%s id=%s: %s", key, task_id, why
            )

    def _paused(self) -> bool:
        with self._lock:
            if time.monotonic() < self._paused_until:
                self._untracked += 1
                return True
            return False

    def _pause(self, entry: dict[str, Any], exc: StoreError) -> None:
        with self._lock:
            self._paused_until = time.monotonic() + TRACKING_PAUSE
            self._untracked += 1
        # The publish goes on: tracking is a safety net, and a store outage must not become
        # an outage of every producer (the store's failure defers the deliveries anyway).
        logger.warning(
            "celery_guard could not record the publish of %s (id %s) in the store, so it is "
            "sent untracked, as are this process's publishes for the next %gs: %s",
            entry["task_name"],
            entry["task_id"],
            TRACKING_PAUSE,
            exc,
        )


def publish_entry(
    task: Any,
    body: Any,
    headers: dict[str, Any],
    exchange: Any,
    routing_key: str | None,
    properties: dict[str, Any],
    max_payload_bytes: int | None,
    *,
    key_for: KeyFor,
) -> dict[str, Any] | None:
    """The record of one publish (``Publishes.track_publish``'s arguments), or ``None`` when it
    is not tracked: a message the reaper could not send again, or whose key no worker can use.

    Sets the key headers when the task option gave the key (``send_task`` by name), so the
    worker runs the message under the key its record names, as ``apply_async`` already does.
    """
    if not isinstance(body, (tuple, list)) or len(body) != 3:
        return None  # task protocol 1: a body celery_guard does not read
    args, kwargs, embed = body
    task_id = headers.get("id")
    if not task_id:
        return None
    try:
        key, source = resolve_key(
            headers.get(HEADER_KEY) or None,
            headers.get(HEADER_KEY_SOURCE),
            lambda: key_for(task, args or (), kwargs or {}),
            task_id,
        )
    except Exception as exc:
        # The worker keeps such a message as a dead letter; no key row will ever come.
        logger.debug("celery_guard does not track %s (id %s): %s", task.name, task_id, exc)
        return None
    if source is KeySource.OPTION and HEADER_KEY not in headers:
        headers[HEADER_KEY] = key
        headers[HEADER_KEY_SOURCE] = source.value
    text = messages.from_publish(
        task.name,
        task_id,
        args,
        kwargs,
        embed or {},
        headers,
        key=key,
        source=source,
        exchange=exchange,
        routing_key=routing_key,
        properties=properties,
    )
    if text is None:
        logger.debug("celery_guard does not track %s (id %s): not JSON", task.name, task_id)
        return None
    if max_payload_bytes is not None and len(text.encode("utf-8")) > max_payload_bytes:
        logger.warning(
            "celery_guard does not track the publish of %s (id %s): its message is larger "
            "than guard_max_payload_bytes",
            task.name,
            task_id,
        )
        return None
    now = time.time()
    eta = _timestamp(headers.get("eta"))
    expires = _timestamp(headers.get("expires"))
    stamp = headers.get(PUBLISHED_AT_HEADER)
    return {
        "key": key,
        "task_name": task.name,
        "task_id": task_id,
        "message": text,
        "publisher_stamp": float(stamp) if isinstance(stamp, (int, float)) else None,
        "countdown": 0.0 if eta is None else eta - now,
        "expires_in": None if expires is None else expires - now,
    }


def _timestamp(value: Any) -> float | None:
    if not value:
        return None
    try:
        moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
        return moment.timestamp()
    except (TypeError, ValueError):
        return None


def connect_tracking() -> None:
    """Record tracked publishes (``install()``; a no-op for a publish no tracker sends)."""
    signals.before_task_publish.connect(
        _on_before_publish, weak=False, dispatch_uid="celery_guard.track_publish"
    )


def _on_before_publish(
    sender: Any = None,
    body: Any = None,
    exchange: Any = None,
    routing_key: str | None = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """``before_task_publish``: record a guarded publish before it reaches the broker."""
    context = _CONTEXT.get()
    if headers is None or context is None or messages.republishing():
        return  # not published through a tracking app's send_task, or a re-publish
    name = str(headers.get("task") or sender)
    task = context.tracker.guarded_task(name)
    if task is None:
        return  # by name to a task this app does not know, or not a GuardedTask
    current = get_current_task()
    if current is not None and current.name == name and current.request.id == headers.get("id"):
        return  # the running task's own retry or deferral: its key has a row already
    try:
        context.tracker.track(
            task,
            body=body,
            headers=headers,
            exchange=exchange,
            routing_key=routing_key,
            properties=properties or {},
            context=context,
        )
    except Exception:  # never let tracking stop a publish
        logger.exception("celery_guard publish tracking failed for %s", name)


# -- the reaper's side ------------------------------------------------------------------------


class QueueProbe:
    """Whether a Redis queue has moved past a message, read without taking anything."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._connection: Any = None
        self._redis: bool | None = None
        self._oldest: dict[str, list[float | None]] = {}

    def begin_pass(self) -> None:
        self._oldest.clear()

    def moved_past(self, message: dict[str, Any], stamp: float | None) -> bool | None:
        """True: every priority list of the message's queue is empty or starts with a message
        published after it (lost, or taken by a worker); False: it may still be waiting
        there; ``None``: cannot tell (not a Redis broker, an unknown route, a message without
        a publish-time header), and only the delay applies."""
        if stamp is None:
            return None
        channel = self._channel()
        if channel is None:
            return None
        queues = _queues_of(channel, message.get("exchange"), message.get("routing_key"))
        if not queues:
            return None
        for queue in queues:
            if queue not in self._oldest:
                lists = redis_queues.channel_lists(channel, queue)
                self._oldest[queue] = (
                    [] if lists is None else redis_queues.oldest_stamps(channel.client, lists)
                )
            for oldest in self._oldest[queue]:
                if oldest is None:
                    return None
                if oldest <= stamp:
                    return False
        return True

    def _channel(self) -> Any:
        if self._redis is False:
            return None
        if self._connection is None:
            connection = self.app.connection_for_read()
            if getattr(connection.transport, "driver_type", None) != "redis":
                self._redis = False
                connection.release()
                return None
            self._redis = True
            self._connection = connection
        return self._connection.default_channel

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.release()
            except Exception:  # closing a broken connection may fail too
                logger.debug("celery_guard outbox: closing the broker connection failed")
            self._connection = None


def _queues_of(channel: Any, exchange: str | None, routing_key: str | None) -> list[str]:
    """The queues a message routed this way lands in (kombu's virtual exchange tables)."""
    if not exchange:
        return [routing_key] if routing_key else []
    try:
        queues = channel.typeof(exchange).lookup(
            channel.get_table(exchange), exchange, routing_key, None
        )
    except Exception:  # an exchange this broker does not know: cannot tell
        return []
    return [queue for queue in queues or () if queue]


@dataclass
class OutboxReport:
    """What one pass did with the tracked publishes."""

    forgotten: int = 0
    republished: list[str] = field(default_factory=list)
    postponed: int = 0
    abandoned: list[str] = field(default_factory=list)


class UnclaimedRepublisher:
    """The reaper holder's part: forget claimed publishes, re-publish the unclaimed ones."""

    def __init__(self, app: Any, store: PublishRecovery, *, after: float) -> None:
        self.app = app
        self.store = store
        self.after = after
        self.probe = QueueProbe(app)
        #: Where the next cleanup batch starts (key order), so passes take turns over a big
        #: table instead of scanning all of it each time.
        self._cursor = ""

    def forget_claimed(self, report: OutboxReport) -> None:
        """Delete records whose key has a row (or whose message expired), in bounded batches."""
        for _ in range(CLEANUP_BATCHES):
            deleted, last = self.store.forget_claimed_publishes(self._cursor, CLEANUP_BATCH)
            report.forgotten += deleted
            self._cursor = last or ""
            if last is None:
                return

    def republish_due(self, report: OutboxReport) -> None:
        """Re-publish records unclaimed ``after`` seconds past their due time (or their last
        re-publish); on a Redis broker only once their queue has moved past them."""
        records = self.store.due_publishes(self.after, DUE_BATCH)
        report.forgotten += self.store.forget_done_publishes(
            [record.key for record in records if record.claimed or record.expired]
        )
        self.probe.begin_pass()
        waiting: list[str] = []
        try:
            for record in records:
                if record.claimed or record.expired:
                    continue
                if record.republishes >= MAX_UNCLAIMED_REPUBLISHES:
                    self._abandon(record, report)
                    continue
                message = serialization.loads(record.message)
                try:
                    moved = self.probe.moved_past(message, record.publisher_stamp)
                except Exception as exc:
                    logger.warning(
                        "celery_guard reaper could not read the broker's queues (%s); "
                        "unclaimed publishes wait for the next pass",
                        exc,
                    )
                    self.probe.close()
                    return
                if moved is False:
                    waiting.append(record.key)
                    continue
                if not self._republish(record, message, report):
                    return
        finally:
            report.postponed += self.store.postpone_publishes(waiting)

    def _republish(
        self, record: PublishRecord, message: dict[str, Any], report: OutboxReport
    ) -> bool:
        stamp = time.time()
        # Mark first: if two reapers ever overlap, only the one whose mark landed publishes.
        if not self.store.mark_publish_republished(record.key, record.task_id, stamp, self.after):
            return True
        try:
            messages.republish(self.app, message, published_at=stamp)
        except Exception as exc:
            self.store.unmark_publish_republished(record)
            logger.warning(
                "celery_guard reaper could not re-publish unclaimed key=%s id=%s: %s",
                record.key,
                record.task_id,
                exc,
            )
            return False
        report.republished.append(record.key)
        logger.warning(
            "celery_guard reaper re-published unclaimed publish key=%s task=%s id=%s: no worker "
            "claimed it within guard_unclaimed_republish_after (%gs) of its due time or last "
            "re-publish (re-publish %d of at most %d)",
            record.key,
            record.task_name,
            record.task_id,
            self.after,
            record.republishes + 1,
            MAX_UNCLAIMED_REPUBLISHES,
        )
        return True

    def _abandon(self, record: PublishRecord, report: OutboxReport) -> None:
        if self.store.forget_publish(record.key, record.task_id):
            report.abandoned.append(record.key)
            logger.error(
                "celery_guard reaper gave up on unclaimed publish key=%s task=%s id=%s: "
                "re-published %d times and never claimed. Do the workers of its queue run "
                "%s as a GuardedTask? Its record is deleted; the message is not sent again",
                record.key,
                record.task_name,
                record.task_id,
                record.republishes,
                record.task_name,
            )

    def close(self) -> None:
        self.probe.close()
