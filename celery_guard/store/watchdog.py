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
from typing import Any

import psycopg
from sqlalchemy import Engine, event

from celery_guard import forks

logger = logging.getLogger("celery_guard.store")


class CallWatchdog:
    """Closes a connection's socket when one call on it runs ``seconds`` past its start.

    Arming and disarming are one dict write each, with no lock: a dict's item assignment and
    ``pop`` are atomic under the GIL, and the watchdog thread, the only other user, copies the
    items in one step and removes a deadline only if it is still the one it found due (see
    :meth:`_run`). Every claim and completion arms and disarms once.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deadlines: dict[int, float] = {}  # socket fd -> monotonic deadline
        self._thread: threading.Thread | None = None
        self._generation: int | None = None

    def disarm(self, fd: int) -> None:
        self._deadlines.pop(fd, None)

    def _start(self) -> None:
        # Per process: a thread does not survive a fork. (Two threads of a new process arming
        # at once may start two watchdogs: harmless, either shuts a due socket once.)
        self._deadlines = {}
        self._generation = forks.current
        self._thread = threading.Thread(
            target=self._run, name="celery_guard-store-watchdog", daemon=True
        )
        self._thread.start()

    def arm_connection(self, dbapi_connection: Any) -> int | None:
        """Arm the deadline for one call on ``dbapi_connection`` (a psycopg connection); the
        caller passes what it returns to :meth:`disarm` when the call ends (``None``: there is
        no socket to watch)."""
        try:
            # psycopg's fileno() is this attribute behind a Python call, on every statement.
            fd: int = dbapi_connection.pgconn.socket
        except Exception:  # closed, or a driver without a socket (no pgconn)
            return None
        if self._generation != forks.current:
            self._start()
        # The thread is never woken for a new deadline: each is "now + seconds", so one armed
        # while the thread sleeps is never earlier than that sleep's end (see _run).
        self._deadlines[fd] = time.monotonic() + self.seconds
        return fd

    def cursor_class(self) -> type[psycopg.Cursor[Any]]:
        """A psycopg cursor class whose ``execute`` and ``executemany`` arm this watchdog."""
        watchdog = self

        class WatchedCursor(psycopg.Cursor[Any]):
            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                fd = watchdog.arm_connection(self.connection)
                try:
                    return super().execute(query, params, **kwargs)
                finally:
                    if fd is not None:
                        watchdog._deadlines.pop(fd, None)  # disarm(), inlined: every statement

            def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
                fd = watchdog.arm_connection(self.connection)
                try:
                    super().executemany(query, params_seq, **kwargs)
                finally:
                    if fd is not None:
                        watchdog.disarm(fd)

        return WatchedCursor

    def install(self, engine: Engine) -> None:
        """Watch every statement run on ``engine``'s connections, hot path included.

        Through the driver's cursor class, set as each connection opens, rather than
        SQLAlchemy's ``before_cursor_execute``/``after_cursor_execute`` events: any connection
        event on an engine sends every statement through SQLAlchemy's event dispatch (the
        store engine has none; see ``TaskConnection`` in engine.py). A pool ``connect``
        listener is not a connection event and costs nothing per statement.
        """
        cursor_class = self.cursor_class()

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.cursor_factory = cursor_class

    def _run(self) -> None:
        deadlines = self._deadlines  # this process's (``_start`` made it before the thread)
        while True:
            now = time.monotonic()
            # dict.copy() copies the table in C without running Python code, so no other
            # thread changes it meanwhile: arm_connection() and disarm() need no lock.
            armed = deadlines.copy()
            for fd, due in armed.items():
                # Still the deadline found due, not a later call's on the same socket: a
                # statement that ends in between is shut anyway, as it would be a moment later.
                if due <= now and deadlines.get(fd) is due:
                    deadlines.pop(fd, None)
                    _shut(fd, self.seconds)
            nearest = min((due for due in armed.values() if due > now), default=None)
            # With nothing armed, sleep one period: whatever is armed meanwhile is due no
            # earlier than the wake-up (arm_connection adds "now + seconds").
            time.sleep(self.seconds if nearest is None else max(0.01, nearest - now))


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
