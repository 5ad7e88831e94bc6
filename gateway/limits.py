"""Quotas, rate limits and the teach permission of each principal, shared by every replica.

One principal must not be able to starve the others, or fill a Redis that runs
``noeviction`` and so stop writes for everyone. What each principal may use is
``limits.default``, with ``limits.roles`` and ``limits.principals.<name>`` overriding some fields
(shared/config.py):

- **rates** — MCP messages, ``learn`` samples and ``learn`` bytes — are token buckets in
  Redis (GCRA: one value per bucket, the time at which it would be full again). One call
  of :data:`THROTTLE_LUA` checks every bucket a request needs and takes from all of them or
  from none: one round trip, every key in the principal's slot. A request's check runs on
  the request's way in (:meth:`Limits.admit_request`, from the kernel); a replica takes
  request tokens a few at a time, so most requests cost no round trip. While Redis does not
  answer, each replica enforces the request rate by itself, in memory (:class:`_LocalRates`);
- **open listen streams** and **open event streams** (GET /mcp streams, WebSocket
  connections, server->client requests awaiting a legacy client's answer) are leases in a sorted set per kind that their replica renews, so the streams
  of a replica that died stop counting once their lease runs out;
- **subscriptions per legacy session** are capped by the subscribe script itself
  (gateway/mcp/sessions.py), **requests in flight per WebSocket** by the connection that
  holds them (it lives on one replica), and **the sample log's backlog** by its append
  script (gateway/tools/learning.py);
- **inference calls in flight** (``generate``, ``score``) are counted by each replica in its
  own memory (:meth:`Limits.inference_slot`): what they hold — a context window read from
  Redis, a place in a worker batch, the wait for the answer — is that replica's, so the mesh
  admits at most ``replicas x inference_in_flight`` per principal. A shared count would cost
  every call two round trips and a lease renewed while it runs, and would make inference
  fail while Redis is away, for a bound the worker batches' round-robin already keeps fair.

What each principal may use changes at runtime too: the admin API sets fields of
:class:`PrincipalLimits` for one principal over the config's (:func:`set_override`, in a key of
the principal's slot). A replica keeps each principal's limits in memory (:meth:`Limits.of`, no
round trip) and reads the override again when the control channel says it changed (at once on
every replica), and at the latest ``OVERRIDE_RECHECK_S`` after its last reading (a replica whose
subscription missed the message). While Redis is unreachable the last limits read stay in force.

Going over a limit raises :class:`~gateway.errors.LimitExceeded` (HTTP 429 + Retry-After,
JSON-RPC ``data.retryAfterS``) and counts in ``learnmesh_limit_exceeded_total{limit}``.

Who may teach: ``learning.teachers`` names the principals (``*``: all) whose ``learn``
calls, and samples imported for them by an operator, are accepted; the admin API grants and
revokes over that list at runtime (:func:`set_teacher`), in a key of the principal's slot
that the learn quota's script reads, so the permission costs no round trip of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from gateway.errors import OUTAGE, Forbidden, InvalidParams, LimitExceeded, Unavailable
from shared import keys, metrics
from shared.aio import pause
from shared.config import Config, ConfigError, PrincipalLimits
from shared.log_throttle import ThrottledWarning
from shared.redis_batch import pack_command
from shared.redis_cluster_batch import auto_pipeline
from shared.samples import Sample

log = logging.getLogger(__name__)

THROTTLE_LUA = """
-- KEYS: [the teach flag,] then one bucket per limit, all in the principal's slot.
-- ARGV[1]: '' (no permission to check: every key is a bucket), or the principal's teach
-- permission by the config ('1' / '0'), which a flag in KEYS[1] set by the admin API overrides.
-- Then per bucket: the interval in us between two tokens (1e6 / rate), the burst, this call's cost
-- (negative: give tokens back). A bucket holds the time at which it is full again (us).
-- Returns {1}: taken from every bucket; {0, wait ms, bucket number}: over a limit, nothing
-- taken; {-1}: not permitted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local first = 1
if ARGV[1] ~= '' then
  if (redis.call('GET', KEYS[1]) or ARGV[1]) ~= '1' then return {-1} end
  first = 2
end
local full_at, wait, over = {}, 0, 0
for i = first, #KEYS do
  local a = 2 + (i - first) * 3
  local interval, burst, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local at = math.max(tonumber(redis.call('GET', KEYS[i]) or '0'), now) + cost * interval
  local late = at - now - burst * interval
  if late > wait then wait, over = late, i - first + 1 end
  full_at[i] = at
end
if over > 0 then return {0, math.ceil(wait / 1000), over} end
for i = first, #KEYS do
  local ttl_ms = math.ceil((full_at[i] - now) / 1000)
  if ttl_ms > 0 then
    redis.call('SET', KEYS[i], string.format('%.17g', full_at[i]), 'PX', ttl_ms)
  else
    redis.call('DEL', KEYS[i])
  end
end
return {1}
"""

LEASE_LUA = """
-- KEYS[1]: a principal's leases of one kind (listen streams, event streams). ARGV: lease id, cap, lease ms.
-- Takes a lease (or renews one already held); 0 when the cap is reached.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

LEASE_S = 30.0  # a dead replica's open streams stop counting after this long
_OUTAGE_PAUSE_S = 1.0  # see admit_request
_STOCKS_MAX = 65536  # principals whose request tokens a replica keeps (dropping them only costs round trips)
_CHUNK_S = 0.01  # a replica takes 10 ms of a principal's request rate at a time (at most a quarter burst)
RATE_BUCKETS = ("requests", "learn_samples", "learn_bytes")
OVERRIDE_RECHECK_S = 10.0  # a replica reads a principal's runtime limits again at least this often
_THROTTLE_SHA = hashlib.sha1(THROTTLE_LUA.encode(), usedforsecurity=False).hexdigest()

Refund = Callable[[], Awaitable[None]]


@dataclasses.dataclass(slots=True)
class _Known:
    """A principal's limits as this replica last read them: the config's and its runtime override."""

    limits: PrincipalLimits
    read_at: float  # time.monotonic()
    ticket: int  # which reading: a later one wins, whatever order they finish in


class _Stock:
    """A principal's request tokens on this replica: taken from Redis ahead, or known to be out."""

    __slots__ = ("tokens", "low", "blocked_until", "refill")

    def __init__(self, low: int) -> None:
        self.tokens = 0
        self.low = low  # at this many tokens left the next chunk is fetched, so requests rarely wait
        self.blocked_until = 0.0  # time.monotonic() before which Redis would refuse
        self.refill: asyncio.Future[None] | None = None

    def idle(self) -> bool:
        return self.refill is None or self.refill.done()


class _LocalRates:
    """The request rates this replica enforces by itself while Redis does not answer: a GCRA
    bucket per principal in memory, at the principal's rate and burst. Each replica bounds what
    reaches it, so the mesh admits up to replicas x the limit during an outage, never without
    bound. A bucket is kept across outages (only time refills it), so Redis going away and
    coming back again and again hands out no fresh bursts; it is charged only while Redis is
    away, so it costs nothing while Redis answers."""

    def __init__(self) -> None:
        self._full_at: dict[str, float] = {}  # principal -> time.monotonic() its bucket is full again
        self.engaged = False
        self._engage_log = ThrottledWarning(log)
        self._end_log = ThrottledWarning(log)

    def admit(self, principal: str, lim: PrincipalLimits, now: float) -> None:
        """Take one request token of ``principal`` here, or raise :class:`LimitExceeded` as Redis would."""
        if not self.engaged:
            self.engaged = True
            metrics.LIMITS_LOCAL_FALLBACK.set(1)
            self._engage_log.warning("redis unreachable: request rate limits enforced by each replica for "
                                     "itself (the mesh admits up to replicas x each limit)")
        interval = 1 / lim.requests_per_s
        at = max(self._full_at.get(principal, now), now) + interval
        late = at - now - lim.requests_burst * interval
        if late > 0:
            raise exceeded("requests", _too_many_requests(lim), max(1, math.ceil(late)))
        if principal not in self._full_at and len(self._full_at) >= _STOCKS_MAX:
            for idle in [p for p, full_at in self._full_at.items() if full_at <= now] or list(self._full_at):
                del self._full_at[idle]  # a full bucket is what a principal not in the table gets
        self._full_at[principal] = at

    def redis_answers(self) -> None:
        if self.engaged:
            self.engaged = False
            metrics.LIMITS_LOCAL_FALLBACK.set(0)
            self._end_log.warning("redis answers again: request rate limits checked in redis again")


def _too_many_requests(lim: PrincipalLimits) -> str:
    return f"Too many requests: at most {lim.requests_per_s:g} per second (bursts of {lim.requests_burst})"


def _background(refill: Awaitable[None]) -> asyncio.Future[None]:
    """A refill that requests may await; its failure is theirs to see (or logged by the next one)."""
    future = asyncio.ensure_future(refill)
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


def _chunk(lim: PrincipalLimits) -> int:
    return max(1, min(lim.requests_burst // 4, int(lim.requests_per_s * _CHUNK_S)))


def _interval_us(rate_per_s: float) -> str:
    return "%.17g" % (1e6 / rate_per_s)


def _retry_after_s(wait_ms: int) -> int:
    return max(1, math.ceil(wait_ms / 1000))


def exceeded(limit: str, message: str, retry_after_s: int) -> LimitExceeded:
    """The error for a principal over ``limit``, counted in the metrics."""
    metrics.LIMIT_EXCEEDED.labels(limit).inc()
    return LimitExceeded(limit, message, retry_after_s)


class Limits:
    """One replica's view of the limits (``Gateway.limits``)."""

    def __init__(self, redis: aioredis.Redis, cfg: Config) -> None:
        self.redis = redis
        self.cfg = cfg.limits
        self.teachers = frozenset(cfg.learning.teachers)
        self.teacher_roles = frozenset(cfg.learning.teacher_roles)
        self._configured = {name: cfg.limits.of(name) for name in {*cfg.limits.principals, *cfg.limits.principal_roles}}
        self._known: dict[str, _Known] = {}
        self._reading: dict[str, asyncio.Future[None]] = {}
        self._tickets = 0
        self._batch = auto_pipeline(redis)
        self._stocks: dict[str, _Stock] = {}
        self._outage_until = 0.0
        self._local = _LocalRates()
        self._lease = redis.register_script(LEASE_LUA)
        self._inference: dict[str, int] = {}  # principal -> its generate/score calls in flight here
        self.waits_max = cfg.redis.max_connections  # the blocking pool's size (gateway/app.py)
        self.waits_held = 0  # event streams open here, each holding a connection of that pool

    async def aclose(self) -> None:
        """Stop the override reads under way and let go of the batches' connections: before
        the Redis client closes."""
        reading = list(self._reading.values())
        for fut in reading:
            fut.cancel()
        await asyncio.gather(*reading, return_exceptions=True)
        await self._batch.aclose()

    def by_config(self, principal: str) -> PrincipalLimits:
        """The limits the config gives ``principal``: default, its role's, then its own."""
        return self._configured.get(principal, self.cfg.default)

    def of(self, principal: str) -> PrincipalLimits:
        """The limits in force for ``principal`` on this replica, with no round trip: the
        config's with the runtime override as last read (read again in the background once
        ``OVERRIDE_RECHECK_S`` old). A principal not read yet has the config's until its reading
        is in; the async entry points (:meth:`current`) wait for that first reading."""
        known = self._known.get(principal)
        if known is None or time.monotonic() - known.read_at >= OVERRIDE_RECHECK_S:
            self._read_soon(principal)
        return self.by_config(principal) if known is None else known.limits

    async def current(self, principal: str) -> PrincipalLimits:
        """:meth:`of`, after the first reading of a principal this replica has not read yet
        (one round trip; skipped while Redis is known to be unreachable), so a principal whose
        limits were lowered cannot use the config's on a replica that just started."""
        if principal not in self._known and time.monotonic() >= self._outage_until:
            await asyncio.shield(self._read_soon(principal))
        return self.of(principal)

    async def refresh(self, principal: str) -> PrincipalLimits:
        """Read ``principal``'s override now; the limits in force after it."""
        await asyncio.shield(self._read_soon(principal, again=True))
        return self.of(principal)

    def changed(self, principal: str) -> None:
        """The admin API changed ``principal``'s override (the control channel says so): read it
        again now, whatever reading is under way (it may predate the change)."""
        if principal in self._known or principal in self._reading:
            self._read_soon(principal, again=True)

    def recheck_all(self) -> None:
        """Read every known principal's override again at its next request (control messages
        may have been missed)."""
        for known in self._known.values():
            known.read_at = -math.inf

    def _read_soon(self, principal: str, again: bool = False) -> asyncio.Future[None]:
        reading = self._reading.get(principal)
        if reading is None or again:
            self._tickets += 1
            reading = self._reading[principal] = _background(self._read(principal, self._tickets))

            def forget(done: asyncio.Future[None]) -> None:
                if self._reading.get(principal) is done:
                    del self._reading[principal]

            reading.add_done_callback(forget)
        return reading

    async def _read(self, principal: str, ticket: int) -> None:
        """Read ``principal``'s override; a Redis that does not answer leaves the last limits read
        in force (the config's for a principal never read), and is asked again after ``_OUTAGE_PAUSE_S``."""
        try:
            limits = self.with_override(principal, parse_override(await self.redis.get(keys.limit_override(principal))))
            read_at = time.monotonic()
        except (RedisError, OSError) as exc:
            if isinstance(exc, OUTAGE):
                self._outage_until = time.monotonic() + _OUTAGE_PAUSE_S
            log.warning("could not read the runtime limits of %r (%s); the last read stay in force",
                        principal, type(exc).__name__)
            known = self._known.get(principal)
            limits = self.by_config(principal) if known is None else known.limits
            read_at = time.monotonic() - OVERRIDE_RECHECK_S + _OUTAGE_PAUSE_S
        known = self._known.get(principal)
        if known is not None and known.ticket > ticket:
            return
        if known is None and len(self._known) >= _STOCKS_MAX:
            self._known.clear()  # costs each principal one round trip, at its next request
        if known is not None and known.limits != limits:
            self._stocks.pop(principal, None)  # its chunk and its wait were the old rate's
        self._known[principal] = _Known(limits, read_at, ticket)

    def with_override(self, principal: str, fields: dict[str, Any]) -> PrincipalLimits:
        """The config's limits of ``principal`` with ``fields`` over them; a stored override the
        config no longer takes is ignored (logged), never half applied."""
        base = self.by_config(principal)
        if not fields:
            return base
        try:
            return PrincipalLimits(**{**dataclasses.asdict(base), **fields})
        except (ConfigError, TypeError) as exc:
            log.error("ignoring the runtime limits of %r: %s", principal, exc)
            return base

    def sources(self, principal: str, fields: dict[str, Any]) -> dict[str, str]:
        """Where each limit of ``principal`` comes from: ``default``, ``role`` (``limits.roles``),
        ``principal`` (``limits.principals``) or ``runtime`` (the admin API's ``fields``)."""
        role = self.cfg.roles.get(self.cfg.principal_roles.get(principal, ""), {})
        own = self.cfg.principals.get(principal, {})
        return {f.name: ("runtime" if f.name in fields else "principal" if f.name in own
                         else "role" if f.name in role else "default")
                for f in dataclasses.fields(PrincipalLimits)}

    def teaches_by_config(self, principal: str) -> bool:
        return ("*" in self.teachers or principal in self.teachers
                or self.cfg.principal_roles.get(principal) in self.teacher_roles)

    # ------------------------------------------------------------------ token buckets
    async def _throttle(self, names: list[str], args: list[str | int]) -> Any:
        """The throttle script on the master of ``names``' slot (EVALSHA). A master without it (a
        replica promoted by a failover: script caches are not replicated; a master restarted or
        added) gets the script itself once (EVAL, which also caches it there), sent wherever the
        EVALSHA went, so a slot map that has not caught up with the failover yet cannot send
        it to another node."""
        try:
            return await self._batch.submit(pack_command(("EVALSHA", _THROTTLE_SHA, len(names), *names, *args)),
                                            names[0])
        except NoScriptError:
            return await self._batch.submit(pack_command(("EVAL", THROTTLE_LUA, len(names), *names, *args)),
                                            names[0])

    async def admit_request(self, principal: str) -> None:
        """Take one token of the principal's request rate, or raise :class:`LimitExceeded`.

        Most calls cost no round trip: a replica takes the principal's tokens from Redis a few
        at a time (``_chunk``) and hands them out here, and once Redis says the bucket is empty
        it refuses locally until the wait Redis named is over (nothing but time refills a
        bucket); the next chunk is fetched while half of one is left, so requests rarely wait
        for it. All replicas together so admit at most two chunks (20 ms of the rate) more per
        replica than the bucket holds. While Redis is unreachable (asked again every
        ``_OUTAGE_PAUSE_S``) this replica bounds the principal by itself (:class:`_LocalRates`)
        at the same rate and burst, so an outage, or an attacker who can slow Redis down, never
        lifts the limit: the mesh then admits up to replicas x the limit."""
        lim = await self.current(principal)
        if not lim.requests_per_s:
            return
        stock = self._stocks.get(principal)
        if stock is None:
            if len(self._stocks) >= _STOCKS_MAX:
                self._stocks.clear()
            chunk = _chunk(lim)
            stock = self._stocks[principal] = _Stock(chunk // 2 if chunk > 1 else -1)  # -1: one at a time
        while True:
            if stock.tokens > 0:
                stock.tokens -= 1
                if stock.tokens <= stock.low and stock.idle() and time.monotonic() >= stock.blocked_until:
                    stock.refill = _background(self._refill(principal, lim, stock))  # before it runs out
                return
            now = time.monotonic()
            if now < stock.blocked_until:
                raise exceeded("requests", _too_many_requests(lim), max(1, math.ceil(stock.blocked_until - now)))
            if now < self._outage_until:
                self._local.admit(principal, lim, now)
                return
            refill = stock.refill
            if refill is None or refill.done():
                refill = stock.refill = _background(self._refill(principal, lim, stock))
            await asyncio.shield(refill)

    async def _refill(self, principal: str, lim: PrincipalLimits, stock: _Stock) -> None:
        """Take up to a chunk of tokens (one if no more are left), or learn how long to wait."""
        key, interval = keys.limit_bucket(principal, "requests"), _interval_us(lim.requests_per_s)
        chunk = _chunk(lim)
        try:
            for cost in (chunk, 1) if chunk > 1 else (1,):
                reply = await self._throttle([key], ["", interval, lim.requests_burst, cost])
                self._local.redis_answers()
                if reply[0] == 1:
                    stock.tokens += cost
                    return
            stock.blocked_until = time.monotonic() + reply[1] / 1000
        except OUTAGE:
            self._outage_until = time.monotonic() + _OUTAGE_PAUSE_S

    async def admit_learn(self, principal: str, samples: list[Sample]) -> Refund:
        """Check that ``principal`` may teach and take ``samples``' count and bytes from its learn
        quota, in one script call. Returns what gives the tokens back (the samples were not
        written after all). Raises :class:`Forbidden` or :class:`LimitExceeded`."""
        lim = await self.current(principal)
        nbytes = sum(len(s.to_json()) for s in samples)
        buckets: list[tuple[str, float, int, int]] = []
        for name, rate, burst, cost, unit in (
                ("learn_samples", lim.learn_samples_per_s, lim.learn_samples_burst, len(samples), "samples"),
                ("learn_bytes", lim.learn_bytes_per_s, lim.learn_bytes_burst, nbytes, "bytes")):
            if not rate:
                continue
            if cost > burst:
                raise InvalidParams(f"this call carries {cost} {unit}, more than the {burst} a principal may "
                                    "send at once; split it into smaller calls", {"limit": name})
            buckets.append((name, rate, burst, cost))
        verdict = "1" if self.teaches_by_config(principal) else "0"
        reply = await self._run_buckets(principal, buckets, verdict)
        if reply[0] == -1:
            raise self.forbidden(principal)
        if reply[0] == 0:
            name, rate, burst, _ = buckets[reply[2] - 1]
            unit = "samples" if name == "learn_samples" else "bytes"
            raise exceeded(name, f"learn quota reached: at most {rate:g} {unit} per second (bursts of {burst})",
                           _retry_after_s(reply[1]))

        async def refund() -> None:
            if not buckets:
                return
            try:
                await self._run_buckets(principal, [(n, r, b, -c) for n, r, b, c in buckets], "")
            except (RedisError, OSError):
                log.warning("could not give back the learn quota of a refused call")

        return refund

    async def _run_buckets(self, principal: str, buckets: list[tuple[str, float, int, int]], verdict: str) -> Any:
        names = [keys.teacher_grant(principal)] if verdict else []
        args: list[str | int] = [verdict]
        for name, rate, burst, cost in buckets:
            names.append(keys.limit_bucket(principal, name))
            args += [_interval_us(rate), burst, cost]
        return await self._throttle(names, args)

    # ------------------------------------------------------------------ the teach permission
    def forbidden(self, principal: str) -> Forbidden:
        metrics.LEARN_FORBIDDEN.inc()
        return Forbidden(f"principal {principal!r} may not teach this model: learn needs the teach "
                         "permission, which an admin grants", "teach")

    async def may_teach(self, principal: str) -> bool:
        """The permission in force: the admin API's grant or revoke, else ``learning.teachers``."""
        flag = await self.redis.get(keys.teacher_grant(principal))
        if flag is None:
            return self.teaches_by_config(principal)
        return flag in (b"1", "1")

    async def check_teacher(self, principal: str) -> None:
        if not await self.may_teach(principal):
            raise self.forbidden(principal)

    # ------------------------------------------------------------------ inference in flight
    @contextlib.contextmanager
    def inference_slot(self, principal: str) -> Iterator[None]:
        """Hold one of the principal's ``inference_in_flight`` on this replica for the life of a
        ``generate`` or ``score`` call, however it ends (answer, error, cancel, disconnect). One
        principal's hundreds of concurrent calls would otherwise fill every worker batch and this
        replica's memory; fairness among principals only bounds how long the others wait."""
        cap = self.of(principal).inference_in_flight
        held = self._inference.get(principal, 0)
        if cap and held >= cap:
            raise exceeded("inference_in_flight", f"at most {cap} generate/score calls may be in flight at once "
                           "(on this gateway replica): wait for one to end", self.cfg.cap_retry_after_s)
        self._inference[principal] = held + 1
        try:
            yield
        finally:
            left = self._inference[principal] - 1
            if left:
                self._inference[principal] = left
            else:
                del self._inference[principal]  # principals without calls in flight cost nothing

    # ------------------------------------------------------------------ open streams
    @contextlib.asynccontextmanager
    async def listen_slot(self, principal: str) -> AsyncIterator[None]:
        """Hold one of the principal's ``listen_streams`` for the life of a listen stream."""
        async with self._slot(keys.listen_leases(principal), (await self.current(principal)).listen_streams,
                              "listen_streams",
                              "subscriptions/listen streams"):
            yield

    @contextlib.asynccontextmanager
    async def stream_slot(self, principal: str) -> AsyncIterator[None]:
        """Hold one of the principal's ``event_streams`` for the life of a GET /mcp stream, a
        WebSocket connection or a wait for a 2025-11-25 client's answer to a server->client
        request. Each holds a connection of its replica's blocking pool (``redis.max_connections``
        of them, for these waits alone) all the while: without a cap, one principal could take
        the pool and stop every other principal's streams and server->client requests. Nor may
        all principals together hold more than the pool has: a stream opened past it would find
        no connection and end at once (its client reconnecting in a loop), so it is refused with
        503 + Retry-After instead, and the replica's other requests are never in its way."""
        if self.waits_held >= self.waits_max:
            metrics.LIMIT_EXCEEDED.labels("replica_event_streams").inc()
            raise Unavailable(f"this gateway replica holds {self.waits_max} event streams and server requests "
                              "awaiting an answer, as many as its redis.max_connections; retry later",
                              self.cfg.cap_retry_after_s)
        self.waits_held += 1
        try:
            async with self._slot(keys.stream_leases(principal), (await self.current(principal)).event_streams,
                                  "event_streams",
                                  "event streams (GET /mcp streams, WebSocket connections, server requests "
                                  "awaiting an answer)"):
                yield
        finally:
            self.waits_held -= 1

    @contextlib.asynccontextmanager
    async def _slot(self, key: str, cap: int, limit: str, what: str) -> AsyncIterator[None]:
        """Hold a lease in ``key`` (at most ``cap`` at once, over every replica; 0: no cap)."""
        if not cap:
            yield
            return
        lease, lease_ms = uuid.uuid4().hex, int(LEASE_S * 1000)
        if not await self._lease(keys=[key], args=[lease, cap, lease_ms]):
            raise exceeded(limit, f"at most {cap} {what} may be open at once", self.cfg.cap_retry_after_s)
        renewal = asyncio.create_task(self._renew(key, lease, cap, lease_ms))
        try:
            yield
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
            try:
                await self.redis.zrem(key, lease)
            except (RedisError, OSError):
                pass  # the lease runs out by itself

    async def _renew(self, key: str, lease: str, cap: int, lease_ms: int) -> None:
        while True:
            await pause(LEASE_S / 3)
            try:
                await self._lease(keys=[key], args=[lease, cap, lease_ms])
            except (RedisError, OSError):
                log.warning("could not renew an open stream's lease; retrying")


async def set_teacher(redis: aioredis.Redis, principal: str, teach: bool, by: str) -> None:
    """Grant (``teach``) or revoke the teach permission of ``principal`` on every replica, over
    whatever ``learning.teachers`` says."""
    record = json.dumps({"teach": teach, "by": by, "ts_ms": int(time.time() * 1000)})
    pipe = redis.pipeline(transaction=False)
    pipe.set(keys.teacher_grant(principal), "1" if teach else "0")
    pipe.hset(keys.TEACHER_GRANTS, principal, record)
    await pipe.execute()


async def teacher_grants(redis: aioredis.Redis) -> dict[str, dict[str, Any]]:
    """Every runtime grant and revoke: principal -> {teach, by, ts_ms}."""
    raw = await redis.hgetall(keys.TEACHER_GRANTS)
    out: dict[str, dict[str, Any]] = {}
    for name, record in (raw or {}).items():
        out[name.decode() if isinstance(name, bytes) else str(name)] = json.loads(record)
    return out


def parse_override(raw: Any) -> dict[str, Any]:
    """The fields of a stored override (``keys.limit_override``); {} for none, or for a record
    no admin API wrote (logged: the config's limits hold rather than a request failing)."""
    if raw is None:
        return {}
    with contextlib.suppress(ValueError, KeyError, TypeError):
        fields = json.loads(raw)["limits"]
        if isinstance(fields, dict):
            return fields
    log.error("ignoring a malformed runtime limits record: %r", raw[:200])
    return {}


def override_record(fields: dict[str, Any], by: str) -> str:
    return json.dumps({"limits": fields, "by": by, "ts_ms": int(time.time() * 1000)}, sort_keys=True)


async def read_override(redis: aioredis.Redis, principal: str) -> dict[str, Any] | None:
    """``principal``'s runtime override as stored: {limits, by, ts_ms}, or None."""
    raw = await redis.get(keys.limit_override(principal))
    return None if raw is None else dict(json.loads(raw))


async def set_override(redis: aioredis.Redis, principal: str, fields: dict[str, Any], by: str) -> None:
    """Set ``principal``'s limits ``fields`` over the config's, on every replica (the caller
    tells them on the control channel); ``fields`` are validated already. The principal's rate
    buckets start full: a bucket holds the time it is full again, which the old rate set (a
    principal slowed to one request an hour and then restored would otherwise still wait hours)."""
    record = override_record(fields, by)
    pipe = redis.pipeline(transaction=False)
    pipe.set(keys.limit_override(principal), record)
    pipe.delete(*(keys.limit_bucket(principal, name) for name in RATE_BUCKETS))
    pipe.hset(keys.LIMIT_OVERRIDES, principal, record)
    await pipe.execute()


async def clear_override(redis: aioredis.Redis, principal: str) -> None:
    """Back to the config's limits for ``principal`` (its rate buckets full, as for a change)."""
    pipe = redis.pipeline(transaction=False)
    pipe.delete(keys.limit_override(principal), *(keys.limit_bucket(principal, name) for name in RATE_BUCKETS))
    pipe.hdel(keys.LIMIT_OVERRIDES, principal)
    await pipe.execute()


async def overrides(redis: aioredis.Redis) -> dict[str, dict[str, Any]]:
    """Every runtime override: principal -> {limits, by, ts_ms}."""
    raw = await redis.hgetall(keys.LIMIT_OVERRIDES)
    return {(name.decode() if isinstance(name, bytes) else str(name)): json.loads(record)
            for name, record in (raw or {}).items()}
