"""Telling a dead worker process from a slow one, through PostgreSQL's advisory locks.

A prefork worker's main process holds one session-level advisory lock, on a connection of its
own, for the whole worker; its pool processes record that lock's id with each claim, without
asking anyone: the main writes the id it holds (0 while it holds none) into a few bytes of
memory shared with the pool before it forks, and a claim reads them. A process that runs
bodies outside a prefork pool (solo, threads, gevent) holds its own. When the worker dies
whole (SIGKILL, the OOM killer), the kernel closes that socket, PostgreSQL ends the session and
its lock goes at once (docs/design.md). The reaper takes over the keys of owners whose lock is
gone without waiting out their lease; fencing keeps that safe if the owner was in fact alive
(its liveness connection had dropped). A frozen or partitioned process keeps its session, so
it still waits out the TTL. One pool process dying alone is noticed by the main process
through its renewal relay (celery_guard/lease/relay.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import select
import struct
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

import psycopg
from sqlalchemy import exc as sa_exc

from celery_guard import forks
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
        #: The prefork worker's main process, once it holds the lock for the whole worker.
        self._worker_generation: int | None = None
        #: Shared with the pool processes: the lock id the main holds now, 0 for none.
        self._shared: mmap.mmap | None = None
        _instances.add(self)

    @property
    def supported(self) -> bool:
        return self.store.dialect_name == "postgresql"

    def hold_for_worker(self, owner: str) -> int | None:
        """Main process of a prefork worker, before the pool forks: hold the worker's lock.

        Its pool processes then record its id with their claims (:meth:`lock_id`), so one
        session per worker stands for all of them. Call it again often (the renewal relay does,
        about twice a second): a session that was lost is noticed without a round trip, the
        pool stops recording the lock at once, and the lock is taken again on a new session.
        """
        if self._shared is None:
            self._shared = mmap.mmap(-1, 8)  # anonymous and shared: inherited by every fork
        self._worker_generation = forks.current
        held = self.lock_id(owner)
        struct.pack_into("q", self._shared, 0, held or 0)
        return held

    @property
    def worker_lock(self) -> int | None:
        """The worker's lock id as its main process holds it now (``None``: not held)."""
        if self._shared is None:
            return None
        return struct.unpack_from("q", self._shared, 0)[0] or None

    def lock_id(self, owner: str) -> int | None:
        """Hold (or re-take) this process's lock; ``None`` when it cannot be held right now.

        In a pool process of a worker whose main holds the lock, the main's id, with no round
        trip: the worker lives and dies with its main process's session.
        """
        if not self.supported:
            return None
        if self._worker_generation is not None and self._worker_generation != forks.current:
            return self.worker_lock
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
                    self._connection = self._open()
                    self._pid = os.getpid()
                # Re-entrant for the same session; re-run now and then to notice a session
                # that was lost (a restarted server), and take the lock again on a new one.
                row = self._connection.execute(
                    "SELECT pg_try_advisory_lock(%s)", (wanted,)
                ).fetchone()
                held = bool(row[0]) if row is not None else False
            except (psycopg.Error, sa_exc.SQLAlchemyError) as exc:
                logger.warning("celery_guard liveness lock unavailable: %s", exc)
                self._drop()
                return None
            self._checked_at = now
            self._owner_lock = wanted if held else None
            if not held:
                logger.warning("celery_guard liveness lock %s is held by another session", wanted)
            return self._owner_lock

    def _open(self) -> Any:
        """A psycopg connection of the lock's own, in autocommit, outside the engine's pool
        (so the main process's pool of one stays free for everything else)."""
        pooled = self.store.engine.raw_connection()
        connection: Any = pooled.dbapi_connection
        pooled.detach()
        connection.autocommit = True
        # As a pooled session would, it lives until the engine is disposed.
        self.store.keep(connection)
        return connection

    def _session_spoke(self) -> bool:
        """Whether the idle lock session received anything: a server ending it (a restart,
        ``pg_terminate_backend``) or a dropped connection. Its lock is then gone already.
        """
        try:
            fd = self._connection.fileno()
            return bool(select.select([fd], [], [], 0)[0])
        except Exception:  # closed or invalidated: recheck
            return True

    def _after_fork_in_child(self) -> None:
        """A forked child must not keep the parent's lock session open: when the parent dies,
        its session (and the worker's lock) must end with it, not when the last child exits."""
        connection = self._connection
        if connection is None or self._pid == os.getpid():
            return
        _inherited.append(connection)  # never collected: psycopg would not close it anyway
        self._connection = None
        with contextlib.suppress(Exception):
            os.close(connection.pgconn.socket)

    def _drop(self) -> None:
        connection, self._connection, self._owner_lock = self._connection, None, None
        if connection is not None:
            self.store.forget_kept(connection)
            with contextlib.suppress(Exception):
                connection.close()


#: Every lock object, weakly: a fork's child drops what it inherited (_after_fork_in_child).
_instances: weakref.WeakSet[ProcessLiveness] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for liveness in list(_instances):
        liveness._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
