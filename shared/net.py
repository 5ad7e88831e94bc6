"""Small socket helpers shared by the supervisor, the embedded Redis, benches and tests."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

_LOWEST_PORT = 20000
_given: set[int] = set()
_share = (0, 1)  # this process's slice of the range, of how many (see share_ports)


def share_ports(index: int, count: int) -> None:
    """Pick ports from the ``index``-th of ``count`` equal slices of the range only: processes
    that pick side by side (parallel test runners) then never pick one port between its check
    and its bind by another."""
    if not 0 <= index < count:
        raise ValueError(f"slice {index} of {count} does not exist")
    global _share
    _share = (index, count)


def _span(top: int) -> tuple[int, int]:
    """The ports [low, high) this process picks from, below ``top``."""
    index, count = _share
    width = (top - _LOWEST_PORT) // count
    return _LOWEST_PORT + index * width, _LOWEST_PORT + (index + 1) * width


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pair(offset: int, host: str = "127.0.0.1") -> int:
    """A port free on ``host`` whose partner ``port + offset`` is free too, both below the
    kernel's ephemeral range (a Redis Cluster node's client and bus ports)."""
    low, top = _span(min(_ephemeral_low(), 32768) - offset)
    rnd = random.Random()  # noqa: S311 - spreads picks across the range, not a secret
    for _ in range(1000):
        port = rnd.randrange(low, top)
        if port in _given or port + offset in _given or not (_bindable(host, port) and _bindable(host, port + offset)):
            continue
        _given.update((port, port + offset))
        return port
    raise RuntimeError(f"no free port pair (+{offset}) in {low}-{top}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listened_on(host: str, port: int) -> bool:
    """Whether another socket listens on ``host:port`` now. SO_REUSEADDR as servers bind, so the
    closing connections a process that just stopped left behind do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, taken from below the kernel's ephemeral range and never
    handed out twice by this process. A port the kernel hands out (bind to 0) can be taken
    again before the caller binds it: by the local end of any outgoing connection, or by a
    ZeroMQ socket that keeps reconnecting to a killed peer's endpoint and connects to itself.
    Ports below that range are never given to outgoing connections."""
    low, top = _span(min(_ephemeral_low(), 32768))
    rnd = random.Random()  # noqa: S311 - spreads picks across the range, not a secret
    for _ in range(1000):
        port = rnd.randrange(low, top)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{top}")
