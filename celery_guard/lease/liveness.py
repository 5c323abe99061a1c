"""Telling a dead worker process from a slow one, through PostgreSQL's advisory locks.

Each worker process that runs guarded bodies holds a session-level advisory lock on a
connection of its own. When the process dies (SIGKILL, the OOM killer), the kernel closes that
socket, PostgreSQL ends the session and its locks go at once (docs/design.md). The reaper takes
over the keys of owners whose lock is gone without waiting out their lease; fencing keeps that
safe if the owner was in fact alive (its liveness connection had dropped). A frozen or
partitioned process keeps its session, so it still waits out the TTL.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import threading
import time
from dataclasses import replace
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from celery_guard.config import GuardConfig
from celery_guard.store.engine import StoreEngine

logger = logging.getLogger("celery_guard.lease")


_inherited: list[Any] = []


def owner_lock_id(owner: str) -> int:
    """A positive 63-bit advisory-lock id for an owner string (``node/pid``)."""
    digest = hashlib.sha256(f"celery_guard:{owner}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def liveness_store(config: GuardConfig, store: StoreEngine) -> StoreEngine | None:
    """The engine the liveness sessions connect with; ``None`` when there are none to hold.

    A session-level lock needs a session that lives as long as the process: the store's own
    engine when it reaches PostgreSQL directly, ``guard_liveness_url`` (a direct URL of the same
    database) when one is given, and none behind a transaction pooler without one, which would
    hand the session to other clients between transactions (the reaper then waits out the
    lease TTL, docs/pgbouncer.md). The reaper reads ``pg_locks`` through the store's URL: the
    same database, so the same locks.
    """
    if not config.liveness_locks:
        return None
    if config.liveness_url is not None:
        direct = replace(
            config, store_url=config.liveness_url, store_pooling="session", liveness_url=None
        )
        return StoreEngine(direct)
    if config.store_pooling == "transaction":
        return None
    return store


class ProcessLiveness:
    """This process's liveness lock; ``lock_id()`` is what a claim records as ``owner_lock``."""

    def __init__(self, store: StoreEngine, *, recheck_after: float) -> None:
        self.store = store
        self.recheck_after = recheck_after
        self._lock = threading.Lock()
        self._connection: Any = None
        self._pid: int | None = None
        self._owner_lock: int | None = None
        self._checked_at = 0.0

    @property
    def supported(self) -> bool:
        return self.store.dialect_name == "postgresql"

    def lock_id(self, owner: str) -> int | None:
        """Hold (or re-take) this process's lock; ``None`` when it cannot be held right now."""
        if not self.supported:
            return None
        with self._lock:
            now = time.monotonic()
            fresh = self._pid == os.getpid() and now - self._checked_at < self.recheck_after
            if fresh and self._owner_lock is not None and not self._session_spoke():
                return self._owner_lock
            wanted = owner_lock_id(owner)
            try:
                if self._pid != os.getpid() and self._connection is not None:
                    # Inherited across fork: the parent's session is not ours. Keep the object
                    # referenced so that collecting it never closes the parent's socket.
                    _inherited.append(self._connection)
                    self._connection = None
                if self._connection is None:
                    self._connection = self.store.engine.connect().execution_options(
                        isolation_level="AUTOCOMMIT"
                    )
                    self._pid = os.getpid()
                # Re-entrant for the same session; re-run now and then to notice a session
                # that was lost (a restarted server), and take the lock again on a new one.
                held = self._connection.execute(
                    text("SELECT pg_try_advisory_lock(:lock)"), {"lock": wanted}
                ).scalar_one()
            except sa_exc.SQLAlchemyError as exc:
                logger.warning("celery_guard liveness lock unavailable: %s", exc)
                self._drop()
                return None
            self._checked_at = now
            self._owner_lock = wanted if held else None
            if not held:
                logger.warning("celery_guard liveness lock %s is held by another session", wanted)
            return self._owner_lock

    def _session_spoke(self) -> bool:
        """Whether the idle lock session received anything: a server ending it (a restart,
        ``pg_terminate_backend``) or a dropped connection. Its lock is then gone already.
        """
        try:
            fd = self._connection.connection.dbapi_connection.fileno()
            return bool(select.select([fd], [], [], 0)[0])
        except Exception:  # closed or invalidated: recheck
            return True

    def _drop(self) -> None:
        connection, self._connection, self._owner_lock = self._connection, None, None
        if connection is not None:
            try:
                connection.invalidate()
                connection.close()
            except sa_exc.SQLAlchemyError:
                pass
