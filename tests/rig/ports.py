"""Free TCP port lookup for the private servers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """Return a port on 127.0.0.1 that was free a moment ago.

    There is an unavoidable race between closing the probe socket and the server binding
    the port; in practice the kernel does not hand the same ephemeral port out again soon.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
