"""A fault-injecting TCP proxy on 127.0.0.1, driven at runtime by the test that started it.

Why our own: Toxiproxy, the usual tool, is a Go binary that is not on PyPI or in Debian (its
``toxiproxy-python`` package is only a 2019 client for that server). The pure-Python proxies on
the package index either bind every interface and take their faults only at start
(``toxic-proxy`` 0.1.0), only delay and throttle (``sloww``), or need a newer Python
(``faultlib``). What the scenarios need fits in one asyncio loop on one thread here.

Put it between a worker and a server by giving the worker the proxy's port instead of the
server's. The faults, any time after :meth:`FaultProxy.start`:

- :meth:`latency` per direction (``upstream``: client to server; ``downstream``: back), added
  to every chunk without lowering throughput (chunks queue; each leaves when it is due);
- :meth:`bandwidth`: a byte rate per direction;
- :meth:`blackhole`: connections, old and new, are accepted but nothing is forwarded; what was
  sent waits, as in TCP's retransmissions during a partition, and flows once healed unless a
  peer gave up first (a client's timeout, or :meth:`reset`). The proxy's kernel still
  acknowledges what the client sends, so to the client this is a peer that is up and silent
  (a frozen server, or a pooler in front of a dead one): ``tcp_user_timeout`` does not fire,
  only a client-side deadline does;
- :meth:`reset`: every open connection is aborted with a RST to both peers;
- :meth:`refuse`: the listening socket is closed, so new connections are refused;
- :meth:`cut`: refuse and reset (a hard partition);
- :meth:`flap`: alternate up and down (``cut`` or ``blackhole``) with a period;
- :meth:`heal`: back to normal (no fault, no flapping; latency and bandwidth cleared).

It runs on a daemon thread of the test process (no process to stop), and :meth:`stop`
(or the ``with`` block, or the rig's atexit registry) ends it. The counters in :attr:`stats`
tell a test that traffic really went through it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from . import procs
from .ports import free_port

T = TypeVar("T")

_CHUNK = 64 * 1024
#: How long a control call waits for the proxy's loop to carry it out.
_CONTROL_TIMEOUT = 10.0


@dataclass
class ProxyStats:
    """What went through the proxy since it started."""

    accepted: int = 0
    refused_while_down: int = 0
    resets: int = 0
    bytes_upstream: int = 0
    bytes_downstream: int = 0
    open_connections: int = 0


class _Direction:
    """One direction's settings: extra latency (s) and byte rate (None = unlimited)."""

    def __init__(self) -> None:
        self.latency = 0.0
        self.rate: float | None = None


class _Link:
    """One proxied connection: the client's side, the upstream side, and their pumps."""

    def __init__(self, proxy: FaultProxy, client: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    def abort(self, rst: bool) -> None:
        """Close both sides now; with ``rst`` the peers get a RST instead of a FIN."""
        if self.closed:
            return
        self.closed = True
        for writer in (self.client, self.upstream):
            if writer is None:
                continue
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
            writer.transport.abort()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``target_host:target_port`` with faults."""

    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", port: int | None = None
    ) -> None:
        if not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError(f"the fault proxy only forwards to loopback, not {target_host}")
        self.target_host = target_host
        self.target_port = target_port
        self._port = port or free_port()
        self.stats = ProxyStats()
        self._up = _Direction()
        self._down = _Direction()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._links: set[_Link] = set()
        self._flowing: asyncio.Event | None = None
        self._flapper: asyncio.Task[None] | None = None
        self._accepting = False

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self._port)

    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._close_all())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"faultproxy-{self._port}", daemon=True)
        self._thread.start()
        if not ready.wait(_CONTROL_TIMEOUT):
            raise RuntimeError(f"fault proxy on port {self._port} did not start")
        if failure:
            self._thread = None
            raise RuntimeError(f"fault proxy on port {self._port}: {failure[0]}")
        procs.register(self)
        return self

    def stop(self) -> None:
        """Close every connection and the listener, end the thread (bounded)."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_CONTROL_TIMEOUT)
        self._thread = None
        procs.unregister(self)

    def emergency_kill(self) -> None:
        self.stop()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- faults (called from the test's thread) -------------------------------------------------

    def latency(self, upstream: float = 0.0, downstream: float = 0.0) -> None:
        """Delay every chunk by ``upstream`` s towards the server, ``downstream`` s back."""
        self._up.latency, self._down.latency = float(upstream), float(downstream)

    def bandwidth(self, upstream: float | None = None, downstream: float | None = None) -> None:
        """Limit each direction to so many bytes per second (``None``: unlimited)."""
        self._up.rate, self._down.rate = upstream, downstream

    def blackhole(self) -> None:
        """Accept, but forward nothing either way until :meth:`heal`."""
        self._control(self._set_flowing(False))

    def reset(self) -> None:
        """Abort every open connection with a RST to both peers."""
        self._control(self._reset())

    def refuse(self) -> None:
        """Refuse new connections (the listener closes); open ones stay."""
        self._control(self._stop_accepting())

    def cut(self) -> None:
        """A hard partition: refuse new connections and reset the open ones."""
        self._control(self._cut())

    def flap(self, period: float, down: str = "cut", up_fraction: float = 0.5) -> None:
        """Alternate up (``up_fraction`` of each period) and down (``cut`` or ``blackhole``)."""
        if down not in ("cut", "blackhole"):
            raise ValueError(f"down must be 'cut' or 'blackhole', not {down!r}")
        if not (period > 0 and 0 < up_fraction < 1):
            raise ValueError("flap needs period > 0 and 0 < up_fraction < 1")
        self._control(self._start_flapping(period, down, up_fraction))

    def heal(self) -> None:
        """Back to normal: no flapping, forwarding, accepting, no latency or rate limit."""
        self.latency()
        self.bandwidth()
        self._control(self._heal())

    # -- the loop's side ------------------------------------------------------------------------

    def _control(self, coroutine: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or self._thread is None:
            coroutine.close()
            raise RuntimeError("the fault proxy is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(_CONTROL_TIMEOUT)

    async def _open(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        await self._start_accepting()

    async def _start_accepting(self) -> None:
        if self._accepting:
            return
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self._port, reuse_address=True, backlog=128
        )
        self._accepting = True

    async def _stop_accepting(self) -> None:
        if not self._accepting or self._server is None:
            return
        self._accepting = False
        server, self._server = self._server, None
        # Closes the listening socket at once (wait_closed() would wait for every connection);
        # connections still in the kernel's backlog are reset, as a refusing peer's would be.
        server.close()

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _reset(self) -> None:
        for link in list(self._links):
            link.abort(rst=True)
            self.stats.resets += 1
        self._links.clear()
        self.stats.open_connections = 0

    async def _cut(self) -> None:
        await self._stop_accepting()
        await self._reset()

    async def _up_again(self) -> None:
        await self._set_flowing(True)
        await self._start_accepting()

    async def _heal(self) -> None:
        if self._flapper is not None:
            self._flapper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flapper
            self._flapper = None
        await self._up_again()

    async def _start_flapping(self, period: float, down: str, up_fraction: float) -> None:
        if self._flapper is not None:
            self._flapper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flapper

        async def flapping() -> None:
            while True:
                await self._up_again()
                await asyncio.sleep(period * up_fraction)
                if down == "cut":
                    await self._cut()
                else:
                    await self._set_flowing(False)
                await asyncio.sleep(period * (1 - up_fraction))

        self._flapper = asyncio.get_running_loop().create_task(flapping())

    async def _close_all(self) -> None:
        if self._flapper is not None:
            self._flapper.cancel()
        await self._stop_accepting()
        for link in list(self._links):
            link.abort(rst=False)
        self._links.clear()
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._accepting:
            # Accepted by the kernel just before the listener closed: refuse it.
            self.stats.refused_while_down += 1
            _Link(self, writer).abort(rst=True)
            return
        self.stats.accepted += 1
        link = _Link(self, writer)
        self._links.add(link)
        self.stats.open_connections = len(self._links)
        try:
            assert self._flowing is not None
            await self._flowing.wait()  # a blackhole holds even the connect to the server
            if link.closed:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError:
                link.abort(rst=True)
                return
            link.upstream = up_writer
            if link.closed:
                up_writer.transport.abort()
                return
            loop = asyncio.get_running_loop()
            link.tasks = [
                loop.create_task(self._pump(link, reader, up_writer, self._up, True)),
                loop.create_task(self._pump(link, up_reader, writer, self._down, False)),
            ]
            await asyncio.gather(*link.tasks, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy stops: end quietly (asyncio's stream callback reads the outcome)
        finally:
            link.abort(rst=False)
            self._links.discard(link)
            self.stats.open_connections = len(self._links)

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: _Direction,
        upstream: bool,
    ) -> None:
        """Copy one direction: read, hold for the latency, wait out a blackhole, throttle."""
        assert self._flowing is not None
        flowing = self._flowing
        pending: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()
        ended = False

        async def read() -> None:
            nonlocal ended
            try:
                while True:
                    await flowing.wait()
                    data = await reader.read(_CHUNK)
                    if not data:
                        break
                    pending.append((time.monotonic() + direction.latency, data))
                    arrived.set()
            except (ConnectionError, OSError):
                pass
            finally:
                ended = True
                arrived.set()

        reading = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                if not pending:
                    if ended:
                        break
                    arrived.clear()
                    await arrived.wait()
                    continue
                due, data = pending[0]
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await flowing.wait()
                pending.popleft()
                rate = direction.rate
                if rate:
                    step = max(1, int(rate / 20))
                    for start in range(0, len(data), step):
                        piece = data[start : start + step]
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(len(piece) / rate)
                else:
                    writer.write(data)
                    await writer.drain()
                if upstream:
                    self.stats.bytes_upstream += len(data)
                else:
                    self.stats.bytes_downstream += len(data)
            if writer.can_write_eof():
                with contextlib.suppress(OSError):
                    writer.write_eof()
        except (ConnectionError, OSError):
            link.abort(rst=True)
        finally:
            reading.cancel()
