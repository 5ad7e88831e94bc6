"""Sockets an attacker on the host would open against learnmesh's ZeroMQ links, and a way to
know that their handshake is over (so "nothing was delivered" is a fact, not a wait)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Outsider:
    """One socket of a process that is not in the mesh: ``curve_server_key`` set means it
    speaks CURVE with a random keypair of its own (pinning the real server's public key, which
    anyone can read) or ``keypair``; None means it does not speak CURVE at all. ``bind`` makes
    it the server (``curve_server``: with a key of its own)."""

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, *, curve_server_key: bytes | None = None,
                 bind: bool = False, curve_server: bool = False, keypair: tuple[bytes, bytes] | None = None) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_server:  # an impostor server with a key of its own
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, zmq.curve_keypair()[1])
        elif curve_server_key is not None:
            public, secret = keypair or zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        if kind == zmq.SUB:
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_EVENTS)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    def handshake(self, timeout_s: float = 20.0) -> int:
        """The outcome of the first handshake: zmq.EVENT_HANDSHAKE_SUCCEEDED or a failure event."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.monitor.poll(100):
                return int(recv_monitor_message(self.monitor)["event"])
        raise AssertionError(f"no handshake within {timeout_s}s")

    def received(self) -> list[list[bytes]]:
        """Everything delivered to it so far."""
        got = []
        while self.sock.poll(0):
            got.append(self.sock.recv_multipart())
        return got

    def close(self) -> None:
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def metric(url: str, name: str, **labels: str) -> float:
    """A sample of a process's /metrics (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in httpx.get(url, timeout=5).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return 0.0


def send_all(outsiders: list[Outsider], msg: list[Any]) -> None:
    for o in outsiders:
        try:
            o.sock.send_multipart(msg, zmq.NOBLOCK)
        except zmq.Again:  # nothing connected: there is no peer to queue for
            pass


def bind_when_free(make: Callable[[], zmq.Socket], timeout_s: float = 10.0) -> zmq.Socket:
    """``make()`` (a socket that binds) once the port is free again: ZeroMQ releases a closed
    socket's port in its I/O thread, a moment after close() returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.02)
