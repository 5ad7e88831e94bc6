"""What one gateway replica holds while it runs: config, Redis clients, the registry,
sessions, the request-state sealer, and the control-channel listener that ties the
replicas together (session invalidation, cancellation, resource-updated fan-out).

Components (``gateway.tools.*``) hang their own objects on it (``.store``,
``.workers``, ``.samples`` ...) in their ``startup(state)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.auth import Authenticator, OriginGuard
from gateway.registry import Registry
from gateway.request_state import RequestStateSealer
from gateway.sessions import SessionRegistry
from shared import keys
from shared.config import Config

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Listener:
    """A 2026-07-28 subscriptions/listen stream open on this replica."""

    principal: str
    uris: set[str]
    flags: dict[str, Any]
    queue: asyncio.Queue


@dataclass(eq=False)
class GatewayState:
    config: Config
    redis: aioredis.Redis
    blocking_redis: aioredis.Redis
    registry: Registry
    sessions: SessionRegistry = field(init=False)
    sealer: RequestStateSealer = field(init=False)
    auth: Authenticator = field(init=False)
    origin_guard: OriginGuard = field(init=False)
    dispatcher: Any = None
    listeners: dict[str, set[Listener]] = field(default_factory=dict)
    inflight: dict[tuple[str, str | None, str], Any] = field(default_factory=dict)
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    control_connected: asyncio.Event = field(default_factory=asyncio.Event)
    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        gw = self.config.gateway
        self.sessions = SessionRegistry(self.redis, self.blocking_redis, gw)
        self.sessions.publish_control = self.publish_control
        self.sealer = RequestStateSealer(gw.request_state_keys, gw.request_state_ttl_s)
        self.auth = Authenticator(gw)
        self.origin_guard = OriginGuard(gw)

    # ------------------------------------------------------------------ resource updates
    async def notify_resource_updated(self, principal: str, uri: str) -> None:
        """Tell every subscriber of ``principal`` on every replica that ``uri`` changed:
        legacy sessions through their event log, listen streams through pub/sub."""
        note = {"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": uri}}
        for sid in await self.sessions.subscribers(principal, uri):
            await self.sessions.append_event(principal, sid, note)
        await self.publish_control({"t": "res", "p": principal, "u": uri})

    async def notify_list_changed(self, principal: str | None, kind: str) -> None:
        """``kind``: tools | resources | prompts. ``principal=None`` means everyone (listen streams)."""
        await self.publish_control({"t": "lc", "p": principal, "k": kind})

    def add_listener(self, principal: str, uris: set[str], flags: dict[str, Any], queue: asyncio.Queue) -> Listener:
        lis = Listener(principal, uris, flags, queue)
        self.listeners.setdefault(principal, set()).add(lis)
        return lis

    def remove_listener(self, lis: Listener) -> None:
        group = self.listeners.get(lis.principal)
        if group is not None:
            group.discard(lis)
            if not group:
                del self.listeners[lis.principal]

    def _deliver(self, principal: str, test: Any, note: dict[str, Any]) -> None:
        for lis in list(self.listeners.get(principal, ())):
            if test(lis):
                with contextlib.suppress(asyncio.QueueFull):
                    lis.queue.put_nowait(note)

    # ------------------------------------------------------------------ cancellation
    def track(self, principal: str, sid: str | None, rid: Any, call: Any) -> tuple[str, str | None, str]:
        key = (principal, sid, orjson.dumps(rid).decode())
        self.inflight[key] = (asyncio.current_task(), call)
        return key

    def untrack(self, key: tuple[str, str | None, str]) -> None:
        self.inflight.pop(key, None)

    async def cancel_request(self, principal: str, sid: str | None, rid: Any) -> None:
        if sid is None:
            self._cancel_local(principal, None, orjson.dumps(rid).decode())
            return
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
        elif t == "lc":
            flag = f"{m['k']}ListChanged"
            note = {"method": f"notifications/{m['k']}/list_changed", "params": {}}
            targets = [m["p"]] if m.get("p") else list(self.listeners)
            for principal in targets:
                self._deliver(principal, lambda lis: lis.flags.get(flag) is True, note)

    async def run_control_listener(self) -> None:
        """Subscribe to the control channel for the life of the replica, reconnecting with backoff.
        After a reconnect the session cache is dropped: messages may have been missed."""
        backoff_s = 0.05
        while not self.shutting_down.is_set():
            pubsub = self.blocking_redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.GATEWAY_CONTROL_CHANNEL)
                self.sessions.forget_all()
                self.control_connected.set()
                backoff_s = 0.05
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        payload = orjson.loads(msg["data"])
                    except orjson.JSONDecodeError:
                        continue
                    if payload.get("o") != self.replica_id:
                        self._on_control(payload)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.control_connected.clear()
                log.warning("control channel lost (%s); retrying", type(exc).__name__)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)
