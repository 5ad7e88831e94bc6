"""The gateway's view of the inference workers: one ZeroMQ DEALER per worker endpoint.

Which endpoints: the static ``worker.endpoints``, plus (``worker.discovery``) every worker
announced in Redis (shared/worker_registry.py), read every ``worker.register_interval_ms``.
A worker whose announcement appears gets a connection; one whose announcement is withdrawn
or expires loses it (once it stops answering, or after ``worker.registration_ttl_ms`` when it
still answers: Redis losing its keys does not empty the pool), and its requests in flight are
retried on another worker. Static workers stay in the pool while silent (they rejoin on their
next answer). A worker whose heartbeat says it is leaving (stopping) gets no new requests.

Liveness is ping/pong: every ``worker.heartbeat_interval_ms`` the pool sends HELLO to each
worker and the worker answers with a HEARTBEAT (version, load). Any message from a worker
counts as a sign of life; a worker silent for ``worker.heartbeat_timeout_ms`` is declared
dead, and the requests in flight on it are retried on another live worker — up to
``worker.max_request_losses`` workers lost under one request, which then fails rather than
go on to the next (it may be what kills them). A worker that
comes back (same endpoint) answers the next HELLO and rejoins — nothing to restart here; when
its heartbeat names another process than before (restarted faster than the heartbeat timeout),
the requests the old process had are retried at once rather than waited for.

Routing: the least-loaded live worker at or past the request's ``min_model_version``;
if only older workers are live, wait up to ``consistency.timeout_s`` for one to catch up,
then fail with a clear error. No live worker at all: fail with a retry hint. A worker whose
heartbeat reports it more than ``consistency.max_lag`` versions behind the trainer's latest, or
that trails another live worker by more, leaves the routing pool until it catches up — unless every live worker lags that far, in
which case the least-loaded of them still serves (stale answers beat none; requests that
need a version say so with ``min_model_version``). A worker whose heartbeat claims a version
above the trainer's latest (``keys.MODEL_VERSION``, read every few seconds and at once when a
claim exceeds it) is treated as lagging too, and logged once: versions are the trainer's to
make, and a believed false claim would make every honest worker look behind.

Benching: a worker that answers heartbeats but lets ``worker.max_consecutive_timeouts``
requests in a row time out, with no answer of any kind from it between (a wedged serving loop),
is benched for ``worker.bench_cooloff_s``: one warning, no new requests, and the requests in
flight on it are retried elsewhere at once (counted as lost, so ``worker.max_request_losses``
holds). After the cool-off the gateway sends it a probe of its own (a one-token generation, so
no caller's request is the one to find it still wedged): any answer brings it back, a probe
unanswered within ``worker.request_timeout_s`` benches it again. Benched workers still serve when
every other candidate is benched too: a bench may be mistaken, and a request that may time out
beats one refused outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError, ResponseError

from shared import keys, metrics, wire, worker_registry
from shared.aio import cancelling, pause, stop_if_cancelled
from shared.config import Config
from shared.curve import CurveKeys, HandshakeWatch
from shared.inference import max_frame_bytes, max_reply_frame_bytes
from shared.log_throttle import ThrottledWarning
from shared.text import as_str
from shared.wire import MsgType
from shared.zmq_util import make_socket

log = logging.getLogger("learnmesh.workers")

_DEAD = object()  # put into a request's queue when its worker is declared dead
_LOST, _DRAINING = object(), object()  # why a request came back without a result (see _await_result)
# What a benched worker is asked after its cool-off: the smallest request its serving loop runs.
_PROBE = {"op": "generate", "prompt": "probe", "max_tokens": 1, "temperature": 0.0, "entries": []}
DRAINED_REFRESH_S = 2.0


class NoWorker(RuntimeError):
    """No live worker can take the request (none up, or none at the requested version)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # None: the configured redis.retry_after_s (gateway/errors.py)


class WorkerRequestError(RuntimeError):
    """A worker refused or failed a request (``code``: bad_input | internal | ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class WorkerTimeout(RuntimeError):
    """The request did not complete within its timeout (it was cancelled on the worker)."""


@dataclass(eq=False)
class WorkerLink:
    index: int
    endpoint: str
    sock: zmq.asyncio.Socket
    worker_id: str | None = None
    instance: str | None = None  # the process answering there (heartbeat): a new one lost what the old one had
    version: int = 0
    lag: int = 0  # versions behind the trainer's latest, as the worker's heartbeat reports
    reported_load: int = 0
    capacity: int = 1  # the worker's largest batch (heartbeat or announcement): load is weighed against it
    static: bool = True  # from worker.endpoints; False: discovered through its announcement
    model_id: str | None = None
    last_seen_s: float = 0.0       # monotonic; 0 = never heard from
    joined_s: float = field(default_factory=time.monotonic)
    silence_reported: bool = False  # "never answered" logged once
    last_heartbeat_wall_s: float = 0.0
    unannounced_since: float | None = None  # monotonic: when a discovered worker's announcement went
    alive: bool = False
    leaving: bool = False  # its heartbeat says it is stopping: no new requests
    handshake_failing: bool = False  # the process at the endpoint does not hold the pinned worker key
    overclaim_warned: bool = False  # its version claim above the trainer's latest was logged (once per streak)
    timeouts: int = 0  # requests in a row that timed out here with no answer from the worker between
    benched_until: float | None = None  # monotonic: no requests; from then on, probed (see _probe_benched)
    probe: tuple[str, float] | None = None  # the probe out on a benched worker: its id and deadline (monotonic)
    watch: HandshakeWatch | None = None
    inflight: dict[str, asyncio.Queue[Any]] = field(default_factory=dict)  # reply parts, or _DEAD
    tasks: list[asyncio.Task] = field(default_factory=list)  # its reader and handshake watch

    @property
    def load(self) -> int:
        return max(len(self.inflight), self.reported_load)

    def behind(self, newest: int) -> int:
        """Versions behind: what its heartbeat reports, or how far it trails ``newest`` (a version
        another worker serves), whichever is more. A worker counts only the versions it could open,
        so one whose key ring is wrong or outdated reports no lag while it serves old weights."""
        return max(self.lag, newest - self.version)

    def set_handshake_failing(self, failing: bool) -> None:
        self.handshake_failing = failing

    @property
    def routable(self) -> bool:
        """Not benched (a benched worker comes back by answering a probe, not a caller's request)."""
        return self.benched_until is None

    def status(self) -> dict[str, Any]:
        return {"index": self.index, "endpoint": self.endpoint, "id": self.worker_id or f"worker-{self.index}",
                "alive": self.alive,
                "version": self.version, "lag": self.lag, "load": self.load, "inflight": len(self.inflight),
                "model_id": self.model_id, "last_heartbeat": self.last_heartbeat_wall_s or None,
                "handshake_failing": self.handshake_failing, "capacity": self.capacity, "leaving": self.leaving,
                "benched": self.benched_until is not None, "request_timeouts": self.timeouts,
                "source": "static" if self.static else "discovered"}


class WorkerPool:
    """Connections to every worker; :meth:`request` routes, streams and retries one request."""

    def __init__(self, cfg: Config, *, endpoints: list[str] | None = None,
                 zmq_ctx: zmq.asyncio.Context | None = None, redis: aioredis.Redis | None = None) -> None:
        """With ``redis``, the pool follows the mesh-wide drain set (``keys.WORKERS_DRAINED``)
        that admins change through any replica."""
        self.cfg = cfg
        self.redis = redis
        self.wcfg = cfg.worker
        self.max_frame = max_frame_bytes(cfg)  # what a worker reads of one frame (ZMQ_MAXMSGSIZE)
        self.max_reply = max_reply_frame_bytes(cfg)  # what this gateway reads of one frame from a worker
        self.ctx = zmq_ctx or zmq.asyncio.Context()
        self._own_ctx = zmq_ctx is None
        self.gateway_id = uuid.uuid4().hex[:12]
        self.curve = CurveKeys.load(cfg.zmq, "gateway")
        self._indices = itertools.count()  # a link's index is never reused: routing excludes by it
        self.links = [self._link(next(self._indices), ep)
                      for ep in (endpoints if endpoints is not None else self.wcfg.endpoints)]
        self._discovered: dict[str, WorkerLink] = {}  # advertised endpoint -> its link
        self._skipped: dict[str, str] = {}  # worker id -> why its announcement is unusable (logged once)
        self._unreadable: set[str] = set()  # worker ids whose announcement a lost master holds (logged once)
        self._unreachable: dict[str, str] = {}  # announced endpoint ZeroMQ refuses -> why (logged once)
        self._beyond_cap = ThrottledWarning(log)  # announcements past worker.max_discovered
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count(1)
        self.drained: set[str] = set()  # worker ids that get no new requests (admin drain)
        # the trainer's latest version (keys.MODEL_VERSION); None: unknown (no Redis, key absent)
        self.published_version: int | None = None
        self._published_stale = asyncio.Event()  # a heartbeat claims more: read it again now

    def _link(self, index: int, endpoint: str, *, static: bool = True) -> WorkerLink:
        """A DEALER pinned to the workers' public key: a process on that port without the
        worker secret key (someone else's worker, one that took the port while ours was down)
        never completes the handshake, so nothing is queued for it (immediate) or sent to it;
        its watch reports that, and connects again once the real worker can be back.

        It reads frames up to :func:`max_reply_frame_bytes`: a worker that sends a longer one
        (misconfigured, or any process on that port when CURVE is off) loses the connection, and
        with it the answers to every request in flight there, which are retried elsewhere at
        once; the watch reports it and connects again."""
        watch = HandshakeWatch(self.ctx, "worker", endpoint, max_frame_bytes=self.max_reply)
        try:
            sock = make_socket(self.ctx, zmq.DEALER, connect=endpoint, hwm=self.wcfg.hwm, immediate=True,
                               curve=self.curve.client("worker") if self.curve is not None else None,
                               monitor=watch.address, max_frame_bytes=self.max_reply)
        except zmq.ZMQError:
            watch.close()
            raise
        link = WorkerLink(index, endpoint, cast(zmq.asyncio.Socket, sock), static=static,
                          watch=watch)  # asyncio context
        watch.attach(sock)
        watch.on_change = link.set_handshake_failing
        # a new connection gets a new routing id at the worker: answers for the old one are lost
        watch.on_broken = lambda: self._retry_inflight(link)
        return link

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for link in self.links:
            self._start_link(link)
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="worker-heartbeats"))
        if self.redis is not None:
            self._tasks.append(asyncio.create_task(self._follow_drained(self.redis), name="workers-drained"))
            self._tasks.append(asyncio.create_task(self._follow_published(self.redis), name="workers-published"))
            if self.wcfg.discovery:
                self._tasks.append(asyncio.create_task(self._follow_registry(self.redis), name="workers-discovery"))

    def _start_link(self, link: WorkerLink) -> None:
        reader = asyncio.create_task(self._reader(link), name=f"worker-reader-{link.index}")
        reader.add_done_callback(self._reader_stopped)
        link.tasks.append(reader)
        if link.watch is not None:
            link.tasks.append(asyncio.create_task(link.watch.run(), name=f"worker-handshakes-{link.index}"))

    async def close(self) -> None:
        await _cancel_all(self._tasks)
        for link in list(self.links):
            await self._close_link(link)
        self.links.clear()
        if self._own_ctx:
            self.ctx.term()

    async def _close_link(self, link: WorkerLink) -> None:
        """Stop ``link``'s tasks and close its socket; its requests in flight go elsewhere."""
        await _cancel_all(link.tasks)
        self._retry_inflight(link)
        if link.watch is not None:
            link.watch.close()
        link.sock.close(linger=0)

    def status(self) -> list[dict[str, Any]]:
        """Per-worker id, endpoint, liveness, version, load and last heartbeat (admin API)."""
        return [link.status() for link in self.links]

    def live(self) -> list[WorkerLink]:
        return [link for link in self.links
                if link.alive and not link.leaving and link.worker_id not in self.drained]

    def drain(self, worker_id: str) -> None:
        """Route no new requests to ``worker_id`` (requests in flight finish)."""
        self.drained.add(worker_id)

    def undrain(self, worker_id: str) -> None:
        self.drained.discard(worker_id)
        self._notify_soon()

    def set_drained(self, worker_ids: set[str]) -> None:
        if worker_ids != self.drained:
            self.drained = set(worker_ids)
            self._notify_soon()

    def _notify_soon(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(notify())

    async def wait_live(self, n: int = 1, timeout_s: float = 10.0) -> None:
        """Wait until at least ``n`` workers answer heartbeats (startup, tests)."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.live()) >= n), timeout_s)

    # ------------------------------------------------------------------ background tasks
    async def _reader(self, link: WorkerLink) -> None:
        """Read everything ``link``'s worker sends for the life of the pool. A message that cannot
        be read is reported and dropped: one bad frame must not silence the worker."""
        while True:
            frames = await link.sock.recv_multipart(copy=False)
            try:
                notify = self._receive(link, frames)
            except (ValueError, TypeError) as exc:  # wire.WireError is a ValueError
                metrics.WORKER_BAD_MESSAGES.inc()
                log.warning("dropped a malformed message from worker %s (%s): %s", link.worker_id, link.endpoint, exc)
                continue
            if notify:
                async with self._changed:
                    self._changed.notify_all()

    def _receive(self, link: WorkerLink, frames: list[Any]) -> bool:
        """Apply one message to ``link``; True when waiters for live workers must look again.
        Raises before changing anything when the message is malformed."""
        msg_type, header, _ = wire.decode(frames)
        version = header.get("version")
        if msg_type == MsgType.HEARTBEAT:
            worker_id = str(header.get("worker") or link.worker_id)
            load, lag = int(header.get("load") or 0), int(header.get("lag") or 0)
            link.worker_id, link.reported_load, link.lag = worker_id, load, lag
            link.model_id = header.get("model_id")
            link.capacity = max(1, int(header.get("max_batch_size") or link.capacity))
            link.last_heartbeat_wall_s = time.time()
            leaving = header.get("leaving") is True
            if leaving and not link.leaving:
                log.info("worker %s (%s) is stopping; no new requests go there", worker_id, link.endpoint)
            if leaving != link.leaving:
                link.leaving = leaving
                metrics.WORKERS_LIVE.set(len(self.live()))
            instance = header.get("instance")
            if isinstance(instance, str):
                if link.instance not in (None, instance) and link.inflight:
                    log.warning("worker %s (%s) restarted; retrying its %d requests elsewhere", worker_id,
                                link.endpoint, len(link.inflight))
                    self._retry_inflight(link)
                if link.instance not in (None, instance):  # a new process: what benched the old one is gone
                    self._unbench(link)
                link.instance = instance
        elif msg_type in (MsgType.TOKEN, MsgType.RESULT, MsgType.ERROR):
            q = link.inflight.get(str(header.get("id")))
            if q is not None:
                q.put_nowait((msg_type, header))
            self._unbench(link)  # it answers requests (a late answer too): not wedged
        was_alive = link.alive
        link.last_seen_s = time.monotonic()
        link.alive = True
        if isinstance(version, int):
            link.version = version
            if self.overclaims(link) and not link.overclaim_warned:
                self._published_stale.set()  # the trainer may just have published it
        if not was_alive:
            metrics.WORKERS_LIVE.set(len(self.live()))
            log.info("worker %s (%s) is live at version %d", link.worker_id, link.endpoint, link.version)
        return not was_alive or msg_type == MsgType.HEARTBEAT

    def _reader_stopped(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("worker reader %s stopped: %r", task.get_name(), task.exception())

    async def _heartbeats(self) -> None:
        interval_s = self.wcfg.heartbeat_interval_ms / 1000
        timeout_s = self.wcfg.heartbeat_timeout_ms / 1000
        hello = wire.encode(MsgType.HELLO, {"gateway": self.gateway_id})
        while True:
            now = time.monotonic()
            for link in list(self.links):
                if link.sock.closed:  # left the pool while this round ran
                    continue
                with contextlib.suppress(zmq.Again):
                    await link.sock.send_multipart(hello, flags=zmq.NOBLOCK)
                if link.alive and now - link.last_seen_s > timeout_s:
                    self._declare_dead(link)
                elif not link.last_seen_s and now - link.joined_s > timeout_s:
                    self._report_silence(link)
                await self._probe_benched(link, now)
            await pause(interval_s)

    async def _probe_benched(self, link: WorkerLink, now: float) -> None:
        """Once ``link``'s cool-off is over, send it a probe through its serving loop (a one-token
        generation, as a caller's request goes); any answer unbenches it (:meth:`_on_message`).
        A probe unanswered within ``worker.request_timeout_s`` is cancelled and the worker stays
        benched for another cool-off, with no other warning."""
        if link.benched_until is None or not link.alive:  # not benched; or dead: the heartbeats handle it
            return
        if link.probe is not None:
            rid, deadline = link.probe
            if now < deadline:
                return
            link.probe = None
            link.benched_until = now + self.wcfg.bench_cooloff_s
            await self._cancel(link, rid)
            return
        if now < link.benched_until:
            return
        rid = f"probe-{uuid.uuid4().hex}"
        msg = wire.encode(MsgType.INFER, {**_PROBE, "id": rid, "stream": False})
        with contextlib.suppress(zmq.Again):  # not connected: the heartbeats find out
            await link.sock.send_multipart(msg, flags=zmq.NOBLOCK)
            link.probe = (rid, now + self.wcfg.request_timeout_s)

    @staticmethod
    def _report_silence(link: WorkerLink) -> None:
        """Say once that ``link``'s worker never answered (port closed, an address this gateway
        cannot reach, something that accepts and never speaks): nothing is routed there."""
        if link.silence_reported or link.handshake_failing:  # a failing handshake is reported by its watch
            return
        link.silence_reported = True
        log.warning("worker %s at %s has not answered a heartbeat since it %s; nothing is routed there until it "
                    "does (is that address reachable from this gateway?)", link.worker_id or "?", link.endpoint,
                    "was announced" if not link.static else "was configured")

    async def _follow_registry(self, redis: aioredis.Redis) -> None:
        """Connect to every announced worker and drop the ones whose announcement is gone."""
        interval_s = self.wcfg.register_interval_ms / 1000
        failing = False
        while True:
            skipped: dict[str, str] = {}
            unreadable: set[str] = set()
            try:
                announced = await worker_registry.registered(redis, skipped.__setitem__, unreadable.add)
            except (RedisError, OSError) as exc:  # Redis away: keep the workers known so far
                if not failing:  # a reply (WRONGTYPE: the index holds something else) says what to fix
                    why = f"{type(exc).__name__}: {exc}" if isinstance(exc, ResponseError) else type(exc).__name__
                    log.warning("cannot read the worker announcements (%s); routing to the %d workers known "
                                "until Redis answers", why, len(self.links))
                failing = True
            else:
                if failing:
                    log.info("worker announcements readable again: %d announced", len(announced))
                failing = False
                self._report_skipped(skipped)
                self._report_unreadable(unreadable)
                try:
                    await self.follow_announcements(announced, unreadable)
                except Exception:  # a bug here must not stop discovery for the life of the gateway
                    log.exception("following the worker announcements failed; trying again")
            await pause(interval_s)

    def _report_skipped(self, skipped: dict[str, str]) -> None:
        """Log each unusable announcement once (until it changes or goes)."""
        for worker_id, why in skipped.items():
            if self._skipped.get(worker_id) != why:
                log.warning("ignoring the announcement of worker %s: %s", worker_id, why)
        self._skipped = skipped

    def _report_unreadable(self, unreadable: set[str]) -> None:
        """Log once each worker whose announcement sits on a cluster master that does not answer."""
        for worker_id in unreadable - self._unreadable:
            log.warning("the announcement of worker %s cannot be read (its Redis master does not answer); it "
                        "keeps its place in the pool until it can", worker_id)
        self._unreadable = unreadable

    async def follow_announcements(self, announced: list[worker_registry.Registration],
                                   unreadable: Collection[str] = ()) -> None:
        """Make the discovered part of the pool match ``announced`` (endpoints already among the
        static ones are not connected twice). A worker whose announcement is gone leaves at once
        when it no longer answers; one that still answers stays for ``worker.registration_ttl_ms``,
        time enough for a live worker to announce itself again after Redis lost its keys
        (restarted without persistence, flushed), so the pool does not empty meanwhile. A worker
        in ``unreadable`` (its announcement on a cluster master that is away) stays as it is."""
        static = {link.endpoint for link in self.links if link.static}
        wanted = self._capped({reg.endpoint: reg for reg in announced if reg.endpoint not in static})
        now = time.monotonic()
        for endpoint, link in list(self._discovered.items()):
            if endpoint in wanted or link.worker_id in unreadable:
                link.unannounced_since = None
            elif link.alive and not link.leaving and \
                    now - (link.unannounced_since or now) < self.wcfg.registration_ttl_ms / 1000:
                if link.unannounced_since is None:  # Redis restarted or flushed, or the key deleted
                    log.warning("worker %s (%s) is no longer announced but still answers; it stays in the pool "
                                "for up to %gs while it announces itself again", link.worker_id, link.endpoint,
                                self.wcfg.registration_ttl_ms / 1000)
                    link.unannounced_since = now
            else:
                await self._forget(link)
        self._unreachable = {ep: why for ep, why in self._unreachable.items() if ep in wanted}
        for endpoint, reg in wanted.items():
            if endpoint not in self._discovered and endpoint not in self._unreachable:
                self._join(reg)

    def _capped(self, wanted: dict[str, worker_registry.Registration]) -> dict[str, worker_registry.Registration]:
        """``wanted`` cut to ``worker.max_discovered`` workers: anyone with write access to Redis
        could announce thousands, and each costs a socket, a task and heartbeats. Workers already
        in the pool keep their place; newcomers are taken in worker id order, so every gateway
        makes the same choice."""
        cap = self.wcfg.max_discovered
        if len(wanted) <= cap:
            return wanted
        kept = {ep: reg for ep, reg in wanted.items() if ep in self._discovered}
        for reg in sorted((r for ep, r in wanted.items() if ep not in kept), key=lambda r: (r.worker_id, r.endpoint)):
            if len(kept) >= cap:
                break
            kept[reg.endpoint] = reg
        self._beyond_cap.warning("ignoring %d worker announcements beyond worker.max_discovered (%d of %d announced "
                                 "are in the pool)", len(wanted) - len(kept), len(kept), len(wanted))
        return kept

    def _join(self, reg: worker_registry.Registration) -> None:
        try:
            link = self._link(next(self._indices), reg.endpoint, static=False)
        except zmq.ZMQError as exc:  # a name ZeroMQ refuses (written straight into Redis): not tried
            log.warning("ignoring the announcement of worker %s: cannot connect to %s (%s)",  # again while
                        reg.worker_id, reg.endpoint, exc)  # it is announced
            self._unreachable[reg.endpoint] = str(exc)
            return
        self._discovered[reg.endpoint] = link
        link.worker_id, link.capacity = reg.worker_id, reg.capacity  # until its heartbeat says
        self.links.append(link)
        self._start_link(link)
        log.info("worker %s announced at %s joins the pool", reg.worker_id, reg.endpoint)

    async def _forget(self, link: WorkerLink) -> None:
        log.warning("worker %s (%s) is no longer announced; leaving the pool with %d requests to retry",
                    link.worker_id, link.endpoint, len(link.inflight))
        del self._discovered[link.endpoint]
        self.links.remove(link)
        await self._close_link(link)
        metrics.WORKERS_LIVE.set(len(self.live()))
        metrics.WORKERS_BENCHED.set(sum(w.benched_until is not None for w in self.links))
        self._notify_soon()

    async def _follow_drained(self, redis: aioredis.Redis) -> None:
        while True:
            try:
                self.set_drained({as_str(m) for m in await redis.smembers(keys.WORKERS_DRAINED)})
            except (RedisError, OSError) as exc:  # Redis away: keep the last known set
                log.debug("could not read the drained workers: %s", type(exc).__name__)
            await pause(DRAINED_REFRESH_S)

    def overclaims(self, link: WorkerLink) -> bool:
        """Its heartbeat claims a version the trainer never published. Only the trainer makes
        versions, so the claim is false (a buggy or hostile process holding the worker key);
        believed, it would make every honest worker look lagging and draw all the traffic."""
        return self.published_version is not None and link.version > self.published_version

    def _believed_version(self, link: WorkerLink) -> int:
        """Its claim, at most the trainer's latest: a request that needs a later version waits for
        the next read of it rather than go to a worker whose claim is not possible yet."""
        if self.published_version is None:
            return link.version
        return min(link.version, self.published_version)

    async def _follow_published(self, redis: aioredis.Redis) -> None:
        """Keep :attr:`published_version`, the bound of what a heartbeat's version may claim:
        read every ``DRAINED_REFRESH_S``, and at once when a heartbeat claims more."""
        while True:
            stop_if_cancelled()  # a cancel landing as wait_for times out is swallowed below (shared/aio.py)
            self._published_stale.clear()
            try:
                raw = await redis.get(keys.MODEL_VERSION)
                text = as_str(raw) if raw is not None else ""
                self.published_version = int(text) if text.isdigit() else None
            except (RedisError, OSError) as exc:  # Redis away: keep the last known version
                log.debug("could not read the model version: %s", type(exc).__name__)
            self._judge_claims()
            async with self._changed:  # requests waiting for a version may take a worker now
                self._changed.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._published_stale.wait(), DRAINED_REFRESH_S)

    def _judge_claims(self) -> None:
        for link in self.links:
            if not self.overclaims(link):
                link.overclaim_warned = False
            elif not link.overclaim_warned:
                link.overclaim_warned = True
                log.warning("worker %s (%s) claims model version %d, above the trainer's latest (%s in Redis): "
                            "routing treats it as lagging until its claim is possible", link.worker_id,
                            link.endpoint, link.version, self.published_version)

    def _declare_dead(self, link: WorkerLink) -> None:
        log.warning("worker %s (%s) missed heartbeats; retrying its %d requests elsewhere",
                    link.worker_id, link.endpoint, len(link.inflight))
        link.alive = False
        metrics.WORKERS_LIVE.set(len(self.live()))
        self._retry_inflight(link)

    def _timed_out(self, link: WorkerLink) -> None:
        """One more request that timed out on ``link`` with nothing answered there since the last
        answer; at ``worker.max_consecutive_timeouts`` the worker is benched."""
        link.timeouts += 1
        limit = self.wcfg.max_consecutive_timeouts
        if not limit or link.timeouts < limit:
            return
        cooloff_s = self.wcfg.bench_cooloff_s
        if link.benched_until is None:  # benched already (every worker was): no other warning
            log.warning("worker %s (%s) let %d requests in a row time out while it answers heartbeats; no requests "
                        "go there for %gs, then a probe (retrying its %d requests in flight elsewhere)",
                        link.worker_id, link.endpoint, link.timeouts, cooloff_s, len(link.inflight))
        link.benched_until = time.monotonic() + cooloff_s
        metrics.WORKERS_BENCHED.set(sum(w.benched_until is not None for w in self.links))
        self._retry_inflight(link)

    def _unbench(self, link: WorkerLink) -> None:
        link.timeouts = 0
        if link.benched_until is None:
            return
        link.benched_until = link.probe = None
        metrics.WORKERS_BENCHED.set(sum(w.benched_until is not None for w in self.links))
        log.info("worker %s (%s) answers requests again; back in the routing pool", link.worker_id, link.endpoint)

    @staticmethod
    def _retry_inflight(link: WorkerLink) -> None:
        """Hand every request in flight on ``link`` back to its caller, which retries it elsewhere."""
        for q in link.inflight.values():
            q.put_nowait(_DEAD)
        link.inflight.clear()

    # ------------------------------------------------------------------ routing
    def _pick(self, min_version: int, exclude: set[int]) -> WorkerLink | None:
        live = [w for w in self.live() if w.index not in exclude] or self.live()
        max_lag = self.cfg.consistency.max_lag
        live = [w for w in live if not self.overclaims(w)] or live  # like laggards: only when nothing else is live
        newest = max((self._believed_version(w) for w in live), default=0)
        live = [w for w in live if w.behind(newest) <= max_lag] or live  # laggards only when nothing else is live
        ok = [w for w in live if self._believed_version(w) >= min_version]
        if not ok:
            return None
        ok = [w for w in ok if w.routable] or ok  # benched ones only when nothing else can take it
        return min(ok, key=lambda w: (w.load / w.capacity, w.load, w.index))

    async def _choose(self, min_version: int, exclude: set[int], deadline: float) -> WorkerLink:
        version_deadline = time.monotonic() + self.cfg.consistency.timeout_s
        no_worker_deadline = time.monotonic() + self.wcfg.heartbeat_timeout_ms / 1000
        async with self._changed:
            while True:
                link = self._pick(min_version, exclude)
                if link is not None:
                    return link
                now = time.monotonic()
                live = self.live()
                if not live and now >= min(no_worker_deadline, deadline):
                    raise NoWorker("no inference worker is available; retry shortly",
                                   retry_after_s=self.cfg.redis.retry_after_s)
                if live and now >= min(version_deadline, deadline):
                    best = max(w.version for w in live)
                    raise NoWorker(f"no worker reached model version {min_version} within "
                                   f"{self.cfg.consistency.timeout_s:g}s (newest live: {best}); retry later",
                                   retry_after_s=max(1, int(self.cfg.consistency.timeout_s)))
                limit = min(deadline, version_deadline if live else no_worker_deadline) - now
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.01, limit))

    async def request(self, header: dict[str, Any], frames: list[bytes] | None = None, *,
                      min_version: int = 0, timeout_s: float | None = None,
                      on_token: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None,
                      on_retry: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
        """Send one INFER and return the worker's RESULT header.

        Retries on another worker when the chosen one dies (``on_retry`` is told, so partial
        streamed text can be reset). Raises :class:`NoWorker`, :class:`WorkerRequestError`
        or :class:`WorkerTimeout`; never waits past ``timeout_s``.
        """
        op = str(header.get("op"))
        t0 = time.monotonic()
        outcome = "error"
        try:
            result = await self._request(header, frames, min_version, timeout_s, on_token, on_retry)
            outcome = "ok"
            return result
        except NoWorker:
            outcome = "no_worker"
            raise
        except WorkerTimeout:
            outcome = "timeout"
            raise
        except WorkerRequestError as exc:
            outcome = "bad_input" if exc.code == "bad_input" else "error"
            raise
        finally:
            metrics.INFER_REQUESTS.labels(op, outcome).inc()
            metrics.INFER_SECONDS.labels(op).observe(time.monotonic() - t0)

    def _check_frames(self, msg: list[Any]) -> None:
        """A worker disconnects a peer that sends a frame over its limit, and with it every other
        request on that connection: such a request is refused here, before it is sent."""
        longest = max(len(f) for f in msg)
        if longest > self.max_frame:
            raise WorkerRequestError("bad_input", f"the request has a part of {longest} bytes; a worker reads "
                                     f"at most {self.max_frame} (from the context and gateway body limits)")

    async def _request(self, header: dict[str, Any], frames: list[bytes] | None, min_version: int,
                       timeout_s: float | None, on_token: Callable[[str, dict[str, Any]], Awaitable[None]] | None,
                       on_retry: Callable[[], Awaitable[None]] | None) -> dict[str, Any]:
        timeout_s = self.wcfg.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        tried: set[int] = set()
        lost = 0
        base_id = header.get("id") or uuid.uuid4().hex
        for attempt in itertools.count():
            link = await self._choose(min_version, tried, deadline)
            tried.add(link.index)
            rid = f"{base_id}.{attempt}.{next(self._ids)}"
            queue: asyncio.Queue = asyncio.Queue()
            link.inflight[rid] = queue
            try:
                msg = wire.encode(MsgType.INFER, {**header, "id": rid, "stream": on_token is not None}, frames or ())
                self._check_frames(msg)
                try:
                    await link.sock.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:  # not connected (worker down) or its queue is full
                    link.inflight.pop(rid, None)
                    if link.alive:
                        self._declare_dead(link)
                    continue
                result = await self._await_result(link, rid, queue, deadline, on_token)
            finally:
                link.inflight.pop(rid, None)
            if isinstance(result, dict):
                return result
            if result is _LOST:
                lost += 1
                if lost >= self.wcfg.max_request_losses:
                    log.warning("request %s was in flight on %d workers that were lost; not sent to another",
                                base_id, lost)
                    raise WorkerRequestError("worker_lost", f"the request was in flight on {lost} inference workers "
                                             "that stopped answering; it is not sent to another")
            metrics.INFER_RETRIES.inc()
            if on_retry is not None:
                await on_retry()
        raise AssertionError("unreachable")

    async def _await_result(self, link: WorkerLink, rid: str, queue: asyncio.Queue, deadline: float,
                            on_token: Callable[[str, dict[str, Any]], Awaitable[None]] | None
                            ) -> dict[str, Any] | object:
        """The RESULT header; ``_LOST`` when the worker died under the request, ``_DRAINING`` when it
        is stopping and refused it (both: try another)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                link.inflight.pop(rid, None)  # not among the requests a bench hands back: its time is spent
                self._timed_out(link)
                await self._cancel(link, rid)
                raise WorkerTimeout("the request did not complete within its timeout")
            try:
                if queue.empty():  # asyncio.timeout: no wrapper task per message, unlike wait_for on 3.11
                    async with asyncio.timeout(remaining):
                        item = await queue.get()
                else:
                    item = queue.get_nowait()
            except TimeoutError:
                if not cancelling():  # asyncio.timeout reports a cancel landing as it expires as a timeout
                    continue
                await self._cancel(link, rid)
                raise asyncio.CancelledError from None
            except asyncio.CancelledError:
                await self._cancel(link, rid)
                raise
            if item is _DEAD:
                await self._cancel(link, rid)  # in case it was only slow, not dead
                return _LOST
            msg_type, h = item
            if msg_type == MsgType.TOKEN:
                if on_token is not None:
                    await on_token(str(h.get("text", "")), h)
            elif msg_type == MsgType.RESULT:
                return h
            elif h.get("code") == "shutting_down":
                return _DRAINING  # the worker is stopping: retry elsewhere
            else:
                raise WorkerRequestError(str(h.get("code") or "internal"), str(h.get("message") or "worker error"))

    async def _cancel(self, link: WorkerLink, rid: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await link.sock.send_multipart(wire.encode(MsgType.CANCEL, {"id": rid}), flags=zmq.NOBLOCK)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    tasks.clear()
