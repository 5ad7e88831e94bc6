"""Worker side of weight-delta sync (ZeroMQ Clone pattern).

The subscriber connects its SUB socket first, then asks the trainer's ROUTER for a snapshot
(a dense anchor plus the next delta sequence number). Deltas that arrive meanwhile are
buffered; once the snapshot is loaded, those not newer than it are dropped and the rest are
applied in order. A sequence gap, a delta whose base is not the held version, or a new
publisher session (trainer restart) triggers a fresh snapshot. Every packet is verified by
the envelope before anything is decoded. Each chunk of a delta is decoded (and validated) when
it arrives — the trainer streams them while it encodes the rest — and nothing is applied until
the last chunk has passed, so a request served between two :meth:`DeltaSubscriber.poll` calls
sees exactly one version. Rejected packets are counted (``stats`` and Prometheus) and never
applied.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from services.worker.delta_inbox import DeltaInbox
from shared import metrics, wire
from shared.config import Config
from shared.crypto import (
    MAX_SEALED_FRAME_BYTES,
    STREAM_DELTA,
    STREAM_HEARTBEAT,
    EnvelopeOpener,
    EnvelopeReject,
    KeyRing,
    Opened,
)
from shared.curve import CurveKeys, HandshakeWatch
from shared.delta.codec import BaseMismatch, CodecError, DecodedChunk, DeltaDecoder, Layout, LayoutMismatch
from shared.log_throttle import ThrottledWarning
from shared.zmq_util import CONTROL_FRAME_BYTES, make_socket

log = logging.getLogger(__name__)

_MAX_BUFFERED = 4096
_SUB_HWM = 100_000  # never reached: the inbox drains the socket (a full pipe can abort libzmq, #3937)
_MIN_QUEUE_BYTES = 16 * 1024 * 1024
_MAX_QUEUE_BYTES = 256 * 1024 * 1024
_WARN_INTERVAL_S = 60.0
# rejections that a key ring other than the trainer's explains (docs/delta.md, "Keys and rotation")
_KEY_REJECTS = {
    "wrong_key": "they are sealed with a key this worker's ring (security.delta_key_file) does not hold; "
                 "give it the trainer's ring",
    "retired_key": "they are sealed with a key this worker's ring retired; give it the trainer's ring",
    "bad_signature": "they are not signed by a signing key of this worker's ring (a ring from before a "
                     "signing-key rotation, or forged packets)",
}
_REJECTS = {  # the other reasons (docs/delta.md, "Envelope"): damage or replays on the way
    "truncated": "a packet arrived cut short",
    "malformed": "a packet is not a well-formed delta envelope",
    "tampered": "a packet failed its authentication tag (changed on the way)",
    "replayed": "a packet arrived a second time",
    "out_of_order": "a packet arrived after a later one",
    "stale": "a packet of an earlier trainer session, or an answer to an earlier snapshot request",
    "base_mismatch": "a delta applies to another version than the one held; it resyncs by snapshot",
    "layout": "a delta or snapshot is for another model layout than this worker's",
    "corrupt": "a delta or snapshot failed to decode; it resyncs by snapshot",
}


@dataclass
class _Assembly:
    """A delta being received: its chunks are decoded (validated) as they arrive and applied
    together once the last one is in, so a request never sees part of a version."""

    version: int
    n: int
    codec: dict[str, Any]
    decoded: list[DecodedChunk] = field(default_factory=list)
    received: int = 0
    decode_s: float = 0.0


class DeltaSubscriber:
    """Keep ``params`` in step with the trainer; call :meth:`poll` between batches."""

    def __init__(self, cfg: Config, zmq_ctx: zmq.Context, worker_id: str, params: dict[str, torch.Tensor],
                 version: int, *, model_id: str | None = None, queue_bytes: int | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.params = params
        self.model_id = model_id
        self.decoder = DeltaDecoder(params, version, model_id or "")
        self.opener = EnvelopeOpener(load_ring(cfg.security.delta_key_file), require_signature=cfg.security.sign_deltas)
        self.stats: dict[str, Any] = {"applied": 0, "anchors": 0, "resyncs": 0, "snapshot_timeouts": 0,
                                      "dropped_old": 0, "overflows": 0, "rejected": {}, "latest_seen": version}
        self.queue_bytes = queue_bytes or default_queue_bytes(self.decoder.layout)
        keys = CurveKeys.load(cfg.zmq, "worker")
        trainer = keys.client("trainer") if keys else None  # pinned: only the real trainer is heard
        self._watches: list[HandshakeWatch] = []

        def connect(kind: int, endpoint: str, max_frame_bytes: int = CONTROL_FRAME_BYTES, **opts: Any) -> zmq.Socket:
            # a connection the trainer broke (a frame over the bound) is connected again by the
            # watch: the deltas lost meanwhile show as a gap, an unanswered snapshot request is retried
            watch = HandshakeWatch(zmq_ctx, "trainer", endpoint, max_frame_bytes=max_frame_bytes)
            sock = make_socket(zmq_ctx, kind, connect=endpoint, curve=trainer, monitor=watch.address,
                               max_frame_bytes=max_frame_bytes, **opts)
            watch.attach(sock)
            self._watches.append(watch)
            return sock

        sec = cfg.security
        sub = connect(zmq.SUB, sec.delta_pub_endpoint, MAX_SEALED_FRAME_BYTES, hwm=_SUB_HWM)
        self._inbox = DeltaInbox(zmq_ctx, sub, self._watches.pop(), self.queue_bytes)
        # immediate: a request or ack is queued only on a live connection, so what a worker sends
        # while the trainer is away is not delivered in a burst when it returns (a snapshot each)
        self._dealer = connect(zmq.DEALER, sec.snapshot_endpoint, MAX_SEALED_FRAME_BYTES,
                               identity=f"{worker_id}-{secrets.token_hex(4)}".encode(), immediate=True)
        self._push = connect(zmq.PUSH, sec.ack_endpoint, hwm=100, immediate=True)
        self._expected_seq: int | None = None
        self._session: tuple[int, str] | None = None
        self._assembly: _Assembly | None = None
        self._refused: int | None = None  # version of the last delta refused by the codec
        self._buffer: deque[Opened] = deque()
        self._buffer_bytes = 0
        self._pending_req: str | None = None
        self._req_sent_at: float | None = None  # None: not sent yet (no connection to the trainer)
        self._req_made_at = 0.0
        self._unreachable_logged = False
        self._unanswered = ThrottledWarning(log)
        self._snap_parts: dict[int, tuple[Opened, bytes]] = {}
        self._warned: dict[str, float] = {}  # reason -> when its next warning may be logged
        self._session_checked_until = 0.0  # monotonic: no snapshot for packets of an older session until then
        self._request_snapshot("join")

    @property
    def version(self) -> int:
        return self.decoder.version

    @property
    def synced(self) -> bool:
        """A snapshot of the trainer's weights has been loaded (deltas follow it from then on)."""
        return self._session is not None

    @property
    def lag(self) -> int:
        """Versions between the newest one announced by the trainer and the one held."""
        return max(0, self.stats["latest_seen"] - self.version)

    # ---------------------------------------------------------------- public API
    def poll(self, max_packets: int = 64) -> int | None:
        """Apply pending verified updates in place; return the new version, or None if unchanged."""
        before = self.version
        for watch in self._watches:
            watch.poll()
        self._poll_snapshot()
        packets, overflowed = self._inbox.take(max_packets)
        if overflowed:
            self._on_overflow()
        for frames in packets:
            self._on_packet(frames)
        if self._pending_req is not None:
            self._poll_snapshot()
        return self.version if self.version != before else None

    def wait(self, timeout_ms: int) -> bool:
        """Block up to ``timeout_ms`` until an update or snapshot part is readable (for idle workers)."""
        if self._inbox.pending():
            return True
        poller = zmq.Poller()
        poller.register(self._inbox.bell, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        return bool(poller.poll(timeout_ms))

    def close(self) -> None:
        self._inbox.close()
        for watch in self._watches:
            watch.close()
        for sock in (self._dealer, self._push):
            sock.close(linger=0)

    # ---------------------------------------------------------------- packets
    def _reject(self, reason: str, detail: object = "") -> None:
        """Count a refused packet and say why in the log, at most once a minute per reason: a
        worker that opens no packet serves old weights, and a hostile or broken network must
        show where operators look without flooding it. ``detail`` names sequence numbers,
        versions and checks, never key material."""
        rej = self.stats["rejected"]
        rej[reason] = rej.get(reason, 0) + 1
        metrics.DELTA_REJECTED.labels(reason).inc()
        now = time.monotonic()
        if now < self._warned.get(reason, 0.0):
            return
        self._warned[reason] = now + _WARN_INTERVAL_S
        why = _KEY_REJECTS.get(reason) or _REJECTS.get(reason, "")
        log.warning("worker %s refuses delta packets (%s, %d so far): %s%s; it serves version %d",
                    self.worker_id, reason, rej[reason], why, f" ({detail})" if detail else "", self.version)

    def _on_packet(self, frames: list[bytes]) -> None:
        try:
            mtype, _, payload = wire.decode(frames)
        except wire.WireError as exc:
            self._reject("malformed", exc)
            return
        if mtype != wire.MsgType.DELTA:
            self._reject("malformed", f"a {mtype.name} message on the delta link")
            return
        try:
            op = self.opener.open(payload)
        except EnvelopeReject as exc:
            if exc.reason == "superseded":
                self.stats["dropped_old"] += 1
            else:
                self._reject(exc.reason, exc.detail)
            if exc.reason == "stale":
                self._check_session()
            return
        if op.header["stream"] == STREAM_HEARTBEAT:
            self._on_heartbeat(op)
            return
        if op.header["stream"] != STREAM_DELTA or not _valid_delta_meta(op.meta):
            self._reject("malformed")
            return
        self.stats["latest_seen"] = max(self.stats["latest_seen"], op.meta["version"])
        session = (op.header["t0"], op.header["sess"])
        if self._session is not None and session != self._session and self._pending_req is None:
            self._buffer_op(op)
            self._request_snapshot("publisher_restart")
            return
        if self._pending_req is not None:
            self._buffer_op(op)
            return
        self._handle(op)

    def _on_overflow(self) -> None:
        """The inbox dropped packets (more than ``queue_bytes`` waited: a long batch): what is
        held of the stream is useless without them, one snapshot replaces it all."""
        self.stats["overflows"] += 1
        self._assembly = None
        self._buffer, self._buffer_bytes = deque(), 0
        if self._pending_req is None:
            self._request_snapshot("overflow")
        # else the pending snapshot, and a gap seen after it, cover what was dropped

    def _check_session(self) -> None:
        """A genuine packet of a session older than the one followed is a replay, or comes from a
        trainer restarted under the same name on a host whose clock is behind: every packet it
        sends would be refused. Only a snapshot, which answers this worker's own nonce, tells
        which; it is asked for at most once per ``consistency.timeout_s``, so replayed packets
        cost the trainer one snapshot per interval at most."""
        now = time.monotonic()
        if now < self._session_checked_until:
            return
        self._session_checked_until = now + self.cfg.consistency.timeout_s
        self._request_snapshot("stale_session")

    def _buffer_op(self, op: Opened) -> None:
        """Hold a verified packet until the pending snapshot is loaded (bounded; oldest go first)."""
        self._buffer.append(op)
        self._buffer_bytes += len(op.payload)
        while len(self._buffer) > _MAX_BUFFERED or self._buffer_bytes > self.queue_bytes:
            self._buffer_bytes -= len(self._buffer.popleft().payload)

    def _on_heartbeat(self, op: Opened) -> None:
        meta = op.meta
        if not (_is_int(meta.get("version")) and _is_int(meta.get("next_seq"))):
            self._reject("malformed")
            return
        self.stats["latest_seen"] = max(self.stats["latest_seen"], meta["version"])
        if self._pending_req is not None or self._session is None:
            return
        if (op.header["t0"], op.header["sess"]) != self._session:
            self._request_snapshot("publisher_restart")
        elif self._expected_seq is not None and meta["next_seq"] > self._expected_seq:
            self._request_snapshot("gap")

    def _handle(self, op: Opened) -> None:
        if self._expected_seq is None:
            raise RuntimeError("a delta is handled only after a snapshot set the expected seq")
        seq, meta = op.header["seq"], op.meta
        if seq < self._expected_seq or meta["version"] <= self.version:
            self.stats["dropped_old"] += 1
            return
        if seq > self._expected_seq:
            self._buffer_op(op)
            self._request_snapshot("gap")
            return
        self._expected_seq = seq + 1
        if meta["i"] == 0:
            if not self._start_assembly(meta):
                return
        elif self._refused == meta["version"]:
            return  # the rest of a delta refused at its first chunk
        asm = self._assembly
        if asm is None or asm.version != meta["version"] or meta["i"] != asm.received or meta["n"] != asm.n \
                or meta["codec"] != asm.codec:
            self._request_snapshot("gap")
            return
        if self._add_chunk(asm, op.payload) and asm.received == asm.n:
            self._assembly = None
            self._apply(asm)

    def _start_assembly(self, meta: dict[str, Any]) -> bool:
        """A delta's first packet: refuse a wrong base or layout now, not after the last chunk."""
        self._assembly = None
        codec = meta["codec"]
        try:
            self.decoder.check_header(codec)
            if meta["n"] != max(1, codec["nchunks"]):
                raise CodecError("packet count does not match the header")
        except CodecError as exc:
            self._refuse(meta["version"], exc)
            return False
        self._refused = None
        self._assembly = _Assembly(meta["version"], meta["n"], codec)
        return True

    def _add_chunk(self, asm: _Assembly, payload: bytes) -> bool:
        """Decode the next chunk into ``asm``; False when the codec refuses it (the delta is dropped)."""
        asm.received += 1
        if asm.codec["nchunks"]:  # (an empty delta is one packet without a chunk)
            t0 = time.perf_counter()
            try:
                asm.decoded.append(self.decoder.decode_chunk(asm.codec, payload))
            except CodecError as exc:
                self._refuse(asm.version, exc)
                return False
            asm.decode_s += time.perf_counter() - t0
        return True

    def _refuse(self, version: int, exc: CodecError) -> None:
        """Count a delta that failed the codec's checks; nothing of it is applied."""
        self._assembly = None
        self._refused = version
        if isinstance(exc, BaseMismatch):
            self._reject("base_mismatch", f"delta {version}: {exc}")
            self._request_snapshot("base_mismatch")
        elif isinstance(exc, LayoutMismatch):
            self._reject("layout", f"delta {version}: {exc}")
        else:
            self._reject("corrupt", f"delta {version}: {exc}")
            self._request_snapshot("corrupt")

    def _apply(self, asm: _Assembly) -> None:
        t0 = time.perf_counter()
        try:
            decoded = self.decoder.finish(asm.codec, asm.decoded)
        except CodecError as exc:
            self._refuse(asm.version, exc)
            return
        self.decoder.apply(self.params, decoded)
        kind = asm.codec.get("kind", "delta")
        self.stats["applied"] += 1
        metrics.DELTA_APPLIED.labels(kind).inc()
        metrics.DELTA_APPLY_SECONDS.observe(asm.decode_s + time.perf_counter() - t0)
        self._ack()

    def _ack(self) -> None:
        msg = wire.encode(wire.MsgType.ACK, {"worker": self.worker_id, "version": self.version})
        try:
            self._push.send_multipart(msg, zmq.NOBLOCK)
        except zmq.Again:
            pass  # trainer not reachable: acks are advisory, the heartbeat carries the version too

    # ---------------------------------------------------------------- snapshots
    def _request_snapshot(self, cause: str) -> None:
        if self._pending_req is not None and cause != "timeout":
            return
        if cause != "join":
            self.stats["resyncs"] += 1
            metrics.DELTA_RESYNCS.labels(cause).inc()
            log.info("worker %s resyncing by snapshot (%s) at version %s", self.worker_id, cause, self.version)
        self._assembly = None
        self._pending_req = secrets.token_hex(16)
        self._req_made_at = time.monotonic()
        self._req_sent_at = None
        self._snap_parts = {}
        self._send_request()

    def _send_request(self) -> None:
        """Send the pending snapshot request if the trainer is connected; else it is sent by a
        later poll once it is (one request, however long the trainer is away)."""
        msg = wire.encode(wire.MsgType.SNAPSHOT_REQ, {"req": self._pending_req, "worker": self.worker_id})
        try:
            self._dealer.send_multipart(msg, zmq.NOBLOCK)
        except zmq.Again:
            away_s = time.monotonic() - self._req_made_at
            if not self._unreachable_logged and away_s > self.cfg.consistency.timeout_s:
                self._unreachable_logged = True
                log.warning("worker %s cannot reach the trainer at %s for %.1fs; it serves version %d and asks "
                            "for a snapshot once the trainer is back", self.worker_id,
                            self.cfg.security.snapshot_endpoint, away_s, self.version)
            return
        self._req_sent_at = time.monotonic()
        if self._unreachable_logged:
            self._unreachable_logged = False
            log.info("worker %s reached the trainer at %s again", self.worker_id, self.cfg.security.snapshot_endpoint)

    def _poll_snapshot(self) -> None:
        if self._pending_req is None:
            # a late reply to an earlier request: drain and ignore
            self._drain_dealer()
            return
        if self._req_sent_at is None:
            self._send_request()
            if self._req_sent_at is None:
                return
        while True:
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._on_snapshot_part(frames)
            if self._pending_req is None:
                return
        if self._req_sent_at is not None and time.monotonic() - self._req_sent_at > self.cfg.consistency.timeout_s:
            self.stats["snapshot_timeouts"] += 1
            self._unanswered.warning("worker %s: snapshot request unanswered for %.1fs; retrying",
                                     self.worker_id, self.cfg.consistency.timeout_s)
            self._request_snapshot("timeout")

    def _drain_dealer(self) -> None:
        while True:
            try:
                self._dealer.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return

    def _on_snapshot_part(self, frames: list[bytes]) -> None:
        op = self._open_snapshot_part(frames)
        if op is None:
            return
        meta = op.meta
        self._snap_parts[meta["i"]] = (op, op.payload)
        ordered = [self._snap_parts[i] for i in range(meta["n"]) if i in self._snap_parts]
        if len(ordered) != meta["n"]:
            return
        if self._load_snapshot(meta, [p for _, p in ordered]):
            self._adopt_snapshot(op)

    def _open_snapshot_part(self, frames: list[bytes]) -> Opened | None:
        """The opened envelope of one part of the snapshot asked for; None (counted) otherwise."""
        try:
            mtype, _, payload = wire.decode(frames)
            if mtype != wire.MsgType.SNAPSHOT:
                raise wire.WireError("not a snapshot")
        except wire.WireError:
            self._reject("malformed")
            return None
        try:
            op = self.opener.open(payload, track=False)
        except EnvelopeReject as exc:
            self._reject(exc.reason, exc.detail)
            return None
        if op.meta.get("req") != self._pending_req:
            self._reject("stale", "a snapshot part answering an earlier request")
            return None
        if not _valid_snapshot_meta(op.meta):
            self._reject("malformed")
            return None
        return op

    def _load_snapshot(self, meta: dict[str, Any], parts: list[bytes]) -> bool:
        """Decode every part, then apply; False (nothing applied) when the codec refuses it."""
        if self.model_id is None:
            self.decoder.model_id = meta["model"]
        try:
            decoded = self.decoder.decode(meta["codec"], parts)
        except CodecError as exc:
            self._reject("layout" if isinstance(exc, LayoutMismatch) else "corrupt", f"snapshot: {exc}")
            # wait for the retry timer instead of asking again at once: a worker built for another
            # model must not make the trainer encode snapshots in a loop
            self._pending_req = secrets.token_hex(16)
            self._snap_parts = {}
            return False
        self.decoder.apply(self.params, decoded)
        self.stats["anchors"] += 1
        metrics.DELTA_APPLIED.labels("snapshot").inc()
        return True

    def _adopt_snapshot(self, op: Opened) -> None:
        """Follow the publisher's delta stream from the snapshot's sequence number on, then
        handle the deltas buffered while the snapshot was on its way."""
        meta = op.meta
        self._pending_req = None
        self._snap_parts = {}
        self._session = (op.header["t0"], op.header["sess"])
        self._expected_seq = meta["pub_seq"]
        self.opener.adopt(op.header["sender"], STREAM_DELTA, op.header["t0"], op.header["sess"],
                          meta["pub_seq"] - 1)
        self._ack()
        buffered, self._buffer, self._buffer_bytes = list(self._buffer), deque(), 0
        for b in sorted(buffered, key=lambda o: o.header["seq"]):
            if self._pending_req is not None:
                self._buffer_op(b)
                continue
            sess = (b.header["t0"], b.header["sess"])
            if sess < self._session:
                self.stats["dropped_old"] += 1
            elif sess > self._session:
                self._buffer_op(b)
                self._request_snapshot("publisher_restart")
            else:
                self._handle(b)


def default_queue_bytes(layout: Layout) -> int:
    """Twice the model's dense size, within [16, 256] MiB: more deltas than that waiting cost
    more to decode than one snapshot to load; a delta chunk (at most the dense size of its
    range plus indices, and never over 64 MiB) always fits."""
    dense = layout.numel * layout.dtype.itemsize
    return min(_MAX_QUEUE_BYTES, max(_MIN_QUEUE_BYTES, 2 * dense))


def load_ring(path: str) -> KeyRing:
    """The delta key ring: AES keys and verify keys, never a signing key (the trainer alone
    signs). A ring not written yet (the trainer makes it on first start) is read once it
    appears; until then every delta is refused."""
    if not os.path.exists(path):
        log.warning("delta key ring %s does not exist yet: deltas are refused until the trainer writes it", path)
        return KeyRing.waiting_for(path)
    return KeyRing.load(path)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _valid_delta_meta(m: dict[str, Any]) -> bool:
    return (_is_int(m.get("version")) and _is_int(m.get("i")) and _is_int(m.get("n"))
            and 0 <= m["i"] < m["n"] <= 1_000_000 and isinstance(m.get("codec"), dict))


def _valid_snapshot_meta(m: dict[str, Any]) -> bool:
    return (_valid_delta_meta(m) and _is_int(m.get("pub_seq")) and m["pub_seq"] >= 0
            and isinstance(m.get("model"), str))
