"""A prefork worker's renewal relay: the pool processes' lease renewals, run by the main process.

A pool process holds one PostgreSQL connection, and while a body's transaction is open on it
(docs/design.md, "One connection per pool process") its heartbeat thread cannot renew there.
So with leases in the store's rows, each heartbeat round (one message per round, whatever the
number of leases) goes over a local socket to the worker's main process, which renews them on
its own connection and answers which keys are still held. A frozen pool process sends nothing
and loses its leases as before; a body past its hard deadline is left out of the round by the
heartbeat as before. Leases in Redis are renewed in Redis by the pool process itself.

Each pool process also keeps a second, silent connection to the relay, its *presence*: when
the process dies (SIGKILL, the OOM killer) the kernel closes it, and the main process ends the
leases of that process's keys at once (token-checked, as the reaper's takeover of a dead owner).
The worker's own liveness lock then only has to stand for the worker as a whole
(celery_guard/lease/liveness.py). Sockets are Unix-domain, in Linux's abstract namespace where
available (nothing to clean up on disk), and served by :mod:`socketserver`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from celery_guard.errors import StoreError, StoreUnavailable

logger = logging.getLogger("celery_guard.lease")

#: Renews (key, handle) leases for ``ttl`` seconds and answers the keys still held.
RenewFn = Callable[[list[tuple[str, int]], float], set[str]]


class RenewalRelay:
    """Main process: serves its pool processes' renewal rounds and notices their deaths."""

    def __init__(
        self,
        renew: RenewFn,
        *,
        on_process_gone: Callable[[int], None] = lambda pid: None,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        #: Runs one round on the main process's connection.
        self.renew = renew
        #: Called with a pool process's pid when its presence connection closes.
        self.on_process_gone = on_process_gone
        #: Called about twice a second by the serving thread (keeping the liveness lock).
        self.tick = tick
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.address = ""

    def bind(self) -> str:
        """Listen (before the pool forks, so every pool process knows where); the address."""
        if sys.platform.startswith("linux"):
            address = f"\0celery_guard-relay-{os.getpid()}-{os.urandom(6).hex()}"
        else:  # pragma: no cover - no abstract namespace
            address = os.path.join(tempfile.gettempdir(), f"cg-relay-{os.getpid()}.sock")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
        self._pid = os.getpid()
        self._server = _Server(address, self)
        os.register_at_fork(after_in_child=self._forget_in_child)
        self.address = address
        return address

    def start(self) -> None:
        """Serve, in a daemon thread of the main process (after the pool forked)."""
        server = self._server
        if server is None or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="celery_guard-relay",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket (worker shutdown)."""
        server, self._server = self._server, None
        if server is None or self._pid != os.getpid():
            return
        if self._thread is not None:
            server.shutdown()
            self._thread = None
        server.server_close()
        if not self.address.startswith("\0"):  # pragma: no cover - no abstract namespace
            with contextlib.suppress(OSError):
                os.unlink(self.address)

    def _forget_in_child(self) -> None:
        # A pool process must not hold the main's listening socket (or serve it).
        server, self._server, self._thread = self._server, None, None
        if server is not None and self._pid != os.getpid():
            with contextlib.suppress(OSError):
                server.socket.close()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """One renewal round: ``{"ttl": s, "leases": [[key, handle], ...]}``."""
        pairs = [(str(key), int(handle)) for key, handle in request.get("leases", [])]
        try:
            renewed = self.renew(pairs, float(request["ttl"])) if pairs else set()
        except StoreError as exc:
            return {"error": str(exc)}
        return {"renewed": sorted(renewed)}


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    # Every pool process's presence waits here until the serving thread starts.
    request_queue_size = 256

    def __init__(self, address: str, relay: RenewalRelay) -> None:
        self.relay = relay
        super().__init__(address, _Handler)

    def service_actions(self) -> None:
        try:
            self.relay.tick()
        except Exception:
            logger.exception("celery_guard relay tick failed")


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        relay = self.server.relay
        for line in self.rfile:
            try:
                request = json.loads(line)
            except ValueError:
                return
            if "presence" in request:
                self._presence(int(request["presence"]))
                return
            try:
                answer = relay.answer(request)
            except Exception as exc:  # a bad round must not end the relay
                logger.exception("celery_guard relay could not answer a renewal round")
                answer = {"error": f"relay failed: {exc}"}
            try:
                self.wfile.write(json.dumps(answer).encode() + b"\n")
                self.wfile.flush()
            except OSError:
                return

    def _presence(self, pid: int) -> None:
        # Nothing more is ever sent on a presence connection: reading returns when the pool
        # process's end closes, which its death does.
        with contextlib.suppress(OSError):
            while self.rfile.read(4096):
                pass
        try:
            self.server.relay.on_process_gone(pid)
        except Exception:
            logger.exception("celery_guard could not end the leases of pool process %s", pid)


class RelayRenewer:
    """Pool process: renews the leases its heartbeat holds through the main's relay."""

    #: True like the SQL rows it stands for: the heartbeat asks nothing else of it.
    in_store = True

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        observer: Callable[[float, StoreError | None], None] | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        #: Told each round's latency and outcome, as a store call's (the circuit breaker's
        #: counts: the round stands for the store call this process no longer makes).
        self.observer = observer
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._reader: Any = None
        self._presence: socket.socket | None = None

    def announce(self) -> None:
        """Open this process's presence connection (``worker_process_init``); kept until exit."""
        try:
            presence = self._connect()
        except OSError as exc:
            logger.warning("celery_guard could not reach the worker's renewal relay: %s", exc)
            return
        try:
            presence.sendall(json.dumps({"presence": os.getpid()}).encode() + b"\n")
        except OSError as exc:
            presence.close()
            logger.warning("celery_guard could not reach the worker's renewal relay: %s", exc)
            return
        self._presence = presence

    def _connect(self) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(self.timeout)
            connection.connect(self.address)
        except OSError:
            connection.close()
            raise
        return connection

    def renew_leases(
        self,
        leases: Iterable[tuple[str, int]],
        ttl: float,
        statuses: Mapping[str, str] | None = None,
    ) -> set[str]:
        """One round through the relay; ``StoreUnavailable`` when it does not answer."""
        pairs = [[key, handle] for key, handle in leases]
        if not pairs:
            return set()
        started = time.monotonic()
        try:
            renewed = self._round(pairs, ttl)
        except StoreError as exc:
            self._tell(time.monotonic() - started, exc)
            raise
        self._tell(time.monotonic() - started, None)
        return renewed

    def _tell(self, seconds: float, error: StoreError | None) -> None:
        if self.observer is None:
            return
        try:
            self.observer(seconds, error)
        except Exception:  # counting a round must never change its outcome
            logger.exception("celery_guard: the renewal observer failed")

    def _round(self, pairs: list[list[Any]], ttl: float) -> set[str]:
        payload = json.dumps({"ttl": ttl, "leases": pairs}).encode() + b"\n"
        with self._lock:
            try:
                if self._socket is None:
                    connection = self._connect()
                    self._socket, self._reader = connection, connection.makefile("rb")
                self._socket.sendall(payload)
                line = self._reader.readline()
                if not line:
                    raise OSError("the relay closed the connection")
                answer = json.loads(line)
            except (OSError, ValueError) as exc:
                # A late answer would be read as the next round's: start a new connection.
                self._close()
                raise StoreUnavailable(f"the worker's renewal relay did not answer: {exc}") from exc
        if "error" in answer:
            raise StoreError(str(answer["error"]))
        return {str(key) for key in answer.get("renewed", [])}

    def close(self) -> None:
        """Close both connections (a process that stays alive but stops using the relay; a
        closed presence tells the main this process is gone, so only at its end)."""
        with self._lock:
            self._close()
        presence, self._presence = self._presence, None
        if presence is not None:
            with contextlib.suppress(OSError):
                presence.close()

    def _close(self) -> None:
        connection, reader, self._socket, self._reader = self._socket, self._reader, None, None
        with contextlib.suppress(OSError):
            if reader is not None:
                reader.close()
            if connection is not None:
                connection.close()
