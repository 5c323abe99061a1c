"""``celery_guard_published``: publish tracking (``guard_track_publishes``, opt-in).

Written by producers before each message is sent, read and trimmed by the reaper's holder.
Only called when tracking is on, so a schema migrated without that table keeps working while it
is off.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import Double, bindparam, delete, exists, func, or_, select, update

from celery_guard.store.base import PublishRecord
from celery_guard.store.engine import StoreEngine, only_row, upsert
from celery_guard.store.schema import db_epoch_now, keys, published


class Publishes:
    """Tracked publishes: the producer's record, the reaper's re-publish of unclaimed ones."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    # -- the producer's side ------------------------------------------------------------------

    def track_publish(
        self,
        *,
        key: str,
        task_name: str,
        task_id: str,
        message: str,
        publisher_stamp: float | None,
        countdown: float,
        expires_in: float | None,
    ) -> bool:
        """Record a publish before its message is sent: one autocommitted INSERT.

        ``countdown`` (seconds until the message is due: its ETA) and ``expires_in`` are added
        to the database's clock here, so the reaper compares them with that clock alone. False
        when the key has a record already (an earlier publish not forgotten yet): one record per
        key is all the reaper needs.
        """
        parameters = {
            "p_key": key,
            "p_task_name": task_name,
            "p_task_id": task_id,
            "p_message": message,
            "p_stamp": publisher_stamp,
            "p_countdown": max(0.0, countdown),
            "p_expires_in": expires_in,
        }
        db = self.db
        statement = _track_publish_statement(db.dialect_name)
        return db.call(lambda: db.execute_hot(statement, parameters))[1] == 1

    def forget_publish(self, key: str, task_id: str) -> bool:
        """Delete the record of one publish: its message was never sent, was revoked, or names
        a task the worker does not know (then it is a dead letter, and no key row will come)."""
        statement = delete(published).where(published.c.key == key, published.c.task_id == task_id)
        return self.db.call(lambda: self.db.execute_single(statement))[1] == 1

    # -- the reaper's side --------------------------------------------------------------------

    def forget_claimed_publishes(self, after_key: str, limit: int) -> tuple[int, str | None]:
        """Examine up to ``limit`` records in key order after ``after_key``, and delete those
        whose key has a row (claimed at least once: the keys table owns it now) or whose
        message has expired.

        Returns (deleted, the last key examined), or (deleted, ``None``) once the end of the
        table was reached; pass that key back to go on, ``""`` to start over. The work per call
        is bounded whatever the table's size (a long backlog), with no full scan.
        """
        db = self.db
        window = (
            select(published.c.key)
            .where(published.c.key > after_key)
            .order_by(published.c.key)
            .limit(limit)
            .subquery()
        )
        bounds = select(func.count().label("n"), func.max(window.c.key).label("last"))
        row = only_row(db.call(lambda: db.execute_single(bounds, read_only=True))[0])
        examined, last = int(row["n"]), row["last"]
        if not examined:
            return 0, None
        statement = delete(published).where(
            published.c.key > after_key, published.c.key <= last, _publish_done()
        )
        deleted = db.call(lambda: db.execute_single(statement))[1]
        return deleted, (str(last) if examined >= limit else None)

    def due_publishes(self, after: float, limit: int) -> list[PublishRecord]:
        """Records whose delay is over: ``after`` seconds since they were due (or since their
        last re-publish), oldest first, each flagged ``claimed`` / ``expired``."""
        now = db_epoch_now()
        statement = (
            select(
                published,
                exists().where(keys.c.key == published.c.key).label("claimed"),
                (published.c.expires_at <= now).label("expired"),
            )
            .where(published.c.waiting_since <= now - after)
            .order_by(published.c.waiting_since)
            .limit(limit)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [PublishRecord.from_mapping(row) for row in rows]

    def forget_done_publishes(self, record_keys: list[str]) -> int:
        """Delete those of ``record_keys``' records that are claimed or expired (only those)."""
        if not record_keys:
            return 0
        statement = delete(published).where(published.c.key.in_(record_keys), _publish_done())
        return self.db.call(lambda: self.db.execute_single(statement))[1]

    def mark_publish_republished(
        self, key: str, task_id: str, publisher_stamp: float, after: float
    ) -> bool:
        """Take the right to re-publish a record now, before publishing; False when its key was
        claimed or another reaper re-published it meanwhile (two holders after a stall)."""
        now = db_epoch_now()
        statement = (
            update(published)
            .where(
                published.c.key == key,
                published.c.task_id == task_id,
                published.c.waiting_since <= now - after,
                ~exists().where(keys.c.key == published.c.key),
            )
            .values(
                republished_at=now,
                waiting_since=now,
                republishes=published.c.republishes + 1,
                publisher_stamp=publisher_stamp,
            )
        )
        return self.db.call(lambda: self.db.execute_single(statement))[1] == 1

    def unmark_publish_republished(self, before: PublishRecord) -> None:
        """Undo :meth:`mark_publish_republished` after the broker refused the copy; the delay
        still restarts, so a broker outage is not retried at every pass."""
        statement = (
            update(published)
            .where(
                published.c.key == before.key,
                published.c.task_id == before.task_id,
                published.c.republishes == before.republishes + 1,
            )
            .values(
                republished_at=before.republished_at,
                republishes=before.republishes,
                publisher_stamp=before.publisher_stamp,
            )
        )
        self.db.call(lambda: self.db.execute_single(statement))

    def postpone_publishes(self, record_keys: list[str]) -> int:
        """Restart the delay of records whose message still waits in its queue (a backlog)."""
        if not record_keys:
            return 0
        statement = (
            update(published)
            .where(published.c.key.in_(record_keys))
            .values(waiting_since=db_epoch_now())
        )
        return self.db.call(lambda: self.db.execute_single(statement))[1]

    # -- operator reads (guard status) --------------------------------------------------------

    def unclaimed_publishes(self) -> tuple[int, float | None]:
        """(tracked publishes whose key has no row yet, seconds since the oldest was published)."""
        now = db_epoch_now()
        statement = select(
            func.count().label("n"),
            func.min(published.c.published_at).label("oldest"),
            now.label("now"),
        ).where(~exists().where(keys.c.key == published.c.key))
        row = only_row(self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0])
        oldest = row["oldest"]
        age = None if oldest is None else max(0.0, float(row["now"]) - float(oldest))
        return int(row["n"]), age


def _publish_done() -> Any:
    """A tracked publish the reaper has nothing left to do for: its key has a row (claimed at
    least once, in any state), or its message expired (a worker would discard it unrun)."""
    return or_(
        exists().where(keys.c.key == published.c.key),
        published.c.expires_at <= db_epoch_now(),
    )


@functools.cache
def _track_publish_statement(dialect_name: str) -> Any:
    """The producer's INSERT, built once per dialect (``execute_hot`` caches its SQL)."""
    now = db_epoch_now()
    due = now + bindparam("p_countdown", type_=Double)
    return (
        upsert(dialect_name, published)
        .values(
            key=bindparam("p_key"),
            task_name=bindparam("p_task_name"),
            task_id=bindparam("p_task_id"),
            message=bindparam("p_message"),
            published_at=now,
            publisher_stamp=bindparam("p_stamp", type_=Double),
            due_at=due,
            expires_at=now + bindparam("p_expires_in", type_=Double),
            waiting_since=due,
            republishes=0,
        )
        .on_conflict_do_nothing(index_elements=[published.c.key])
    )
