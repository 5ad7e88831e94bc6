"""Resource subscriptions across the proxy: a client subscribed to an upstream's resource
(2025-11-25 ``resources/subscribe``, or a 2026-07-28 ``subscriptions/listen`` naming it) gets the
upstream's ``notifications/resources/updated`` for it, whatever revision either side speaks.

Per (principal, upstream) this replica keeps the upstream URIs its clients watch (counted: two
listen streams may name one URI) and one follower holding the upstream's stream for them: on
2026-07-28 a ``subscriptions/listen`` with those ``resourceSubscriptions`` (restarted when the set
changes); on 2025-11-25 ``resources/subscribe`` on the principal's upstream session and that
session's GET stream (every URI subscribed again on a new session: an upstream that restarted
forgets the old one with its subscriptions). A stdio upstream's stream is the principal's own process
(gateway/proxy/stdio_pool.py), held while the follower runs. An update becomes
``Gateway.notify_resource_updated`` for the client's form of the URI, which reaches the
principal's subscribed sessions and listen streams on every replica.
A subscription lives as long as the client's (until unsubscribe, or the listen stream ends) on
the replica that took it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

from gateway.mcp.types import MODERN_VERSION
from gateway.proxy.wire import Hooks, Message
from shared.aio import pause

if TYPE_CHECKING:
    from gateway.mcp.dispatcher import Call
    from gateway.proxy.proxy import Proxy, Upstream

log = logging.getLogger(__name__)

RETRY_S = 2.0

Key = tuple[str, str]  # principal, upstream name


class ResourceFollowers:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self._uris: dict[Key, collections.Counter[str]] = {}
        self._followers: dict[Key, asyncio.Task[None]] = {}
        self._pending: dict[tuple[Key, str], asyncio.Future[None]] = {}  # subscriptions on their way upstream

    async def subscribe(self, call: Call, client_uri: str) -> None:
        """Follow ``client_uri`` for the principal; raises what the upstream made of it. While one
        subscription of a URI is on its way to the upstream, another waits for its outcome: it
        counts as followed once that one succeeded, and asks the upstream itself if it failed."""
        up, uri = self.proxy.resource_target(call, client_uri, "resources/subscribe")
        key = (call.principal, up.name)
        await self._settled(key, uri)
        watched = self._uris.setdefault(key, collections.Counter())
        watched[uri] += 1
        if watched[uri] > 1:
            return
        self._pending[(key, uri)] = done = asyncio.get_running_loop().create_future()
        try:
            if await up.client.negotiated() != MODERN_VERSION:  # 2025-11-25: the upstream keeps the set
                await up.client.request(call.principal, "resources/subscribe", {"uri": uri})
        except BaseException:
            # Not followed after all: counted, the next subscribe would take it as followed already
            # and never ask the upstream.
            watched[uri] -= 1
            if not watched[uri]:
                del watched[uri]
            if not watched and key not in self._followers:
                self._uris.pop(key, None)
            raise
        finally:
            del self._pending[(key, uri)]
            done.set_result(None)
        self._restart(key, up)

    async def _settled(self, key: Key, uri: str) -> None:
        """Return once no subscription of ``uri`` is on its way to the upstream."""
        while (pending := self._pending.get((key, uri))) is not None:
            await asyncio.wait([pending])

    async def unsubscribe(self, call: Call, client_uri: str) -> None:
        try:
            up, uri = self.proxy.resource_target(call, client_uri, None)  # answered {} either way: no refusal to audit
        except Exception:  # noqa: BLE001 - an upstream gone since: nothing left to undo
            return
        key = (call.principal, up.name)
        await self._settled(key, uri)  # counted only once the upstream answered
        watched = self._uris.get(key)
        if watched is None or watched[uri] == 0:
            return
        watched[uri] -= 1
        if watched[uri]:
            return
        del watched[uri]
        if up.client.revision != MODERN_VERSION:
            try:
                await up.client.request(call.principal, "resources/unsubscribe", {"uri": uri})
            except Exception:  # noqa: BLE001 - best effort: the follower stops anyway when the set is empty
                log.debug("proxy upstream %s: resources/unsubscribe failed", up.name)
        self._restart(key, up)

    def _restart(self, key: Key, up: Upstream) -> None:
        old = self._followers.pop(key, None)
        if old is not None:
            old.cancel()
        uris = sorted(self._uris.get(key) or ())
        if not uris:
            self._uris.pop(key, None)
            return
        self._followers[key] = asyncio.create_task(self._follow(key[0], up, uris),
                                                   name=f"proxy-resources-{up.name}")

    async def _follow(self, principal: str, up: Upstream, uris: list[str]) -> None:
        hooks = Hooks(notify=lambda msg: self.updated(principal, up, msg))
        while True:
            try:
                await up.client.follow_resources(principal, uris, hooks)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the upstream is away: follow again when it is back
                log.debug("proxy upstream %s: resource stream ended (%s)", up.name, type(exc).__name__)
            await pause(RETRY_S)

    async def updated(self, principal: str, up: Upstream, msg: Message) -> None:
        """An update from the principal's stream (or a stdio upstream's process of the principal)
        reaches the principal's subscribers, with the URI in the client's form."""
        params = msg.get("params")
        uri = params.get("uri") if isinstance(params, dict) else None
        if msg.get("method") == "notifications/resources/updated" and isinstance(uri, str):
            await self.proxy.gateway.notify_resource_updated(principal, self.proxy.uri_for_client(up, uri))

    def close(self) -> None:
        for task in self._followers.values():
            task.cancel()
        self._followers.clear()
        self._uris.clear()

    def forget(self, upstream: str) -> None:
        """The upstream was removed or changed: its followers end (clients subscribe again)."""
        for key in [k for k in self._followers if k[1] == upstream]:
            self._followers.pop(key).cancel()
            self._uris.pop(key, None)
