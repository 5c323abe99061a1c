"""The fault proxy itself, against a small echo server on loopback (no database, no broker)."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.rig.faultproxy import FaultProxy
from tests.rig.procs import wait_until


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            try:
                data = self.request.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def proxy(echo_port: int) -> Iterator[FaultProxy]:
    with FaultProxy(echo_port) as running:
        yield running


def connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(proxy.address, timeout=timeout)


def roundtrip(sock: socket.socket, payload: bytes = b"ping") -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def test_forwards_both_ways_and_counts(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert roundtrip(sock, b"hello") == b"hello"
    assert proxy.stats.accepted == 1
    wait_until(lambda: proxy.stats.bytes_downstream == 5, 5, "the bytes to be counted")
    assert proxy.stats.bytes_upstream == 5


def test_only_loopback_targets() -> None:
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy(5432, target_host="10.0.0.1")


def test_latency_per_direction(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        roundtrip(sock)  # connected upstream
        proxy.latency(upstream=0.3, downstream=0.2)
        started = time.monotonic()
        assert roundtrip(sock) == b"ping"
        assert time.monotonic() - started >= 0.5
        proxy.heal()  # under load only the lower bound above is safe to assert on time
        assert roundtrip(sock) == b"ping"


def test_bandwidth_limit(proxy: FaultProxy) -> None:
    payload = b"x" * 40_000
    with connect(proxy, timeout=30) as sock:
        roundtrip(sock)
        proxy.bandwidth(upstream=50_000)
        started = time.monotonic()
        assert roundtrip(sock, payload) == payload
        assert time.monotonic() - started >= 0.6  # 40 kB at 50 kB/s: 0.8 s


def test_blackhole_holds_traffic_until_healed(proxy: FaultProxy) -> None:
    with connect(proxy) as old:
        roundtrip(old)
        proxy.blackhole()
        old.settimeout(0.5)
        old.sendall(b"held")
        with pytest.raises(TimeoutError):
            old.recv(10)
        with connect(proxy) as new:  # a new connection is accepted, and hangs too
            new.settimeout(0.5)
            new.sendall(b"new")
            with pytest.raises(TimeoutError):
                new.recv(10)
            proxy.heal()
            new.settimeout(5)
            assert new.recv(10) == b"new"
        old.settimeout(5)
        assert old.recv(10) == b"held"


def test_reset_aborts_open_connections_with_rst(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        roundtrip(sock)
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"after")
            sock.recv(10)
        assert proxy.stats.resets == 1
    with connect(proxy) as again:  # reset is not refuse
        assert roundtrip(again) == b"ping"


def test_refuse_then_heal(proxy: FaultProxy) -> None:
    with connect(proxy) as open_before:
        roundtrip(open_before)
        proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            connect(proxy).close()
        assert roundtrip(open_before) == b"ping", "refuse leaves open connections alone"
        proxy.cut()
        with pytest.raises(ConnectionError):
            roundtrip(open_before)
    proxy.heal()
    with connect(proxy) as sock:
        assert roundtrip(sock) == b"ping"


def test_flapping_alternates_up_and_down(proxy: FaultProxy) -> None:
    proxy.flap(period=0.4, down="cut")
    seen: set[str] = set()

    def both_seen() -> bool:
        try:
            with connect(proxy, timeout=1) as sock:
                roundtrip(sock)
            seen.add("up")
        except OSError:
            seen.add("down")
        return seen == {"up", "down"}

    wait_until(both_seen, 20, "the proxy to be seen both up and down", 0.05)
    proxy.heal()
    with connect(proxy) as sock:
        assert roundtrip(sock) == b"ping"


def test_stop_closes_everything(echo_port: int) -> None:
    proxy = FaultProxy(echo_port).start()
    sock = connect(proxy)
    roundtrip(sock)
    proxy.stop()
    with contextlib.suppress(OSError), sock:
        assert sock.recv(10) == b""
    with pytest.raises(ConnectionRefusedError):
        connect(proxy).close()
