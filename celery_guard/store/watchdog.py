"""A client-side deadline for PostgreSQL calls: the backstop of ``guard_store_timeout``.

``statement_timeout`` and ``lock_timeout`` bound what the server runs; ``tcp_user_timeout``
bounds a peer that stops acknowledging. None of them bounds a peer that acknowledges and never
answers: a frozen server (SIGSTOP, a paused VM), or a proxy or pooler in front of a server that
is gone. libpq then waits forever, and so would a claim, a heartbeat renewal (which then never
notices the lease is lost) or a commit. The watchdog shuts down the socket of a call that
outlives its deadline; the driver fails the call as a lost connection, the pool drops it, and
the store reports the store unavailable as for any other outage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, event

logger = logging.getLogger("celery_guard.store")

_INFO_KEY = "celery_guard_watched_fd"


class CallWatchdog:
    """Closes a connection's socket when one call on it runs ``seconds`` past its start."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._cond = threading.Condition()
        self._deadlines: dict[int, float] = {}  # socket fd -> monotonic deadline
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._idle = False  # the thread waits with no deadline to wake it

    def arm(self, fd: int) -> None:
        with self._cond:
            self._deadlines[fd] = time.monotonic() + self.seconds
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                # Per process: a thread does not survive a fork.
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="celery_guard-store-watchdog", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._cond.notify()  # deadlines only come later than the ones it waits for

    def disarm(self, fd: int) -> None:
        with self._cond:
            self._deadlines.pop(fd, None)

    @contextlib.contextmanager
    def watching(self, dbapi_connection: Any) -> Iterator[None]:
        """Arm the deadline for one call on ``dbapi_connection`` (a psycopg connection)."""
        fd = _fileno(dbapi_connection)
        if fd is None:
            yield
            return
        self.arm(fd)
        try:
            yield
        finally:
            self.disarm(fd)

    def install(self, engine: Engine) -> None:
        """Watch every statement ``engine`` runs (the hot path arms :meth:`watching` itself)."""

        @event.listens_for(engine, "before_cursor_execute")
        def _before(conn: Any, cursor: Any, statement: Any, *args: Any) -> None:
            fd = _fileno(conn.connection.dbapi_connection)
            if fd is not None:
                conn.info[_INFO_KEY] = fd
                self.arm(fd)

        @event.listens_for(engine, "after_cursor_execute")
        def _after(conn: Any, *args: Any) -> None:
            fd = conn.info.pop(_INFO_KEY, None)
            if fd is not None:
                self.disarm(fd)

        @event.listens_for(engine, "handle_error")
        def _error(context: Any) -> None:
            conn = context.connection
            fd = conn.info.pop(_INFO_KEY, None) if conn is not None else None
            if fd is not None:
                self.disarm(fd)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for fd, due in list(self._deadlines.items()):
                    if due <= now:
                        del self._deadlines[fd]
                        _shut(fd, self.seconds)
                nearest = min(self._deadlines.values(), default=None)
                self._idle = nearest is None
                self._cond.wait(None if nearest is None else max(0.01, nearest - now))


def _fileno(dbapi_connection: Any) -> int | None:
    try:
        return int(dbapi_connection.fileno())
    except Exception:  # closed, or a driver without a socket
        return None


def _shut(fd: int, seconds: float) -> None:
    """Shut the socket down (not close: the driver still owns the descriptor)."""
    logger.warning(
        "celery_guard store call got no answer within %.1fs: closing its connection", seconds
    )
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
