"""An in-memory :class:`~celery_guard.store.base.KeyStore` for the handler's unit tests.

Its claim is the property tests' reference model (tests/property/model.py), which those tests
check against the real SQL store on SQLite and PostgreSQL; here the model's time uncertainty is
settled by a clock the test moves. The body's transaction is a list of writes that land only
when the store commits it, so a test sees what "commits with the COMPLETED marker" means
without a database.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from celery_guard.errors import Fenced, StoreUnavailable
from celery_guard.store.base import (
    ClaimOutcome,
    ClaimRequest,
    ClaimResult,
    DeadLetter,
    KeyRecord,
)
from tests.property import model


class Clock:
    """Seconds, moved by the test."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Entry:
    row: model.Row
    task_name: str
    message: str | None
    lease_expires_at: float | None = None
    expires_at: float | None = None
    created_at: float = 0.0


class MemoryTransaction:
    """Stands for SQLAlchemy's ``RootTransaction`` in ``Execution``."""

    def __init__(self, connection: MemoryConnection) -> None:
        self.connection = connection
        self.is_active = True

    def rollback(self) -> None:
        if self.connection.on_boundary is not None:
            self.connection.on_boundary("rollback")
        self.connection.writes.clear()
        self.connection.completion = None
        self.is_active = False


class MemoryConnection:
    """Stands for the body's SQLAlchemy ``Connection``: ``execute(value)`` adds a write."""

    def __init__(self, on_boundary: Callable[[str], None] | None) -> None:
        self.on_boundary = on_boundary
        self.writes: list[Any] = []
        self.completion: Callable[[], None] | None = None
        self.closed = False

    def begin(self) -> MemoryTransaction:
        return MemoryTransaction(self)

    def execute(self, value: Any) -> None:
        self.writes.append(value)

    def close(self) -> None:
        self.closed = True

    def invalidate(self) -> None:
        self.closed = True


@dataclass
class MemoryKeyStore:
    """Keys, dead letters and the bodies' committed writes, in memory."""

    clock: Clock = field(default_factory=Clock)
    rows: dict[str, _Entry] = field(default_factory=dict)
    letters: list[DeadLetter] = field(default_factory=list)
    #: What the bodies' transactions committed, in commit order.
    committed: list[Any] = field(default_factory=list)
    #: Set to make every call fail as a store that does not answer.
    down: bool = False
    _tokens: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    # -- KeyStore -----------------------------------------------------------------------------

    def claim(self, request: ClaimRequest) -> ClaimResult:
        self._answer()
        now = self.clock()
        entry = self.rows.get(request.key)
        row = entry.row if entry is not None else model.Row()
        lapsed = entry is not None and (entry.lease_expires_at or now + 1) <= now
        expired = entry is not None and (entry.expires_at or now + 1) <= now
        outcome, after = model.claim(
            row,
            fingerprint=request.fingerprint,
            check=request.check_fingerprint,
            owner=request.owner,
            ttl=request.lease_ttl,
            external=request.external_token,
            first_token=next(self._tokens),
            lapsed=lapsed,
            expired=expired,
        )
        if entry is None:
            entry = self.rows[request.key] = _Entry(
                row=after, task_name=request.task_name, message=request.message, created_at=now
            )
        entry.row = after
        if outcome is ClaimOutcome.CLAIMED:
            entry.lease_expires_at = now + request.lease_ttl
            entry.expires_at = None
            entry.task_name = request.task_name
            entry.message = request.message
        remaining = (entry.lease_expires_at or now) - now
        return ClaimResult(
            outcome=outcome, record=self._record(request.key, entry), lease_remaining=remaining
        )

    def complete(
        self,
        key: str,
        token: int,
        result: str,
        retention: float | None,
        connection: Any = None,
    ) -> None:
        self._answer()
        entry = self.rows.get(key)
        if entry is None or not model.owns(entry.row, token):
            raise Fenced(key, token)

        def land() -> None:
            assert entry is not None
            if not model.owns(entry.row, token):
                raise Fenced(key, token)
            now = self.clock()
            entry.row = replace(
                entry.row,
                state=model.COMPLETED,
                result=result,
                lease=None,
                retention=model.retention_class(retention),
            )
            entry.lease_expires_at = None
            entry.expires_at = None if retention is None else now + retention

        if connection is None:
            land()
        else:
            connection.completion = land

    def release(self, key: str, token: int, error: str | None) -> bool:
        self._answer()
        entry = self.rows.get(key)
        if entry is None or not model.owns(entry.row, token):
            return False
        entry.row = replace(entry.row, state=model.RELEASED, last_error=error, lease=None)
        entry.lease_expires_at = None
        return True

    def get(self, key: str) -> KeyRecord | None:
        self._answer()
        entry = self.rows.get(key)
        return None if entry is None else self._record(key, entry)

    def dead_letter(self, token: int, letter: DeadLetter) -> DeadLetter:
        self._answer()
        entry = self.rows.get(letter.key)
        if entry is None or not model.owns(entry.row, token):
            raise Fenced(letter.key, token)
        entry.row = replace(entry.row, state=model.DEAD, last_error=letter.error, lease=None)
        entry.lease_expires_at = None
        stored = replace(letter, id=len(self.letters) + 1, created_at=self.clock())
        self.letters.append(stored)
        return stored

    def connect(self, on_boundary: Callable[[str], None] | None = None) -> Any:
        self._answer()
        return MemoryConnection(on_boundary)

    def commit(self, transaction: Any) -> None:
        self._answer()
        connection: MemoryConnection = transaction.connection
        if connection.on_boundary is not None:
            connection.on_boundary("commit")  # as SQLAlchemy's commit event does
        if connection.completion is not None:
            connection.completion()  # raises Fenced: nothing of the transaction lands
        self.committed.extend(connection.writes)
        transaction.is_active = False

    def transaction_failed(self, connection: Any) -> bool:
        return False

    # -- for the lease backend and the tests ----------------------------------------------------

    def renew_leases(self, leases: Iterable[tuple[str, int]], ttl: float) -> set[str]:
        self._answer()
        renewed = set()
        for key, _handle in leases:
            entry = self.rows.get(key)
            if entry is not None and entry.row.state == model.RUNNING:
                entry.lease_expires_at = self.clock() + ttl
                renewed.add(key)
        return renewed

    def take_over(self, key: str) -> None:
        """Let the key's lease run out, as a frozen owner's would."""
        entry = self.rows[key]
        entry.lease_expires_at = self.clock() - 1

    def _answer(self) -> None:
        if self.down:
            raise StoreUnavailable("store memory unavailable: switched off by the test")

    def _record(self, key: str, entry: _Entry) -> KeyRecord:
        row = entry.row
        now = self.clock()
        return KeyRecord(
            key=key,
            task_name=entry.task_name,
            state=row.state or "",
            attempts=row.attempts,
            fencing_token=row.token,
            lease_expires_at=entry.lease_expires_at,
            owner=row.owner,
            owner_lock=None,
            claim_id=None,
            claim_reason=row.reason,
            fingerprint=row.fingerprint,
            message=entry.message,
            result=row.result,
            last_error=row.last_error,
            duplicates=row.duplicates,
            created_at=entry.created_at,
            updated_at=now,
            completed_at=None,
            expires_at=entry.expires_at,
            republished_at=None,
        )
