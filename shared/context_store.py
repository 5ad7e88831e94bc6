"""Per-principal, per-modality conversation context in Redis.

A principal owns contexts; a context has one channel per modality (text, image, audio —
``context.modalities``), each an ordered list of entries. Every operation is ONE call of
``shared/lua/context.lua`` (FCALL of a Redis Function library loaded once — on Redis < 7,
EVALSHA of the same code through redis-py ``register_script``): it reads or
writes, bumps the context's version, updates recency and enforces the per-channel window,
the per-principal byte budget (exact LRU over the principal's contexts) and the idle TTL
atomically. The global budget (LRU over principals) is checked in the same call; evicting
another principal's keys is a follow-up call on that principal's keys, needed only when the
global budget is exceeded. See docs/context.md for the data model and the rules.

Entries are stored as MessagePack arrays of the fields of ``Entry`` (content as raw bytes,
never base64), so the entries of a window reply, joined behind one array header, decode in
one C call straight into ``Entry`` objects (see pack_entry).
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

import msgspec
import orjson
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import keys, metrics
from shared.config import ContextConfig
from shared.redis_batch import AutoPipeline, pack_arg, pack_args
from shared.types import ContextWindow, Entry

log = logging.getLogger(__name__)

_V = TypeVar("_V")
_HEADER = struct.Struct(">BIdHHH")  # format 1 (before the MessagePack form): still read
_HSIZE = _HEADER.size
_FORMAT = 1
_ENCODE = msgspec.msgpack.Encoder().encode
_INTS = struct.Struct(">BIBIBQ")  # tokens, size_bytes, ts_ms of a stored entry (see pack_entry)
_DECODE_RUN = msgspec.msgpack.Decoder(list[Entry]).decode
_DECODE_ONE = msgspec.msgpack.Decoder(Entry).decode
_LRU_SCALE = 1000  # LRU zset score = last-use ms * 1000 (+ tiebreak); see context.lua
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_PRINCIPAL_BAD = re.compile(r"[{}|\x00\s]")
MAX_ROLE_BYTES = 64
MAX_MIME_BYTES = 128
MAX_LINKS = 64
MAX_LAST_N = 1_000_000
MAX_TOKENS_LIMIT = 2**31 - 1


class ContextError(ValueError):
    """Bad input to the context store (maps to JSON-RPC -32602 / HTTP 400)."""


class ContextNotFound(ContextError):
    """The context does not exist for this principal (or was evicted)."""


class VersionUnavailable(ContextNotFound):
    """The requested version is not retained (older than ``versions_retained``, or evicted)."""


class InvalidModality(ContextError):
    """A modality that is not configured in ``context.modalities``."""


class EntryTooLarge(ContextError):
    """An entry over ``context.max_entry_bytes``."""


class ContextExists(ContextError):
    """fork() target id is already used."""


@dataclass
class AppendResult:
    entry_id: str
    version: int
    evicted: list[str] = field(default_factory=list)  # this principal's contexts evicted by the append
    evicted_principals: list[str] = field(default_factory=list)  # evicted for the global budget


@dataclass
class ContextInfo:
    id: str
    version: int
    bytes: int
    entries: dict[str, int]
    last_used_ms: int
    created_ms: int = 0


def pack_entry(role: str, content: bytes, *, tokens: int, ts_ms: int, mime: str | None = None,
               links: Sequence[str] = ()) -> bytes:
    """The body of an entry's stored form: the MessagePack of its fields after id and
    modality (role, content, mime, tokens, size_bytes, ts_ms, links), without the array
    header. Its length is what budgets count. The script stores it behind the array header,
    the id and the modality (see stored_entry): only the script knows the sequence number.
    The integers have fixed widths (MessagePack uint32, uint32, uint64; decoders take any
    width), so an entry's counted size does not depend on its time or token count."""
    return b"".join((_ENCODE(role), _ENCODE(content), _ENCODE(mime), _INTS.pack(0xCE, tokens, 0xCE, len(content),
                                                                              0xCF, ts_ms), _ENCODE(tuple(links))))


def stored_entry(modality: str, seq: int, body: bytes) -> bytes:
    """An entry as the script stores it (see context.lua): a MessagePack array of the
    fields of ``Entry`` — what ``msgspec.msgpack.decode(.., type=Entry)`` reads back."""
    return b"\x99" + _ENCODE(f"{modality}:{seq}") + _ENCODE(modality) + body


def _array_header(n: int) -> bytes:
    """The MessagePack header of an array of ``n`` items (a run of ``n`` stored entries)."""
    if n < 16:
        return bytes((0x90 + n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 65536 else b"\xdd" + n.to_bytes(4, "big")


_ROLES: dict[bytes, str] = {}  # role bytes -> str: a handful of distinct roles, decoded once


def unpack_entries(modality: str, first: int, values: Sequence[bytes]) -> list[Entry]:
    """Decode stored entries ``first, first + 1, ...`` of a channel one by one: a run that
    does not decode as one MessagePack array because it holds entries of format 1."""
    out = []
    unpack, roles, seq = _HEADER.unpack_from, _ROLES, first
    for raw in values:
        if raw[:1] == b"\x99":
            out.append(_DECODE_ONE(raw))
            seq += 1
            continue
        fmt, tokens, ts, rl, ml, ll = unpack(raw)
        if fmt != _FORMAT:
            raise ValueError(f"unknown entry format {fmt}")
        pos = _HSIZE + rl
        rb = raw[_HSIZE:pos]
        role = roles.get(rb)
        if role is None:
            role = rb.decode()
            if len(roles) < 256:
                roles[rb] = role
        if ml or ll:
            mime = raw[pos:pos + ml].decode() if ml else None
            pos += ml
            links = tuple(raw[pos:pos + ll].decode().split(",")) if ll else ()
            content = raw[pos + ll:]
        else:
            mime, links, content = None, (), raw[pos:]
        out.append(Entry(f"{modality}:{seq}", modality, role, content, mime, tokens, len(content), int(ts), links))
        seq += 1
    return out


def _check_limit(name: str, v: Any, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise ContextError(f"{name} must be an integer in 1..{hi}")


_ERRORS: dict[str, type[ContextError]] = {
    "LM_NOTFOUND": ContextNotFound, "LM_VERSION": VersionUnavailable, "LM_BADLINK": ContextError,
    "LM_EXISTS": ContextExists,
}


def script_config(cfg: ContextConfig) -> bytes:
    """The script's configuration argument (ARGV[3] of context.lua), encoded once per store."""
    return (f"{cfg.channel_max_entries}:{cfg.channel_max_bytes}:{cfg.principal_budget_bytes}:"
            f"{cfg.global_budget_bytes}:{cfg.idle_ttl_s * 1000}:{cfg.versions_retained}:{cfg.audit_maxlen}:"
            f"{cfg.global_lru_resolution_ms}").encode()


def _script_source() -> str:
    return resources.files("shared").joinpath("lua/context.lua").read_text()


def _library(source: str) -> tuple[str, str]:
    """(function name, FUNCTION LOAD code). The name carries a digest of the source, so a
    changed script is a new function and replicas running different versions never mix."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    fn = f"lm_ctx_{digest}"
    code = (f"#!lua name=learnmesh_ctx_{digest}\n{source}\n"
            f"redis.register_function('{fn}', lm_main)\n")
    return fn, code


_SEEN_MAX = 65536  # contexts the read cache remembers reading without keeping them (~17 MiB at most with 20-character names)

_LU = b"\x00u"  # meta field prefix of a context's last use (see context.lua)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# Bytes the read cache counts per entry besides its content: the Entry struct, its id,
# modality and role strings, its time (an int object), the content's bytes header — ~330
# measured with tracemalloc (test_the_read_cache_counts_what_an_entry_takes).
_HELD_ENTRY_OVERHEAD = 330


class _Held(msgspec.Struct, gc=False):
    """Entries of one context a store keeps from its last read (its read cache): per
    channel the first seq and the entries from there on, all of one life (``epoch``) of the
    context. Within one life an entry's (channel, seq) never names other content, so the
    next read of the context asks Redis only for the entries outside these ranges.

    Nothing here is tracked by Python's garbage collector: not this struct (no cycles: it
    holds strings, ints, and a dict of tuples), not ``Entry`` objects (see shared/types.py),
    and, after their first collection, not the tuples and dicts holding only those. So a
    cache of 10^5 entries costs collections nothing; with dataclass entries, full collections
    paused for tens of milliseconds (p99 90-175 ms in ``bench_context.py --full``), and with a
    tracked ``_Held`` per context they cost first reads ~8 µs each."""

    epoch: str
    channels: dict[str, tuple[int, tuple[Entry, ...], int]]  # mod -> (first seq, entries, bytes counted)
    nbytes: int = 0
    held_arg: str = ""  # spec(), computed at the first read that sends it
    # The read these channels are the window of: its arguments (modalities, last_n,
    # max_tokens) and the context's VER field then (see context.lua). A read with the same
    # arguments sends that token; if the context is still there, the script answers "unchanged".
    sig: str = ""
    token: str = ""
    version: int = 0
    packed: bytes = b""  # the script arguments of such a read, packed (see get_window)

    def spec(self) -> str:
        """The script's ``held`` argument (see held_set in context.lua)."""
        if len(self.channels) == 1:  # the usual case, without a generator
            for m, (first, es, _) in self.channels.items():
                return f"{self.epoch};{m}:{first}:{first + len(es) - 1}" if es else self.epoch + ";"
        return self.epoch + ";" + ";".join(f"{m}:{first}:{first + len(es) - 1}"
                                           for m, (first, es, _) in self.channels.items() if es)


def _channel(first: int, entries: Sequence[Entry]) -> tuple[int, tuple[Entry, ...], int]:
    ents = tuple(entries)
    return first, ents, sum([len(e.content) for e in ents]) + _HELD_ENTRY_OVERHEAD * len(ents)


class ContextStore:
    """The context store API used by the gateway, workers and the trainer."""

    def __init__(self, redis: aioredis.Redis, cfg: ContextConfig, *,
                 clock_ms: Callable[[], int] | None = None) -> None:
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            # Content is raw bytes: use a sibling client on the same server that does not decode.
            kwargs = dict(redis.connection_pool.connection_kwargs, decode_responses=False)
            pool = redis.connection_pool.__class__(connection_class=redis.connection_pool.connection_class,
                                                   max_connections=redis.connection_pool.max_connections,
                                                   **kwargs)
            redis = aioredis.Redis(connection_pool=pool)
        self.redis = redis
        # Concurrent operations share pipelined round trips (each is still one script call).
        self._batch = AutoPipeline(redis)
        self.cfg = cfg
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        source = _script_source()
        self._fn, self._fn_code = _library(source)
        # Redis Functions (7.0+): the library is loaded once and each call runs only lm_main.
        # An EVAL script would re-run the whole chunk, re-creating every helper closure, per call.
        self._use_functions: bool | None = None  # None: not yet known
        self._script = redis.register_script(source + "\nreturn lm_main(KEYS, ARGV)\n")
        self._modalities = set(cfg.modalities)
        self._mod_order = {m: i for i, m in enumerate(cfg.modalities)}
        self._mod_names = {m.encode(): m for m in cfg.modalities}
        self._cfg_arg = script_config(cfg)
        self._global_keys = [keys.CTX_GLOBAL_BYTES, keys.CTX_GLOBAL_LRU, keys.AUDIT_STREAM]
        self._heads: dict[tuple[str, str], bytes] = {}
        self._head_template()
        self._now: tuple[int, bytes] = (-1, b"")  # see _now_arg
        self._sig_packed: dict[str, bytes] = {}  # see get_window
        self._op_metrics: dict[str, tuple[Any, Any]] = {}
        self.round_trips = 0  # script calls made (the bench divides by operations)
        # Read cache: (principal, context) -> entries of its last read, LRU, bounded in bytes.
        self._held: OrderedDict[tuple[str, str], _Held] = OrderedDict()
        self._held_bytes = 0
        # Contexts read but not (yet) kept -> their reads so far (see _admit).
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.entries_fetched = 0  # entries read from Redis
        self.entries_reused = 0   # entries get_window took from the read cache instead
        self._read_metrics = (metrics.CONTEXT_READ_ENTRIES.labels("redis"), metrics.CONTEXT_READ_ENTRIES.labels("cache"))

    # ------------------------------------------------------------------ validation
    def _check_principal(self, principal: str) -> None:
        if not principal or len(principal) > 256 or _PRINCIPAL_BAD.search(principal):
            raise ContextError(f"bad principal name {principal!r}")

    @staticmethod
    def _check_id(context_id: str) -> None:
        if not isinstance(context_id, str) or not _ID_RE.fullmatch(context_id):
            raise ContextError("context id must be 1-128 characters of [A-Za-z0-9._:-], starting alphanumeric")

    def _check_modality(self, modality: str) -> None:
        if modality not in self._modalities:
            raise InvalidModality(f"unknown modality {modality!r}; configured: {', '.join(self.cfg.modalities)}")

    def _modalities_arg(self, modalities: Iterable[str] | None) -> str:
        if modalities is None:
            return ""
        mods = list(modalities)
        if not mods:
            raise ContextError("modalities must not be empty (omit it for all)")
        for m in mods:
            self._check_modality(m)
        return ",".join(mods)

    # ------------------------------------------------------------------ plumbing
    def _keys(self, principal: str) -> list[str]:
        """KEYS of every script call: the principal's 5 keys, then the 3 global ones."""
        return keys.ctx_keys(principal) + self._global_keys

    def _head(self, op: str, principal: str, n: int) -> bytes:
        """The RESP command header of ``n`` arguments and its first ones: ``FCALL <fn> 8
        <keys of principal> <global keys> <op> <principal> <config>`` (cached per principal
        and operation — an operation always has the same number of arguments: packing ~20
        arguments per call was a large share of the client's time)."""
        head = self._heads.get((op, principal))
        if head is None:
            if len(self._heads) >= 32768:  # ~250 bytes each: 8 MiB at most
                self._heads.clear()
            # A principal's first call in this process (every call, in a gateway serving more
            # principals than the cache holds): one formatting of a template with the
            # principal in its keys, not ~15 arguments packed one by one.
            pb = principal.encode()
            lens = self._key_lens
            keys_part = self._keys_template % (lens[0] + len(pb), pb, lens[1] + len(pb), pb, lens[2] + len(pb), pb,
                                               lens[3] + len(pb), pb, lens[4] + len(pb), pb)
            head = self._heads[(op, principal)] = b"*%d\r\n%b%b%b%b%b" % (
                n, self._fcall_part, keys_part, self._after_keys, pack_args((op, principal)), self._cfg_part)
        return head

    def _head_template(self) -> None:
        """The constant parts of every call's header (see _head): ``FCALL <fn> 8``, the
        principal's keys as a template (each key around the principal), the global keys and
        the configuration, packed."""
        marker = "\x00"  # never in a principal's name (_check_principal)
        ks = keys.ctx_keys(marker)
        parts = [k.encode().split(marker.encode()) for k in ks]
        if len(parts) != 5 or any(len(p) != 2 for p in parts):
            raise RuntimeError("every context key must name its principal once")
        self._key_lens = [len(a) + len(b) for a, b in parts]
        self._keys_template = b"".join(b"$%%d\r\n%b%%b%b\r\n" % (a.replace(b"%", b"%%"), b.replace(b"%", b"%%"))
                                       for a, b in parts)
        self._fcall_part = pack_args(("FCALL", self._fn, len(ks) + len(self._global_keys)))
        self._after_keys = pack_args(self._global_keys)
        self._cfg_part = pack_arg(self._cfg_arg)

    def _now_arg(self) -> bytes:
        """ARGV 4 (now, ms) packed; the same for every call within a millisecond."""
        now = self._clock_ms()
        if now != self._now[0]:
            self._now = (now, pack_arg(now))
        return self._now[1]

    async def _call(self, op: str, principal: str, *args: Any, packed: bytes | None = None) -> Any:
        """One script call: ARGV ``op, principal, config, now, *args`` (``packed``: ``args``
        already packed with ``pack_args``, ``len(args)`` arguments)."""
        self.round_trips += 1
        t0 = time.perf_counter()
        tail = self._now_arg() + (packed if packed is not None else pack_args(args))
        n = 15 + len(args)  # FCALL, name, numkeys, 8 keys, op, principal, config, now, then args
        try:
            if self._use_functions is not False:
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

    async def _evalsha(self, op: str, principal: str, args: tuple[Any, ...]) -> Any:
        """The script as EVALSHA (Redis < 7: no Functions)."""
        return await self._script(keys=self._keys(principal), args=[op, principal, self._cfg_arg,
                                                                    self._clock_ms(), *args])

    async def _retry(self, op: str, principal: str, args: tuple[Any, ...], n: int, tail: bytes,
                     exc: ResponseError) -> Any:
        """After an error reply: load the library if this server lacks it (first use, or it
        restarted) and call again, or fall back to EVALSHA on Redis < 7; a script error
        becomes its ContextError."""
        try:
            text = str(exc).lower()
            if "function not found" in text:
                await self.redis.function_load(self._fn_code, replace=True)
                self._use_functions = True
                return await self._batch.submit(self._head(op, principal, n) + tail)
            if "unknown command" in text and self._use_functions is None:
                log.info("context store: Redis without Functions, using EVALSHA")
                self._use_functions = False
                return await self._evalsha(op, principal, args)
            raise exc
        except ResponseError as err:
            kind, _, msg = str(err).partition(" ")
            msg = msg.split(" script: ", 1)[0]
            error = _ERRORS.get(kind)
            metrics.CONTEXT_OPS.labels(op, "error").inc()
            if error is None:
                raise
            raise error(msg) from None

    @staticmethod
    def _evicted(flat: list[Any]) -> list[str]:
        out = []
        for i in range(0, len(flat), 2):
            out.append(_text(flat[i]))
            metrics.CONTEXT_EVICTIONS.labels(_text(flat[i + 1])).inc()
        return out

    async def _enforce_global(self, victims: list[Any]) -> list[str]:
        """Evict the principals the script chose for the global budget (LRU over principals)."""
        done = []
        for i in range(0, len(victims), 2):
            who, score = _text(victims[i]), _text(victims[i + 1])
            n, _held = await self._call("evict_principal", who, score, "global_budget")
            if n >= 0:
                done.append(who)
                if n:
                    metrics.CONTEXT_EVICTIONS.labels("global_budget").inc(n)
                log.info("context: evicted principal %s (%d contexts) for the global budget", who, n)
        return done

    def _mod(self, name: Any) -> str:
        """A modality name from a reply (the configured str, not a new one per entry)."""
        return self._mod_names.get(name) or _text(name)

    def _in_order(self, channels: dict[str, _V]) -> dict[str, _V]:
        """Channels in the configured modality order."""
        order = self._mod_order
        return {m: channels[m] for m in sorted(channels, key=lambda m: order.get(m, len(order)))}

    def _runs(self, flat: list[Any], pos: int) -> list[tuple[str, int, list[Entry]]]:
        """Decode the runs of entries at ``flat[pos:]`` (see runs_reply in context.lua) as
        (modality, first seq, entries)."""
        runs = []
        end = len(flat)
        while pos < end:
            mod, first, n = self._mod(flat[pos]), int(flat[pos + 1]), int(flat[pos + 2])
            vals = flat[pos + 3:pos + 3 + n]
            pos += 3 + n
            if None in vals:  # an entry not stored (never expected): the run splits there
                parts, start = [], 0
                for i, v in enumerate([*vals, None]):
                    if v is None:
                        if i > start:
                            parts.append((first + start, vals[start:i]))
                        start = i + 1
            else:
                parts = [(first, vals)]
            for seq, part in parts:
                try:  # stored entries behind one array header: one MessagePack array, one C call
                    ents = _DECODE_RUN(b"".join((_array_header(len(part)), *part)))
                except msgspec.MsgspecError:  # entries of format 1 among them (none decodes as an Entry)
                    ents = unpack_entries(mod, seq, part)
                runs.append((mod, seq, ents))
                self.entries_fetched += len(ents)
        return runs

    @staticmethod
    def _decode_runs(runs: list[tuple[str, int, list[Entry]]]) -> dict[str, list[tuple[int, list[Entry]]]]:
        """Runs (see _runs) as modality -> [(first seq, entries)]."""
        chans: dict[str, list[tuple[int, list[Entry]]]] = {}
        for mod, first, ents in runs:
            chans.setdefault(mod, []).append((first, ents))
        return chans

    def _window(self, principal: str, context_id: str, version: int,
                runs: list[tuple[str, int, list[Entry]]]) -> ContextWindow:
        """The window of the script's runs."""
        win = ContextWindow(principal=principal, context_id=context_id, version=int(version))
        for mod, parts in self._in_order(self._decode_runs(runs)).items():
            if len(parts) == 1:
                win.channels[mod] = parts[0][1]
            else:  # linked entries resolved outside the window come as runs of their own
                parts.sort(key=lambda p: p[0])
                win.channels[mod] = [e for _, ents in parts for e in ents]
        return win

    # ------------------------------------------------------------------ API
    async def append(self, principal: str, context_id: str, modality: str, role: str, content: bytes, *,
                     mime: str | None = None, tokens: int | None = None, links: Sequence[str] = ()) -> AppendResult:
        """Append one entry (creating the context if needed); returns its id and the new version."""
        self._check_principal(principal)
        self._check_id(context_id)
        self._check_modality(modality)
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise ContextError("content must be bytes")
        content = bytes(content)
        if len(content) > self.cfg.max_entry_bytes:
            raise EntryTooLarge(f"entry of {len(content)} bytes exceeds context.max_entry_bytes "
                                f"({self.cfg.max_entry_bytes})")
        if not role or len(role.encode()) > MAX_ROLE_BYTES:
            raise ContextError(f"role must be 1-{MAX_ROLE_BYTES} bytes")
        if mime is not None and (len(mime.encode()) > MAX_MIME_BYTES or not mime):
            raise ContextError(f"mime must be 1-{MAX_MIME_BYTES} bytes")
        if modality == "text":
            try:
                content.decode("utf-8")
            except UnicodeDecodeError:
                raise ContextError("text content must be valid UTF-8") from None
        if tokens is None:
            tokens = len(content)  # bytes-level tokenizer: one token per byte
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS_LIMIT:
            raise ContextError("tokens must be an integer in 0..2^31-1")
        links = list(links)
        if len(links) > MAX_LINKS:
            raise ContextError(f"at most {MAX_LINKS} links per entry")
        for link in links:
            mod, _, seq = str(link).partition(":")
            self._check_modality(mod)
            if mod == modality or not seq.isdigit() or int(seq) < 1:
                raise ContextError(f"link {link!r} must name an entry of another channel, like 'image:3'")
        packed = pack_entry(role, content, tokens=tokens, ts_ms=self._clock_ms(), mime=mime, links=links)
        seq, version, evicted, victims = await self._call("append", principal, context_id, modality, packed,
                                                          ",".join(links))
        metrics.CONTEXT_APPENDED_BYTES.labels(modality).inc(len(content))
        result = AppendResult(entry_id=f"{modality}:{int(seq)}", version=int(version), evicted=self._evicted(evicted))
        if victims:
            result.evicted_principals = await self._enforce_global(victims)
        return result

    async def get_window(self, principal: str, context_id: str, *, modalities: Iterable[str] | None = None,
                         last_n: int | None = None, max_tokens: int | None = None,
                         resolve_links: bool = False) -> ContextWindow:
        """The newest entries per channel: all, the last ``last_n``, and/or within ``max_tokens``
        (per channel; always at least the newest entry). ``resolve_links`` adds entries of the
        requested modalities that returned entries link to, even outside the window."""
        key = (principal, context_id)
        try:
            held = self._held.get(key)
        except TypeError:  # unhashable: not a name (the checks below say so)
            held = None
        if held is None:  # a held record's names were checked when it was kept
            self._check_principal(principal)
            self._check_id(context_id)
        mods = self._modalities_arg(modalities)
        if last_n is not None:
            _check_limit("last_n", last_n, MAX_LAST_N)
        if max_tokens is not None:
            _check_limit("max_tokens", max_tokens, MAX_TOKENS_LIMIT)
        what = (context_id, mods, last_n or 0, max_tokens or 0)  # ARGV 5-8 of ops.window
        if resolve_links:  # linked entries come from Redis every time (see ops.window)
            version, flat, _wins, _ver = self._window_reply(await self._call("window", principal, *what, "1", "", ""))
            return self._window(principal, context_id, version, flat)
        sig = f"{mods}|{last_n or 0}|{max_tokens or 0}"
        same: tuple[dict[str, Any], int] | None = None  # what "unchanged" would refer to
        held_arg = token = ""
        packed = None
        snap: dict[str, tuple[int, tuple[Entry, ...], int]] = {}  # the channels `held_arg` names
        if held is not None:
            if not held.held_arg:
                held.held_arg = held.spec()
            held_arg, snap = held.held_arg, held.channels  # taken together: a concurrent read may re-fill `held`
            if held.sig == sig:  # taken now: a concurrent read may re-label `held` meanwhile
                same, token = (snap, held.version), held.token
                if not held.packed:  # the same arguments as long as `held` is not re-labelled
                    held.packed = self._window_args(context_id, sig, what, held_arg, token)
                packed = held.packed
        if packed is None:
            packed = self._window_args(context_id, sig, what, held_arg, token)
        try:
            reply = await self._call("window", principal, *what, "0", held_arg, token, packed=packed)
        except ContextNotFound:
            self._forget(key)
            raise
        if reply[2] == -1 and same is not None:  # as it was at our last read with these arguments
            return self._unchanged(key, same, mods, reply)
        f0, r0 = self.entries_fetched, self.entries_reused
        version, flat, wins, ver = self._window_reply(reply)
        win = self._assemble(principal, context_id, version, flat, wins, ver, held, snap, mods, sig)
        if win is None:  # the reply and what we hold do not fit together: never expected
            log.warning("context %s/%s: read cache out of step, reading it whole", principal, context_id)
            self._forget(key)
            version, flat, wins, ver = self._window_reply(await self._call("window", principal, *what, "0", "", ""))
            win = self._assemble(principal, context_id, version, flat, wins, ver, None, {}, mods, sig)
            if win is None:
                raise RuntimeError(f"context {context_id}: window reply does not match its ranges")
        if self.entries_fetched != f0:
            self._read_metrics[0].inc(self.entries_fetched - f0)
        if self.entries_reused != r0:
            self._read_metrics[1].inc(self.entries_reused - r0)
        return win

    def _window_args(self, context_id: str, sig: str, what: tuple[str, str, int, int], held_arg: str,
                     token: str) -> bytes:
        """ARGV 5-11 of ops.window packed: the context id, the arguments ``sig`` stands for (a
        handful of distinct ones per process: packed once each), the held entries, the token."""
        rest = self._sig_packed.get(sig)
        if rest is None:
            if len(self._sig_packed) >= 1024:
                self._sig_packed.clear()
            rest = self._sig_packed[sig] = pack_args((*what[1:], "0"))
        return pack_arg(context_id) + rest + pack_args((held_arg, token))

    def _unchanged(self, key: tuple[str, str], same: tuple[dict[str, Any], int], mods: str,
                   reply: list[Any]) -> ContextWindow:
        """The window of an "unchanged" reply: the held channels and version the read sent the
        token of (``same``), the channels asked for."""
        if reply[3]:
            self._evicted(reply[4:4 + 2 * int(reply[3])])
        channels, version = same
        asked = mods.split(",") if mods else None
        out: dict[str, list[Entry]] = {}
        n = 0
        for mod, (_first, ents, _) in channels.items():
            if asked is None or mod in asked:
                out[mod] = list(ents)
                n += len(ents)
        win = ContextWindow(key[0], key[1], version, self._in_order(out) if len(out) > 1 else out)
        self.entries_reused += n
        self._read_metrics[1].inc(n)
        self._recently_read(key)
        return win

    def _recently_read(self, key: tuple[str, str]) -> None:
        """The held record of ``key`` (if still kept) becomes the read cache's most recent."""
        try:
            self._held.move_to_end(key)
        except KeyError:  # dropped meanwhile (budget) or never kept
            pass

    def _window_reply(self, flat: list[Any]) -> tuple[Any, list[tuple[str, int, list[Entry]]], list[Any], str]:
        """Split ops.window's flat reply (see context.lua) into version, runs (decoded, see
        _runs), window ranges ``[mod, first, last, ...]`` and the
        context's VER token ("<version>;<epoch>;<ranges>", see context.lua); evictions it
        reports are counted here."""
        nwin = int(flat[2])
        pos = 3 + 3 * nwin
        wins = flat[3:pos]
        nev = int(flat[pos])
        if nev:
            self._evicted(flat[pos + 1:pos + 1 + 2 * nev])
        return flat[0], self._runs(flat, pos + 1 + 2 * nev), wins, _text(flat[1])

    def _assemble(self, principal: str, context_id: str, version: Any, runs: list[tuple[str, int, list[Entry]]],
                  wins: list[Any], ver: str, held: _Held | None, snap: dict[str, tuple[int, tuple[Entry, ...], int]],
                  mods: str, sig: str) -> ContextWindow | None:
        """The window from the script's reply (runs of the entries we did not hold, and the
        first/last seq of every channel's window) plus the entries held (``snap``: the
        channels of ``held`` when the read named them to the script — a concurrent read may
        have re-filled ``held`` since); then keep what was read for the next read. None if they
        do not cover the windows exactly."""
        win = ContextWindow(principal, context_id, int(version))
        fetched = self._decode_runs(runs)
        parts_of_ver = ver.split(";", 2)  # version, epoch (the context's life), channel ranges
        epoch = parts_of_ver[1] if len(parts_of_ver) > 1 else ""
        same_life = held is not None and held.epoch == epoch
        # keep what this read gets? (a context the cache holds: yes; else see _admit)
        keeping = bool(self.cfg.read_cache_bytes) and (held is not None or self._admit((principal, context_id)))
        kept: dict[str, tuple[int, tuple[Entry, ...], int]] = {}
        unchanged = same_life
        for i in range(0, len(wins), 3):
            mod = self._mod(wins[i])
            lo, hi = int(wins[i + 1]), int(wins[i + 2])
            parts = fetched.pop(mod, [])
            ch = snap.get(mod) if same_life else None
            if ch is not None:
                first, ents, nbytes = ch
                a, b = max(lo, first), min(hi, first + len(ents) - 1)
                if a <= b:
                    self.entries_reused += b - a + 1
                    if not parts and first == lo and len(ents) == hi - lo + 1:  # unchanged since the last read
                        win.channels[mod] = list(ents)
                        kept[mod] = ch
                        continue
                    mine = ents[a - first:b - first + 1]
                    if a == lo and len(parts) == 1 and parts[0][0] == b + 1 and b + len(parts[0][1]) == hi:
                        # The usual read after appends: what we hold, then the new entries.
                        # The byte count follows from the held one (what left the window out,
                        # what came in) instead of a pass over every entry.
                        new = parts[0][1]
                        for e in new:  # a loop, not sum(): usually one to three entries
                            nbytes += len(e.content) + _HELD_ENTRY_OVERHEAD
                        for e in ents[:a - first]:
                            nbytes -= len(e.content) + _HELD_ENTRY_OVERHEAD
                        for e in ents[b - first + 1:]:
                            nbytes -= len(e.content) + _HELD_ENTRY_OVERHEAD
                        entries = [*mine, *new]
                        win.channels[mod] = entries
                        kept[mod] = (lo, tuple(entries), nbytes)
                        unchanged = False
                        continue
                    parts.append((a, list(mine)))
                    if len(parts) > 1:
                        parts.sort(key=lambda p: p[0])
            unchanged = False
            expect = lo
            for first, es in parts:  # contiguous and exactly lo..hi
                if first != expect:
                    return None
                expect += len(es)
            if expect != hi + 1:
                return None
            entries = parts[0][1] if len(parts) == 1 else [e for _, es in parts for e in es]
            win.channels[mod] = entries
            if keeping:
                kept[mod] = _channel(lo, entries)
        if fetched:  # entries outside every window
            return None
        if len(win.channels) > 1:
            win.channels = self._in_order(win.channels)
        # `ver` is the token the next read with these arguments sends back as is: "unchanged"
        # if the context's VER is still this.
        current = same_life and held.channels is snap  # type: ignore[union-attr]  # not re-filled since
        if unchanged and current and len(kept) == len(snap):
            held.sig, held.token, held.version = sig, ver, int(version)  # type: ignore[union-attr]
            held.packed = b""  # type: ignore[union-attr]
            self._recently_read((principal, context_id))
        elif keeping and epoch:
            if same_life and mods:  # channels this read did not ask for stay as they were
                asked = mods.split(",")
                for mod, ch in snap.items():
                    if mod not in asked:
                        kept.setdefault(mod, ch)
            key = (principal, context_id)
            if current and self._held.get(key) is held:  # the usual read after appends: re-filled in place
                held.channels, held.sig, held.token, held.version = kept, sig, ver, int(version)  # type: ignore[union-attr]
                held.held_arg, held.packed = "", b""  # type: ignore[union-attr]
                self._keep(key, held, replace=False)  # type: ignore[arg-type]
            else:
                self._keep(key, _Held(epoch, kept, sig=sig, token=ver, version=int(version)))
        return win

    def _admit(self, key: tuple[str, str]) -> bool:
        """Whether a read of ``key``, which the cache does not hold, keeps what it read: from
        the context's ``read_cache_admit_reads``-th read among the last _SEEN_MAX contexts
        read. A context read once (a one-shot session, a scan over many contexts) does not
        crowd out those read again and again, and its read does not pay for keeping its
        entries (on this project's VM a first read that kept them cost the client ~40% more:
        docs/context.md, "Read cache")."""
        need = self.cfg.read_cache_admit_reads
        if need <= 1:
            return True
        seen = self._seen.pop(key, 0) + 1
        if seen >= need:
            return True
        self._seen[key] = seen
        if len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        return False

    def _keep(self, key: tuple[str, str], held: _Held, *, replace: bool = True) -> None:
        """Keep ``held`` as the read cache's most recent record of ``key`` (``replace``: a new
        record; else the one kept, re-filled) within the cache's byte budget."""
        nbytes = 0
        for ch in held.channels.values():
            nbytes += ch[2]
        if replace:
            self._forget(key)
        else:
            self._held_bytes -= held.nbytes
        held.nbytes = nbytes
        if nbytes > self.cfg.read_cache_bytes // 8:  # one context may not crowd out the rest
            if not replace:
                del self._held[key]
            return
        if replace:
            self._held[key] = held
        else:
            self._held.move_to_end(key)
        self._held_bytes += nbytes
        while self._held_bytes > self.cfg.read_cache_bytes:
            _, old = self._held.popitem(last=False)
            self._held_bytes -= old.nbytes

    def _forget(self, key: tuple[str, str]) -> None:
        old = self._held.pop(key, None)
        if old is not None:
            self._held_bytes -= old.nbytes

    async def read_at_version(self, principal: str, context_id: str, version: int, *,
                              modalities: Iterable[str] | None = None) -> ContextWindow:
        """The context exactly as it was at ``version`` (raises VersionUnavailable if not retained)."""
        self._check_principal(principal)
        self._check_id(context_id)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ContextError("version must be a positive integer")
        mods = self._modalities_arg(modalities)
        reply = await self._call("read_at", principal, context_id, version, mods)
        self._evicted(reply[1])
        return self._window(principal, context_id, reply[0], self._runs(reply, 2))

    async def version(self, principal: str, context_id: str) -> int:
        self._check_principal(principal)
        self._check_id(context_id)
        ver, evicted = await self._call("version", principal, context_id)
        self._evicted(evicted)
        return int(ver)

    async def list_contexts(self, principal: str) -> list[ContextInfo]:
        """The principal's live contexts, most recently used first."""
        self._check_principal(principal)
        raw, lru, evicted = await self._call("list", principal)
        self._evicted(evicted)
        scores = {_text(lru[i]): int(float(lru[i + 1])) for i in range(0, len(lru), 2)}
        used = {cid: sc // _LRU_SCALE for cid, sc in scores.items()}
        out = []
        for i in range(0, len(raw), 2):
            m = orjson.loads(raw[i + 1])
            ch = m.get("ch") or {}
            cid = _text(raw[i])
            out.append(ContextInfo(id=cid, version=int(m["v"]), bytes=int(m["b"]),
                                   entries={k: int(c["hi"]) - int(c["lo"]) + 1 for k, c in ch.items()},
                                   last_used_ms=used.get(cid, 0), created_ms=int(m.get("t", 0))))
        out.sort(key=lambda i: scores.get(i.id, 0), reverse=True)  # exact LRU order, MRU first
        return out

    async def clear(self, principal: str, context_id: str) -> int:
        """Empty every channel; returns the new version (older versions stay readable while retained)."""
        self._check_principal(principal)
        self._check_id(context_id)
        ver, evicted = await self._call("clear", principal, context_id)
        self._evicted(evicted)
        return int(ver)

    async def fork(self, principal: str, src_id: str, dst_id: str | None = None) -> str:
        """Copy a context's current entries into a new context (server-side, one round trip)."""
        self._check_principal(principal)
        self._check_id(src_id)
        dst_id = dst_id if dst_id is not None else f"{src_id[:100]}-{uuid.uuid4().hex[:12]}"
        self._check_id(dst_id)
        if dst_id == src_id:
            raise ContextExists("fork target must differ from the source")
        _ver, evicted, victims = await self._call("fork", principal, src_id, dst_id)
        self._evicted(evicted)
        if victims:
            await self._enforce_global(victims)
        return dst_id

    async def evict(self, principal: str, context_id: str, *, reason: str = "admin") -> bool:
        """Remove a context entirely (audited); False if it did not exist."""
        self._check_principal(principal)
        self._check_id(context_id)
        if not re.fullmatch(r"[a-z_]{1,32}", reason):
            raise ContextError("bad eviction reason")
        done, evicted = await self._call("evict", principal, context_id, reason)
        self._evicted(evicted)
        return bool(done)

    async def principal_bytes(self, principal: str) -> int:
        """Bytes the principal holds (entries physically kept, retained versions included)."""
        raw = await self.redis.hget(keys.ctx_meta(principal), "\x00bytes")
        return int(raw or 0)

    async def global_bytes(self) -> int:
        raw = await self.redis.hget(keys.CTX_GLOBAL_BYTES, "\x00total")
        return int(raw or 0)

    async def lru_order(self, principal: str) -> list[str]:
        """The principal's contexts in exact LRU order, least recently used first, read
        without running an operation (no idle expiry, no use): R's scores are lower bounds
        brought up to date by the last-use fields (see context.lua). For admin and tests."""
        self._check_principal(principal)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrange(keys.ctx_lru(principal), 0, -1, withscores=True)
            pipe.hgetall(keys.ctx_meta(principal))
            lru, meta = await pipe.execute()
        def last(cid: bytes, score: float) -> float:
            return max(score, float(meta.get(_LU + cid, 0)))
        return [_text(c) for c, _ in sorted(lru, key=lambda cs: (last(*cs), cs[0]))]

    async def principals(self) -> list[str]:
        """Principals known to the global LRU, most recently used first (for admin)."""
        return [_text(p) for p in await self.redis.zrevrange(keys.CTX_GLOBAL_LRU, 0, -1)]

