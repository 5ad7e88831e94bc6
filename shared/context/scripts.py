"""Calls of the context script (``context.lua``, next to this module): every store operation
is ONE call — FCALL of a Redis Function library, loaded on first use and again after a
server lost it; on Redis < 7, which has no Functions, EVALSHA of the same code. Calls share
pipelined round trips (``AutoPipeline``); an error reply of the script becomes its
``ContextError``."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import keys, metrics
from shared.config import ContextConfig
from shared.context.errors import SCRIPT_ERRORS
from shared.redis_batch import AutoPipeline, pack_bulk

log = logging.getLogger(__name__)

GLOBAL_KEYS = [keys.CTX_GLOBAL_BYTES, keys.CTX_GLOBAL_LRU, keys.AUDIT_STREAM]
_HEADS_MAX = 32768  # cached command heads (see ContextScript._head): ~250 bytes each, 8 MiB at most


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
            f"{cfg.global_budget_bytes}:{cfg.idle_ttl_s * 1000}:{cfg.versions_retained}:{cfg.audit_maxlen}:"
            f"{cfg.global_lru_resolution_ms}").encode()


def script_keys(principal: str) -> list[str]:
    """KEYS of every call: the principal's 5 keys, then the 3 global ones."""
    return keys.ctx_keys(principal) + GLOBAL_KEYS


class ContextScript:
    """The context script as one store calls it: ARGV ``op, principal, config, now, *args``."""

    def __init__(self, redis: aioredis.Redis, cfg: ContextConfig, clock_ms: Callable[[], int]) -> None:
        self.redis = redis
        # Concurrent operations share pipelined round trips (each is still one script call).
        self._batch = AutoPipeline(redis)
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

    async def call(self, op: str, principal: str, *args: str | bytes | int, packed: bytes | None = None) -> Any:
        """One script call: ARGV ``op, principal, config, now, *args`` (``packed``: ``args``
        already packed with ``pack_bulk``, ``len(args)`` arguments)."""
        self.round_trips += 1
        t0 = time.perf_counter()
        tail = self._now_arg() + (packed if packed is not None else pack_bulk(args))
        n = 15 + len(args)  # FCALL, name, numkeys, 8 keys, op, principal, config, now, then args
        try:
            if self.use_functions is not False:
                out = await self._batch.submit(self._head(op, principal, n) + tail)
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

    def _head(self, op: str, principal: str, n: int) -> bytes:
        """The RESP command header of ``n`` arguments and its first ones: ``FCALL <fn> 8
        <keys of principal> <global keys> <op> <principal> <config>``, cached per principal
        and operation (an operation always has the same number of arguments).

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
                                               lens[3] + len(pb), pb, lens[4] + len(pb), pb)
            head = self._heads[(op, principal)] = b"*%d\r\n%b%b%b%b%b" % (
                n, self._fcall_part, keys_part, self._after_keys, pack_bulk((op, principal)), self._cfg_part)
        return head

    def _head_template(self) -> None:
        """The constant parts of every call's header (see _head): ``FCALL <fn> 8``, the
        principal's keys as a template (each key around the principal), the global keys and
        the configuration, packed."""
        marker = "\x00"  # never in a principal's name (see validation.check_principal)
        ks = keys.ctx_keys(marker)
        parts = [k.encode().split(marker.encode()) for k in ks]
        if len(parts) != 5 or any(len(p) != 2 for p in parts):
            raise RuntimeError("every context key must name its principal once")
        self._key_lens = [len(a) + len(b) for a, b in parts]
        self._keys_template = b"".join(b"$%%d\r\n%b%%b%b\r\n" % (a.replace(b"%", b"%%"), b.replace(b"%", b"%%"))
                                       for a, b in parts)
        self._fcall_part = pack_bulk(("FCALL", self.fn, len(ks) + len(GLOBAL_KEYS)))
        self._after_keys = pack_bulk(tuple(GLOBAL_KEYS))
        self._cfg_part = pack_bulk((self.cfg_arg,))

    def _now_arg(self) -> bytes:
        """ARGV 4 (now, ms) packed; the same for every call within a millisecond."""
        now = self._clock_ms()
        if now != self._now[0]:
            self._now = (now, pack_bulk((now,)))
        return self._now[1]

    async def _evalsha(self, op: str, principal: str, args: tuple[str | bytes | int, ...]) -> Any:
        """The script as EVALSHA (Redis < 7: no Functions)."""
        return await self._evalsha_script(keys=script_keys(principal),
                                          args=[op, principal, self.cfg_arg, self._clock_ms(), *args])

    async def _retry(self, op: str, principal: str, args: tuple[str | bytes | int, ...], n: int, tail: bytes,
                     exc: ResponseError) -> Any:
        """After an error reply: load the library if this server lacks it (first use, or it
        restarted) and call again, or fall back to EVALSHA on Redis < 7; a script error
        becomes its ContextError."""
        try:
            text = str(exc).lower()
            if "function not found" in text:
                await self.redis.function_load(self._fn_code, replace=True)
                self.use_functions = True
                return await self._batch.submit(self._head(op, principal, n) + tail)
            if "unknown command" in text and self.use_functions is None:
                log.info("context store: Redis without Functions, using EVALSHA")
                self.use_functions = False
                return await self._evalsha(op, principal, args)
            raise exc
        except ResponseError as err:
            kind, _, msg = str(err).partition(" ")
            msg = msg.split(" script: ", 1)[0]
            error = SCRIPT_ERRORS.get(kind)
            metrics.CONTEXT_OPS.labels(op, "error").inc()
            if error is None:
                raise
            raise error(msg) from None
