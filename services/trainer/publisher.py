"""Trainer side of weight-delta sync (ZeroMQ Clone pattern).

* PUB (``security.delta_pub_endpoint``): one DELTA message per codec chunk, sealed by the
  envelope. Without a byte budget a lossy delta streams: each chunk is sealed and sent as soon
  as the encoder has it, so workers decode it while the next one is encoded (every chunk goes
  out and the version only becomes visible when the last is applied, so order changes nothing
  a request can see). With ``scheduling.bandwidth_cap_bytes_s`` (or ``compression.max_ratio``)
  the whole delta is encoded first, chunks go out most important first
  (``scheduling.priority_mode``) and only as many as the budget since the last publish allows —
  the rest stays in the encoder's residual and goes out later (error feedback).
* ROUTER (``security.snapshot_endpoint``): answers SNAPSHOT_REQ with a dense anchor of the
  reference (what every receiver should hold) plus the next delta sequence number, so a
  worker can join, or rejoin after a gap or a publisher restart. Each connection is sent at
  most one snapshot per ``consistency.snapshot_interval_ms`` (:class:`SnapshotGate`): a peer
  that asks in a loop costs one sealed snapshot per interval, not one per request.
* PULL (``security.ack_endpoint``): workers' ACKs of applied versions (:meth:`acks`).

The latest version is also written to Redis at ``keys.MODEL_VERSION`` so the gateway can
compute each worker's lag from its heartbeats.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import zmq
from redis import Redis

from shared import keys, metrics, wire
from shared.config import Config
from shared.crypto import (
    STREAM_DELTA,
    STREAM_HEARTBEAT,
    STREAM_SNAPSHOT,
    EnvelopeSealer,
    SigningKey,
    trainer_keys,
)
from shared.curve import CurveKeys, CurveServer
from shared.delta.codec import DeltaEncoder, EncodedDelta
from shared.log_throttle import ThrottledWarning
from shared.zmq_util import DroppedMessages, bind_address, make_socket

log = logging.getLogger(__name__)

_MAX_REQ_NONCE = 64
_MAX_ACKED_WORKERS = 4096  # worker ids an ack may name: the ids are the sender's word, their count is bounded
_SNAPSHOT_HWM_SLACK = 16  # parts beyond one snapshot a connection's queue holds
_QUEUED_DELTAS, _PUB_HWM_SLACK = 4, 256  # what a subscriber's queue holds: 4 deltas' chunks and heartbeats
_MAX_WAITING_PEERS = 4096  # connections whose snapshot request waits for the end of their interval


@dataclass
class PublishStats:
    version: int
    kind: str  # "delta" | "anchor"
    bytes: int
    packets: int
    chunks_dropped: int
    density: float
    rel_error: float
    encode_s: float
    send_s: float
    extra: dict[str, Any] = field(default_factory=dict)


class SnapshotGate:
    """Which snapshot requests are answered when: each peer (a connection's routing id) is sent
    at most one snapshot per ``interval_s``. A request that comes sooner waits for the end of
    the interval; a further one replaces it (only the newest nonce is answered: a worker
    accepts only the answer to its latest request), so a peer asking in a loop, authenticated
    or not, makes the trainer seal and send one snapshot per interval. Counted in
    ``learnmesh_delta_snapshot_requests_total{outcome}``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._served: dict[bytes, float] = {}  # peer -> when it was last sent a snapshot (monotonic)
        self._waiting: dict[bytes, str] = {}  # peer -> the nonce to answer once its interval ends
        self._warning = ThrottledWarning(log)

    def admit(self, peer: bytes, req: str) -> bool:
        """True: answer ``req`` now. False: it waits for :meth:`due`, or is refused."""
        now = time.monotonic()
        last = self._served.get(peer)
        if peer not in self._waiting and (last is None or now - last >= self.interval_s):
            self._served[peer] = now
            metrics.DELTA_SNAPSHOT_REQUESTS.labels("served").inc()
            return True
        if peer in self._waiting:
            outcome = "coalesced"
        elif len(self._waiting) >= _MAX_WAITING_PEERS:
            metrics.DELTA_SNAPSHOT_REQUESTS.labels("refused").inc()
            self._warning.warning("refused a snapshot request: %d connections already wait for theirs",
                                  len(self._waiting))
            return False
        else:
            outcome = "deferred"
        self._waiting[peer] = req
        metrics.DELTA_SNAPSHOT_REQUESTS.labels(outcome).inc()
        if outcome == "coalesced":
            self._warning.warning("a connection on the snapshot link asks for snapshots faster than one per %gs; "
                                  "its requests are merged into one (learnmesh_delta_snapshot_requests_total)",
                                  self.interval_s)
        return False

    def due(self) -> list[tuple[bytes, str]]:
        """The waiting requests whose peer's interval has ended (now counted as served); peers
        with nothing waiting are forgotten once their interval is over."""
        now = time.monotonic()
        ready = [(peer, req) for peer, req in self._waiting.items() if now - self._served[peer] >= self.interval_s]
        for peer, _ in ready:
            del self._waiting[peer]
            self._served[peer] = now
            metrics.DELTA_SNAPSHOT_REQUESTS.labels("served").inc()
        if len(self._served) > len(self._waiting) + _MAX_WAITING_PEERS:
            self._served = {p: t for p, t in self._served.items() if p in self._waiting or now - t < self.interval_s}
        return ready


class DeltaPublisher:
    """Encode ``new - last published``, seal, publish; serve snapshots; collect acks."""

    ack_listener: Callable[[str, int], None] | None = None  # (worker, version): services.trainer.operations

    def __init__(self, cfg: Config, zmq_ctx: zmq.Context, named_params: dict[str, torch.Tensor], version: int,
                 model_id: str, *, sender: str | None = None, redis_client: Redis | None = None,
                 start_thread: bool = True) -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.sender = sender or f"trainer-{os.getpid()}"
        sec = cfg.security
        self.ring, signer = trainer_keys(sec.delta_key_file, sec.signing_key_path, sign=sec.sign_deltas,
                                         grace_s=sec.delta_key_grace_s)
        self.sealer = EnvelopeSealer(self.ring, self.sender, signer=signer,
                                     rekey_after_packets=sec.rekey_after_packets, sign=sec.sign_deltas)
        self.encoder = DeltaEncoder(cfg.compression, named_params, version, model_id,
                                    priority_mode=cfg.scheduling.priority_mode)
        self._lock = threading.RLock()  # encoder + sealer
        self._sock_lock = threading.Lock()  # ROUTER + PULL
        sockets: list[zmq.Socket] = []
        keys = CurveKeys.load(cfg.zmq, "trainer")
        workers = keys.server("deltas") if keys else None  # only workers' keys subscribe, ask and ack
        sec, host = cfg.security, cfg.zmq.bind_host
        try:
            # a few deltas' chunks per subscriber: one that keeps its connection and stops reading
            # costs that much memory, then misses packets (a gap: it resyncs once it reads again)
            self._pub = _bind(zmq_ctx, zmq.PUB, bind_address(sec.delta_pub_endpoint, host), sockets,
                              hwm=_QUEUED_DELTAS * self.encoder.chunk_ranges + _PUB_HWM_SLACK, curve=workers)
            # one snapshot queued per connection: a peer that asks and never reads holds one, not
            # one per interval until ZeroMQ's default of thousands of parts
            self._router = _bind(zmq_ctx, zmq.ROUTER, bind_address(sec.snapshot_endpoint, host), sockets,
                                 hwm=self.encoder.chunk_ranges + _SNAPSHOT_HWM_SLACK, curve=workers)
            self._acks_sock = _bind(zmq_ctx, zmq.PULL, bind_address(sec.ack_endpoint, host), sockets, curve=workers)
        except BaseException:
            for sock in sockets:
                sock.close(linger=0)
            raise
        self._dropped_requests = DroppedMessages("snapshots", log)
        self._dropped_acks = DroppedMessages("acks", log)
        self._acks: dict[str, int] = {}
        self._sent_version = version  # the newest version a worker can hold: acks beyond it are refused
        self._snap_cache: EncodedDelta | None = None
        self._gate = SnapshotGate(cfg.consistency.snapshot_interval_ms / 1000)
        self._last_publish = time.monotonic()
        self._redis = redis_client
        if self._redis is None and cfg.redis.url:
            from shared.redis_client import sync_client

            self._redis = cast(Redis, sync_client(cfg.redis, socket_timeout=cfg.redis.socket_timeout_s))
        self._set_latest(version)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if start_thread:
            self.start()

    @property
    def version(self) -> int:
        return self.encoder.version

    # ---------------------------------------------------------------- publishing
    def publish(self, named_params: dict[str, torch.Tensor], version: int, *, anchor: bool | None = None,
                lossless: bool = False) -> PublishStats:
        """Encode and send the change since the last publish as ``version`` (``lossless``: bit-exact)."""
        self._raise_background_error()
        self.reload_keys()
        now = time.monotonic()
        max_bytes = None
        cap = self.cfg.scheduling.bandwidth_cap_bytes_s
        if cap > 0:
            max_bytes = max(self.cfg.scheduling.min_bandwidth, int(cap * (now - self._last_publish)))
        self._last_publish = now
        with self._lock:
            # chunks are sealed and sent from inside encode(): a lossy delta streams, so workers
            # decode chunk k while chunk k+1 is still being encoded
            sent_before = self.sealer.next_seq(STREAM_DELTA)
            enc = self.encoder.encode(named_params, version, anchor=anchor, max_bytes=max_bytes,
                                      sink=self._send_chunk, lossless=lossless)
            if not enc.chunks:  # an empty delta still moves receivers to the new version
                self._send_chunk(enc.header, 0, b"")
            packets = self.sealer.next_seq(STREAM_DELTA) - sent_before
            send_s = enc.stats.get("sink_s", 0.0)
        st = enc.stats
        metrics.DELTA_PUBLISHED.labels(enc.header["kind"]).inc()
        metrics.DELTA_BYTES.labels("sent").inc(enc.nbytes)
        metrics.DELTA_ENCODE_SECONDS.observe(st["encode_s"])
        metrics.DELTA_DENSITY.set(st.get("density", 0.0))
        metrics.DELTA_RESIDUAL.set(st.get("rel_error", 0.0))
        self._set_latest(version)
        return PublishStats(version, enc.header["kind"], enc.nbytes, packets, st.get("chunks_dropped", 0),
                            st.get("density", 0.0), st.get("rel_error", 0.0), st["encode_s"], send_s,
                            {"tuner": self.encoder.tuner_report()} if self.cfg.compression.tuner != "off" else {})

    def reload_keys(self) -> None:
        """Pick up a ring changed on disk, and the signing key it names when that changed too."""
        with self._lock:
            if not self.ring.reload_if_changed():
                return
            signer = self.sealer.signer
            if signer is not None and self.ring.signer != signer.id:
                fresh = SigningKey.load(self.cfg.security.signing_key_path)
                if fresh.id == self.ring.signer:
                    self.sealer.set_signer(fresh)

    def _send_chunk(self, header: dict[str, Any], i: int, blob: bytes) -> None:
        meta = {"model": self.model_id, "base": header["base"], "version": header["version"], "i": i,
                "n": max(1, header["nchunks"]), "codec": header}
        self._sent_version = max(self._sent_version, header["version"])  # before a worker can ack it
        frames = self.sealer.seal(STREAM_DELTA, meta, blob)
        self._pub.send_multipart(wire.encode(wire.MsgType.DELTA, {"v": header["version"]}, frames), copy=False)

    def heartbeat(self) -> None:
        """Announce the latest version and next sequence number, so a worker that lost the
        last packets of a delta notices the gap even when no further delta follows."""
        with self._lock:
            meta = {"hb": True, "model": self.model_id, "version": self.encoder.version,
                    "next_seq": self.sealer.next_seq(STREAM_DELTA)}
            frames = self.sealer.seal(STREAM_HEARTBEAT, meta, b"")
            self._pub.send_multipart(wire.encode(wire.MsgType.DELTA, {"hb": 1}, frames), copy=False)

    def _set_latest(self, version: int) -> None:
        metrics.DELTA_LATEST_VERSION.set(version)
        if self._redis is not None:
            try:
                self._redis.set(keys.MODEL_VERSION, version)
            except Exception as exc:  # Redis down must not stop training; the gateway sees stale lag
                log.warning("could not record model version in Redis: %s", type(exc).__name__)

    # ---------------------------------------------------------------- snapshots and acks
    def serve_pending(self) -> None:
        """Answer queued snapshot requests and drain acks (non-blocking)."""
        with self._sock_lock:
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                self._answer_snapshot(frames)
            self._serve_due()
            while True:
                try:
                    frames = self._acks_sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                self._record_ack(frames)

    def _serve_due(self) -> None:
        for ident, req in self._gate.due():
            self._send_snapshot(ident, req)

    def _answer_snapshot(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            mtype, header, _ = wire.decode(frames[1:])
        except wire.WireError as exc:
            self._dropped_requests.drop(exc)
            return
        req = header.get("req")
        if mtype != wire.MsgType.SNAPSHOT_REQ or not isinstance(req, str) or len(req) > _MAX_REQ_NONCE:
            self._dropped_requests.drop(f"{mtype.name} is not a snapshot request with a nonce of at most "
                                        f"{_MAX_REQ_NONCE} characters")
            return
        if self._gate.admit(ident, req):
            self._send_snapshot(ident, req)

    def _send_snapshot(self, ident: bytes, req: str) -> None:
        with self._lock:
            if self._snap_cache is None or self._snap_cache.header["version"] != self.encoder.version:
                self._snap_cache = self.encoder.snapshot()  # one encode per version, however many ask
            snap = self._snap_cache
            pub_seq = self.sealer.next_seq(STREAM_DELTA)
            sealed = []
            for i, blob in enumerate(snap.chunks):
                meta = {"model": self.model_id, "version": snap.header["version"], "i": i,
                        "n": len(snap.chunks), "req": req, "pub_seq": pub_seq, "codec": snap.header}
                sealed.append(self.sealer.seal(STREAM_SNAPSHOT, meta, blob))
        for i, env in enumerate(sealed):
            msg = wire.encode(wire.MsgType.SNAPSHOT, {"i": i, "n": len(sealed)}, env)
            try:
                self._router.send_multipart([ident, *msg], copy=False)
            except zmq.ZMQError:
                return
        metrics.DELTA_BYTES.labels("snapshot").inc(sum(len(f) for env in sealed for f in env))

    def _record_ack(self, frames: list[bytes]) -> None:
        try:
            mtype, header, _ = wire.decode(frames)
        except wire.WireError as exc:
            self._dropped_acks.drop(exc)
            return
        worker, version = header.get("worker"), header.get("version")
        if not (mtype == wire.MsgType.ACK and isinstance(worker, str) and isinstance(version, int)
                and not isinstance(version, bool) and len(worker) < 256):
            self._dropped_acks.drop(f"{mtype.name} is not an ack naming a worker and a version")
            return
        if not 0 <= version <= self._sent_version:  # would hide that worker's real acks (latency, lag)
            self._dropped_acks.drop(f"an ack of version {version}, not one sent (0..{self._sent_version})")
            return
        if worker not in self._acks and len(self._acks) >= _MAX_ACKED_WORKERS:
            self._dropped_acks.drop(f"an ack names more than {_MAX_ACKED_WORKERS} worker ids")
            return
        self._acks[worker] = max(version, self._acks.get(worker, -1))
        if self.ack_listener is not None:  # operations: step->serving latency (publisher thread)
            self.ack_listener(worker, version)

    def acks(self) -> dict[str, int]:
        """Worker id -> last applied version it acknowledged."""
        if self._thread is None:
            self.serve_pending()
        return dict(self._acks)

    def lag(self) -> dict[str, int]:
        """Worker id -> versions behind the latest publish (from acks)."""
        return {w: self.version - v for w, v in self.acks().items()}

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve_loop, name="delta-publisher", daemon=True)
        self._thread.start()

    def _serve_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._acks_sock, zmq.POLLIN)
        interval_s = self.cfg.consistency.delta_heartbeat_ms / 1000
        next_hb = time.monotonic() + interval_s
        try:
            while not self._stop.is_set():
                if poller.poll(min(50, int(interval_s * 1000))):
                    self.serve_pending()
                else:
                    with self._sock_lock:
                        self._serve_due()
                if time.monotonic() >= next_hb:
                    self.heartbeat()
                    next_hb = time.monotonic() + interval_s
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                self._error = exc
        except BaseException as exc:  # forwarded to the next publish() call
            self._error = exc

    def _raise_background_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("delta publisher background thread failed") from err

    def close(self) -> None:
        """Stop serving and close the sockets (a second call does nothing)."""
        if self._pub.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for sock in (self._pub, self._router, self._acks_sock):
            sock.close(linger=0)
        self.encoder.close()


def _bind(ctx: zmq.Context, kind: int, endpoint: str, made: list[zmq.Socket], hwm: int = 10_000,
          retry_s: float = 3.0, curve: CurveServer | None = None) -> zmq.Socket:
    """Bind, retrying briefly while a previous publisher's socket still holds the port
    (ZeroMQ closes sockets asynchronously, so an in-process restart can race it)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock = make_socket(ctx, kind, bind=endpoint, hwm=hwm, curve=curve)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        made.append(sock)
        return sock
