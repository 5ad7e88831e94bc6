"""The one place ZeroMQ sockets are made: bind/connect, identity, linger, high-water marks and
the largest frame a socket reads are always explicit (never ZeroMQ's unbounded or
infinite defaults), and so is CURVE (shared/curve.py: a server's keys and allow-list, or a
client's keys and pinned server key)."""

from __future__ import annotations

import logging

import zmq

from shared import metrics
from shared.curve import HANDSHAKE_EVENTS, CurveClient, CurveServer, new_socket
from shared.log_throttle import ThrottledWarning

DEFAULT_HWM = 10_000
DEFAULT_LINGER_MS = 0
CONTROL_FRAME_BYTES = 64 * 1024
"""Largest frame a socket reads unless told otherwise: room for the control messages (sample
wake-ups, snapshot requests, acks, subscriptions) the trainer's sockets receive, and for what
a PUSH socket receives (nothing)."""
HEARTBEAT_MS = (2_000, 10_000)
"""ZMTP heartbeats on every connection: a PING every 2 s, and a connection that has carried
nothing for 10 s is closed. A peer whose host vanished or whose process is frozen sends no FIN,
so TCP alone would keep its connection for many minutes: messages would queue towards it and
replies be awaited from it. A closed connection is what the sockets' users already notice
(ZMQ_IMMEDIATE refuses to queue, a connecting socket reconnects and hands over again)."""


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                identity: bytes | None = None, hwm: int = DEFAULT_HWM, linger_ms: int = DEFAULT_LINGER_MS,
                subscribe: bytes | None = None, router_mandatory: bool = False,
                immediate: bool = False, curve: CurveServer | CurveClient | None = None,
                monitor: str | None = None, max_frame_bytes: int = CONTROL_FRAME_BYTES,
                heartbeat_ms: tuple[int, int] = HEARTBEAT_MS) -> zmq.Socket:
    """Create a socket with explicit options, then bind or connect (exactly one of them).

    ``immediate=True`` (ZMQ_IMMEDIATE) queues messages only on completed connections, so a
    message to a peer that is down fails fast (EAGAIN) instead of waiting for it to return
    (with CURVE, a connection completes only after the handshake: nothing is queued for a
    peer that does not hold the pinned key). ``curve``: None only where ``zmq.curve`` is off.
    ``monitor``: an inproc address that gets the socket's handshake events from its first
    connection on (shared.curve.HandshakeWatch).

    ``max_frame_bytes`` (ZMQ_MAXMSGSIZE): a peer that sends a longer frame is disconnected
    before the frame is read. On a bound socket it holds from the first byte, before any CURVE
    handshake: without it a client holding no key makes the server buffer whatever frame length
    it announces, for every connection it opens. A connecting socket is bounded too, by the
    longest frame its server sends (delta chunks: shared.crypto.MAX_SEALED_FRAME_BYTES; worker
    replies: shared.inference.max_reply_frame_bytes), so a misconfigured server, or any process
    on its port when CURVE is off, cannot make it buffer without end; libzmq never reconnects a
    connection closed that way, so a connecting socket needs its
    :class:`~shared.curve.HandshakeWatch`, which reports it and connects again.

    ``heartbeat_ms``: (PING interval, silence after which a connection is closed); see
    :data:`HEARTBEAT_MS`."""
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= or connect=")
    sock = new_socket(ctx, kind, curve)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
    sock.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_ms[1])
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
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


class DroppedMessages:
    """What a bound socket does with a message it cannot read: count it
    (``learnmesh_zmq_dropped_messages_total{link}``) and say why in the log, at most once per
    interval whatever the rate (a peer sending nothing else must not flood the log)."""

    def __init__(self, link: str, logger: logging.Logger) -> None:
        self.link = link
        self._counter = metrics.ZMQ_DROPPED.labels(link)
        self._warning = ThrottledWarning(logger)
        self.count = 0

    def drop(self, why: object) -> None:
        self.count += 1
        self._counter.inc()
        self._warning.warning("dropped a message on the %s link: %s", self.link, why)
