"""What the store hands back: plain frozen records, no SQLAlchemy rows escape the store module."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, RootTransaction


class ClaimOutcome(str, enum.Enum):
    """The answers a claim can get (docs/design.md#the-claim-one-statement-one-round-trip)."""

    #: This execution owns the key now (a first run, a retry, or a takeover of an expired lease).
    CLAIMED = "claimed"
    #: The key is COMPLETED: do not run, answer with the stored result.
    DUPLICATE = "duplicate"
    #: Another execution holds a live lease: do not run, check again later.
    IN_FLIGHT = "in_flight"
    #: The key belongs to a different payload: refuse, never skip silently.
    CONFLICT = "conflict"
    #: The key is dead-lettered: do not run until an operator replays it.
    DEAD = "dead"


@dataclass(frozen=True, kw_only=True)
class ClaimRequest:
    """Everything one claim needs; built by the handler, executed by the store in one round trip."""

    key: str
    task_name: str
    #: SHA-256 of the canonical payload, or ``None`` when the arguments are not JSON.
    fingerprint: str | None
    #: ``False`` for task-id keys: a replacement (``Task.replace``) legitimately reuses the id
    #: with another payload.
    check_fingerprint: bool
    owner: str
    #: JSON text of what re-publishing needs, or ``None``.
    message: str | None
    lease_ttl: float
    #: The advisory-lock id this process holds for liveness (PostgreSQL), or ``None``.
    owner_lock: int | None = None
    #: With Redis leases: the token the lease store issued with the lease this claimant holds.
    #: Holding that lease entitles the claim to take a RUNNING row over, and the row's token
    #: becomes the larger of it and the row's next token. ``None``: the row is the lease.
    external_token: int | None = None


@dataclass(frozen=True, kw_only=True)
class KeyRecord:
    """One row of ``celery_guard_keys``; times are epoch seconds by the database's clock."""

    key: str
    task_name: str
    state: str
    attempts: int
    fencing_token: int
    lease_expires_at: float | None
    owner: str | None
    owner_lock: int | None
    claim_id: str | None
    claim_reason: str | None
    fingerprint: str | None
    message: str | None
    result: str | None
    last_error: str | None
    duplicates: int
    created_at: float
    updated_at: float
    completed_at: float | None
    expires_at: float | None
    republished_at: float | None

    @classmethod
    def from_mapping(cls, row: Any) -> KeyRecord:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """A claim's answer: the outcome and the row as the claim left it."""

    outcome: ClaimOutcome
    record: KeyRecord
    #: Seconds left on the current owner's lease (negative when it has expired).
    lease_remaining: float


@dataclass(frozen=True, kw_only=True)
class DeadLetter:
    """A dead letter as stored (``id`` and ``created_at`` are set by the store)."""

    key: str
    task_name: str
    task_id: str | None
    message: str | None
    #: "transient" (attempts exhausted), "permanent", or "poison" (stopped at claim).
    error_class: str
    error_type: str
    error: str
    traceback: str | None
    reason: str
    attempts: int
    id: int | None = None
    created_at: float | None = None
    replayed_at: float | None = None

    @classmethod
    def from_mapping(cls, row: Any) -> DeadLetter:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class WorkerRecord:
    """A worker's last heartbeat in the store."""

    hostname: str
    pid: int
    state: str
    running: int
    fenced: int
    circuit: str | None
    started_at: float
    seen_at: float
    expires_at: float
    #: Whether the heartbeat is fresh (``expires_at`` later than the database's now).
    alive: bool


@dataclass(frozen=True, kw_only=True)
class PublishRecord:
    """A tracked publish (``celery_guard_published``); times by the database's clock except
    ``publisher_stamp``, which is the producer's ``guard_published_at`` header."""

    key: str
    task_name: str
    task_id: str
    message: str
    published_at: float
    publisher_stamp: float | None
    due_at: float
    expires_at: float | None
    waiting_since: float
    republished_at: float | None
    republishes: int
    #: Whether the key had a row in the keys table when this was read (claimed at least once).
    claimed: bool = False
    #: Whether the message's ``expires`` had passed when this was read.
    expired: bool = False

    @classmethod
    def from_mapping(cls, row: Any) -> PublishRecord:
        values = {name: row[name] for name in cls.__dataclass_fields__ if name in row}
        for flag in ("claimed", "expired"):
            values[flag] = bool(values.get(flag))
        return cls(**values)


class KeyStore(Protocol):
    """What one delivery needs of the store: the handler's and ``self.guard``'s narrow view.

    :class:`~celery_guard.store.SqlStore` provides it on PostgreSQL and SQLite; the handler's
    unit tests run against an in-memory one built from the property tests' reference model.
    """

    def claim(self, request: ClaimRequest) -> ClaimResult:
        """Insert or take over the key's row in one statement and say what happened."""

    def complete(
        self,
        key: str,
        token: int,
        result: str,
        retention: float | None,
        connection: Connection | None = None,
    ) -> None:
        """Mark the key COMPLETED with ``result`` if ``token`` owns it, else raise ``Fenced``;
        with ``connection``, inside that open transaction (the caller commits)."""

    def release(self, key: str, token: int, error: str | None) -> bool:
        """Give the key up after an execution that did not complete; False if not ours."""

    def get(self, key: str) -> KeyRecord | None:
        """The key's row, or ``None``."""

    def dead_letter(self, token: int, letter: DeadLetter) -> DeadLetter:
        """End ``token``'s ownership as DEAD and keep ``letter``, in one transaction."""

    def connect(self, on_boundary: Callable[[str], None] | None = None) -> Connection:
        """A new connection for a body's own transaction (see ``SqlStore.connect``)."""

    def commit(self, transaction: RootTransaction) -> None:
        """Commit a body's transaction; failures are ``StoreError``."""

    def transaction_failed(self, connection: Connection) -> bool:
        """True when a failed statement left the open transaction able only to roll back."""
