"""``ContextStore``: the context store's API, used by the gateway, workers and the trainer.
Each operation checks its input (validation.py), makes one script call (scripts.py) and
decodes the reply (replies.py); reads go through the store's read cache (read_cache.py)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from shared import keys, metrics
from shared.config import ContextConfig, RedisConfig
from shared.context.budget import GlobalAccounts, GlobalEvictor
from shared.context.entries import pack_entry
from shared.context.errors import ContextExists, ContextNotFound
from shared.context.read_cache import Channel, Held, ReadCache
from shared.context.replies import ScriptReplies, evicted
from shared.context.scripts import ContextScript
from shared.context.validation import (
    MAX_LAST_N,
    MAX_TOKENS_LIMIT,
    check_entry,
    check_id,
    check_limit,
    check_principal,
    check_reason,
    check_request_id,
    check_version,
    modalities_arg,
)
from shared.redis_batch import pack_bulk
from shared.redis_client import AsyncRedis, Reach
from shared.text import as_str
from shared.types import ContextWindow

log = logging.getLogger(__name__)

_LRU_SCALE = 1000  # LRU zset score = last-use ms * 1000 (+ tiebreak); see context.lua
_LU = b"\x00u"  # meta field prefix of a context's last use (see context.lua)


@dataclass
class AppendResult:
    entry_id: str
    version: int
    evicted: list[str] = field(default_factory=list)  # this principal's contexts evicted by the append
    opened: bool = False  # the channel held no entry before: the principal's resource list grew
    repeated: bool = False  # the request id named an earlier append: this is its answer, nothing appended


@dataclass
class ContextInfo:
    id: str
    version: int
    bytes: int
    entries: dict[str, int]
    last_used_ms: int
    created_ms: int = 0


class ContextStore:
    """Per-principal, per-modality conversation context in Redis (see shared/context/).

    ``redis_cfg``: its ``wait_replicas`` / ``wait_timeout_ms`` apply to every write (append,
    clear, fork, evict, global-budget eviction): an acknowledged write is on that many
    replicas; one refused with ``ReplicasBehind`` reached its master and may or may not stay.

    ``on_evicted``: told ``(principal, contexts)`` when an operation's reply reports evictions
    of that principal's contexts (idle, budget or admin), e.g. to tell its clients their
    resource list changed. Called synchronously, only when something was evicted."""

    def __init__(self, redis: AsyncRedis, cfg: ContextConfig, *,
                 clock_ms: Callable[[], int] | None = None, redis_cfg: RedisConfig | None = None) -> None:
        if isinstance(redis, aioredis.RedisCluster):
            if redis.get_connection_kwargs().get("decode_responses"):
                raise ValueError("the context store's cluster client must not decode responses (content is bytes)")
        elif redis.connection_pool.connection_kwargs.get("decode_responses"):
            # Content is raw bytes: use a sibling client on the same server that does not decode;
            # it owns its pool, so closing it (``store.redis.aclose()``) disconnects the pool.
            kwargs = dict(redis.connection_pool.connection_kwargs, decode_responses=False)
            pool = redis.connection_pool.__class__(connection_class=redis.connection_pool.connection_class,
                                                   max_connections=redis.connection_pool.max_connections,
                                                   **kwargs)
            redis = aioredis.Redis.from_pool(pool)
        self.redis = redis
        self.cfg = cfg
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._script = ContextScript(redis, cfg, self._clock_ms, redis_cfg)
        self._global = GlobalAccounts(redis, self._script, cfg, self._clock_ms)
        if not self._script.inline:  # on one server the script stamps (see budget.py)
            self._script.stamp = self._global.stamp
        self._replies = ScriptReplies(cfg.modalities)
        self._cache = ReadCache(cfg, self._replies)
        self._read_metrics = (metrics.CONTEXT_READ_ENTRIES.labels("redis"), metrics.CONTEXT_READ_ENTRIES.labels("cache"))
        self.on_evicted: Callable[[str, list[str]], None] | None = None
        self._script.on_error_evicted = self._evicted

    def _evicted(self, principal: str, flat: Sequence[Any]) -> list[str]:
        """The contexts of a reply's ``[context, reason, ...]`` pairs, counted and reported."""
        if not flat:
            return []
        gone = evicted(flat)
        if self.on_evicted is not None:
            self.on_evicted(principal, gone)
        return gone

    async def aclose(self) -> None:
        """Finish what is on the wire and let go of the store's connections: before the Redis
        client closes (a later operation fails with redis-py's ``ConnectionError``)."""
        await self._script.batch.aclose()

    @property
    def round_trips(self) -> int:
        """Script calls made (the bench divides by operations)."""
        return self._script.round_trips

    @property
    def posted(self) -> int:
        """Global accounting commands sent beside script calls, in the same batches (on a
        cluster; on one server the script keeps the accounting: none)."""
        return self._global.posted

    @property
    def entries_fetched(self) -> int:
        """Entries read from Redis."""
        return self._replies.entries_fetched

    @property
    def entries_reused(self) -> int:
        """Entries get_window took from the read cache instead."""
        return self._cache.entries_reused

    async def append(self, principal: str, context_id: str, modality: str, role: str, content: bytes, *,
                     mime: str | None = None, tokens: int | None = None, links: Sequence[str] = (),
                     request_id: str | None = None) -> AppendResult:
        """Append one entry (creating the context if needed); returns its id and the new version.
        ``request_id`` makes a retry safe: an append naming the id of one of the context's last
        8 appends that named one appends nothing and answers that append's entry and version."""
        check_principal(principal)
        check_id(context_id)
        if request_id is not None:
            check_request_id(request_id)
        content, tokens, links = check_entry(self.cfg, modality, role, content, mime=mime, tokens=tokens, links=links)
        packed = pack_entry(role, content, tokens=tokens, ts_ms=self._clock_ms(), mime=mime, links=links)
        seq, version, gone, delta, opened, earlier = await self._script.call(
            "append", principal, context_id, modality, packed, ",".join(links), request_id or "")
        self._global.report(principal, delta)
        if earlier:
            earlier = earlier.decode() if isinstance(earlier, bytes) else str(earlier)
            return AppendResult(entry_id=f"{earlier}:{int(seq)}", version=int(version),
                                evicted=self._evicted(principal, gone), repeated=True)
        metrics.CONTEXT_APPENDED_BYTES.labels(modality).inc(len(content))
        return AppendResult(entry_id=f"{modality}:{int(seq)}", version=int(version),
                            evicted=self._evicted(principal, gone), opened=bool(opened))

    async def get_window(self, principal: str, context_id: str, *, modalities: Iterable[str] | None = None,
                         last_n: int | None = None, max_tokens: int | None = None,
                         resolve_links: bool = False) -> ContextWindow:
        """The newest entries per channel: all, the last ``last_n``, and/or within ``max_tokens``
        (per channel; always at least the newest entry). ``resolve_links`` adds entries of the
        requested modalities that returned entries link to, even outside the window."""
        key = (principal, context_id)
        held = self._cache.get(key)
        if held is None:  # a held record's names were checked when it was kept
            check_principal(principal)
            check_id(context_id)
        mods = modalities_arg(self.cfg, modalities)
        if last_n is not None:
            check_limit("last_n", last_n, MAX_LAST_N)
        if max_tokens is not None:
            check_limit("max_tokens", max_tokens, MAX_TOKENS_LIMIT)
        what = (context_id, mods, last_n or 0, max_tokens or 0)  # ARGV 5-8 of ops.window
        if resolve_links:  # linked entries come from Redis every time (see ops.window)
            reply = await self._script.call("window", principal, *what, "1", "", "")
            version, runs, _wins, _ver, gone = self._replies.window_reply(reply)
            self._evicted(principal, gone)
            return self._replies.window(principal, context_id, version, runs)
        sig = f"{mods}|{last_n or 0}|{max_tokens or 0}"
        same: tuple[dict[str, Channel], int] | None = None  # what "unchanged" would refer to
        held_arg = token = ""
        packed = None
        snap: dict[str, Channel] = {}  # the channels `held_arg` names
        if held is not None:
            if not held.held_arg:
                held.held_arg = held.spec()
            held_arg, snap = held.held_arg, held.channels  # taken together: a concurrent read may re-fill `held`
            if held.sig == sig:  # taken now: a concurrent read may re-label `held` meanwhile
                same, token = (snap, held.version), held.token
                if not held.packed:  # the same arguments as long as `held` is not re-labelled
                    held.packed = pack_bulk((*what, "0", held_arg, token))
                packed = held.packed
        if packed is None:
            packed = pack_bulk((*what, "0", held_arg, token))
        try:
            reply = await self._script.call("window", principal, *what, "0", held_arg, token, packed=packed)
        except ContextNotFound:
            self._cache.forget(key)
            raise
        if reply[2] == -1 and same is not None:  # as it was at our last read with these arguments
            if reply[3]:
                self._evicted(principal, reply[4:4 + 2 * int(reply[3])])
            r0 = self._cache.entries_reused
            as_held = self._cache.unchanged(key, same, mods)
            self._read_metrics[1].inc(self._cache.entries_reused - r0)
            return as_held
        f0, r0 = self._replies.entries_fetched, self._cache.entries_reused
        win = self._assemble(key, reply, held, snap, mods, sig, principal)
        if win is None:  # the reply and what we hold do not fit together: never expected
            log.warning("context %s/%s: read cache out of step, reading it whole", principal, context_id)
            self._cache.forget(key)
            reply = await self._script.call("window", principal, *what, "0", "", "")
            win = self._assemble(key, reply, None, {}, mods, sig, principal)
            if win is None:
                raise RuntimeError(f"context {context_id}: window reply does not match its ranges")
        if self._replies.entries_fetched != f0:
            self._read_metrics[0].inc(self._replies.entries_fetched - f0)
        if self._cache.entries_reused != r0:
            self._read_metrics[1].inc(self._cache.entries_reused - r0)
        return win

    def _assemble(self, key: tuple[str, str], reply: list[Any], held: Held | None, snap: dict[str, Channel],
                  mods: str, sig: str, principal: str) -> ContextWindow | None:
        version, runs, wins, ver, gone = self._replies.window_reply(reply)
        self._evicted(principal, gone)
        return self._cache.assemble(key, int(version), runs, wins, ver, held, snap, mods, sig)

    async def read_at_version(self, principal: str, context_id: str, version: int, *,
                              modalities: Iterable[str] | None = None) -> ContextWindow:
        """The context exactly as it was at ``version`` (raises VersionUnavailable if not retained)."""
        check_principal(principal)
        check_id(context_id)
        check_version(version)
        mods = modalities_arg(self.cfg, modalities)
        reply = await self._script.call("read_at", principal, context_id, version, mods)
        self._evicted(principal, reply[1])
        return self._replies.window(principal, context_id, reply[0], self._replies.runs(reply, 2))

    async def version(self, principal: str, context_id: str) -> int:
        check_principal(principal)
        check_id(context_id)
        ver, gone, delta = await self._script.call("version", principal, context_id)
        self._global.report(principal, delta)
        self._evicted(principal, gone)
        return int(ver)

    async def list_contexts(self, principal: str) -> list[ContextInfo]:
        """The principal's live contexts, most recently used first."""
        check_principal(principal)
        raw, lru, gone = await self._script.call("list", principal)
        self._evicted(principal, gone)
        scores = {as_str(lru[i]): int(float(lru[i + 1])) for i in range(0, len(lru), 2)}
        used = {cid: sc // _LRU_SCALE for cid, sc in scores.items()}
        out = []
        for i in range(0, len(raw), 2):
            m = orjson.loads(raw[i + 1])
            ch = m.get("ch") or {}
            cid = as_str(raw[i])
            out.append(ContextInfo(id=cid, version=int(m["v"]), bytes=int(m["b"]),
                                   entries={k: int(c["hi"]) - int(c["lo"]) + 1 for k, c in ch.items()},
                                   last_used_ms=used.get(cid, 0), created_ms=int(m.get("t", 0))))
        out.sort(key=lambda i: scores.get(i.id, 0), reverse=True)  # exact LRU order, MRU first
        return out

    async def clear(self, principal: str, context_id: str) -> int:
        """Empty every channel; returns the new version (older versions stay readable while retained)."""
        check_principal(principal)
        check_id(context_id)
        ver, gone, delta = await self._script.call("clear", principal, context_id)
        self._global.report(principal, delta)
        self._evicted(principal, gone)
        return int(ver)

    async def fork(self, principal: str, src_id: str, dst_id: str | None = None) -> str:
        """Copy a context's current entries into a new context (server-side, one round trip)."""
        check_principal(principal)
        check_id(src_id)
        dst_id = dst_id if dst_id is not None else f"{src_id[:100]}-{uuid.uuid4().hex[:12]}"
        check_id(dst_id)
        if dst_id == src_id:
            raise ContextExists("fork target must differ from the source")
        _ver, gone, delta = await self._script.call("fork", principal, src_id, dst_id)
        self._global.report(principal, delta)
        self._evicted(principal, gone)
        return dst_id

    async def evict(self, principal: str, context_id: str, *, reason: str = "admin") -> bool:
        """Remove a context entirely (audited); False if it did not exist."""
        check_principal(principal)
        check_id(context_id)
        check_reason(reason)
        done, gone, delta = await self._script.call("evict", principal, context_id, reason)
        self._global.report(principal, delta)
        self._evicted(principal, gone)
        return bool(done)

    async def principal_bytes(self, principal: str) -> int:
        """Bytes the principal holds (entries physically kept, retained versions included)."""
        raw = await self.redis.hget(keys.ctx_meta(principal), "\x00bytes")
        return int(raw or 0)

    async def global_bytes(self, reach: Reach | None = None) -> int:
        """Bytes held by all principals, as reported (see shared/context/budget.py); ``reach``:
        of the shards whose master answers."""
        return await self._global.total(reach)

    def evictor(self, *, owner: str | None = None, report_settle_s: float | None = None) -> GlobalEvictor:
        """The task that enforces ``global_budget_bytes`` and sets the global reports right (the
        gateway runs one: ``run()``; ``report_settle_s``: see ``GlobalEvictor``)."""
        return GlobalEvictor(self._global, self.cfg, owner=owner, report_settle_s=report_settle_s)

    async def enforce_global_budget(self) -> list[str]:
        """One sweep of the global budget now, without the lease: the principals evicted."""
        return await self._global.sweep(self.cfg.global_budget_bytes)

    async def seen_principals(self) -> list[tuple[str, int]]:
        """(principal, ms of its last stamped use) of every principal the store has stamped,
        newest first (audit reads visit their streams)."""
        return await self._global.seen()

    async def lru_order(self, principal: str) -> list[str]:
        """The principal's contexts in exact LRU order, least recently used first, read
        without running an operation (no idle expiry, no use): R's scores are lower bounds
        brought up to date by the last-use fields (see context.lua). For admin and tests."""
        check_principal(principal)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrange(keys.ctx_lru(principal), 0, -1, withscores=True)
            pipe.hgetall(keys.ctx_meta(principal))
            lru, meta = await pipe.execute()

        def last(cid: bytes, score: float) -> float:
            return max(score, float(meta.get(_LU + cid, 0)))
        return [as_str(c) for c, _ in sorted(lru, key=lambda cs: (last(*cs), cs[0]))]

    async def principals(self, reach: Reach | None = None) -> list[str]:
        """Principals known to the global LRU, most recently used first (for admin); ``reach``:
        those of the shards whose master answers."""
        return await self._global.principals(reach)
