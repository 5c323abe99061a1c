"""What the store hands back (plain frozen records: no SQLAlchemy rows escape the store), and
the narrow protocol each consumer of the store is typed against.

:class:`~celery_guard.store.SqlStore` is made of one part per table (``store.keys``,
``store.dead_letters``, ``store.recovery``, ``store.publishes``, ``store.workers``); the wiring
(``celery_guard/install.py``) hands each consumer the part it needs, and the consumer sees it
through one of the protocols below, not as the whole store.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

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


class ClaimRequest(NamedTuple):
    """Everything one claim needs; built by the handler, executed by the store.

    A named tuple rather than a frozen dataclass: one is built per delivery, and a frozen
    dataclass sets each field through ``object.__setattr__`` (docs/performance.md).
    """

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
    #: A hint, never a rule: ``True`` when the key most likely has no row yet (a message's
    #: first delivery), ``False`` for a retry, a deferral or a redelivery. The PostgreSQL store
    #: then tries the cheaper insert-only claim first; either way the outcome is the same.
    likely_new: bool = True


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
        return assembled(cls, {name: row[name] for name in _KEY_RECORD_FIELDS})


_KEY_RECORD_FIELDS = tuple(KeyRecord.__dataclass_fields__)

_Record = TypeVar("_Record")


def assembled(cls: type[_Record], values: dict[str, Any]) -> _Record:
    """The instance of the frozen dataclass ``cls`` that ``cls(**values)`` builds, ``values``
    naming every field, set in one step.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; for the
    twenty columns of a key's row, built at every claim, that was the largest single piece of
    a claim's own Python work (bench/instructions.py). Only for records without ``__slots__``,
    ``__post_init__`` or field converters, as those here: tests/unit/test_store_records.py
    checks that it builds what the constructor builds.
    """
    record: _Record = object.__new__(cls)
    record.__dict__.update(values)
    return record


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

    ``SqlStore.keys`` (:class:`~celery_guard.store.keys.Keys`) provides it on PostgreSQL and
    SQLite; the handler's unit tests run against an in-memory one built from the property
    tests' reference model.
    """

    def claim(self, request: ClaimRequest) -> ClaimResult:
        """Insert or take over the key's row and say what happened (one atomic statement
        decides; ``request.likely_new`` may only change how many are sent)."""

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
        """A new connection for a body's own transaction (see ``Keys.connect``)."""

    def commit(self, transaction: RootTransaction) -> None:
        """Commit a body's transaction; failures are ``StoreError``."""

    def transaction_failed(self, connection: Connection) -> bool:
        """True when a failed statement left the open transaction able only to roll back."""


class LeaseRows(Protocol):
    """What leases kept in the key rows need (``SqlLeases``): the heartbeat's renewal."""

    def renew_leases(self, leases: Iterable[tuple[str, int]], ttl: float) -> set[str]:
        """Extend the leases still held by their tokens, in one statement; return those keys."""


class DeadLetterStore(Protocol):
    """What the dead-letter sink (``DeadLetterSink``) needs: keep, read, replay a letter."""

    def dead_letter(self, token: int, letter: DeadLetter) -> DeadLetter:
        """End ``token``'s ownership as DEAD and keep ``letter``, in one transaction."""

    def add_dead_letter(self, letter: DeadLetter) -> DeadLetter:
        """Keep a letter no key row owns (a delivery that could not even be claimed)."""

    def get_dead_letter(self, letter_id: int) -> DeadLetter | None:
        """One dead letter by id, or ``None``."""

    def revive(self, letter_id: int) -> DeadLetter | None:
        """Mark the letter replayed and its key claimable; ``None`` when replayed already."""

    def unrevive(self, letter_id: int) -> None:
        """Undo :meth:`revive` after its message could not be published."""


class RecoveryStore(Protocol):
    """What the reaper (``Reaper``) needs: leadership, orphans, dead owners, pruning."""

    def acquire_leadership(self, name: str, holder: str, ttl: float) -> bool:
        """Take or keep the named lease for ``holder``; True while ``holder`` has it."""

    def resign_leadership(self, name: str, holder: str) -> None:
        """Give the named lease up at once, if ``holder`` has it."""

    def now(self) -> float:
        """The database's clock, in epoch seconds."""

    def orphans(self, republish_after: float, limit: int) -> list[KeyRecord]:
        """RUNNING keys whose lease expired, not re-published in the last ``republish_after`` s."""

    def mark_republished(self, key: str, token: int, republish_after: float) -> bool:
        """Record a re-publish; False when someone claimed or re-published the key meanwhile."""

    def dead_owner_keys(self, limit: int) -> list[tuple[str, int, bool]]:
        """(key, token, lease still running) of RUNNING keys whose owner's lock is gone."""

    def running_of(self, owner: str, limit: int) -> list[tuple[str, int, bool]]:
        """RUNNING keys whose owner is exactly ``owner``: (key, token, lease still running)."""

    def expire_lease(self, key: str, token: int) -> bool:
        """End a running lease now (its owner is dead)."""

    def prune_completed(self, limit: int, keep_tracked: bool = False) -> int:
        """Delete up to ``limit`` COMPLETED keys whose retention ended; return how many."""

    def prune_pass(self, budget: float, keep_tracked: bool = False) -> int:
        """Prune in batches until none is left, ``budget`` seconds pass, or the batch cap."""


class PublishLog(Protocol):
    """What the producer's publish tracking (``PublishTracker``) needs."""

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
        """Record a publish before its message is sent; False when the key has a record."""

    def forget_publish(self, key: str, task_id: str) -> bool:
        """Delete the record of one publish."""


class PublishRecovery(Protocol):
    """What the reaper's re-publisher of unclaimed publishes (``UnclaimedRepublisher``) needs."""

    def forget_publish(self, key: str, task_id: str) -> bool:
        """Delete the record of one publish."""

    def forget_claimed_publishes(self, after_key: str, limit: int) -> tuple[int, str | None]:
        """Delete claimed or expired records in one bounded window; (deleted, where to go on)."""

    def due_publishes(self, after: float, limit: int) -> list[PublishRecord]:
        """Records whose delay is over, oldest first, flagged ``claimed`` / ``expired``."""

    def forget_done_publishes(self, record_keys: list[str]) -> int:
        """Delete those of ``record_keys``' records that are claimed or expired."""

    def postpone_publishes(self, record_keys: list[str]) -> int:
        """Restart the delay of records whose message still waits in its queue."""

    def mark_publish_republished(
        self, key: str, task_id: str, publisher_stamp: float, after: float
    ) -> bool:
        """Take the right to re-publish a record now; False when another took it or it was
        claimed."""

    def unmark_publish_republished(self, before: PublishRecord) -> None:
        """Undo :meth:`mark_publish_republished` after the broker refused the copy."""


class StoreClock(Protocol):
    """The store's cheapest question, its clock: the circuit monitor's probe."""

    def now(self) -> float:
        """The database's clock, in epoch seconds."""


class KeyCounts(Protocol):
    """The key counts the sampler reads."""

    def count_keys_by_state(self) -> dict[str, int]:
        """How many keys are in each state."""

    def count_expired_leases(self) -> int:
        """RUNNING keys whose row lease has expired."""

    def oldest_running(self) -> KeyRecord | None:
        """The RUNNING key claimed longest ago, or ``None``."""


class DeadLetterCounts(Protocol):
    """The dead-letter counts the sampler reads."""

    def count_dead_letters(self) -> tuple[int, int]:
        """(all dead letters, those not replayed yet)."""


class WorkerList(Protocol):
    """The worker heartbeats the sampler reads."""

    def list_workers(self, seen_within: float = 3600.0) -> list[WorkerRecord]:
        """Workers seen in the last ``seen_within`` seconds, alive or not."""


class SampleSource(Protocol):
    """What the sampler (``Sampler``) reads, part by part (``SqlStore`` provides it)."""

    @property
    def keys(self) -> KeyCounts:
        """The keys table's counts."""

    @property
    def dead_letters(self) -> DeadLetterCounts:
        """The dead-letter table's counts."""

    @property
    def workers(self) -> WorkerList:
        """The workers' heartbeats."""

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
