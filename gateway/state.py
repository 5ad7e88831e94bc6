"""What one gateway replica runs on: the :class:`Gateway` built once by the app's lifespan
(gateway/app.py) and handed to the transports, the dispatcher, tool handlers (``ctx.state``)
and the admin routes (:func:`gateway_of`).

It also carries the control channel that ties the replicas together over Redis pub/sub:
session invalidation, cancellation, resource-updated / list-changed fan-out, and the changes
made through the admin API (runtime config, upstreams, a principal's limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import redis.asyncio as aioredis
import zmq.asyncio
from redis.exceptions import RedisError
from starlette.requests import HTTPConnection

from gateway import pubsub
from gateway.auth import Authenticator, OriginGuard, WsTickets
from gateway.auth_throttle import AuthThrottle
from gateway.limits import Limits
from gateway.mcp.dispatcher import Call, Dispatcher
from gateway.mcp.kernel import Kernel
from gateway.mcp.list_revisions import ListRevisions, OpenStream, list_name, parse_name
from gateway.mcp.request_state import RequestStateSealer
from gateway.mcp.sessions import SessionRegistry
from gateway.mcp.types import Notification
from gateway.proxy import store as proxy_store
from gateway.proxy.proxy import Proxy
from gateway.registry import Registry
from shared import control, keys
from shared.aio import spawn
from shared.config import Config, ConfigError
from shared.log_throttle import ThrottledWarning
from shared.text import as_str

if TYPE_CHECKING:  # the components import this module for the type, so only the type checker follows back
    from gateway.admin.auth import AdminKeyring
    from gateway.admin.stats import LocalStats
    from gateway.tasks import TaskManager
    from gateway.tools.learning import SampleIngest
    from gateway.workers import WorkerPool
    from shared.context import ContextStore

log = logging.getLogger(__name__)

InflightKey = tuple[str, str | None, str]  # principal, session id, JSON of the request id


@dataclass(eq=False)
class Listener:
    """A 2026-07-28 subscriptions/listen stream open on this replica. ``ended`` says why it is to
    end (``shutdown``, ``overflow``): its stream reads that after each note it takes, so a full
    queue never hides the reason (a marker put in the queue is only what wakes an idle stream)."""

    principal: str
    uris: set[str]
    flags: dict[str, Any]
    queue: asyncio.Queue[dict[str, Any]]
    ended: str | None = None


_WAKE = {"method": "$end"}  # put in an idle listener's queue: read ``Listener.ended``


@dataclass(eq=False)
class Gateway:
    """The replica's components, each built once, and the state the control channel keeps."""

    config: Config
    redis: aioredis.Redis
    blocking_redis: aioredis.Redis  # no socket timeout: blocking reads (Limits.stream_slot counts them)
    subscriber_redis: aioredis.Redis  # no socket timeout, a pool of its own: the pub/sub channels
    registry: Registry
    replica_id: str
    zmq_ctx: zmq.asyncio.Context
    store: ContextStore
    workers: WorkerPool
    samples: SampleIngest
    tasks: TaskManager
    limits: Limits  # the tasks' too
    admin_keyring: AdminKeyring
    admin_stats: LocalStats
    sessions: SessionRegistry = field(init=False)
    sealer: RequestStateSealer = field(init=False)
    auth: Authenticator = field(init=False)
    origin_guard: OriginGuard = field(init=False)
    ws_tickets: WsTickets = field(init=False)
    dispatcher: Dispatcher = field(init=False)
    kernel: Kernel = field(init=False)  # what both transports hand their messages to
    proxy: Proxy = field(init=False)  # upstream MCP servers (gateway/proxy/)
    listeners: dict[str, set[Listener]] = field(default_factory=dict)
    list_revisions: ListRevisions = field(init=False)
    session_streams: dict[str, dict[str, set[OpenStream]]] = field(default_factory=dict)  # principal -> sid -> here
    _notes: set[asyncio.Task[Any]] = field(default_factory=set)  # event-log appends under way
    _listener_overflow: ThrottledWarning = field(default_factory=lambda: ThrottledWarning(log))
    inflight: dict[InflightKey, tuple[asyncio.Task[Any], Call]] = field(default_factory=dict)
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    control_connected: asyncio.Event = field(default_factory=asyncio.Event)
    prepared: asyncio.Event = field(default_factory=asyncio.Event)  # the start's steps on Redis are done
    proxy_reload: asyncio.Future[None] | None = None
    config_reload: asyncio.Future[None] | None = None
    file_config: Config = field(init=False)  # ``config`` before runtime overrides (PATCH /admin/config)

    def __post_init__(self) -> None:
        self.file_config = copy.deepcopy(self.config)
        gw = self.config.gateway
        self.sessions = SessionRegistry(self.redis, self.blocking_redis, gw)
        self.sessions.publish_control = self.publish_control
        self.list_revisions = ListRevisions(self.redis, gw.session_idle_ttl_s)
        self.sealer = RequestStateSealer(gw.request_state_keys, gw.request_state_ttl_s)
        self.auth = Authenticator(gw, AuthThrottle(self.redis, gw.auth_throttle))
        self.origin_guard = OriginGuard(gw)
        self.ws_tickets = WsTickets(self.redis, gw.ws_ticket_ttl_s)
        self.dispatcher = Dispatcher(self.registry, self)
        self.kernel = Kernel(self)
        self.proxy = Proxy(self)

    # ------------------------------------------------------------------ resource updates
    async def notify_resource_updated(self, principal: str, uri: str) -> None:
        """Tell every subscriber of ``principal`` on every replica that ``uri`` changed:
        legacy sessions through their event log, listen streams through pub/sub."""
        note = Notification(method="notifications/resources/updated", params={"uri": uri})
        for sid in await self.sessions.subscribers(principal, uri):
            await self.sessions.append_event(principal, sid, note)
        await self.publish_control({"t": "res", "p": principal, "u": uri})

    async def notify_list_changed(self, principal: str | None, kind: str, upstream: str | None = None) -> None:
        """``kind``: tools | resources | prompts, on every replica. ``principal=None`` means everyone
        who may see the list: with ``upstream`` (a proxied server's list changed) only principals
        allowed to use it, and every replica drops its copy of that upstream's lists. The change is
        counted first, so a session with no stream open now is told when it opens one."""
        revision = await self.list_revisions.bump(principal, kind, upstream)
        await self.publish_control({"t": "lc", "p": principal, "k": kind, "u": upstream, "r": revision})

    async def contexts_evicted(self, principals: list[str]) -> None:
        """Contexts of these principals were evicted (idle, over a budget, by an admin), or a call
        changed their lists otherwise: their clients' resources/list changed (a lost hint is
        logged, never raised: the change was made)."""
        for principal in principals:
            try:
                await self.notify_list_changed(principal, "resources")
            except (RedisError, OSError) as exc:
                log.warning("could not announce an eviction's resources/list_changed: %s", type(exc).__name__)
                return

    async def list_changed_here(self, kind: str, upstream: str | None = None) -> None:
        """``notify_list_changed(None, kind, upstream)`` for the clients of this replica only
        (each replica learns of an upstream's change on its own, and counts it)."""
        revision = await self.list_revisions.bump(None, kind, upstream)
        self._on_control({"t": "lc", "p": None, "k": kind, "u": upstream, "r": revision})

    @contextlib.asynccontextmanager
    async def session_stream(self, principal: str, sid: str) -> AsyncIterator[None]:
        """Mark a legacy session's event stream (GET or WebSocket) open on this replica while the
        block runs: broadcast notifications (``list_changed``) go into the logs of those sessions.
        On entry the session's log first gets each list change it was not told about while no
        stream of it was open; on exit the session records what this stream told it."""
        stream = OpenStream(principal, sid)
        group = self.session_streams.setdefault(principal, {})
        group.setdefault(sid, set()).add(stream)  # before the revisions are read: no change falls between
        try:
            await self._tell_missed(stream)
            yield
        finally:
            group[sid].discard(stream)
            if not group[sid]:
                del group[sid]
            if not group:
                self.session_streams.pop(principal, None)
            try:
                await self.list_revisions.record(stream)
            except (RedisError, OSError):  # the next stream tells the client again: twice, not never
                log.warning("could not record the list changes a session stream told about")

    async def _tell_missed(self, stream: OpenStream) -> None:
        try:
            changed = await self.list_revisions.open(stream)
            kinds: list[str] = []
            for name in changed:
                kind, upstream = parse_name(name)
                if kind not in kinds and (upstream is None or self.proxy.may_see(stream.principal, upstream, kind)):
                    kinds.append(kind)
            for kind in kinds:
                await self.sessions.append_event(stream.principal, stream.sid,
                                                 Notification(method=f"notifications/{kind}/list_changed"))
            await self.list_revisions.record(stream)
        except (RedisError, OSError):
            stream.recorded = None  # told nothing: the session's record stays as it was
            log.warning("could not compare a session's list revisions; it is told of changes from now on")

    def add_listener(self, principal: str, uris: set[str], flags: dict[str, Any],
                     queue: asyncio.Queue[dict[str, Any]]) -> Listener:
        lis = Listener(principal, uris, flags, queue)
        self.listeners.setdefault(principal, set()).add(lis)
        return lis

    def remove_listener(self, lis: Listener) -> None:
        group = self.listeners.get(lis.principal)
        if group is not None:
            group.discard(lis)
            if not group:
                del self.listeners[lis.principal]

    def close_listeners(self) -> None:
        """End every listen stream on this replica (the replica is stopping)."""
        for group in list(self.listeners.values()):
            for lis in list(group):
                lis.ended = lis.ended or "shutdown"
                with contextlib.suppress(asyncio.QueueFull):  # a full queue has a stream busy, not waiting
                    lis.queue.put_nowait(_WAKE)

    def _deliver(self, principal: str, test: Callable[[Listener], bool], note: dict[str, Any]) -> None:
        for lis in list(self.listeners.get(principal, ())):
            if lis.ended is None and test(lis):
                try:
                    lis.queue.put_nowait(note)
                except asyncio.QueueFull:
                    # Dropping notes would leave the client believing what it follows is current:
                    # the stream ends instead (answered as on shutdown) and the client, listening
                    # again, lists and reads afresh.
                    lis.ended = "overflow"
                    self._listener_overflow.warning(
                        "a subscriptions/listen stream of %s fell %d notifications behind: it ends, and its "
                        "client listens again", principal, lis.queue.maxsize)

    # ------------------------------------------------------------------ cancellation
    def track(self, principal: str, sid: str | None, rid: Any, call: Call) -> InflightKey:
        key = (principal, sid, orjson.dumps(rid).decode())
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("track() runs inside the request's task")
        self.inflight[key] = (task, call)
        return key

    def untrack(self, key: InflightKey) -> None:
        # Without a session (2026-07-28) two clients of a principal may send one id: the key is
        # the latest one's, not to be dropped when the other ends.
        found = self.inflight.get(key)
        if found is not None and found[0] is asyncio.current_task():
            del self.inflight[key]

    async def cancel_request(self, principal: str, sid: str | None, rid: Any) -> None:
        """Cancel the principal's request ``rid`` (of session ``sid``; None: a 2026-07-28 request)
        on whichever replica serves it."""
        await self.publish_control({"t": "cancel", "p": principal, "s": sid, "r": orjson.dumps(rid).decode()})

    def _cancel_local(self, principal: str, sid: str | None, rid: str) -> None:
        found = self.inflight.get((principal, sid, rid))
        if found is not None:
            task, call = found
            call.cancelled = True
            task.cancel()

    # ------------------------------------------------------------------ control channel
    async def publish_control(self, message: dict[str, Any]) -> None:
        self._on_control(message)  # this replica first, without waiting for the round trip
        try:
            await self.redis.publish(keys.GATEWAY_CONTROL_CHANNEL, orjson.dumps({**message, "o": self.replica_id}))
        except RedisError:
            log.warning("could not publish a control message; other replicas will catch up on re-check")

    def _on_control(self, m: dict[str, Any]) -> None:
        t = m.get("t")
        if t == "inv":
            self.sessions.forget(m["p"], m["s"])
        elif t == "cancel":
            self._cancel_local(m["p"], m["s"], m["r"])
        elif t == "res":
            note = {"method": "notifications/resources/updated", "params": {"uri": m["u"]}}
            self._deliver(m["p"], lambda lis: m["u"] in lis.uris, note)
        elif t == "proxy":
            self._reload_proxy()
        elif t == "cfg":
            self._reload_config()
        elif t == "lc":
            self._on_list_changed(m)
        elif t == "lim":
            self.limits.changed(m["p"])

    def _on_list_changed(self, m: dict[str, Any]) -> None:
        kind, upstream, revision = m["k"], m.get("u"), m.get("r")
        name = list_name(kind, upstream, mine=bool(m.get("p")))
        if upstream is not None:
            self.proxy.catalog_changed(upstream)
        flag = f"{kind}ListChanged"
        method = f"notifications/{kind}/list_changed"
        note: dict[str, Any] = {"method": method, "params": {}}
        targets = [m["p"]] if m.get("p") else {*self.listeners, *self.session_streams}
        for principal in targets:
            if upstream is not None and not self.proxy.may_see(principal, upstream, kind):
                continue
            self._deliver(principal, lambda lis: lis.flags.get(flag) is True, note)
            for sid, streams in self.session_streams.get(principal, {}).items():
                self._append_note(principal, sid, Notification(method=method))
                for stream in streams:
                    stream.tell(name, revision)

    def _append_note(self, principal: str, sid: str, note: Notification) -> None:
        spawn(self.sessions.append_event(principal, sid, note), self._notes, "logging a notification for a session stream")

    async def run_control_listener(self) -> None:
        """Follow the control channel for the life of the replica. After a reconnect the session
        cache is dropped and what the admin API may have changed is read again: invalidations
        may have been missed."""
        await pubsub.follow(self.subscriber_redis, keys.GATEWAY_CONTROL_CHANNEL, self._on_control_frame,
                            on_subscribed=self._control_subscribed, on_lost=self.control_connected.clear,
                            what="control channel")

    async def _control_subscribed(self) -> None:
        self.sessions.forget_all()
        self._reload_proxy()
        self._reload_config()
        self.limits.recheck_all()
        self.control_connected.set()

    def _reload_config(self) -> None:
        if self.config_reload is None or self.config_reload.done():
            self.config_reload = asyncio.ensure_future(self.reload_runtime_config())

    async def reload_runtime_config(self) -> None:
        """Follow the runtime overrides of the sections a gateway reads (``consistency``: the
        waits of min_model_version and after_learn, the lag a worker may have). Applied to
        ``config`` in place: the worker pool and the tools hold that object."""
        try:
            raw = await self.redis.hgetall(keys.RUNTIME_CONFIG)
        except RedisError:
            log.warning("could not read the runtime configuration; the next control message retries")
            return
        try:
            new = control.effective_config(self.file_config, {as_str(k): orjson.loads(v) for k, v in raw.items()})
        except (ConfigError, ValueError) as exc:  # written by a validating API; defensive
            log.error("ignoring an invalid runtime configuration: %s", exc)
            return
        self.config.consistency = new.consistency

    def _reload_proxy(self) -> None:
        """Follow the set of upstreams in Redis (an admin change on any replica)."""
        if self.proxy_reload is None or self.proxy_reload.done():
            self.proxy_reload = asyncio.ensure_future(self.reload_proxy())

    async def reload_proxy(self) -> None:
        try:
            await self.proxy.apply(await proxy_store.load(self.redis))
        except RedisError:
            log.warning("could not reload the proxy's upstreams; the next control message retries")

    def _on_control_frame(self, data: bytes) -> None:
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(payload, dict) and payload.get("o") != self.replica_id:
            self._on_control(payload)


def gateway_of(conn: HTTPConnection) -> Gateway:
    """The :class:`Gateway` of the app serving ``conn`` (set by the lifespan before any request)."""
    gateway: Gateway = conn.app.state.gateway
    return gateway
