"""The gateway's MCP client for one upstream, on the kernel's message types.

Revisions:

- **2026-07-28** (stateless): every request carries ``_meta`` with the protocol version and the
  client capabilities, and the ``MCP-Protocol-Version``/``Mcp-Method``/``Mcp-Name`` headers that
  must match the body; no session.
- **2025-11-25** (sessions): ``initialize`` then ``notifications/initialized``; the session id
  (``Mcp-Session-Id``) is held per principal, in Redis, so any replica continues it. An upstream
  that no longer knows the session (HTTP 404) gets a new one and the request is sent again.
- ``auto``: ``server/discover`` decides once per upstream (2026-07-28 when offered, else 2025-11-25).

A stdio upstream runs one process per principal on each replica (gateway/proxy/stdio_pool.py),
each with its own session; its lists are fetched through one more process of its own.

Every call passes the breaker and the concurrency bound, and runs under ``timeout_s``; what
fails becomes :class:`~gateway.proxy.errors.UpstreamFailed`, naming the upstream and never a
credential. The upstream's own JSON-RPC errors keep their code and message.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import msgspec
import redis.asyncio as aioredis

from gateway.errors import GATEWAY_CODES, INTERNAL_ERROR, UPSTREAM_FAILED, McpError
from gateway.mcp.kernel import NAME_BEARING
from gateway.mcp.types import (
    CLIENT_CAPABILITIES_META_KEY,
    HANDSHAKE_VERSIONS,
    LEGACY_VERSION,
    MODERN_VERSION,
    PROTOCOL_VERSION_META_KEY,
    Notification,
    Request,
)
from gateway.proxy.breaker import Breaker
from gateway.proxy.errors import (
    ForeignAnswer,
    MessageTooLarge,
    StdioCapReached,
    Unpassable,
    UpstreamFailed,
    WireClosed,
)
from gateway.proxy.gate import FairGate, NoSlot
from gateway.proxy.scrub import Scrubber
from gateway.proxy.stdio_pool import CATALOG, StdioPool
from gateway.proxy.wire import (
    MAX_LIST_ANSWER_BYTES,
    MAX_MESSAGE_BYTES,
    NO_HOOKS,
    Answer,
    Hooks,
    HttpWire,
    StdioWire,
    Wire,
)
from shared import keys
from shared.config import BreakerConfig, ConfigError, UpstreamConfig
from shared.secret_files import read_private_text

log = logging.getLogger(__name__)

CLIENT_INFO = {"name": "learnmesh-proxy", "version": "0.1.0"}
# What the gateway can carry back to its own clients (gateway/proxy/proxy.py forwards them).
FORWARDED_CAPABILITIES: dict[str, Any] = {"elicitation": {}, "roots": {"listChanged": True}, "sampling": {}}
ALL_FORWARDED = tuple(FORWARDED_CAPABILITIES)
# Asked of a stdio upstream's lists process rather than the principal's (the answers are everyone's).
CATALOG_METHODS = frozenset({"tools/list", "resources/list", "resources/templates/list", "prompts/list"})
# Requests that change nothing at the upstream, so one may be sent again on a new connection when
# a kept-alive one closes before its answer. Any other (a tool call above all) may have acted
# already: it is never sent twice (RFC 9110, 9.2.2).
REPEATABLE = CATALOG_METHODS | {"server/discover", "ping", "resources/read", "resources/subscribe",
                                "resources/unsubscribe", "prompts/get", "completion/complete", "tasks/get"}
SUBSCRIPTION_METHODS = frozenset({"resources/subscribe", "resources/unsubscribe"})
# Request ids start at a random point below this. The replicas continuing one principal's
# 2025-11-25 session, and on 2026-07-28 every replica behind the one credential, share the
# upstream's id space, where answers and cancellations are routed by id: counting from 1 on each
# replica, two calls in flight would share an id and one would get the other's fate. Below 2**52,
# ids stay exact for readers that hold JSON numbers as doubles.
FIRST_ID_BOUND = 1 << 52


@dataclass(frozen=True, slots=True)
class Seat:
    """Who holds a 2025-11-25 upstream session: a principal, with the client capabilities it was
    opened with (clients of one principal that declare different ones get different sessions)."""

    principal: str
    capabilities: tuple[str, ...]

    @property
    def slot(self) -> str:
        return "+".join(self.capabilities) or "none"
_encode = msgspec.json.Encoder().encode
ENVELOPE_PREFIX = "io.modelcontextprotocol/"


def credential_headers(cfg: UpstreamConfig) -> dict[str, str]:
    """The upstream's credential headers, read from their sources now; a missing source is a
    config error naming the header and where it should come from, never a value."""
    return {header.lower(): value for header, value in
            _read_sources(cfg, "header", cfg.headers_from_env, cfg.headers_from_file).items()}


def credential_query(cfg: UpstreamConfig) -> dict[str, str]:
    """The query parameters the upstream takes its key in, read from their sources now (as
    :func:`credential_headers`)."""
    return _read_sources(cfg, "query parameter", cfg.query_from_env, cfg.query_from_file)


def _read_sources(cfg: UpstreamConfig, what: str, from_env: Mapping[str, str],
                  from_file: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, var in from_env.items():
        value = os.environ.get(var)
        if value is None:
            raise ConfigError(f"proxy upstream {cfg.name!r}: {what} {name} needs environment variable {var}")
        out[name] = value
    for name, path in from_file.items():
        out[name] = read_private_text(path, f"credential file of upstream {cfg.name!r}").strip()
    return out


def with_query(url: str, query: Mapping[str, str]) -> str:
    """``url`` (which has no query: the configuration refuses one) with ``query`` as its query."""
    return f"{url}?{urlencode(query)}" if query else url


def stdio_env(cfg: UpstreamConfig) -> dict[str, str]:
    """For a stdio upstream, ``headers_from_env`` names environment variables its process gets
    (its credentials, by their own names); nothing else of the gateway's environment but the basics."""
    return {var: os.environ[var] for var in cfg.headers_from_env.values() if var in os.environ}


def header_value(value: str) -> str:
    """A header value as the kernel reads it back: plain printable ASCII, else ``=?base64?...?=``."""
    if value.isascii() and value.isprintable() and value == value.strip():
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode() + "?="


class UpstreamClient:
    """Speaks MCP to one upstream for every principal of this replica."""

    def __init__(self, cfg: UpstreamConfig, redis: aioredis.Redis, breaker: BreakerConfig,
                 session_ttl_s: int, on_breaker_change: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.redis = redis
        self.session_ttl_s = session_ttl_s
        if cfg.url is not None:
            headers, query = credential_headers(cfg), credential_query(cfg)
            self.http: HttpWire | None = HttpWire(with_query(cfg.url, query), headers, cfg.timeout_s)
            self.stdio: StdioPool | None = None
            self.scrubber = Scrubber([*headers.values(), *query.values()])
        else:
            env = stdio_env(cfg)
            self.http = None
            self.stdio = StdioPool(cfg.name, cfg.command or [], env, cfg.stdio_max_processes, cfg.stdio_idle_s,
                                   cfg.timeout_s)
            self.scrubber = Scrubber(env.values())
        self.revision: str | None = None if cfg.revision == "auto" else cfg.revision
        self.legacy_version = LEGACY_VERSION  # what initialize agreed on
        self.breaker = Breaker(breaker.failures, breaker.reset_s, on_breaker_change)
        self.gate = FairGate(cfg.concurrency, cfg.principal_share)
        self._ids = itertools.count(1 + secrets.randbelow(FIRST_ID_BOUND))
        self._sessions: dict[Seat, str] = {}  # upstream session ids (this replica's copy of Redis)
        self._locks: dict[str, asyncio.Lock] = {}
        self._cancels: set[asyncio.Future[Any]] = set()  # background writes: cancellations, session renewals
        self._renewed: dict[Seat, float] = {}  # when each session's Redis TTL was last renewed
        self._used: dict[Seat, float] = {}  # when each principal's session was last used here
        self._trimmed_at = time.monotonic()
        self._subscribed: dict[Seat, tuple[str | None, set[str]]] = {}  # a session, and the URIs subscribed on it

    # ------------------------------------------------------------------ the one entry point
    async def request(self, principal: str, method: str, params: dict[str, Any], hooks: Hooks = NO_HOOKS,
                      headers: Mapping[str, str] | None = None,
                      capabilities: tuple[str, ...] = ALL_FORWARDED, timeout_s: float | None = None) -> dict[str, Any]:
        """The upstream's result for ``method``; raises McpError (its error) or UpstreamFailed.
        ``headers``: extra request headers for a 2026-07-28 upstream (SEP-2243 ``Mcp-Param-*``);
        ``capabilities``: which of sampling, elicitation, roots the client declared (a 2025-11-25
        upstream session is opened with exactly those, so the upstream sees what the client can do);
        ``timeout_s``: how long the call may take once a slot is taken (default: the upstream's
        ``timeout_s``; a call the gateway hosts as a task may take as long as the task lives)."""
        if not self.breaker.admit():
            raise UpstreamFailed(self.name, "breaker_open",
                                 f"upstream {self.name!r} is failing; calls resume in "
                                 f"{self.breaker.retry_in_s():.0f} s (circuit breaker open)")
        now = asyncio.get_running_loop().time()
        await self._take_slot(principal, now + self.cfg.timeout_s)
        limit_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout_at(now + limit_s):
                result = await self._request(principal, method, params, self.scrubber.hooks(hooks), headers or {},
                                             capabilities)
        except TimeoutError:
            self.breaker.failed()
            raise UpstreamFailed(self.name, "timeout", f"upstream {self.name!r} did not answer {method} "
                                 f"within {limit_s:g} s") from None
        except MessageTooLarge as exc:
            self.breaker.failed()
            raise UpstreamFailed(self.name, "protocol", f"upstream {self.name!r} sent a message over "
                                 f"{exc.limit_bytes} bytes in answer to {method}") from None
        except Unpassable as exc:
            self.breaker.failed()
            raise UpstreamFailed(self.name, "protocol", f"upstream {self.name!r} sent {exc} in answer to "
                                 f"{method}{exc.note}") from None
        except ForeignAnswer:
            self.breaker.failed()
            raise UpstreamFailed(self.name, "protocol", f"upstream {self.name!r} answered {method} with a "
                                 "response to another request (its id is not the request's)") from None
        except (OSError, WireClosed) as exc:
            self.breaker.failed()
            # WireClosed says what happened in words meant for the client; an OSError by its
            # system message (connection refused, no route to host), never its address.
            why = str(exc) if isinstance(exc, WireClosed) else os.strerror(exc.errno) if exc.errno else type(exc).__name__
            raise UpstreamFailed(self.name, "unreachable", f"upstream {self.name!r} is unreachable ({why})") from None
        except UpstreamFailed:
            self.breaker.failed()
            raise
        except StdioCapReached:
            self.breaker.abandoned()  # the gateway's own capacity, not the upstream failing
            raise
        except McpError:
            self.breaker.succeeded()  # the upstream answered: it is alive
            raise
        except BaseException:
            # Cancelled (by the client, a task's cancel, shutdown) or unforeseen: no verdict on the
            # upstream. Were this half-open's one probe, no other call would be let through ever.
            self.breaker.abandoned()
            raise
        finally:
            self.gate.give(principal)
        self.breaker.succeeded()
        return result

    async def _take_slot(self, principal: str, deadline: float) -> None:
        """One of the ``concurrency`` slots, within the principal's share of them; waiting for one
        is not the upstream failing (no breaker count), but it comes out of the call's ``timeout_s``."""
        try:
            await self.gate.take(principal, deadline)
        except asyncio.CancelledError:
            self.breaker.abandoned()
            raise
        except NoSlot as exc:
            self.breaker.abandoned()
            if exc.own_share:
                raise UpstreamFailed(self.name, "busy", f"principal {principal!r} has {self.gate.share} calls in "
                                     f"flight to upstream {self.name!r} (its share of the upstream's concurrency) "
                                     f"and none ended within {self.cfg.timeout_s:g} s") from None
            raise UpstreamFailed(self.name, "busy", f"upstream {self.name!r} has {self.cfg.concurrency} calls in "
                                 f"flight and none ended within {self.cfg.timeout_s:g} s") from None

    async def _request(self, principal: str, method: str, params: dict[str, Any], hooks: Hooks,
                       headers: Mapping[str, str], capabilities: tuple[str, ...]) -> dict[str, Any]:
        if self.stdio is None:
            return await self._over(self._http(), Seat(principal, capabilities), method, params, hooks, headers)
        # A stdio session is opened with every capability: the process serves this principal only,
        # and a question its client cannot answer is refused by gateway/proxy/exchange.py.
        async with self.stdio.lease(CATALOG if method in CATALOG_METHODS else principal) as wire:
            return await self._over(wire, Seat(principal, ALL_FORWARDED), method, params, hooks, headers)

    async def _over(self, wire: Wire, seat: Seat, method: str, params: dict[str, Any], hooks: Hooks,
                    headers: Mapping[str, str]) -> dict[str, Any]:
        if self.revision is None:
            await self._negotiate(wire)
        if self.revision == MODERN_VERSION:
            return self._result(method, await self._modern(wire, method, params, hooks, headers))
        return self._result(method, await self._legacy(wire, seat, method, _legacy_params(params), hooks))

    # ------------------------------------------------------------------ 2026-07-28
    async def _modern(self, wire: Wire, method: str, params: dict[str, Any], hooks: Hooks,
                      extra_headers: Mapping[str, str] | None = None) -> Answer:
        meta = params.get("_meta")
        meta = dict(meta) if isinstance(meta, dict) else {}
        meta[PROTOCOL_VERSION_META_KEY] = MODERN_VERSION
        meta.setdefault(CLIENT_CAPABILITIES_META_KEY, FORWARDED_CAPABILITIES)
        rid = next(self._ids)
        body = _encode(Request(jsonrpc="2.0", id=rid, method=method, params={**params, "_meta": meta}))
        headers = {"mcp-protocol-version": MODERN_VERSION, "mcp-method": method, **(extra_headers or {})}
        name_key = NAME_BEARING.get(method)
        if name_key is not None and isinstance(params.get(name_key), str):
            headers["mcp-name"] = header_value(params[name_key])
        return await self._exchange(wire, body, headers, rid, hooks, method in REPEATABLE, _answer_bound(method))

    async def _exchange(self, wire: Wire, body: bytes, headers: dict[str, str], rid: int, hooks: Hooks,
                        repeatable: bool = True, limit_bytes: int = MAX_MESSAGE_BYTES) -> Answer:
        """One request and its answer; a request abandoned here (the client cancelled, or the
        timeout struck) is cancelled at the upstream too, so it stops working on it."""
        try:
            return await wire.send(body, headers, rid, hooks, repeatable, limit_bytes)
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self._cancel_upstream(wire, headers, rid))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            raise

    async def _cancel_upstream(self, wire: Wire, headers: dict[str, str], rid: int) -> None:
        if isinstance(wire, StdioWire) and not wire.running:
            return  # the process that had the request is gone (and a new one must not start for this)
        params: dict[str, Any] = {"requestId": rid, "reason": "the gateway's client cancelled or timed out"}
        note_headers = {k: v for k, v in headers.items() if k in ("mcp-session-id", "mcp-protocol-version")}
        if headers.get("mcp-protocol-version") == MODERN_VERSION:
            params["_meta"] = {PROTOCOL_VERSION_META_KEY: MODERN_VERSION}
            note_headers["mcp-method"] = "notifications/cancelled"
        try:
            await wire.send(_encode(Notification(method="notifications/cancelled", params=params)),
                            note_headers, None, NO_HOOKS)
        except (OSError, WireClosed):
            pass  # the upstream is gone: nothing left to cancel

    async def _negotiate(self, wire: Wire) -> None:
        lock = self._locks.setdefault("", asyncio.Lock())
        async with lock:
            if self.revision is not None:
                return
            answer = await self._modern(wire, "server/discover", {}, NO_HOOKS)
            self._check_admitted("server/discover", answer)  # a refusal says nothing of the revision
            result = (answer.message or {}).get("result") if answer.status == 200 else None
            offered = result.get("supportedVersions") if isinstance(result, dict) else None
            self.revision = MODERN_VERSION if isinstance(offered, list) and MODERN_VERSION in offered \
                else LEGACY_VERSION
            log.info("upstream %s speaks %s", self.name, self.revision)

    # ------------------------------------------------------------------ 2025-11-25
    async def _legacy(self, wire: Wire, seat: Seat, method: str, params: dict[str, Any], hooks: Hooks) -> Answer:
        for attempt in (1, 2):
            sid = await (self._session(wire, seat) if isinstance(wire, HttpWire) else self._stdio_session(wire))
            rid = next(self._ids)
            body = _encode(Request(jsonrpc="2.0", id=rid, method=method, params=params))
            answer = await self._exchange(wire, body, self._session_headers(sid), rid, hooks, method in REPEATABLE,
                                          _answer_bound(method))
            if answer.status != 404 or sid is None or attempt == 2:
                if method in SUBSCRIPTION_METHODS and isinstance(wire, HttpWire):
                    self._note_subscription(seat, sid, method, params, answer)
                return answer
            await self._forget_session(seat)  # the upstream lost it (restart, expiry): open a new one
        raise AssertionError("unreachable")

    def _session_headers(self, sid: str | None) -> dict[str, str]:
        headers = {"mcp-protocol-version": self.legacy_version}
        if sid is not None:
            headers["mcp-session-id"] = sid
        return headers

    async def _stdio_session(self, wire: StdioWire) -> None:
        """A stdio process has one session (its principal's), opened again after each restart."""
        if wire.session_open:
            return
        async with wire.session_lock:
            if not wire.session_open:
                await self._initialize(wire, Seat("", ALL_FORWARDED))

    async def _session(self, wire: HttpWire, seat: Seat) -> str | None:
        """The upstream session of ``seat``: this replica's copy, else the one in Redis, else a new one."""
        now = time.monotonic()
        self._trim_idle(now)
        if seat.principal:
            self._used[seat] = now
        sid = self._sessions.get(seat)
        if sid is not None:
            self._keep_alive(seat)
            return sid
        async with self._locks.setdefault(seat.slot, asyncio.Lock()):
            if seat in self._sessions:
                return self._sessions[seat]
            stored = await self.redis.get(self._key(seat)) if seat.principal else None
            if stored is not None:
                sid = stored.decode() if isinstance(stored, bytes) else str(stored)
                self._sessions[seat] = sid
                return sid
            return await self._initialize(wire, seat)

    def _trim_idle(self, now: float) -> None:
        """Forget this replica's copies of principals' sessions unused here for the session TTL
        (looked at every third of it). Principals are unbounded (OAuth), and so would these maps
        be. Nothing in use is lost: a call holds its session id, and the next use reads the
        session back from Redis, where another replica may have kept it alive, or opens a new one."""
        if now - self._trimmed_at < self.session_ttl_s / 3:
            return
        self._trimmed_at = now
        held = {*self._used, *self._sessions, *self._renewed, *self._subscribed}
        for seat in [s for s in held if s.principal and now - self._used.get(s, 0.0) > self.session_ttl_s]:
            self._used.pop(seat, None)
            self._sessions.pop(seat, None)
            self._renewed.pop(seat, None)
            self._subscribed.pop(seat, None)

    def _keep_alive(self, seat: Seat) -> None:
        """Renew the Redis copy of a session in use (at most every third of its TTL), so other
        replicas keep finding it while this one serves from its own copy."""
        now = time.monotonic()
        if not seat.principal or now - self._renewed.get(seat, now) < self.session_ttl_s / 3:
            self._renewed.setdefault(seat, now)
            return
        self._renewed[seat] = now
        task = asyncio.ensure_future(self.redis.expire(self._key(seat), self.session_ttl_s))
        self._cancels.add(task)
        task.add_done_callback(_renewed)
        task.add_done_callback(self._cancels.discard)

    def _key(self, seat: Seat) -> str:
        return keys.proxy_session(seat.principal, f"{self.name}/{seat.slot}")

    async def _initialize(self, wire: Wire, seat: Seat) -> str | None:
        rid = next(self._ids)
        caps = {c: FORWARDED_CAPABILITIES[c] for c in seat.capabilities}
        params = {"protocolVersion": LEGACY_VERSION, "capabilities": caps, "clientInfo": CLIENT_INFO}
        answer = await wire.send(_encode(Request(jsonrpc="2.0", id=rid, method="initialize", params=params)),
                                 {"mcp-protocol-version": LEGACY_VERSION}, rid, NO_HOOKS)
        result = self._result("initialize", answer)
        version = result.get("protocolVersion")
        if version not in HANDSHAKE_VERSIONS:  # it would be sent back as every request's MCP-Protocol-Version
            raise UpstreamFailed(self.name, "protocol", f"upstream {self.name!r} agreed to protocol version "
                                 f"{repr(version)[:80]}, which the gateway does not speak")
        self.legacy_version = version
        sid = answer.headers.get("mcp-session-id")
        await wire.send(_encode(Notification(method="notifications/initialized")), self._session_headers(sid),
                        None, NO_HOOKS)
        if isinstance(wire, StdioWire):
            wire.session_generation = wire.generation
            return None
        if sid is not None:
            self._sessions[seat] = sid
            if seat.principal:  # the gateway's own session (standing stream) stays on this replica
                await self.redis.set(self._key(seat), sid, ex=self.session_ttl_s)
        return sid

    async def _forget_session(self, seat: Seat) -> None:
        self._sessions.pop(seat, None)
        self._renewed.pop(seat, None)
        self._used.pop(seat, None)
        self._subscribed.pop(seat, None)
        if seat.principal:
            await self.redis.delete(self._key(seat))

    # ------------------------------------------------------------------ the standing stream
    def _http(self) -> HttpWire:
        if self.http is None:
            raise TypeError("a stdio upstream speaks over its processes' pipes")
        return self.http

    async def follow(self, hooks: Hooks) -> int:
        """Hold the upstream's notification stream open until it ends (HTTP status returned):
        ``subscriptions/listen`` for list changes on 2026-07-28, the session's GET stream on
        2025-11-25 (a session of the gateway's own, not of a principal). HTTP upstreams only."""
        http = self._http()
        if self.revision is None:
            await self._negotiate(http)
        if self.revision == MODERN_VERSION:
            body, headers, _ = self._listen({"toolsListChanged": True, "resourcesListChanged": True,
                                             "promptsListChanged": True})
            return await http.follow(b"POST", headers, body, hooks)
        seat = Seat("", ALL_FORWARDED)
        status = await http.follow(b"GET", self._session_headers(await self._session(http, seat)), None, hooks)
        if status == 404:
            await self._forget_session(seat)
        return status

    def _listen(self, notifications: dict[str, Any]) -> tuple[bytes, dict[str, str], int]:
        """A 2026-07-28 ``subscriptions/listen`` request: body, headers, request id."""
        meta = {PROTOCOL_VERSION_META_KEY: MODERN_VERSION, CLIENT_CAPABILITIES_META_KEY: {}}
        rid = next(self._ids)
        body = _encode(Request(jsonrpc="2.0", id=rid, method="subscriptions/listen",
                               params={"notifications": notifications, "_meta": meta}))
        return body, {"mcp-protocol-version": MODERN_VERSION, "mcp-method": "subscriptions/listen"}, rid

    async def negotiated(self) -> str:
        """The revision spoken with the upstream (asked once when ``auto``, within ``timeout_s``;
        a stdio upstream is asked through its lists' process)."""
        if self.revision is None:
            async with asyncio.timeout(self.cfg.timeout_s):
                if self.stdio is None:
                    await self._negotiate(self._http())
                else:
                    async with self.stdio.lease(CATALOG) as wire:
                        await self._negotiate(wire)
        return self.revision or LEGACY_VERSION

    async def follow_resources(self, principal: str, uris: list[str], hooks: Hooks) -> int:
        """Hold the stream that carries ``principal``'s resource updates open until it ends: a
        ``subscriptions/listen`` naming ``uris`` on 2026-07-28; on 2025-11-25 the GET stream of
        the principal's session, on which ``uris`` are subscribed first unless they already are."""
        hooks = self.scrubber.hooks(hooks)
        if self.stdio is not None:
            return await self._follow_stdio_resources(self.stdio, principal, uris, hooks)
        http = self._http()
        if await self.negotiated() == MODERN_VERSION:
            body, headers, _ = self._listen({"resourceSubscriptions": uris})
            return await http.follow(b"POST", headers, body, hooks)
        seat = Seat(principal, ALL_FORWARDED)
        sid = await self._session(http, seat)
        # The upstream keeps subscriptions per session, and one that restarted forgot them with the
        # session: what the session in use does not hold is subscribed again before following it.
        async with asyncio.timeout(self.cfg.timeout_s):
            while missing := self._not_subscribed(seat, sid, uris):
                for uri in missing:
                    self._result("resources/subscribe",
                                 await self._legacy(http, seat, "resources/subscribe", {"uri": uri}, NO_HOOKS))
                sid = await self._session(http, seat)
        status = await http.follow(b"GET", self._session_headers(sid), None, hooks)
        if status == 404:  # the upstream lost the session (a restart): the next round opens a new one
            await self._forget_session(seat)
        return status

    def _not_subscribed(self, seat: Seat, sid: str | None, uris: list[str]) -> list[str]:
        held_sid, held = self._subscribed.get(seat, (None, set()))
        return [u for u in uris if u not in held or held_sid != sid]

    def _note_subscription(self, seat: Seat, sid: str | None, method: str, params: dict[str, Any],
                           answer: Answer) -> None:
        """Which URIs an HTTP session holds, from the upstream's answers to ``resources/(un)subscribe``
        on it (see :meth:`follow_resources`)."""
        uri = params.get("uri")
        msg = answer.message or {}
        if answer.status != 200 or not isinstance(msg.get("result"), dict) or not isinstance(uri, str):
            return
        held_sid, held = self._subscribed.get(seat, (sid, set()))
        if held_sid != sid:
            held = set()
        if method == "resources/subscribe":
            held.add(uri)
        else:
            held.discard(uri)
        self._subscribed[seat] = (sid, held)

    async def _follow_stdio_resources(self, pool: StdioPool, principal: str, uris: list[str], hooks: Hooks) -> int:
        """The principal's own process, held (so it is not stopped as idle) while it runs: on
        2026-07-28 a ``subscriptions/listen`` request on it; on 2025-11-25 ``resources/subscribe``
        for each URI on its session, again after each restart. Its updates reach ``hooks`` or the
        pool's notes, both the principal's."""
        modern = await self.negotiated() == MODERN_VERSION
        async with pool.lease(principal) as wire:
            if modern:
                body, headers, rid = self._listen({"resourceSubscriptions": uris})
                wire.streams.add(rid)
                try:
                    self._result("subscriptions/listen", await self._exchange(wire, body, headers, rid, hooks))
                finally:
                    wire.streams.discard(rid)
                return 200
            seat = Seat(principal, ALL_FORWARDED)
            async with asyncio.timeout(self.cfg.timeout_s):
                for uri in uris:
                    self._result("resources/subscribe",
                                 await self._legacy(wire, seat, "resources/subscribe", {"uri": uri}, NO_HOOKS))
            await wire.exited()
            return 200

    # ------------------------------------------------------------------ answers
    def _check_admitted(self, method: str, answer: Answer) -> None:
        """HTTP 401 refuses the gateway's own credential for this upstream, whatever JSON-RPC
        error comes with it: passed on as such, the client would take it for a verdict on its key."""
        if answer.status == 401:
            raise UpstreamFailed(self.name, "unreachable",
                                 f"upstream {self.name!r} refused the gateway's credential for {method} (HTTP 401); "
                                 "check the upstream's headers_from_env / headers_from_file")

    def _result(self, method: str, answer: Answer) -> dict[str, Any]:
        self._check_admitted(method, answer)
        msg = self.scrubber.scrub(answer.message)
        if msg is None:
            if answer.status >= 500 or answer.status in (403, 404):
                raise UpstreamFailed(self.name, "unreachable",
                                     f"upstream {self.name!r} answered {method} with HTTP {answer.status}")
            raise UpstreamFailed(self.name, "protocol",
                                 f"upstream {self.name!r} sent no JSON-RPC answer to {method} "
                                 f"(HTTP {answer.status})")
        error = msg.get("error")
        if isinstance(error, dict):
            raise self._upstream_error(method, error)
        result = msg.get("result")
        if not isinstance(result, dict):
            raise UpstreamFailed(self.name, "protocol", f"upstream {self.name!r} sent a malformed answer to {method}")
        return result

    def _upstream_error(self, method: str, error: dict[str, Any]) -> McpError:
        """The upstream's JSON-RPC error as the client gets it: its own code, message and data,
        except that it cannot speak for the gateway. An error in one of the gateway's own codes
        (overloaded, forbidden, over a limit, upstream failed) becomes -32052 with reason
        ``upstream_error`` and the upstream's error whole in ``data.error``; ``data.upstream``,
        which names the upstream in the gateway's errors, is always the gateway's."""
        code = error.get("code")
        code = code if type(code) is int else INTERNAL_ERROR
        message = str(error.get("message", "upstream error"))
        data = error.get("data")
        if code in GATEWAY_CODES:
            return McpError(UPSTREAM_FAILED, f"upstream {self.name!r} answered {method} with error {code}: {message}",
                            {"upstream": self.name, "reason": "upstream_error", "error": error})
        if isinstance(data, dict) and "upstream" in data:
            data = {**data, "upstream": self.name}
        return McpError(code, message, data)

    async def close(self) -> None:
        for task in self._cancels:
            task.cancel()
        if self.http is not None:
            await self.http.close()
        if self.stdio is not None:
            await self.stdio.close()


def _answer_bound(method: str) -> int:
    """The most one message of the answer to ``method`` may take: a list's page has a bound of its own."""
    return MAX_LIST_ANSWER_BYTES if method in CATALOG_METHODS else MAX_MESSAGE_BYTES


def _renewed(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not renew an upstream session's TTL (%s)", type(future.exception()).__name__)


def _legacy_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` for a 2025-11-25 upstream: without the 2026-07-28 ``_meta`` envelope keys (a
    protocol version there would make the upstream read the request as 2026-07-28)."""
    meta = params.get("_meta")
    if not isinstance(meta, dict) or not any(k.startswith(ENVELOPE_PREFIX) for k in meta):
        return params
    kept = {k: v for k, v in meta.items() if not k.startswith(ENVELOPE_PREFIX)}
    out = {k: v for k, v in params.items() if k != "_meta"}
    if kept:
        out["_meta"] = kept
    return out


def describe_sources(cfg: UpstreamConfig) -> Mapping[str, str]:
    """Which headers carry credentials, and from what kind of source (never the value or its name)."""
    return {**{h: "env" for h in cfg.headers_from_env}, **{h: "file" for h in cfg.headers_from_file}}
