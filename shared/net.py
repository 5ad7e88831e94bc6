"""Small socket helpers shared by the supervisor, the embedded Redis, benches and tests."""

from __future__ import annotations

import errno
import os
import random
import socket
from pathlib import Path

_LOWEST_PORT = 20000
# Single ports stay below this: the ports above it are the partners of pairs (a Redis Cluster
# node's bus port, +10000, see free_port_pair), which a restarted node must find free again.
_PARTNERS_FROM = 30000
PORT_SLICE_ENV = "LEARNMESH_PORT_SLICE"  # "<index>/<count>": the slice a process started with picks from
_given: set[int] = set()


def _parse_slice(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"{PORT_SLICE_ENV}={text!r}: expected <index>/<count> with index < count")
    return int(index), int(count)


# This process's slice of the range, of how many (see share_ports). A process started by one that
# shares the range (a gateway, an embedded Redis a test starts) inherits its slice by environment.
_share = _parse_slice(os.environ[PORT_SLICE_ENV]) if os.environ.get(PORT_SLICE_ENV) else (0, 1)


def share_ports(index: int, count: int, children: int | None = None) -> None:
    """Pick ports from the ``index``-th of ``count`` equal slices of the range only: processes
    that pick side by side (parallel test runners) then never pick one port between its check
    and its bind by another. ``children``: the slice the processes this one starts pick from
    (set in the environment they inherit), so that they never pick this process's ports either."""
    for i in (index, children):
        if i is not None and not 0 <= i < count:
            raise ValueError(f"slice {i} of {count} does not exist")
    global _share
    _share = (index, count)
    if children is not None:
        os.environ[PORT_SLICE_ENV] = f"{children}/{count}"


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
    low, top = _span(min(_ephemeral_low(), _PARTNERS_FROM))
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
