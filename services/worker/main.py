"""``learnmesh worker``: one inference worker.

Holds one model replica, binds a ZeroMQ ROUTER (``--endpoint``, else ``worker.endpoints[--index]``;
``zmq.bind_host`` replaces its host), announces the endpoint gateways should connect to in Redis
(services.worker.registration), and serves
INFER requests from gateway DEALERs (message shapes: :mod:`shared.inference`). Requests that
arrive close together are batched (``worker.max_batch_size``, ``worker.max_wait_ms``), taken
into each batch round-robin across the principals the gateways name in their headers, so one
principal's many requests do not keep another's waiting behind all of them; generated text
streams back as TOKEN messages, then a RESULT as soon as that request is done. Every reply names the model
version that produced it. Weight deltas (``services.worker.updates.DeltaSubscriber``) are
applied only between batches, so a request sees exactly one version. The worker keeps no
per-client state: the context arrives with each request.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from shared import metrics, wire
from shared.config import Config, ConfigError, log_level
from shared.curve import CurveKeys
from shared.inference import max_frame_bytes, unpack_entries
from shared.keys import TRAINER_STATUS
from shared.model import Example, LearnModel, MediaError, ModelInputError, build_model
from shared.redis_client import close_sync
from shared.wire import MsgType
from shared.worker_registry import Registration, RegistrationError, advertised_endpoint, is_loopback
from shared.zmq_util import DroppedMessages, bind_address, bound_endpoint, make_socket

log = logging.getLogger("learnmesh.worker")


@dataclass
class Request:
    peer: bytes
    id: str
    op: str
    example: Example
    principal: str = ""  # whom the gateway authenticated: the unit of fairness between callers
    max_tokens: int = 0
    temperature: float = 1.0
    seed: int | None = None
    stream: bool = True
    received_s: float = field(default_factory=time.monotonic)
    cancelled: bool = False


@dataclass
class _Decoding:
    """A request whose context images or audio are being decoded off the serving loop."""

    peer: bytes
    op: str
    message: tuple[dict[str, Any], list[Any]] | None = None  # header and payload, until its turn
    future: concurrent.futures.Future[Request | None] | None = None
    cancelled: bool = False  # the gateway gave up on it: not decoded if not begun, not answered


class Worker:
    """The serving loop. ``run()`` blocks until :meth:`stop` (or SIGTERM in ``main``)."""

    def __init__(self, cfg: Config, endpoint: str, worker_id: str, *, model: LearnModel | None = None,
                 zmq_ctx: zmq.Context | None = None, updates: bool = True) -> None:
        self.cfg = cfg
        self.wcfg = cfg.worker
        self.worker_id = worker_id
        self.instance = uuid.uuid4().hex  # this process: tells a restart, or another process given the same id, apart
        self.model = model if model is not None else build_model(cfg.model)
        self.ctx = zmq_ctx or zmq.Context.instance()
        keys = CurveKeys.load(cfg.zmq, "worker")
        # only gateways (their allow-listed keys) can connect, send requests and read answers
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=bind_address(endpoint, cfg.zmq.bind_host),
                                hwm=self.wcfg.hwm, router_mandatory=True, max_frame_bytes=max_frame_bytes(cfg),
                                curve=keys.server("infer") if keys else None)
        self.endpoint = bound_endpoint(self.sock)  # a ``:*`` bind names its port here
        self.dropped = DroppedMessages("infer", log)
        self.advertised = self._advertised(endpoint)
        self.queue: deque[Request] = deque()  # in arrival order
        # Principals with requests queued -> the latest batch round that served them: the next
        # batch takes the least recently served first (see _take_batch).
        self._served_round: dict[str, int] = {}
        self._round = 0
        self.running: dict[str, Request] = {}
        # Decoding an image may take a second (model.max_image_pixels); a context holds many. On
        # the serving loop it would leave heartbeats unanswered until gateways declare the worker
        # dead: one caller's context could take every worker out in turn. So requests with
        # media are encoded on a thread of their own while the loop goes on answering.
        self.decoding: dict[str, _Decoding] = {}
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="worker-media")
        # Requests waiting for the media thread, per principal; principals take turns (the one
        # served least recently first), so one caller's many images do not hold back another's.
        self._media_lanes: OrderedDict[str, deque[str]] = OrderedDict()
        self._media_job: concurrent.futures.Future[Request | None] | None = None  # on the media thread
        self.version = 0
        self.batches = 0
        self.subscriber = self._subscriber(updates)
        self._stop = False
        self.leaving = False  # stopping: heartbeats say so, requests are refused
        self.drained = False
        self._redis: Any = None
        self._redis_lock = threading.Lock()
        self._reports: threading.Thread | None = None
        self._reports_stop = threading.Event()
        self._digest: tuple[int, str] = (-1, "")
        self.registrar: Any = None

    def _advertised(self, configured: str) -> str | None:
        """The endpoint this worker announces, or None when it does not announce itself: by
        default the configured endpoint with the port it got (``zmq.bind_host`` may bind
        another host than the one peers are told)."""
        if not (self.wcfg.register and self.cfg.redis.url):
            return None
        from urllib.parse import urlsplit

        from shared.redis_client import url_of

        redis_host = urlsplit(url_of(self.cfg.redis)).hostname or "127.0.0.1"
        named = configured.rsplit(":", 1)[0] + ":" + self.endpoint.rsplit(":", 1)[1]
        try:
            advertised = advertised_endpoint(named, self.wcfg.advertise, redis_host)
        except (RegistrationError, KeyError, IndexError, ValueError) as exc:
            self.sock.close(linger=0)
            raise ConfigError(f"worker.advertise: {exc}") from None
        if is_loopback(urlsplit(advertised).hostname) and not is_loopback(urlsplit(self.endpoint).hostname):
            log.warning("worker %s listens on %s but announces %s, which only gateways on the worker's own machine can reach: "
                        "set worker.advertise (e.g. tcp://{host}:{port}) to an address other hosts reach",
                        self.worker_id, self.endpoint, advertised)
        return advertised

    def registration(self) -> Registration:
        """What this worker announces now (called by the registrar's thread)."""
        from shared.control import now_ms

        return Registration(self.worker_id, self.advertised or self.endpoint, self.wcfg.max_batch_size,
                            self.model.model_id, self.version, now_ms(), self.instance)

    def _start_registrar(self) -> None:
        if self.advertised is None:
            return
        from services.worker.registration import Registrar

        self.registrar = Registrar(self.cfg, self._client, self.registration)
        self.registrar.start()

    def _client(self) -> Any:
        """The Redis client, made on first use by whichever thread needs it first. Raises while it
        cannot be made (a cluster client reads the slot map as it is made): the registrar and the
        status reports retry, the serving loop never waits for it."""
        with self._redis_lock:
            if self._redis is None:
                from shared.redis_client import sync_client

                self._redis = sync_client(self.cfg.redis, socket_timeout=2.0)
            return self._redis

    def _subscriber(self, enabled: bool) -> Any:
        if not enabled:
            return None
        try:
            from services.worker.updates import DeltaSubscriber
        except ImportError:
            log.warning("weight updates unavailable (services.worker.updates missing); serving the base model")
            return None
        # the trainer publishes exactly the trainable parameters (same names, same layout digest)
        params = {n: p.detach() for n, p in self.model.trainable_named_parameters()}
        sub = DeltaSubscriber(self.cfg, self.ctx, self.worker_id, params, 0, model_id=self.model.model_id)
        self.version = sub.version
        return sub

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        self._await_snapshot()
        log.info("worker %s ready (model %s, version %d)", self.worker_id, self.model.model_id, self.version)
        self._weights_digest(self.version)
        self._start_registrar()
        self._start_reports()
        try:
            while not self._stop:
                wait_ms = 50.0 if not self.decoding else _DECODED_POLL_MS
                if self.queue:
                    age_ms = (time.monotonic() - self.queue[0].received_s) * 1000
                    wait_ms = max(0.0, self.wcfg.max_wait_ms - age_ms)
                if poller.poll(math.ceil(wait_ms)):
                    self._drain()
                self._take_decoded()
                if not self.queue:
                    self._apply_updates()
                    continue
                age_ms = (time.monotonic() - self.queue[0].received_s) * 1000
                if len(self.queue) >= self.wcfg.max_batch_size or age_ms >= self.wcfg.max_wait_ms:
                    self._apply_updates()
                    self._run_batch()
        finally:
            self._leave()
            if self.registrar is not None:  # gateways know it is leaving: withdrawn, it is not taken for lost keys
                self.registrar.close()
            if self.subscriber is not None:
                self.subscriber.close()
            self._decoder.shutdown(wait=False, cancel_futures=True)
            self._reports_stop.set()
            if self._reports is not None:
                self._reports.join(timeout=5)
                self._withdraw_report()
            if self._redis is not None:
                close_sync(self._redis)
            self.sock.close(linger=0)
            log.info("worker %s stopped", self.worker_id)

    def _await_snapshot(self) -> None:
        """A mesh that has learned is not answered from the base weights: when the trainer's
        status names a published version (or ``worker.await_snapshot`` says a checkpoint is being
        restored where Redis lost that status), the worker takes the trainer's snapshot before it
        answers a gateway or announces itself (gateways route to the workers that serve, or
        wait for one), for ``worker.snapshot_wait_s`` at most. A restarted mesh would otherwise
        serve version 0 until the trainer has restored its checkpoint. Past the bound (no
        trainer answers) it serves the base weights and says so; the snapshot still follows."""
        wait_s = self.wcfg.snapshot_wait_s
        if self.subscriber is None or wait_s <= 0 or not self.cfg.redis.url:
            return
        learned = self._published_version()
        if learned > 0:
            why = f"the trainer has published version {learned}"
        elif self.wcfg.await_snapshot:  # Redis lost the trainer's status; its checkpoint is still there
            why = "the trainer restores a checkpoint (worker.await_snapshot)"
        else:
            return
        log.info("worker %s: %s; taking its snapshot before serving (up to %gs)", self.worker_id, why, wait_s)
        deadline = time.monotonic() + wait_s
        while not self._stop and not self.subscriber.synced:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                log.warning("worker %s: no snapshot from the trainer within %gs (worker.snapshot_wait_s) although "
                            "%s: serving the base weights (version 0) until one arrives", self.worker_id, wait_s, why)
                return
            self.subscriber.wait(math.ceil(min(left_s, 0.2) * 1000))  # short: a stop is seen
            self._apply_updates()

    def _published_version(self) -> int:
        """The version the trainer's status names (0: none, or Redis does not answer: a worker
        that cannot tell does not wait)."""
        try:
            return int(self._client().hget(TRAINER_STATUS, "version") or 0)
        except Exception as exc:  # Redis away, a cluster not formed yet: serving must not wait on it
            log.info("worker %s: the trainer's status is unreadable (%s); serving without waiting for its snapshot",
                     self.worker_id, type(exc).__name__)
            return 0

    def _leave(self) -> None:
        """Refuse what is queued, then tell the gateways this worker is stopping: for two of their
        heartbeat intervals every HELLO gets a HEARTBEAT marked ``leaving`` (they route nothing new
        here) and every request still arriving is refused with ``shutting_down`` (they retry it
        elsewhere at once), so no request sent here is lost unanswered when the socket closes."""
        self.leaving = True
        deadline = time.monotonic() + min(2.0, 2 * self.wcfg.heartbeat_interval_ms / 1000)
        while True:
            for req in self.queue:
                self._error(req.peer, req.id, "shutting_down", "worker is shutting down; retry elsewhere")
            self.queue.clear()
            for rid, dec in self.decoding.items():
                dec.cancelled = True
                self._error(dec.peer, rid, "shutting_down", "worker is shutting down; retry elsewhere")
            self.decoding.clear()
            self._media_lanes.clear()
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                return
            if self.sock.poll(math.ceil(left_ms)):
                self._drain()

    def _start_reports(self) -> None:
        """Status reports run on a thread of their own: a Redis that does not answer (paused,
        its host unreachable) delays them by its timeouts, never the serving loop that answers
        heartbeats and requests."""
        if not self.cfg.redis.url:
            return
        self._reports = threading.Thread(target=self._report_loop, name="worker-status", daemon=True)
        self._reports.start()

    def _report_loop(self) -> None:
        while True:
            self._report_status()
            if self._reports_stop.wait(self.cfg.metrics.status_interval_s):
                return

    def _withdraw_report(self) -> None:
        """A worker that stops cleanly takes its self-report with it: /admin/workers and the
        dashboard stop listing it at once. Not while another process announces this id (the
        report is that one's too)."""
        from shared import control

        if self.registrar is not None and not self.registrar.holds_id:
            return
        try:
            control.withdraw_status(self._client(), f"worker:{self.worker_id}")
        except Exception as exc:  # gone with Redis: the report expires by itself
            log.debug("worker %s could not withdraw its status report: %s", self.worker_id, exc)

    def _report_status(self) -> None:
        """Self-report to Redis for /admin/workers and the dashboard (version, load, lag), and
        learn whether an operator drained this worker. Gateways stop routing to a drained
        worker; it finishes what it has and reports ``drained`` so operators can see when it is
        safe to stop."""
        from shared import control, keys

        try:
            drained = bool(self._client().sismember(keys.WORKERS_DRAINED, self.worker_id))
            if drained != self.drained:
                log.info("worker %s %s by an operator", self.worker_id, "drained" if drained else "undrained")
                self.drained = drained
            lag = self.subscriber.lag if self.subscriber is not None else None
            version, (digest_version, digest) = self.version, self._digest  # the serving loop computes it
            control.report_status(self._client(), f"worker:{self.worker_id}",
                                  ttl_s=control.status_ttl_s(self.cfg), version=version,
                                  load=self.load(), lag=lag, drained=int(drained),
                                  idle=int(drained and not self.queue and not self.running),
                                  weights_digest=digest if digest_version == version else None)
        except Exception as exc:  # Redis away: serving goes on, the report is advisory
            log.debug("worker status report failed: %s", exc)

    def _weights_digest(self, version: int) -> None:
        """Digest of the served weights, now at ``version`` (once per version, in the serving loop
        between batches): equal to the trainer's reported digest exactly when this worker serves
        bit-identical weights. Only reported in Redis: not computed without it."""
        if self.cfg.redis.url and self._digest[0] != version:
            from shared.delta.codec import weights_digest

            self._digest = (version, weights_digest(dict(self.model.trainable_named_parameters())))

    def _apply_updates(self) -> None:
        if self.subscriber is None:
            return
        cpu0 = time.thread_time()
        try:
            new = self.subscriber.poll()
            metrics.CODEC_CPU_SECONDS.labels("decode").inc(time.thread_time() - cpu0)
        except Exception:  # a bad update must not kill serving; the subscriber re-snapshots
            log.exception("applying weight updates failed")
            return
        if new is not None and new != self.version:
            log.info("model version %d -> %d", self.version, new)
            self._weights_digest(new)  # before the version: a report never pairs one with the other's digest
            self.version = new
            metrics.WORKER_VERSION.labels(self.worker_id).set(new)

    def _drain(self, limit: int = 1000) -> None:
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(frames)

    def _send(self, peer: bytes, msg_type: MsgType, header: dict[str, Any], frames: list[bytes] | None = None) -> None:
        try:
            self.sock.send_multipart([peer, *wire.encode(msg_type, header, frames or ())], zmq.NOBLOCK)
        except zmq.ZMQError:  # gateway gone (ROUTER_MANDATORY) or its queue full: drop the reply
            pass

    def _error(self, peer: bytes, rid: Any, code: str, message: str) -> None:
        self._send(peer, MsgType.ERROR, {"id": rid, "version": self.version, "code": code, "message": message})

    def load(self) -> int:
        return len(self.queue) + len(self.running) + len(self.decoding)

    # ------------------------------------------------------------------ messages
    def _on_message(self, frames: list[Any]) -> None:
        peer = frames[0].bytes
        try:
            msg_type, header, payload = wire.decode(frames[1:])
        except wire.WireError as exc:
            self.dropped.drop(exc)
            self._error(peer, None, "bad_input", f"malformed message: {exc}")
            return
        if msg_type == MsgType.HELLO:
            lag = self.subscriber.lag if self.subscriber is not None else 0
            self._send(peer, MsgType.HEARTBEAT, {"worker": self.worker_id, "instance": self.instance,
                                                 "leaving": self.leaving,
                                                 "version": self.version, "lag": lag,
                                                 "load": self.load(), "model_id": self.model.model_id,
                                                 "max_batch_size": self.wcfg.max_batch_size})
        elif msg_type == MsgType.CANCEL:
            rid = header.get("id")
            if not isinstance(rid, str):
                self.dropped.drop("CANCEL without a request id")
                self._error(peer, rid, "bad_input", "request id missing")
                return
            if rid in self.running:
                self.running[rid].cancelled = True
            if rid in self.decoding:
                self.decoding[rid].cancelled = True
            self.queue = deque(r for r in self.queue if r.id != rid)
        elif msg_type == MsgType.INFER:
            self._on_infer(peer, header, payload)
        else:
            self.dropped.drop(f"unexpected message type {msg_type.name}")
            self._error(peer, header.get("id"), "bad_input", f"unexpected message type {msg_type.name}")

    def _on_infer(self, peer: bytes, h: dict[str, Any], payload: list[Any]) -> None:
        rid = h.get("id")
        if not isinstance(rid, str) or not rid:
            self.dropped.drop("INFER without a request id")
            self._error(peer, rid, "bad_input", "request id missing")
            return
        entries = h.get("entries")
        if isinstance(entries, list) and any(isinstance(e, dict) and e.get("modality") in _MEDIA for e in entries):
            if rid in self.decoding:  # one record per id: its answer goes to one request
                self._refuse(peer, rid, str(h.get("op")), ValueError(f"request {rid} is already being decoded"))
                return
            self.decoding[rid] = _Decoding(peer, str(h.get("op")), (h, payload))
            principal = h.get("principal")
            self._media_lanes.setdefault(principal if isinstance(principal, str) else "", deque()).append(rid)
            self._next_decoding()
            return
        try:
            req = self._parse(peer, rid, h, payload)
        except _BAD_INPUT as exc:
            self._refuse(peer, rid, str(h.get("op")), exc)
            return
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Queue ``req``. A principal with nothing queued takes its turn after those that have
        waited since before the latest batch, and before those that batch served."""
        self._served_round.setdefault(req.principal, self._round - 1)
        self.queue.append(req)

    def _refuse(self, peer: bytes, rid: str, op: str, exc: Exception) -> None:
        self._error(peer, rid, "bad_input", str(exc))
        metrics.WORKER_REQUESTS.labels(op, "bad_input").inc()

    def _decode(self, dec: _Decoding, peer: bytes, rid: str, h: dict[str, Any], payload: list[Any]) -> Request | None:
        """On the media thread: the request, or None when it was cancelled before its turn."""
        return None if dec.cancelled else self._parse(peer, rid, h, payload)

    def _next_decoding(self) -> None:
        """Give the idle media thread the next request: the first of the principal whose turn it
        is, who then goes last. A request cancelled before its turn is dropped unanswered."""
        while (self._media_job is None or self._media_job.done()) and self._media_lanes:
            principal, lane = next(iter(self._media_lanes.items()))
            rid = lane.popleft()
            if lane:
                self._media_lanes.move_to_end(principal)
            else:
                del self._media_lanes[principal]
            dec = self.decoding.get(rid)
            if dec is None or dec.message is None:
                continue
            if dec.cancelled:
                del self.decoding[rid]
                continue
            h, payload = dec.message
            dec.message = None
            dec.future = self._media_job = self._decoder.submit(self._decode, dec, dec.peer, rid, h, payload)

    def _take_decoded(self) -> None:
        """Queue the requests whose media are decoded (refuse those that could not be); drop the
        ones cancelled meanwhile; start the next."""
        for rid, dec in list(self.decoding.items()):
            if dec.future is None or not dec.future.done():
                continue
            del self.decoding[rid]
            try:
                req = dec.future.result()
            except _BAD_INPUT as exc:
                if not dec.cancelled:
                    self._refuse(dec.peer, rid, dec.op, exc)
                continue
            except Exception as exc:
                log.exception("decoding the context of request %s failed", rid)
                self._error(dec.peer, rid, "internal", f"inference failed ({type(exc).__name__})")
                continue
            if req is not None and not dec.cancelled:
                self._enqueue(req)
        self._next_decoding()

    def _parse(self, peer: bytes, rid: str, h: dict[str, Any], payload: list[Any]) -> Request:
        op = h.get("op")
        if op not in ("generate", "score"):
            raise ValueError("op must be 'generate' or 'score'")
        prompt = h.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        if len(prompt.encode()) > self.wcfg.max_prompt_bytes:
            raise ValueError(f"prompt is longer than {self.wcfg.max_prompt_bytes} bytes")
        modalities = h.get("modalities")
        if modalities is not None and not (isinstance(modalities, list) and all(isinstance(m, str) for m in modalities)):
            raise ValueError("modalities must be a list of strings")
        entries = unpack_entries(h.get("entries", []), payload)
        principal = h.get("principal")
        principal = principal if isinstance(principal, str) else ""  # the gateway's own probes name none
        if op == "score":
            target = h.get("target")
            if not isinstance(target, str) or not target:
                raise ValueError("score needs a non-empty target")
            # a cut target would be scored as another continuation than the one asked about
            n_target = len(self.model.text_tokens(target.encode())) + 1
            if n_target > self.model.max_target_tokens:
                raise ValueError(f"target is {n_target} tokens with its end; the model scores at most "
                                 f"{self.model.max_target_tokens} (half of model.max_seq)")
            return Request(peer, rid, op, self.model.encode(entries, prompt, target, modalities=modalities), principal)
        max_tokens = h.get("max_tokens", 64)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.wcfg.max_tokens_limit:
            raise ValueError(f"max_tokens must be an integer in 1..{self.wcfg.max_tokens_limit}")
        temperature = h.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 5:
            raise ValueError("temperature must be a number in 0..5")
        seed = h.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise ValueError("seed must be an integer")
        example = self.model.encode(entries, prompt, None, modalities=modalities, reserve_tokens=max_tokens)
        return Request(peer, rid, op, example, principal, max_tokens, float(temperature), seed,
                       h.get("stream", True) is not False)

    # ------------------------------------------------------------------ batches
    def _take_batch(self) -> list[Request]:
        """The next batch, fair between principals: the principal served least recently (then the
        one waiting longest) names the op, and every principal with requests of that op queued gets
        one place in turn, in that order, until the batch is full. A principal's own requests keep
        their arrival order. So a request waits for at most the batch running when it arrived and,
        with more principals waiting than a batch holds, their turns before it, never behind every
        request another principal queued first."""
        lanes: dict[str, deque[Request]] = {}
        for r in self.queue:
            lanes.setdefault(r.principal, deque()).append(r)
        order = sorted(lanes, key=lambda p: self._served_round.get(p, self._round - 1))  # stable: oldest request first
        op = lanes[order[0]][0].op
        ready = [deque(r for r in lanes[p] if r.op == op) for p in order]
        batch: list[Request] = []
        while len(batch) < self.wcfg.max_batch_size and any(ready):
            for lane in ready:
                if lane and len(batch) < self.wcfg.max_batch_size:
                    batch.append(lane.popleft())
        self._round += 1
        taken = {id(r) for r in batch}
        self.queue = deque(r for r in self.queue if id(r) not in taken)
        for r in batch:
            self._served_round[r.principal] = self._round
        waiting = {r.principal for r in self.queue}
        self._served_round = {p: n for p, n in self._served_round.items() if p in waiting}
        return batch

    def _run_batch(self) -> None:
        batch = self._take_batch()
        self.batches += 1
        metrics.WORKER_BATCH_SIZE.labels(batch[0].op).observe(len(batch))
        self.running = {r.id: r for r in batch}
        try:
            if batch[0].op == "score":
                self._run_score(batch)
            else:
                self._run_generate(batch)
        except Exception as exc:
            log.exception("batch failed")
            unanswered = [r for r in batch if r.id in self.running]  # a finished generation has its answer
            metrics.WORKER_REQUESTS.labels(batch[0].op, "error").inc(len(unanswered))
            for r in unanswered:
                self._error(r.peer, r.id, "internal", f"inference failed ({type(exc).__name__})")
        finally:
            self.running = {}

    def _run_score(self, batch: list[Request]) -> None:
        scores = self.model.score([r.example for r in batch])
        metrics.WORKER_REQUESTS.labels("score", "ok").inc(len(batch))
        for r, nll in zip(batch, scores, strict=True):
            self._send(r.peer, MsgType.RESULT, {"id": r.id, "version": self.version, "model_id": self.model.model_id,
                                                "nll": nll, "tokens": r.example.n_target, "batch": len(batch)})

    def _run_generate(self, batch: list[Request]) -> None:
        gens = [_Generation(r) for r in batch]
        steps = self.model.generate([r.example for r in batch], max_tokens=max(r.max_tokens for r in batch),
                                    temperature=[r.temperature for r in batch], seed=[r.seed for r in batch])
        try:
            for chunks in steps:
                for g, chunk in zip(gens, chunks, strict=True):
                    if g.finish is None:
                        self._take_token(g, chunk)
                        if g.finish is not None:  # answered now, not when the batch's longest is done
                            self._finish_generation(g, len(batch))
                if all(g.finish is not None for g in gens):
                    break
                self._drain()  # heartbeats, cancels and new requests while the batch runs
        finally:
            steps.close()
        metrics.WORKER_TOKENS.inc(sum(g.tokens for g in gens))
        for g in gens:
            if g.finish is None:
                g.finish = "length"
                self._finish_generation(g, len(batch))

    def _take_token(self, g: _Generation, chunk: bytes) -> None:
        """One generated token of a running request (b"": the model stopped it)."""
        r = g.request
        if r.cancelled:
            g.finish = "cancelled"
            return
        if not chunk:
            g.finish = "stop" if len(r.example) + g.tokens + 1 < self.model.max_seq else "length"
            return
        g.tokens += 1
        delta = g.decoder.decode(chunk)
        if delta:
            g.text += delta
            if r.stream:
                self._send(r.peer, MsgType.TOKEN, {"id": r.id, "text": delta, "version": self.version})
        if g.tokens >= r.max_tokens:
            g.finish = "length"

    def _finish_generation(self, g: _Generation, batch: int) -> None:
        r = g.request
        self.running.pop(r.id, None)
        metrics.WORKER_REQUESTS.labels("generate", g.finish or "length").inc()
        if g.finish == "cancelled":
            return
        g.text += g.decoder.decode(b"", final=True)
        self._send(r.peer, MsgType.RESULT, {"id": r.id, "version": self.version, "model_id": self.model.model_id,
                                            "worker": self.worker_id, "text": g.text, "tokens": g.tokens,
                                            "finish_reason": g.finish or "length", "batch": batch})


@dataclass
class _Generation:
    """One request's answer as its tokens arrive."""

    request: Request
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    text: str = ""
    tokens: int = 0
    finish: str | None = None


_MEDIA = ("image", "audio")
_BAD_INPUT = (ValueError, TypeError, MediaError, ModelInputError)
_DECODED_POLL_MS = 5.0  # while media are being decoded: how soon the loop looks for them


def worker_id_of(template: str, index: int) -> str:
    """``worker.id`` with ``{host}`` and ``{index}`` filled in; '': ``worker-<index>``."""
    if not template:
        return f"worker-{index}"
    return template.format(host=socket.gethostname(), index=index)


def main(cfg: Config, args: Any) -> int:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    index = int(getattr(args, "index", 0) or 0)
    endpoint = getattr(args, "endpoint", None)
    if endpoint is None:
        if not 0 <= index < len(cfg.worker.endpoints):
            raise ConfigError(f"worker --index {index} is outside worker.endpoints ({len(cfg.worker.endpoints)} "
                              "configured): pass --endpoint (tcp://127.0.0.1:* binds a free port and announces it) "
                              "or list one more endpoint")
        endpoint = cfg.worker.endpoints[index]
    from shared.redis_client import check_access
    from shared.secret_files import check_private

    if cfg.redis.url:
        check_access(cfg.redis)  # wrong credentials: a clear error now, not silent status reports
    if os.path.exists(cfg.security.delta_key_file):  # before the model is built, not after
        check_private(cfg.security.delta_key_file, "security.delta_key_file")
    if cfg.worker.torch_threads:
        import torch

        torch.set_num_threads(cfg.worker.torch_threads)
    worker = Worker(cfg, endpoint, worker_id_of(cfg.worker.id, index))
    try:
        from shared.control import start_metrics_server

        start_metrics_server(cfg, "worker", index)
    except ImportError:
        pass
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    worker.run()
    return 0
