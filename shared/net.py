"""Small socket helpers shared by the supervisor, the embedded Redis, benches and tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel reports free on ``host`` right now (the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
