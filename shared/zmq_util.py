"""The one place ZeroMQ sockets are made: bind/connect, identity, linger and high-water
marks are always explicit (never ZeroMQ's unbounded or infinite defaults), and so is CURVE
(shared/curve.py: a server's keys and allow-list, or a client's keys and pinned server key)."""

from __future__ import annotations

import zmq

from shared.curve import HANDSHAKE_EVENTS, CurveClient, CurveServer, new_socket

DEFAULT_HWM = 10_000
DEFAULT_LINGER_MS = 0


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                identity: bytes | None = None, hwm: int = DEFAULT_HWM, linger_ms: int = DEFAULT_LINGER_MS,
                subscribe: bytes | None = None, router_mandatory: bool = False,
                immediate: bool = False, curve: CurveServer | CurveClient | None = None,
                monitor: str | None = None) -> zmq.Socket:
    """Create a socket with explicit options, then bind or connect (exactly one of them).

    ``immediate=True`` (ZMQ_IMMEDIATE) queues messages only on completed connections, so a
    message to a peer that is down fails fast (EAGAIN) instead of waiting for it to return
    (with CURVE, a connection completes only after the handshake: nothing is queued for a
    peer that does not hold the pinned key). ``curve``: None only where ``zmq.curve`` is off.
    ``monitor``: an inproc address that gets the socket's handshake events from its first
    connection on (shared.curve.HandshakeWatch)."""
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= or connect=")
    sock = new_socket(ctx, kind, curve)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if router_mandatory and kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, subscribe or b"")
    if monitor is not None:
        sock.monitor(monitor, HANDSHAKE_EVENTS)
    try:
        if bind is not None:
            sock.bind(bind)
        else:
            sock.connect(connect)  # type: ignore[arg-type]
    except zmq.ZMQError:
        sock.close(linger=0)  # a failed bind must not leave a socket that blocks ctx.term()
        raise
    return sock


def bind_address(endpoint: str, bind_host: str) -> str:
    """Where a socket configured with ``endpoint`` binds: ``endpoint`` itself, or with
    ``bind_host`` (``zmq.bind_host``) in place of its host, so a process can listen on every
    interface while its peers keep connecting to the name ``endpoint`` advertises."""
    if not bind_host or not endpoint.startswith("tcp://"):
        return endpoint
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{bind_host}:{port}"


def bound_endpoint(sock: zmq.Socket) -> str:
    """The address a bound socket listens on, with the port ZeroMQ chose for ``:*``."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)
