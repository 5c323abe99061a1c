"""``celery_guard_dead_letters``: keeping, listing, replaying and purging dead letters.

A dead letter and its key's DEAD state change together: :meth:`DeadLetters.dead_letter` ends
the owner's execution and stores the letter in one transaction, and a replay
(:meth:`DeadLetters.revive`) marks the letter replayed and makes its key claimable again in one
transaction too. The operator's reads (``guard dlq``, ``guard reconcile``) are here as well.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sqlalchemy import BigInteger, bindparam, case, delete, func, insert, select, text, update

from celery_guard.errors import Fenced, StoreError
from celery_guard.store.base import DeadLetter
from celery_guard.store.engine import StoreEngine, only_row
from celery_guard.store.keys import DEAD, RELEASED, end_ownership
from celery_guard.store.queries import texts
from celery_guard.store.schema import db_epoch_now, dead_letters, keys

#: The hand-written statements, by name (queries/dead_letters.sql).
SQL = texts("celery_guard.store.queries", "dead_letters.sql")


class DeadLetters:
    """The dead-letter table, and the key transitions that go with a letter."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def dead_letter(self, token: int, letter: DeadLetter) -> DeadLetter:
        """Mark the key DEAD (if ``token`` still owns it) and store the letter, atomically."""
        engine = self.db.ready_engine()

        def write() -> DeadLetter:
            with engine.begin() as connection:
                owned = connection.execute(
                    _MARK_DEAD, {"p_key": letter.key, "p_token": token, "p_error": letter.error}
                ).rowcount
                if owned != 1:
                    raise Fenced(letter.key, token)
                values = {k: v for k, v in letter.as_dict().items() if k not in _GENERATED}
                row = connection.execute(
                    insert(dead_letters)
                    .values(**values, created_at=db_epoch_now())
                    .returning(dead_letters.c.id, dead_letters.c.created_at)
                ).one()
            return replace(letter, id=int(row.id), created_at=float(row.created_at))

        return self.db.call(write)

    def add_dead_letter(self, letter: DeadLetter) -> DeadLetter:
        """Record a dead letter no key row owns: a delivery that could not even be claimed
        (an unknown task, a key the store cannot hold). No key's state changes."""
        values = {k: v for k, v in letter.as_dict().items() if k not in _GENERATED}
        statement = (
            insert(dead_letters)
            .values(**values, created_at=db_epoch_now())
            .returning(dead_letters.c.id, dead_letters.c.created_at)
        )
        row = only_row(self.db.call(lambda: self.db.execute_single(statement))[0])
        return replace(letter, id=int(row["id"]), created_at=float(row["created_at"]))

    def list_dead_letters(
        self, *, task_name: str | None = None, since: float | None = None, limit: int = 50
    ) -> list[DeadLetter]:
        """Dead letters, newest first."""
        statement = select(dead_letters).order_by(dead_letters.c.id.desc()).limit(limit)
        if task_name is not None:
            statement = statement.where(dead_letters.c.task_name == task_name)
        if since is not None:
            statement = statement.where(dead_letters.c.created_at >= since)
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [DeadLetter.from_mapping(row) for row in rows]

    def get_dead_letter(self, letter_id: int) -> DeadLetter | None:
        """One dead letter by id, or ``None``."""
        statement = select(dead_letters).where(dead_letters.c.id == letter_id)
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return DeadLetter.from_mapping(rows[0]) if rows else None

    def revive(self, letter_id: int) -> DeadLetter | None:
        """Mark a dead letter replayed and make its key claimable with fresh attempts.

        Returns the letter when this call revived it; ``None`` when it was replayed already (a
        replay is itself idempotent).
        """
        engine = self.db.ready_engine()

        def write() -> DeadLetter | None:
            with engine.begin() as connection:
                row = connection.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id == letter_id, dead_letters.c.replayed_at.is_(None))
                    .values(replayed_at=db_epoch_now())
                    .returning(*dead_letters.c)
                ).one_or_none()
                if row is None:
                    return None
                letter = DeadLetter.from_mapping(row._mapping)
                connection.execute(_REVIVE_KEY, {"p_key": letter.key})
            return letter

        return self.db.call(write)

    def revive_key(self, key: str) -> bool:
        """Make a DEAD key claimable again with fresh attempts (nothing is re-published)."""
        return self.db.call(lambda: self.db.execute_single(_REVIVE_KEY, {"p_key": key}))[1] == 1

    def unrevive(self, letter_id: int) -> None:
        """Undo :meth:`revive` after its message could not be published."""
        engine = self.db.ready_engine()

        def write() -> None:
            with engine.begin() as connection:
                key = connection.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id == letter_id)
                    .values(replayed_at=None)
                    .returning(dead_letters.c.key)
                ).scalar_one_or_none()
                if key is not None:
                    connection.execute(
                        update(keys)
                        .where(keys.c.key == key, keys.c.state == RELEASED, keys.c.attempts == 0)
                        .values(state=DEAD, updated_at=db_epoch_now())
                    )

        self.db.call(write)

    def purge_dead_letters(self, before: float | None = None) -> list[int]:
        """Delete dead letters (created before ``before``, when given); return their ids."""
        statement = delete(dead_letters).returning(dead_letters.c.id)
        if before is not None:
            statement = statement.where(dead_letters.c.created_at < before)
        rows = self.db.call(lambda: self.db.execute_single(statement))[0]
        return sorted(int(row["id"]) for row in rows)

    # -- operator reads and repairs (guard status, guard dlq, guard reconcile) ----------------

    def count_dead_letters(self) -> tuple[int, int]:
        """(all dead letters, those not replayed yet)."""
        statement = select(
            func.count().label("total"),
            func.count(case((dead_letters.c.replayed_at.is_(None), 1))).label("pending"),
        ).select_from(dead_letters)
        row = only_row(self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0])
        return int(row["total"]), int(row["pending"])

    def dead_letter_index(self, limit: int) -> list[tuple[int, str, str, float]]:
        """(id, key, task name, created_at) of the newest ``limit`` dead letters, newest first."""
        statement = (
            select(
                dead_letters.c.id,
                dead_letters.c.key,
                dead_letters.c.task_name,
                dead_letters.c.created_at,
            )
            .order_by(dead_letters.c.id.desc())
            .limit(limit)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [
            (int(row["id"]), str(row["key"]), str(row["task_name"]), float(row["created_at"]))
            for row in rows
        ]

    def pending_dead_letter_ids(
        self, task_name: str, *, after_id: int = 0, limit: int = 1000
    ) -> list[int]:
        """Ids of ``task_name``'s dead letters not replayed yet, ascending, after ``after_id``."""
        statement = (
            select(dead_letters.c.id)
            .where(
                dead_letters.c.task_name == task_name,
                dead_letters.c.replayed_at.is_(None),
                dead_letters.c.id > after_id,
            )
            .order_by(dead_letters.c.id)
            .limit(limit)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [int(row["id"]) for row in rows]

    def insert_dead_letter(self, letter: DeadLetter) -> DeadLetter | None:
        """Record a dead letter found only in the broker's queue, under its own id.

        Returns the stored letter, or ``None`` when that id is already taken (nothing written).
        The key's row is not touched. On PostgreSQL the id sequence is moved past the id, so
        later letters cannot collide with it.
        """
        if letter.id is None:
            raise StoreError("a dead letter from the queue needs its id")
        engine = self.db.ready_engine()
        values = letter.as_dict()
        if values["created_at"] is None:
            values["created_at"] = db_epoch_now()
        statement = (
            self.db.upsert(dead_letters)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[dead_letters.c.id])
            .returning(*dead_letters.c)
        )
        postgres = self.db.dialect_name == "postgresql"

        def write() -> DeadLetter | None:
            with engine.begin() as connection:
                row = connection.execute(statement).one_or_none()
                if row is None:
                    return None
                if postgres:
                    connection.execute(_ADVANCE_ID_SEQUENCE, {"p_id": letter.id})
                return DeadLetter.from_mapping(row._mapping)

        return self.db.call(write)

    def now(self) -> float:
        """The database's clock, in epoch seconds (what every time in the table is in)."""
        return self.db.now()


_MARK_DEAD = end_ownership(DEAD)

# A replayed key starts over: attempts count again from the replay.
_REVIVE_KEY = (
    update(keys)
    .where(keys.c.key == bindparam("p_key"), keys.c.state == DEAD)
    .values(state=RELEASED, attempts=0, updated_at=db_epoch_now())
)

#: Set by the table, never taken from the letter.
_GENERATED = frozenset({"id", "created_at", "replayed_at"})

_ADVANCE_ID_SEQUENCE: Any = text(SQL["advance_id_sequence"]).bindparams(
    bindparam("p_id", type_=BigInteger)
)
