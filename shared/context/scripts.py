"""Calls of the context script (``context.lua``, next to this module): every store operation
is ONE call — FCALL of a Redis Function library, loaded on every master on first use and
again after a master lost it (a restart, a failover to a replica that never had it, a new
master); on Redis < 7, which has no Functions, EVALSHA of the same code. Calls share
pipelined round trips (``AutoPipeline``; on a cluster one per master, see
shared.redis_cluster_batch); an error reply of the script becomes its ``ContextError``."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from shared import keys, metrics
from shared.config import ContextConfig, RedisConfig
from shared.context.errors import SCRIPT_ERRORS, ContextNotFound
from shared.redis_batch import pack_bulk, pack_command
from shared.redis_client import AsyncRedis, check_replicas, for_each_primary
from shared.redis_cluster_batch import auto_pipeline

log = logging.getLogger(__name__)

NUM_KEYS = len(keys.ctx_keys("p"))
_HEADS_MAX = 32768  # cached command heads (see ContextScript._head): ~250 bytes each, 8 MiB at most
# Operations that change what a principal holds: with ``redis.wait_replicas`` they are
# acknowledged only once that many replicas have them (reads also refresh the LRU and
# expire idle contexts, but acknowledge no change).
WRITE_OPS = frozenset({"append", "clear", "fork", "evict", "evict_principal"})


def script_source() -> str:
    return resources.files("shared.context").joinpath("context.lua").read_text()


def library(source: str) -> tuple[str, str]:
    """(function name, FUNCTION LOAD code). The name carries a digest of the source, so a
    changed script is a new function and replicas running different versions never mix."""
    digest = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()[:12]
    fn = f"lm_ctx_{digest}"
    code = (f"#!lua name=learnmesh_ctx_{digest}\n{source}\n"
            f"redis.register_function('{fn}', lm_main)\n")
    return fn, code


def script_config(cfg: ContextConfig) -> bytes:
    """The script's configuration argument (ARGV[3] of context.lua), encoded once per store."""
    return (f"{cfg.channel_max_entries}:{cfg.channel_max_bytes}:{cfg.principal_budget_bytes}:"
            f"{cfg.idle_ttl_s * 1000}:{cfg.versions_retained}:{cfg.audit_maxlen}:"
            f"{cfg.global_lru_resolution_ms}").encode()


def global_keys(principal: str) -> list[str]:
    """The principal's shard of the global accounting, as the script keeps it on one server
    (KEYS 7-9 of context.lua)."""
    shard = keys.ctx_global_shard(principal)
    return [keys.ctx_global_bytes(shard), keys.ctx_global_lru(shard), keys.ctx_global_seen(shard)]


def script_keys(principal: str, inline: bool) -> list[str]:
    """KEYS of every call: the principal's keys (one slot), and with ``inline`` (one server)
    its shard of the global accounting."""
    return keys.ctx_keys(principal) + (global_keys(principal) if inline else [])


class ContextScript:
    """The context script as one store calls it: ARGV ``op, principal, config, now, *args``.

    On one server (``inline``) the script also keeps the global budget's accounting (the
    principal's byte report and its global LRU stamp: shared/context/budget.py); a cluster
    script touches one slot, so there the store keeps it beside the calls."""

    def __init__(self, redis: AsyncRedis, cfg: ContextConfig, clock_ms: Callable[[], int],
                 redis_cfg: RedisConfig | None = None) -> None:
        self.redis = redis
        # Concurrent operations share pipelined round trips (each is still one script call).
        self.batch = auto_pipeline(redis)
        self._routed = isinstance(redis, aioredis.RedisCluster)  # submit with the principal's slot
        self.inline = not self._routed  # one server: any key in a script (see class docstring)
        self.num_keys = NUM_KEYS + (len(global_keys("p")) if self.inline else 0)
        self._global_parts: dict[int, bytes] = {}  # shard -> its keys, packed (see _head)
        self._loading: asyncio.Future[None] | None = None  # a library load under way (see _load)
        self._clock_ms = clock_ms
        source = script_source()
        # Redis Functions (7.0+): the library is loaded once and each call runs only lm_main.
        # An EVAL script would re-run the whole chunk, re-creating every helper closure, per call.
        self.fn, self._fn_code = library(source)
        self.use_functions: bool | None = None  # None: not yet known
        self._evalsha_script = redis.register_script(source + "\nreturn lm_main(KEYS, ARGV)\n")
        self.cfg_arg = script_config(cfg)
        self._heads: dict[tuple[str, str], bytes] = {}
        self._head_template()
        self._now: tuple[int, bytes] = (-1, b"")  # see _now_arg
        self._op_metrics: dict[str, tuple[Any, Any]] = {}  # op -> its latency and count children
        self.round_trips = 0  # script calls made (the bench divides by operations)
        self.stamp: Callable[[str], None] | None = None  # told of each call's principal (global LRU)
        # told (principal, [cid, reason, ...]) of the evictions a call made before its error reply
        self.on_error_evicted: Callable[[str, list[str]], object] | None = None
        # WAIT after each write (see _confirmed); empty: writes are acknowledged by their master alone.
        self._confirm = redis_cfg if redis_cfg is not None and redis_cfg.wait_replicas else None
        self._wait = b"" if self._confirm is None else pack_command(
            ("WAIT", self._confirm.wait_replicas, self._confirm.wait_timeout_ms))

    async def call(self, op: str, principal: str, *args: str | bytes | int, packed: bytes | None = None) -> Any:
        """One script call: ARGV ``op, principal, config, now, *args`` (``packed``: ``args``
        already packed with ``pack_bulk``, ``len(args)`` arguments)."""
        self.round_trips += 1
        t0 = time.perf_counter()
        if self.stamp is not None and op != "evict_principal":
            self.stamp(principal)
        tail = self._now_arg() + (packed if packed is not None else pack_bulk(args))
        n = 7 + self.num_keys + len(args)  # FCALL, name, numkeys, keys, op, principal, config, now, then args
        try:
            if self.use_functions is not False:
                packed = self._head(op, principal, n) + tail
                out = await (self._confirmed(packed, principal) if self._wait and op in WRITE_OPS
                             else self.batch.submit(packed, self.route(principal)))
            else:
                out = await self._evalsha(op, principal, args)
        except ResponseError as exc:
            out = await self._retry(op, principal, args, n, tail, exc)
        m = self._op_metrics.get(op)
        if m is None:  # labelled children cached: .labels() is a dict lookup per call
            m = self._op_metrics[op] = (metrics.CONTEXT_OP_SECONDS.labels(op), metrics.CONTEXT_OPS.labels(op, "ok"))
        m[0].observe(time.perf_counter() - t0)
        m[1].inc()
        return out

    def _send(self, op: str, principal: str, packed: bytes) -> Awaitable[Any]:
        """``packed`` (one script call) through the pipeline: a write confirmed by replicas
        where ``redis.wait_replicas`` asks for it."""
        if self._wait and op in WRITE_OPS:
            return self._confirmed(packed, principal)
        return self.batch.submit(packed, self.route(principal))

    async def _confirmed(self, packed: bytes, principal: str) -> Any:
        """The call and WAIT as one submission: same batch, same connection, WAIT right after
        the call (it counts only its own connection's writes), redirected together. Too few
        replicas in time raises ReplicasBehind: the write is not acknowledged, yet may stay
        on its master (and reach replicas later); an acknowledged one is on that many replicas."""
        reply, acked = await self.batch.submit(packed + self._wait, self.route(principal), 2)
        if self._confirm is not None:  # always, with _wait
            check_replicas(self._confirm, int(acked))
        return reply

    def route(self, principal: str) -> str | None:
        """What a cluster pipeline routes a call of ``principal`` by (its hash tag, the slot of
        all its keys); None on one server, which needs none."""
        return "{" + principal + "}" if self._routed else None

    def _head(self, op: str, principal: str, n: int) -> bytes:
        """The RESP command header of ``n`` arguments and its first ones: ``FCALL <fn> <numkeys>
        <keys of principal> [<its global shard keys>] <op> <principal> <config>``, cached per
        principal and operation (an operation always has the same number of arguments).

        Hand-built rather than packed by hiredis, because it is the hot path: packing all ~19
        arguments of an append with ``hiredis.pack_command`` takes 1.8 µs, a cached head plus
        the packed arguments after it 0.65 µs; and a principal's first head (every call, in a
        gateway serving more principals than the cache holds) is one formatting of a template
        with the principal in its keys — 2.4 µs a call, 3.2 µs building it with hiredis."""
        head = self._heads.get((op, principal))
        if head is None:
            if len(self._heads) >= _HEADS_MAX:
                self._heads.clear()
            pb = principal.encode()
            lens = self._key_lens
            keys_part = self._keys_template % (lens[0] + len(pb), pb, lens[1] + len(pb), pb, lens[2] + len(pb), pb,
                                               lens[3] + len(pb), pb, lens[4] + len(pb), pb, lens[5] + len(pb), pb)
            if self.inline:
                keys_part += self._global_part(keys.ctx_global_shard(principal))
            head = self._heads[(op, principal)] = b"*%d\r\n%b%b%b%b" % (
                n, self._fcall_part, keys_part, pack_bulk((op, principal)), self._cfg_part)
        return head

    def _head_template(self) -> None:
        """The constant parts of every call's header (see _head): ``FCALL <fn> 6``, the
        principal's keys as a template (each key around the principal) and the configuration,
        packed."""
        marker = "\x00"  # never in a principal's name (see validation.check_principal)
        ks = keys.ctx_keys(marker)
        parts = [k.encode().split(marker.encode()) for k in ks]
        if len(parts) != NUM_KEYS or any(len(p) != 2 for p in parts):
            raise RuntimeError("every context key must name its principal once")
        self._key_lens = [len(a) + len(b) for a, b in parts]
        self._keys_template = b"".join(b"$%%d\r\n%b%%b%b\r\n" % (a.replace(b"%", b"%%"), b.replace(b"%", b"%%"))
                                       for a, b in parts)
        self._fcall_part = pack_bulk(("FCALL", self.fn, self.num_keys))
        self._cfg_part = pack_bulk((self.cfg_arg,))

    def _global_part(self, shard: int) -> bytes:
        """The keys of one shard of the global accounting, packed (KEYS 7-9 on one server)."""
        part = self._global_parts.get(shard)
        if part is None:
            part = self._global_parts[shard] = pack_bulk(
                (keys.ctx_global_bytes(shard), keys.ctx_global_lru(shard), keys.ctx_global_seen(shard)))
        return part

    def _now_arg(self) -> bytes:
        """ARGV 4 (now, ms) packed; the same for every call within a millisecond."""
        now = self._clock_ms()
        if now != self._now[0]:
            self._now = (now, pack_bulk((now,)))
        return self._now[1]

    async def load_library(self) -> None:
        """FUNCTION LOAD on every master (replicas copy it), one load at a time: the calls that
        found it missing together wait for the same load."""
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._load())
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        await for_each_primary(self.redis, lambda node: node.function_load(self._fn_code, replace=True))
        log.info("context store: function library %s loaded on every master", self.fn)

    async def _evalsha(self, op: str, principal: str, args: tuple[str | bytes | int, ...]) -> Any:
        """The script as EVALSHA (Redis < 7: no Functions); a write confirmed as by _send."""
        argv = [op, principal, self.cfg_arg, self._clock_ms(), *args]
        ks = script_keys(principal, self.inline)
        if not (self._wait and op in WRITE_OPS):
            return await self._evalsha_script(keys=ks, args=argv)
        packed = pack_command(("EVALSHA", self._evalsha_script.sha, len(ks), *ks, *argv))
        try:
            return await self._confirmed(packed, principal)
        except NoScriptError:  # first use, or a master that never had it
            await for_each_primary(self.redis, lambda node: node.script_load(self._evalsha_script.script))
            return await self._confirmed(packed, principal)

    async def _retry(self, op: str, principal: str, args: tuple[str | bytes | int, ...], n: int, tail: bytes,
                     exc: ResponseError) -> Any:
        """After an error reply: load the library if the master that answered lacks it (first
        use, a restart, a failover, a new master) and call again, or fall back to EVALSHA on
        Redis < 7; a script error becomes its ContextError."""
        try:
            text = str(exc).lower()
            if "function not found" in text:
                await self.load_library()
                self.use_functions = True
                return await self._send(op, principal, self._head(op, principal, n) + tail)
            if "unknown command" in text and not self.use_functions:
                # Calls sent together before the first answer all come back here: each falls back.
                if self.use_functions is None:
                    log.info("context store: Redis without Functions, using EVALSHA")
                self.use_functions = False
                return await self._evalsha(op, principal, args)
            raise exc
        except ResponseError as err:
            kind, _, msg = str(err).partition(" ")
            msg, _, gone = msg.split(" script: ", 1)[0].partition(" ;evicted ")
            if gone and self.on_error_evicted is not None:  # see fail() in context.lua
                self.on_error_evicted(principal, gone.split(" "))
            error = SCRIPT_ERRORS.get(kind)
            metrics.CONTEXT_OPS.labels(op, "error").inc()
            if error is None:
                raise
            if issubclass(error, ContextNotFound):
                raise error.from_script(msg) from None
            raise error(msg) from None
