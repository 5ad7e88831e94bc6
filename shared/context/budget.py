"""The global byte budget over all principals (``context.global_budget_bytes``), with LRU over
principals, in sharded accounting keys: every principal belongs to one of
``keys.CTX_GLOBAL_SHARDS`` shards (each its own hash tag, so the shards spread over a
cluster's masters), with the bytes each principal holds and their sum (``\\0total``) in the
shard's hash, its last use (ms) in the shard's LRU.

- One server: the context script keeps them, in the same call (the store passes the
  principal's shard keys along with its own: shared/context/scripts.py). A call adds its byte
  change to the principal's field and to the total, and stamps the principal's use when its
  last stamp is ``global_lru_resolution_ms`` old (that stamp's time is kept with the
  principal's state). The store sends nothing beside its script calls.
- Cluster: a script touches one principal's slot, so the store keeps them beside the calls.
  A script call that changes the principal's bytes returns the change; the store adds it to
  the principal's field and to the shard's total (HINCRBY, summed over what one event-loop
  turn reported, riding along with the next pipelined batch: no caller waits for them).
  Increments commute, so replicas reporting in any order agree. The store stamps a
  principal's use in its shard's LRU (one ZADD per shard for what one event-loop turn
  stamped, in the next pipelined batch), at most once per ``global_lru_resolution_ms`` per
  principal and store.
- Enforcement: :class:`GlobalEvictor` (one per gateway; one at a time holds the lease) sums
  the shard totals every ``global_evict_interval_s``; while over budget it takes the least
  recently stamped principals whose reported bytes cover the excess and evicts them, at once,
  each whole through its own script (``evict_principal``: all of its contexts or none),
  skipping one stamped again since the evictor read the LRU; an evicted principal's report
  goes with it (so a report left high by a read's idle expiry, or by Redis expiring the
  principal's keys, is cleared then), and it moves from the LRU to ``ctx_global_seen`` — in
  its script call on one server, in the evictor's writes after it on a cluster.

So the total can exceed the budget between sweeps: by at most what every gateway appends in
one interval (docs/context.md has the measured figure), never by a half-evicted context.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from shared import keys, metrics
from shared.aio import pause
from shared.config import ContextConfig
from shared.redis_batch import pack_command
from shared.redis_client import AsyncRedis, Reach, read_within
from shared.text import as_str

if TYPE_CHECKING:
    from shared.context.scripts import ContextScript

log = logging.getLogger(__name__)

TOTAL = b"\x00total"
_STAMPS_MAX = 65536  # principals whose last stamp a store remembers (then it forgets them all)
_CANDIDATES = 64  # least recently used principals read per shard per sweep page


async def _skipped() -> tuple[int, int]:
    return -1, 0


class GlobalAccounts:
    """The sharded accounting keys as one store writes and reads them."""

    def __init__(self, redis: AsyncRedis, script: ContextScript, cfg: ContextConfig,
                 clock_ms: Callable[[], int]) -> None:
        self.redis = redis
        self._script = script
        self.inline = script.inline  # the script keeps the accounting (one server): nothing to send
        self._batch = script.batch
        self._resolution_ms = cfg.global_lru_resolution_ms
        self._clock_ms = clock_ms
        self._stamped: dict[str, int] = {}  # principal -> ms this store last stamped it
        self._unsettled: set[asyncio.Future[Any]] = set()  # posted writes not yet answered
        self.posted = 0  # commands posted beside script calls (the bench divides by operations)
        self._stamps_due: dict[int, dict[str, int]] = {}  # shard -> principal -> ms, not yet sent
        self._bytes_due: dict[int, dict[str, int]] = {}  # shard -> principal -> byte change, not yet sent
        self._flush_scheduled = False

    def stamp(self, principal: str) -> None:
        """The principal was used now: its place in the global LRU (see module docstring)."""
        if self.inline:
            return
        now = self._clock_ms()
        last = self._stamped.get(principal)
        if last is not None and 0 <= now - last < self._resolution_ms:
            return
        if len(self._stamped) >= _STAMPS_MAX:
            self._stamped.clear()
        self._stamped[principal] = now
        self._stamps_due.setdefault(keys.ctx_global_shard(principal), {})[principal] = now
        self._due()

    def report(self, principal: str, delta: int) -> None:
        """The principal's bytes changed by ``delta`` (a script call's reply)."""
        if delta and not self.inline:
            shard = self._bytes_due.setdefault(keys.ctx_global_shard(principal), {})
            shard[principal] = shard.get(principal, 0) + delta
            self._due()

    def _due(self) -> None:
        """What this loop turn stamped and reported goes out together, on the next turn: one
        ZADD per shard for the stamps, one HINCRBY per principal and one per shard total for
        the bytes (with 64 callers, a few commands for dozens of calls)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        stamps, self._stamps_due = self._stamps_due, {}
        changes, self._bytes_due = self._bytes_due, {}
        for shard, members in stamps.items():
            lru = keys.ctx_global_lru(shard)
            # GT: a stamp only moves forward, so two posted stamps that reach Redis out of
            # order (one waited for the cluster's slot map, the next did not) keep the newer.
            self._post(pack_command(("ZADD", lru, "GT", *[x for p, ms in members.items() for x in (ms, p)])), lru)
        for shard, deltas in changes.items():
            gb = keys.ctx_global_bytes(shard)
            for who, delta in deltas.items():
                if delta:
                    self._post(pack_command(("HINCRBY", gb, who, delta)), gb)
            total = sum(deltas.values())
            if total:
                self._post(pack_command(("HINCRBY", gb, TOTAL, total)), gb)

    def _post(self, packed: bytes, key: str) -> None:
        self.posted += 1
        fut = self._batch.post(packed, key)
        self._unsettled.add(fut)
        fut.add_done_callback(self._unsettled.discard)

    async def settled(self) -> None:
        """Until every stamp and report this store made has been written (its own reads see them)."""
        if self._flush_scheduled:
            self._flush()
        if self._unsettled:
            await asyncio.gather(*list(self._unsettled), return_exceptions=True)

    async def total(self, reach: Reach | None = None) -> int:
        """Bytes held by all principals, as reported (``reach``: of the shards whose master answers)."""
        await self.settled()
        got = await asyncio.gather(*[read_within(reach, keys.ctx_global_bytes(k),
                                                 partial(self.redis.hget, keys.ctx_global_bytes(k), TOTAL), None)
                                     for k in range(keys.CTX_GLOBAL_SHARDS)])
        return sum(int(v or 0) for v in got)

    async def _stamps(self, key: Callable[[int], str], count: int = -1,
                      reach: Reach | None = None) -> list[tuple[int, str, int]]:
        """(stamp ms, principal, shard) from every shard's sorted set ``key(shard)``: the
        ``count`` oldest of each (-1: all)."""
        await self.settled()
        redis: Any = self.redis
        shards: list[Any] = await asyncio.gather(*[read_within(reach, key(k), partial(
            redis.zrange, key(k), 0, count if count < 0 else count - 1, withscores=True), [])
            for k in range(keys.CTX_GLOBAL_SHARDS)])
        return [(int(score), as_str(p), k) for k, shard in enumerate(shards) for p, score in shard]

    async def principals(self, reach: Reach | None = None) -> list[str]:
        """Principals that hold contexts, most recently used first (``reach``: of the shards
        whose master answers)."""
        stamps = await self._stamps(keys.ctx_global_lru, reach=reach)
        return [p for _, p, _ in sorted(stamps, reverse=True)]  # the evictor's order, reversed

    async def seen(self) -> list[tuple[str, int]]:
        """(principal, ms of its last stamp) of every principal ever stamped, newest first."""
        last: dict[str, int] = {}
        for t, p, _ in [*await self._stamps(keys.ctx_global_lru), *await self._stamps(keys.ctx_global_seen)]:
            last[p] = max(t, last.get(p, t))
        return sorted(last.items(), key=lambda pt: (-pt[1], pt[0]))

    async def sweep(self, budget_bytes: int) -> list[str]:
        """Evict least recently used principals until the reported total fits ``budget_bytes``;
        returns the principals evicted (those that held contexts)."""
        total = await self.total()
        done: list[str] = []
        while total > budget_bytes:
            candidates = sorted(await self._stamps(keys.ctx_global_lru, _CANDIDATES))
            if not candidates:
                break
            reported = await self._reported(candidates)
            chosen, excess = [], total - budget_bytes
            for (stamp, who, shard), held in zip(candidates, reported, strict=True):
                if excess <= 0:
                    break
                chosen.append((stamp, who, shard, held))
                excess -= held
            outcomes = await self._evict(chosen)
            total -= sum(freed for freed, _ in outcomes)
            done += [c[1] for c, (_, evicted) in zip(chosen, outcomes, strict=True) if evicted]
            if not any(freed or evicted for freed, evicted in outcomes):
                break  # every one was used again meanwhile: the next sweep sees the new order
        return done

    async def _reported(self, candidates: list[tuple[int, str, int]]) -> list[int]:
        """The reported bytes of each candidate (one HMGET per shard)."""
        by_shard: dict[int, list[str]] = {}
        for _, who, shard in candidates:
            by_shard.setdefault(shard, []).append(who)
        shards = list(by_shard)
        got = await asyncio.gather(*[self.redis.hmget(keys.ctx_global_bytes(k), by_shard[k]) for k in shards])
        held = {(k, who): int(v or 0) for k, vals in zip(shards, got, strict=True)
                for who, v in zip(by_shard[k], vals, strict=True)}
        return [held[(shard, who)] for _, who, shard in candidates]

    async def _evict(self, chosen: list[tuple[int, str, int, int]]) -> list[tuple[int, bool]]:
        """Evict the chosen principals, each whole through its own script (the calls share
        pipelined round trips), unless stamped again since the evictor read the LRU: per
        principal (the reported bytes that left the total, whether it held contexts). A
        principal's report is cleared whatever it was (a report left high by an unreported idle
        expiry, or keys Redis expired, goes with it): by its script on one server (which
        answers the report it cleared), else by a few commands per shard after the calls."""
        by_shard: dict[int, list[tuple[int, str, int]]] = {}
        for stamp, who, shard, reported in chosen:
            by_shard.setdefault(shard, []).append((stamp, who, reported))
        shards = list(by_shard)
        scores = await asyncio.gather(*[self.redis.zmscore(keys.ctx_global_lru(k), [w for _, w, _ in by_shard[k]])
                                        for k in shards])
        still = {(k, who) for k, got in zip(shards, scores, strict=True)
                 for (stamp, who, _), score in zip(by_shard[k], got, strict=True)
                 if score is not None and int(score) == stamp}
        now = self._clock_ms()
        replies = await asyncio.gather(*[self._script.call("evict_principal", who, now, "global_budget")
                                         if (shard, who) in still else _skipped()
                                         for _, who, shard, _ in chosen])
        out: list[tuple[int, bool]] = []
        gone: dict[int, list[tuple[str, int]]] = {}
        for (_, who, shard, reported), (n, freed, *cleared) in zip(chosen, replies, strict=True):
            if n < 0:  # stamped again, or used in the last moment
                out.append((0, False))
                continue
            if cleared:  # settled by the script
                reported = int(cleared[0])
            else:
                gone.setdefault(shard, []).append((who, reported))
            out.append((reported, n > 0))
            if n:
                metrics.CONTEXT_EVICTIONS.labels("global_budget").inc(n)
                log.info("context: evicted principal %s (%d contexts, %d bytes) for the global budget", who, n, freed)
        await asyncio.gather(*[self._settle_shard(k, members, now) for k, members in gone.items()])
        return out

    async def _settle_shard(self, shard: int, members: list[tuple[str, int]], now: int) -> None:
        """The evicted principals of one shard: reports cleared, out of the LRU, into ``seen``
        (their audit streams just got the eviction's records); their next use stamps them again."""
        gb = keys.ctx_global_bytes(shard)
        total = sum(reported for _, reported in members)
        await asyncio.gather(*[self._batch.submit(pack_command(("HINCRBY", gb, name, -n)), gb)  # shared round trips
                               for name, n in [*members, (TOTAL, total)] if n])
        for who, _ in members:
            self._stamped.pop(who, None)
        await self.redis.zadd(keys.ctx_global_seen(shard), {who: now for who, _ in members})
        await self.redis.zrem(keys.ctx_global_lru(shard), *[who for who, _ in members])

class GlobalEvictor:
    """The background task that enforces the global budget (see module docstring). Every
    gateway runs one; the lease (``keys.CTX_EVICTOR_LEASE``) lets one sweep at a time, so two
    replicas never both evict for the same excess."""

    def __init__(self, accounts: GlobalAccounts, cfg: ContextConfig, *, owner: str | None = None) -> None:
        self.accounts = accounts
        self.budget_bytes = cfg.global_budget_bytes
        self.interval_s = cfg.global_evict_interval_s
        self.owner = owner or os.urandom(8).hex()
        self.sweeps = 0

    async def sweep_once(self) -> list[str]:
        """One sweep if this replica holds (or takes) the lease; [] otherwise."""
        if not await self._lease():
            return []
        self.sweeps += 1
        return await self.accounts.sweep(self.budget_bytes)

    async def run(self) -> None:
        """Sweep every interval until cancelled; a Redis outage is logged and waited out."""
        while True:
            try:
                await self.sweep_once()
            except (RedisError, OSError) as exc:
                log.warning("context: global budget sweep failed: %s", exc)
            except Exception:  # a sweep that breaks must not end the budget's enforcement
                log.exception("context: global budget sweep failed")
            await pause(self.interval_s)

    async def _lease(self) -> bool:
        redis: Any = self.accounts.redis
        ttl_ms = int(self.interval_s * 3000) + 1000
        if await redis.set(keys.CTX_EVICTOR_LEASE, self.owner, nx=True, px=ttl_ms):
            return True
        if as_str(await redis.get(keys.CTX_EVICTOR_LEASE) or b"") == self.owner:
            await redis.pexpire(keys.CTX_EVICTOR_LEASE, ttl_ms)
            return True
        return False
