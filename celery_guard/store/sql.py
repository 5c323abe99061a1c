"""``SqlStore``: the one store object the runtime builds, made of one part per table.

Every statement celery_guard runs against the database is in the part modules beside this one:
``keys`` (the hot path: claim, complete, release, and the key reads), ``dead_letters``,
``recovery`` (leadership, orphans, dead owners, revocation, pruning), ``publishes`` (publish
tracking) and ``workers`` (heartbeats). They share one :class:`StoreEngine` (``engine.py``:
the per-process engine, error wrapping, the observer, the hot connection). Each consumer is
given the part it needs and typed against its protocol in :mod:`celery_guard.store.base`.
"""

from __future__ import annotations

from sqlalchemy import Engine

from celery_guard.config import GuardConfig
from celery_guard.store.dead_letters import DeadLetters
from celery_guard.store.engine import StoreEngine, StoreObserver
from celery_guard.store.keys import Keys
from celery_guard.store.publishes import Publishes
from celery_guard.store.recovery import Recovery
from celery_guard.store.upgrade import upgrade
from celery_guard.store.workers import Workers

__all__ = ["SqlStore", "StoreObserver"]


class SqlStore:
    """The durable store on PostgreSQL or SQLite: its parts, and the engine they share."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        #: The per-process engine and call wrappers every part runs its statements through.
        self.db = StoreEngine(config)
        #: Which database: ``"postgresql"`` or ``"sqlite"``.
        self.dialect_name = self.db.dialect_name
        #: Dead letters and replays (``celery_guard_dead_letters``).
        self.dead_letters = DeadLetters(self.db)
        #: The idempotency keys: the delivery's hot path and the key reads.
        self.keys = Keys(self.db, self.dead_letters)
        #: Leadership, orphans, dead owners, revocation, pruning.
        self.recovery = Recovery(self.db)
        #: Publish tracking (``guard_track_publishes``).
        self.publishes = Publishes(self.db)
        #: Worker heartbeats.
        self.workers = Workers(self.db)

    @property
    def observer(self) -> StoreObserver | None:
        """Told the outcome and latency of every call (the circuit breaker's counts)."""
        return self.db.observer

    @observer.setter
    def observer(self, observer: StoreObserver | None) -> None:
        self.db.observer = observer

    @property
    def engine(self) -> Engine:
        """This process's engine; a forked child builds its own instead of reusing the parent's."""
        return self.db.engine

    def ensure_schema(self) -> None:
        """Create the tables if they are missing (when ``guard_create_tables`` is on)."""
        self.db.ensure_schema()

    def migrate(self) -> list[str]:
        """Create the missing tables, then upgrade existing ones to the current schema
        (:mod:`celery_guard.store.upgrade`); idempotent. Returns the upgrade's statements."""
        self.db.ensure_schema()
        return self.db.call(lambda: upgrade(self.db.engine))

    def reset_after_fork(self, budget: str | None = None) -> None:
        """Forget the parent's engine; called from ``worker_process_init`` (``budget``: the
        process's connection mode, ``StoreEngine.budget``)."""
        self.db.reset_after_fork(budget)

    def dispose(self) -> None:
        """Close this process's connections (before a fork, or at shutdown)."""
        self.db.dispose()

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
        return self.db.now()
