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
  A script call that changes the principal's bytes returns the change; the store adds what
  one event-loop turn reported to the principals' fields and their sum to the shard's total
  in one step (one small script per shard, riding along with the next pipelined batch: no
  caller waits for it), so a shard's total is always the sum of its reports. Increments
  commute, so replicas reporting in any order agree. The store stamps a principal's use in
  its shard's LRU (one ZADD per shard for what one event-loop turn stamped, in the next
  pipelined batch), at most once per ``global_lru_resolution_ms`` per principal and store;
  a stamp its shard's master did not take (down, failing over) is posted again at the
  evictor's next interval (a stamp only moves forward, so twice is harmless).
- Failover (cluster): reports posted to a master that is down, in flight when it dies, or
  taken by it but not yet on the replica that succeeds it are lost, and reads report nothing
  of the idle contexts they expire. So the evictor also sets reports right
  (:meth:`GlobalAccounts.reconcile`): each sweep it reads a page of every shard's principals
  and makes the report of each whose bytes last changed ``settle`` ago (its state keeps the
  time, ``\\0ch``) what its state holds (``\\0bytes``): by then every report of an earlier
  change has reached the shard or is lost, and none of a later one is under way.
- Enforcement: :class:`GlobalEvictor` (one per gateway; one at a time holds the lease) sums
  the shard totals every ``global_evict_interval_s``; while over budget it takes the least
  recently stamped principals whose reported bytes cover the excess and evicts them, at once,
  each whole through its own script (``evict_principal``: all of its contexts or none),
  skipping one stamped again since the evictor read the LRU; an evicted principal's report
  goes with it (so a report left high by a read's idle expiry, or by Redis expiring the
  principal's keys, is cleared then), and it moves from the LRU to ``ctx_global_seen`` — in
  its script call on one server, in the evictor's writes after it on a cluster. A master that
  does not answer stops nothing: the sweep leaves out the shards it serves and the principals
  whose keys it holds, and evicts among the rest (logged, once per interval of the log).

So the total can exceed the budget between sweeps: by at most what every gateway appends in
one interval (docs/context.md has the measured figure), never by a half-evicted context.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from shared import keys, metrics
from shared.aio import pause
from shared.config import ContextConfig
from shared.log_throttle import ThrottledWarning
from shared.redis_batch import pack_command
from shared.redis_client import MASTER_DOWN, AsyncRedis, Reach, ReplicasBehind, read_within, socket_timeout_s
from shared.text import as_str

if TYPE_CHECKING:
    from shared.context.scripts import ContextScript

log = logging.getLogger(__name__)

TOTAL = b"\x00total"
_STATE = ("\x00bytes", "\x00ch", "\x00clock")  # a principal's bytes, their last change (ms), its last use (see context.lua)
_CLOCK_SCALE = 1000  # "\0clock" is a last use in ms * 1000 (see context.lua)
_STAMPS_MAX = 65536  # principals whose last stamp a store remembers (then it forgets them all)
_CANDIDATES = 64  # least recently used principals read per shard per sweep page
_RECONCILE_PAGE = 32  # principals per shard (with a report, and in the LRU) whose reports a sweep checks
REPORT_SETTLE_S = 10.0  # at least this long after a principal's last byte change its report is set right

# KEYS[1] a shard's bytes hash; ARGV[1] the sum of the changes, then (principal, change) pairs.
_ADD_BYTES = ("for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end\n"
              "if ARGV[1] ~= '0' then redis.call('HINCRBY', KEYS[1], '\\0total', ARGV[1]) end\n")


# KEYS[1] the evictor's lease; ARGV[1] this replica, ARGV[2] its TTL (ms). 1 when this replica holds it.
_TAKE_LEASE = ("local owner = redis.call('GET', KEYS[1])\n"
               "if owner and owner ~= ARGV[1] then return 0 end\n"
               "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n"
               "return 1\n")


def add_bytes(shard: int, changes: dict[str, int]) -> bytes:
    """The command that adds ``changes`` (principal -> bytes) to the reports of ``shard`` and
    their sum to its total, in one step."""
    pairs = [x for who, n in changes.items() if n for x in (who, n)]
    return pack_command(("EVAL", _ADD_BYTES, 1, keys.ctx_global_bytes(shard), sum(changes.values()), *pairs))


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
        self._stamps_held: dict[int, dict[str, int]] = {}  # the same, refused by a master away (see resend)
        self._bytes_due: dict[int, dict[str, int]] = {}  # shard -> principal -> byte change, not yet sent
        self._flush_scheduled = False
        self._cursors: dict[int, tuple[int, int]] = {}  # shard -> where reconcile goes on (reports, LRU)
        self.corrected = 0  # reports reconcile set right

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

    def resend(self) -> None:
        """Post again, with the next batch, the stamps a master that did not answer refused."""
        held, self._stamps_held = self._stamps_held, {}
        for shard, members in held.items():
            _merge_stamps(self._stamps_due.setdefault(shard, {}), members)
        if held:
            self._due()

    def _due(self) -> None:
        """What this loop turn stamped and reported goes out together, on the next turn: one
        ZADD per shard for the stamps, one script per shard for the bytes (with 64 callers, a
        few commands for dozens of calls)."""
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
            posted = self._post(pack_command(("ZADD", lru, "GT", *[x for p, ms in members.items() for x in (ms, p)])),
                                lru)
            posted.add_done_callback(partial(self._hold, shard, members))
        for shard, deltas in changes.items():
            if any(deltas.values()):
                self._post(add_bytes(shard, deltas), keys.ctx_global_bytes(shard))

    def _post(self, packed: bytes, key: str) -> asyncio.Future[Any]:
        self.posted += 1
        fut = self._batch.post(packed, key)
        self._unsettled.add(fut)
        fut.add_done_callback(self._unsettled.discard)
        return fut

    def _hold(self, shard: int, members: dict[str, int], posted: asyncio.Future[Any]) -> None:
        """Stamps whose shard's master did not take them wait for :meth:`resend` (the evictor's
        next interval rather than the next loop turn: no storm of posts at a master that is down)."""
        if posted.cancelled() or not isinstance(posted.exception(), MASTER_DOWN):
            return
        held = self._stamps_held.setdefault(shard, {})
        if len(held) < _STAMPS_MAX:  # beyond, their principals' next use stamps them
            _merge_stamps(held, members)

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

    async def sweep(self, budget_bytes: int, reach: Reach | None = None) -> list[str]:
        """Evict least recently used principals until the reported total fits ``budget_bytes``;
        returns the principals evicted (those that held contexts). On a cluster what a master
        that does not answer holds is left out and noted in ``reach``: the shards it serves
        (their reports and principals), the principals whose keys it holds."""
        reach = reach or Reach(self.redis)
        total = await self.total(reach)
        done: list[str] = []
        away: set[str] = set()  # principals whose master did not answer
        while total > budget_bytes:
            candidates = [c for c in sorted(await self._stamps(keys.ctx_global_lru, _CANDIDATES, reach))
                          if c[1] not in away]
            if not candidates:
                break
            reported = await self._reported(candidates, reach)
            chosen, excess = [], total - budget_bytes
            for (stamp, who, shard), held in zip(candidates, reported, strict=True):
                if excess <= 0:
                    break
                chosen.append((stamp, who, shard, held))
                excess -= held
            outcomes = await self._evict(chosen, reach)
            away.update(c[1] for c, out in zip(chosen, outcomes, strict=True) if out is None)
            reached = [(c[1], out) for c, out in zip(chosen, outcomes, strict=True) if out is not None]
            total -= sum(freed for _, (freed, _) in reached)
            done += [who for who, (_, evicted) in reached if evicted]
            if not any(out is None or out[0] or out[1] for out in outcomes):
                break  # every one was used again meanwhile: the next sweep sees the new order
        return done

    async def _reported(self, candidates: list[tuple[int, str, int]], reach: Reach) -> list[int]:
        """The reported bytes of each candidate (one HMGET per shard)."""
        by_shard: dict[int, list[str]] = {}
        for _, who, shard in candidates:
            by_shard.setdefault(shard, []).append(who)
        shards = list(by_shard)
        redis: Any = self.redis
        got = await asyncio.gather(*[reach.read(keys.ctx_global_bytes(k), partial(
            redis.hmget, keys.ctx_global_bytes(k), by_shard[k]), [None] * len(by_shard[k])) for k in shards])
        held = {(k, who): int(v or 0) for k, vals in zip(shards, got, strict=True)
                for who, v in zip(by_shard[k], vals, strict=True)}
        return [held[(shard, who)] for _, who, shard in candidates]

    async def _evict(self, chosen: list[tuple[int, str, int, int]], reach: Reach) -> list[tuple[int, bool] | None]:
        """Evict the chosen principals, each whole through its own script (the calls share
        pipelined round trips), unless stamped again since the evictor read the LRU: per
        principal (the reported bytes that left the total, whether it held contexts), or None
        where its master did not answer. A principal's report is cleared whatever it was (a
        report left high by an unreported idle expiry, or keys Redis expired, goes with it): by
        its script on one server (which answers the report it cleared), else by a few commands
        per shard after the calls."""
        by_shard: dict[int, list[tuple[int, str, int]]] = {}
        for stamp, who, shard, reported in chosen:
            by_shard.setdefault(shard, []).append((stamp, who, reported))
        shards = list(by_shard)
        redis: Any = self.redis
        scores = await asyncio.gather(*[reach.read(keys.ctx_global_lru(k), partial(
            redis.zmscore, keys.ctx_global_lru(k), [w for _, w, _ in by_shard[k]]), [None] * len(by_shard[k]))
            for k in shards])
        still = {(k, who) for k, got in zip(shards, scores, strict=True)
                 for (stamp, who, _), score in zip(by_shard[k], got, strict=True)
                 if score is not None and int(score) == stamp}
        now = self._clock_ms()
        replies = await asyncio.gather(*[self._evict_principal(who, now, reach)
                                         if (shard, who) in still else _skipped()
                                         for _, who, shard, _ in chosen])
        out: list[tuple[int, bool] | None] = []
        gone: dict[int, list[tuple[str, int]]] = {}
        for (_, who, shard, reported), reply in zip(chosen, replies, strict=True):
            if reply is None:
                out.append(None)
                continue
            n, freed, *cleared = reply
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
        kept = await asyncio.gather(*[self._settle_shard(k, members, now, reach) for k, members in gone.items()])
        unsettled = {who for ok, members in zip(kept, gone.values(), strict=True) if not ok for who, _ in members}
        # Evicted, but their reports still count (their shard's master did not answer).
        return [(0, o[1]) if o is not None and c[1] in unsettled else o for c, o in zip(chosen, out, strict=True)]

    async def _evict_principal(self, who: str, now: int, reach: Reach) -> Any:
        """``evict_principal`` of ``who``: its reply, or None when its master does not answer
        (or, with ``redis.wait_replicas``, has too few replicas to acknowledge it: the eviction
        may stay, and :meth:`reconcile` sets the report right then)."""
        try:
            return await self._script.call("evict_principal", who, now, "global_budget")
        except ReplicasBehind:
            return None
        except MASTER_DOWN as exc:
            reach.lost(exc, keys.ctx_meta(who))  # raises it on one server
            return None

    async def _settle_shard(self, shard: int, members: list[tuple[str, int]], now: int, reach: Reach) -> bool:
        """The evicted principals of one shard: reports cleared, out of the LRU, into ``seen``
        (their audit streams just got the eviction's records); their next use stamps them again.
        False when the shard's master did not answer."""
        gb = keys.ctx_global_bytes(shard)
        try:
            if any(n for _, n in members):
                await self._batch.submit(add_bytes(shard, {who: -n for who, n in members}), gb)
            for who, _ in members:
                self._stamped.pop(who, None)
            await self.redis.zadd(keys.ctx_global_seen(shard), {who: now for who, _ in members})
            await self.redis.zrem(keys.ctx_global_lru(shard), *[who for who, _ in members])
        except MASTER_DOWN as exc:
            reach.lost(exc, gb)
            return False
        return True

    async def reconcile(self, settle_ms: int, reach: Reach) -> int:
        """Set right the reports of the next page of every shard's principals (cluster; on one
        server the script keeps them exact): a principal whose bytes last changed ``settle_ms``
        ago or more gets the report its state holds (``\\0bytes``), and one that holds bytes
        but is missing from the LRU is stamped with its last use. Where its state is gone
        (evicted, expired) its last stamp stands for its last change. Shards and principals
        whose master does not answer wait for a later page. Returns the reports changed."""
        if self.inline:
            return 0
        quiet_before = self._clock_ms() - settle_ms  # taken before any report is read
        fixed = await asyncio.gather(*[self._reconcile_page(k, quiet_before, reach)
                                       for k in range(keys.CTX_GLOBAL_SHARDS)])
        self.corrected += sum(fixed)
        return sum(fixed)

    async def _reconcile_page(self, shard: int, quiet_before: int, reach: Reach) -> int:
        gb, lru = keys.ctx_global_bytes(shard), keys.ctx_global_lru(shard)
        page = await reach.read(gb, partial(self._page, shard), None)
        if page is None or not page[0]:
            return 0
        names, reported, stamped, seen = page
        states = await asyncio.gather(*[self._state(who, reach) for who in names])
        fix: dict[str, int] = {}
        restamp: dict[str, int] = {}
        for who, state, rep, stamp, gone in zip(names, states, reported, stamped, seen, strict=True):
            if state is None:
                continue
            held, changed, last_use = state
            if changed is None:  # no state left: nothing changed after its last stamp's use
                changed = max(int(stamp or 0), int(gone or 0)) + self._resolution_ms
            if changed > quiet_before:
                continue
            if held != int(rep or 0):
                fix[who] = held - int(rep or 0)
            if held and stamp is None:
                restamp[who] = last_use or quiet_before
        try:
            if fix:
                await self._batch.submit(add_bytes(shard, fix), gb)
            if restamp:
                await self._batch.submit(pack_command(("ZADD", lru, "GT", *[x for p, ms in restamp.items()
                                                                            for x in (ms, p)])), lru)
        except MASTER_DOWN as exc:
            reach.lost(exc, gb)
            return 0
        if fix:
            log.info("context: global accounting: %d report(s) of shard %d set right from what the principals hold "
                     "(%+d bytes)", len(fix), shard, sum(fix.values()))
        return len(fix)

    async def _page(self, shard: int) -> tuple[list[str], list[Any], list[Any], list[Any]]:
        """The shard's next principals (with a report, in the LRU), with their reports and
        their stamps in the LRU and in ``seen``; the shard's cursors move on."""
        gb, lru, seen = keys.ctx_global_bytes(shard), keys.ctx_global_lru(shard), keys.ctx_global_seen(shard)
        redis: Any = self.redis
        at_reports, at_lru = self._cursors.get(shard, (0, 0))
        (next_reports, fields), (next_lru, members) = await asyncio.gather(
            redis.hscan(gb, at_reports, count=_RECONCILE_PAGE), redis.zscan(lru, at_lru, count=_RECONCILE_PAGE))
        self._cursors[shard] = (int(next_reports), int(next_lru))
        names = sorted({as_str(f) for f, v in fields.items() if f != TOTAL and int(v)} |
                       {as_str(p) for p, _ in members})
        if not names:
            return [], [], [], []
        reported, stamped, gone = await asyncio.gather(redis.hmget(gb, names), redis.zmscore(lru, names),
                                                       redis.zmscore(seen, names))
        return names, reported, stamped, gone

    async def _state(self, who: str, reach: Reach) -> tuple[int, int | None, int] | None:
        """(bytes, ms of their last change — None without state —, ms of its last use) of a
        principal; None when its master does not answer."""
        meta = keys.ctx_meta(who)
        try:
            held, changed, clock = await self._batch.submit(pack_command(("HMGET", meta, *_STATE)), meta)
        except MASTER_DOWN as exc:
            reach.lost(exc, meta)
            return None
        return int(held or 0), None if held is None else int(changed or 0), int(clock or 0) // _CLOCK_SCALE


def _merge_stamps(into: dict[str, int], stamps: dict[str, int]) -> None:
    for who, ms in stamps.items():
        into[who] = max(ms, into.get(who, ms))


class GlobalEvictor:
    """The background task that enforces the global budget (see module docstring). Every
    gateway runs one; the lease (``keys.CTX_EVICTOR_LEASE``) lets one sweep at a time, so two
    replicas never both evict for the same excess. ``report_settle_s``: how long after a
    principal's last byte change its report is set right (default: ``REPORT_SETTLE_S``, or five
    socket timeouts of the client if longer — what a posted report may take to arrive)."""

    def __init__(self, accounts: GlobalAccounts, cfg: ContextConfig, *, owner: str | None = None,
                 report_settle_s: float | None = None) -> None:
        self.accounts = accounts
        self.budget_bytes = cfg.global_budget_bytes
        self.interval_s = cfg.global_evict_interval_s
        self.owner = owner or os.urandom(8).hex()
        if report_settle_s is None:
            report_settle_s = max(REPORT_SETTLE_S, 5 * (socket_timeout_s(accounts.redis) or 0.0))
        self.settle_ms = int(report_settle_s * 1000)
        self.sweeps = 0
        self._holds = False  # whether this replica held the lease when the lease could last be read
        self._skipping = ThrottledWarning(log)
        self._lease_away = ThrottledWarning(log)
        self._failing = ThrottledWarning(log)

    async def sweep_once(self) -> list[str]:
        """One sweep if this replica holds (or takes) the lease; [] otherwise."""
        self.accounts.resend()
        if not await self._lease():
            return []
        self.sweeps += 1
        reach = Reach(self.accounts.redis)
        evicted = await self.accounts.sweep(self.budget_bytes, reach)
        await self.accounts.reconcile(self.settle_ms, reach)
        if reach.partial:
            self._skipping.warning("context: the global budget's evictor skips what the master(s) %s hold, which do "
                                   "not answer (their shards' reports and principals, the principals whose keys they "
                                   "hold), and evicts among the rest", ", ".join(sorted(reach.unreachable)))
        return evicted

    async def run(self, on_evicted: Callable[[list[str]], Awaitable[None]] | None = None) -> None:
        """Sweep every interval until cancelled; a Redis outage is logged and waited out.
        ``on_evicted``: told of the principals each sweep evicted (whose clients' lists changed)."""
        while True:
            try:
                evicted = await self.sweep_once()
                if evicted and on_evicted is not None:
                    await on_evicted(evicted)
            except (RedisError, OSError) as exc:
                self._failing.warning("context: global budget sweep failed: %s", exc)
            except Exception:  # a sweep that breaks must not end the budget's enforcement
                log.exception("context: global budget sweep failed")
            await pause(self.interval_s)

    async def _lease(self) -> bool:
        """Whether this replica holds the lease (taken or renewed now). While the lease's master
        does not answer, the replica that held it goes on sweeping what it can reach (it held it
        for the lease's TTL at least; a replica that takes it over meanwhile stops it at the next
        interval after the lease answers again), the others wait."""
        try:
            self._holds = await self._renew()
        except MASTER_DOWN as exc:
            self._lease_away.warning("context: the global budget's lease does not answer (%s); this replica %s", exc,
                                     "held it and sweeps on" if self._holds else "does not hold it and waits")
        return self._holds

    async def _renew(self) -> bool:
        """Take the lease if free, or renew it if this replica holds it, in one step: renewing
        after reading the owner would extend a lease another replica took in between, and two
        replicas would sweep for the same excess."""
        redis: Any = self.accounts.redis
        ttl_ms = int(self.interval_s * 3000) + 1000
        return bool(await redis.eval(_TAKE_LEASE, 1, keys.CTX_EVICTOR_LEASE, self.owner, ttl_ms))
