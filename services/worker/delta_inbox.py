"""The worker's delta inbox: a thread that reads the delta SUB socket all the time into a
queue bounded in bytes.

A worker reads deltas only between batches. Left in the socket, what the trainer publishes
during a long batch piles up in libzmq's buffers (its high-water mark counts messages, not
bytes), and a lowered mark is no remedy: libzmq 4.3.5 can abort the process when a TCP
connection's inbound pipe fills (zeromq/libzmq#3937). So the socket is drained at once, and
once the packets waiting exceed ``budget_bytes`` they are all dropped: the subscriber then
loads one snapshot, which costs less than decoding more than a snapshot's worth of deltas
(``docs/delta.md``, "Busy workers"). The socket keeps its ZMTP heartbeats (a vanished trainer
host is still noticed) and its :class:`~shared.curve.HandshakeWatch`, both served by this
thread, the only one that touches the socket.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque

import zmq

from shared.curve import HandshakeWatch

log = logging.getLogger(__name__)

_IDLE_POLL_MS = 100  # how often the thread looks at its watch and at close() when nothing arrives


class DeltaInbox:
    """Owns ``sock`` (a connected SUB socket) and ``watch`` from construction on."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, watch: HandshakeWatch, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.queued_bytes = 0
        self.peak_bytes = 0  # most bytes ever waiting at once
        self.overflows = 0
        self.dropped_packets = 0
        self._sock, self._watch = sock, watch
        self._queue: deque[tuple[list[bytes], int]] = deque()
        self._overflowed = False
        self._rang = False
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._error: BaseException | None = None
        # the doorbell: one message while the queue has packets the consumer has not been told of,
        # so the consumer can wait on it in a zmq.Poller beside its other sockets
        address = f"inproc://delta-inbox-{id(self)}"
        self.bell = ctx.socket(zmq.PAIR)
        self.bell.setsockopt(zmq.LINGER, 0)
        self.bell.bind(address)
        self._bell_tx = ctx.socket(zmq.PAIR)
        self._bell_tx.setsockopt(zmq.LINGER, 0)
        self._bell_tx.connect(address)
        self._start()

    def take(self, max_packets: int) -> tuple[list[list[bytes]], bool]:
        """Up to ``max_packets`` packets in arrival order, and whether packets were dropped (the
        bound was passed) since the last call: those returned all arrived after the drop.
        Raises what stopped the reading thread, once, and starts it again."""
        if self._error is not None:
            error, self._error = self._error, None
            self._start()
            raise RuntimeError("the delta inbox thread stopped; reading again") from error
        with self._lock:
            n = min(max_packets, len(self._queue))
            taken = [self._queue.popleft() for _ in range(n)]
            self.queued_bytes -= sum(size for _, size in taken)
            overflowed, self._overflowed = self._overflowed, False
            if not self._queue:
                self._silence_bell()
        return [frames for frames, _ in taken], overflowed

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="delta-inbox", daemon=True)
        self._thread.start()

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queue) or self._overflowed

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        self._watch.close()
        self._sock.close(linger=0)
        self.bell.close(linger=0)
        self._bell_tx.close(linger=0)

    # ------------------------------------------------------------------ reading thread
    def _silence_bell(self) -> None:
        """Under the lock: the thread rings only after setting ``_rang`` under it too, so no
        ring of a packet still queued is eaten here."""
        while True:
            try:
                self.bell.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        self._rang = False

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                self._watch.poll()
                if poller.poll(_IDLE_POLL_MS):
                    self._read()
        except Exception as exc:  # handed to the consumer: a silent dead reader would freeze the weights
            log.exception("the delta inbox stopped reading")
            self._error = exc

    def _read(self) -> None:
        for _ in range(1000):  # then look at the watch and at close() again
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._add(frames, sum(len(f) for f in frames))

    def _add(self, frames: list[bytes], size: int) -> None:
        with self._lock:
            if self.queued_bytes + size > self.budget_bytes:
                self.dropped_packets += len(self._queue) + 1
                self.overflows += 1
                self._queue.clear()
                self.queued_bytes = 0
                self._overflowed = True
            else:
                self._queue.append((frames, size))
                self.queued_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.queued_bytes)
            ring, self._rang = not self._rang, True
        if ring:
            with contextlib.suppress(zmq.Again):  # bells already waiting say the same
                self._bell_tx.send(b"", zmq.NOBLOCK)
