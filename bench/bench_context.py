"""Context store benchmark: learnmesh's one-script-per-operation store against the naive
baseline used by popular agent-memory servers (one JSON document per context: GET, modify
in the client, SET), measured in the same run, on the same Redis, with the same data and
the same number of concurrent callers.

Both sides use redis-py asyncio and orjson, on uvloop — the gateway's event loop, so the
store is measured as the gateway runs it (``--loop asyncio`` for the standard loop). The naive side stores exactly what the store
stores (role, content, mime, tokens, time, links, version) as one JSON document per context,
keeps the same window (the last ``--entries`` entries) and returns plain dicts (cheaper
than the store's ``Entry`` objects — the baseline is not handicapped).

Prints, per implementation, operation and concurrency, for each of ``--repeat`` runs:
ops/s, p50/p99 latency, Redis commands per operation as sent by the client (round trips;
from INFO commandstats, cross-checked with the store's own call counter), and CPU time
per operation of the benchmark process (client) and of redis-server (INFO cpu) — the CPU
figures hold up on a loaded machine where wall-clock figures do not. Then the ratios of
every run, the memory per 1 KiB entry against the raw payload, and the load average.

Reads are measured twice: through the store as the gateway uses it (its read cache on: a
read fetches only the entries it did not get last time it read that context — appends of
the run before are new to it) and through a store with the cache off (every read fetches
all it returns). Each read row says how many entries per read came from Redis and how
many from the cache. A third read row, ``floor``, is not a store: one Redis Function that
only fetches the last entries of the same data (no state, LRU, budgets or cache; see
``Floor``) — the most any design with one script per read can reach here when the read
must bring its entries from Redis, the case of a process's first read of a context. A
fourth, ``onevalue``, is the store's own script doing a read's bookkeeping but fetching the
window as one prebuilt value (see ``OneValue``): what the store's first read would cost if
its layout held a window in one value.

Default run is short (well under a minute on an idle machine): 300 principals, 100-entry
contexts, 128-byte entries. ``--full``: 10,000 principals (preloaded with a pipelined bulk
load that writes the store's own layout; checked against the script's result first).
``--cluster``: the same run on a single redis-server, then on a Redis Cluster of 3 masters the
bench starts itself (``shared.redis_local_cluster``; no replicas, so both use the same
machine's cores for the same work), then the two side by side: ops/s, p99 and round trips
per operation, and the store's first reads against the fetch-only floor in each.
Before the first measurement, every operation of both sides runs a short warm-up that is
not recorded, on 100 principals of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
import orjson
import redis.asyncio as aioredis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shared import keys  # noqa: E402
from shared.config import ContextConfig, RedisConfig  # noqa: E402
from shared.context import ContextStore, pack_entry, stored_entry  # noqa: E402
from shared.context.entries import array_header, decode_run  # noqa: E402
from shared.context.scripts import NUM_KEYS, library, script_config, script_keys, script_source  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.redis_batch import pack_command  # noqa: E402
from shared.redis_client import AsyncRedis, async_client, for_each_primary  # noqa: E402
from shared.redis_cluster_batch import auto_pipeline  # noqa: E402
from shared.redis_local_cluster import LocalCluster  # noqa: E402
from shared.types import Entry  # noqa: E402


class Naive:
    """One JSON document per context; read-modify-write from the client (2 round trips)."""

    def __init__(self, r: aioredis.Redis, window: int) -> None:
        self.r = r
        self.window = window

    @staticmethod
    def key(principal: str, cid: str) -> str:
        return f"naive:{{{principal}}}:{cid}"

    @staticmethod
    def entry(text: str, n: int, ts_ms: int) -> dict:
        return {"id": f"text:{n}", "modality": "text", "role": "user", "content": text, "mime": None,
                "tokens": len(text), "ts_ms": ts_ms, "links": []}

    async def append(self, principal: str, cid: str, text: str) -> None:
        key = self.key(principal, cid)
        raw = await self.r.get(key)
        doc: dict[str, Any] = orjson.loads(raw) if raw else {"version": 0, "seq": 0, "entries": []}
        doc["version"] += 1
        doc["seq"] += 1
        doc["entries"].append(self.entry(text, doc["seq"], int(time.time() * 1000)))
        if len(doc["entries"]) > self.window:
            del doc["entries"][:-self.window]
        await self.r.set(key, orjson.dumps(doc))

    async def get_window(self, principal: str, cid: str, last_n: int) -> list:
        raw = await self.r.get(self.key(principal, cid))
        assert raw is not None, "every measured context is preloaded"
        return orjson.loads(raw)["entries"][-last_n:]


class _BenchLibrary:
    """A Redis Function library of the bench's own, called through a pipeline like the store's."""

    code = ""

    def __init__(self, r: AsyncRedis) -> None:
        self.r = r
        self.batch = auto_pipeline(r)

    async def load(self) -> None:
        await for_each_primary(self.r, lambda node: node.function_load(self.code, replace=True))


class Floor(_BenchLibrary):
    """The least a read can cost when it is one Lua call: a Redis
    Function that only reads the channel's range (the ``\\0v`` field) and ``HMGET``s the
    last ``n`` stored entries of the store's own layout — no principal state, no LRU use, no
    idle check, no budgets, no read cache — sent through the store's pipeline and decoded as
    the store decodes a run. Not a store: it bounds what any one-script-per-read design can
    reach here when a read must bring its entries from Redis (a first read)."""

    # Sequence numbers' names are kept as the store's script keeps them (SEQS in context.lua):
    # formatting them per call would cost the floor ~3 µs the store does not pay.
    code = """#!lua name=lmbench_floor
local SEQS = {}
redis.register_function('lmbench_floor_window', function(keys, args)
  local cid, n = args[1], tonumber(args[2])
  local hi = tonumber(string.match(redis.call('HGET', keys[2], '\\0v' .. cid), ':(%d+)$'))
  local fields, pre = {}, cid .. '|text|'
  for s = hi - n + 1, hi do
    local d = SEQS[s]
    if not d then d = string.format('%d', s); SEQS[s] = d end
    fields[#fields + 1] = pre .. d
  end
  return redis.call('HMGET', keys[1], unpack(fields))
end)
"""

    async def get_window(self, principal: str, cid: str, last_n: int) -> list[Entry]:
        e, m = keys.ctx_entries(principal), keys.ctx_meta(principal)
        vals = await self.batch.submit(pack_command(("FCALL", "lmbench_floor_window", 2, e, m, cid, last_n)), e)
        return decode_run(vals)  # as the store decodes a run



class OneValue(_BenchLibrary):
    """The store's own read with one thing changed: the window comes as ONE value. The
    store's script (its library, as loaded by the store) plus one operation that does what
    a window read does for its bookkeeping — the principal's state and the context's meta in
    one ``HMGET``, the idle check, the use, the state written back and the TTLs (not the
    global LRU stamp the store posts beside its calls) — but fetches the last entries as one prebuilt value (``prepare`` joins each
    context's last ``n`` stored entries into the field ``\\0w<cid>`` of its entries hash,
    as the read cache's run buffer). Not a store (the value is not maintained): it shows what
    the store's read would cost if its layout held a window in one value instead of one
    value per entry — the layout, not the bookkeeping, is what a first read pays for."""

    OP = """
function ops.bench_one_value()
  local cid = ARGS[5]
  if not raw_meta(cid) then fail('LM_NOTFOUND context ' .. cid) end
  local run = redis.call('HGET', E, '\\0w' .. cid)
  touch(cid)
  finish(true)
  return {#evicted, run}
end
"""

    def __init__(self, r: AsyncRedis, store: ContextStore) -> None:
        super().__init__(r)
        self.cfg_arg = script_config(store.cfg)
        self.decode = msgspec.msgpack.Decoder(list[Entry]).decode  # the window: one prebuilt array
        self.fn, self.code = library(script_source() + self.OP)

    async def prepare(self, principals: int, entries: int, n: int) -> None:
        """Every principal u<i>'s context "c": its last ``n`` stored entries as one value."""
        fields = [f"c|text|{s}" for s in range(entries - n + 1, entries + 1)]
        for start in range(0, principals, 500):
            names = [f"u{i}" for i in range(start, min(principals, start + 500))]
            pipe = self.r.pipeline(transaction=False)
            for p in names:
                pipe.hmget(keys.ctx_entries(p), fields)
            got = await pipe.execute()
            pipe = self.r.pipeline(transaction=False)
            for p, vals in zip(names, got, strict=True):
                pipe.hset(keys.ctx_entries(p), "\x00wc", b"".join((array_header(n), *vals)))
            await pipe.execute()

    async def get_window(self, principal: str, cid: str) -> list[Entry]:
        ks = script_keys(principal, False)  # the floor keeps no global accounting
        reply = await self.batch.submit(pack_command(("FCALL", self.fn, NUM_KEYS, *ks, "bench_one_value",
                                                      principal, self.cfg_arg, int(time.time() * 1000), cid)), ks[0])
        return self.decode(reply[1])


async def client_commands(r: AsyncRedis) -> int:
    """Commands clients sent (script-internal calls excluded), on every master: one per round
    trip here. Not EVAL: on a cluster the store posts its global accounting as EVALs beside its
    calls, in the same batches (counted apart, as posted/op)."""
    async def one(node: aioredis.Redis) -> int:
        stats = await node.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k in (
            "cmdstat_fcall", "cmdstat_evalsha", "cmdstat_get", "cmdstat_set"))
    return sum(await for_each_primary(r, one))


async def server_cpu(r: AsyncRedis) -> float:
    """CPU seconds of every master."""
    async def one(node: aioredis.Redis) -> float:
        info = await node.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return sum(await for_each_primary(r, one))


async def measure(r, name: str, op, n_ops: int, concurrency: int, principals: int, seed: int,
                  first: int = 0) -> dict:
    """Run ``n_ops`` of ``op`` on random principals u<first>..u<first + principals - 1>,
    ``concurrency`` callers at a time."""
    lat: list[float] = []
    remaining = [n_ops]
    rnd = random.Random(seed)

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            p = f"u{first + rnd.randrange(principals)}"
            t0 = time.perf_counter()
            await op(p)
            lat.append(time.perf_counter() - t0)

    c0, s0 = await client_commands(r), await server_cpu(r)
    p0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - p0
    c1, s1 = await client_commands(r), await server_cpu(r)
    lat.sort()
    return {"name": name, "ops_s": n_ops / wall, "p50_ms": lat[len(lat) // 2] * 1e3,
            "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, "cmds_per_op": (c1 - c0) / n_ops,
            "client_us": cpu / n_ops * 1e6, "server_us": (s1 - s0) / n_ops * 1e6}


WARM_PRINCIPALS, WARM_OPS = 100, 500  # the warm-up before the measurements (see main)


def bulk_load(pipe, cfg: ContextConfig, principal: str, cid: str, packed: list[bytes], now_ms: int,
              single: bool) -> int:
    """Queue on `pipe` the state the script leaves after appending `packed` (entry bodies
    of text entries, no links; see pack_entry) to a new context `cid` of a new principal at
    time `now_ms` — the store's own layout (docs/context.md), written without Lua. Audit
    records are not written.
    ``single``: on one server, where the script keeps the time of the principal's global stamp
    with its state (on a cluster, the time its bytes last changed). Returns the stored bytes."""
    n, w, nver = len(packed), cfg.channel_max_entries, cfg.versions_retained
    lo = max(1, n - w + 1)
    vf = max(1, n - nver + 1)
    plo = max(1, vf - w + 1)  # lo of the oldest retained version
    kept = {s: packed[s - 1] for s in range(plo, n + 1)}
    stored = sum(len(v) for v in kept.values())
    lb = sum(len(packed[s - 1]) for s in range(lo, n + 1))
    e, m, lru, ver, _evicted_versions, _audit = keys.ctx_keys(principal)
    pipe.hset(e, mapping={f"{cid}|text|{s}": stored_entry("text", s, v) for s, v in kept.items()})
    meta = {"v": n, "vf": vf, "b": stored, "t": now_ms, "ch": {"text": {"lo": lo, "hi": n, "plo": plo, "lb": lb}},
            "e": f"1.bulk.{principal}"}  # the life's name: unique, its form does not matter
    score = now_ms * 1000
    pipe.hset(m, mapping={cid: orjson.dumps(meta), f"\x00v{cid}": f"{n};{meta['e']};text:{lo}:{n}", f"\x00u{cid}": score,
                          "\x00bytes": stored, "\x00clock": score,
                          "\x00exp": now_ms, "\x00due": now_ms + cfg.idle_ttl_s * 1000,
                          **({"\x00gs": now_ms} if single else {"\x00ch": now_ms})})
    pipe.zadd(lru, {cid: score})
    pipe.hset(ver, mapping={f"{cid}|{v}": f"text:{max(1, v - w + 1)}:{v}" for v in range(vf, n + 1)})
    ttl = cfg.idle_ttl_s * 1000 + cfg.idle_ttl_s * 1000 // 16
    for k in (e, m, lru, ver):
        pipe.pexpire(k, ttl)
    shard = keys.ctx_global_shard(principal)
    pipe.hincrby(keys.ctx_global_bytes(shard), principal, stored)
    pipe.hincrby(keys.ctx_global_bytes(shard), "\x00total", stored)
    pipe.zadd(keys.ctx_global_lru(shard), {principal: now_ms})
    pipe.zadd(keys.ctx_global_seen(shard), {principal: now_ms})
    return stored


async def snapshot(r: aioredis.Redis, principal: str) -> dict:
    e, m, lru, ver, st, _audit = keys.ctx_keys(principal)
    meta = {k: {f: x for f, x in orjson.loads(v).items() if f != "e"}  # "e" names the life: unique by design
            for k, v in cast(dict[bytes, bytes], await r.hgetall(m)).items() if not k.startswith(b"\x00")}
    state = sorted(k for k in cast(list[bytes], await r.hkeys(m)) if k.startswith(b"\x00"))  # names only: clocks differ
    return {"e": await r.hgetall(e), "m": meta, "state": state, "lru": await r.zrange(lru, 0, -1),
            "ver": await r.hgetall(ver),
            "bytes": (await r.hget(m, "\x00bytes")), "g": await r.hget(keys.ctx_global_bytes(keys.ctx_global_shard(principal)), principal)}


async def check_bulk_load(r: aioredis.Redis, store: ContextStore, entries: int, payload: bytes) -> None:
    """The bulk loader must produce exactly the script's state (else the bench measures a fiction)."""
    cfg, now = store.cfg, int(time.time() * 1000)
    packed = [pack_entry("user", payload, tokens=len(payload), ts_ms=now) for _ in range(entries + 20)]
    fixed = ContextStore(r, cfg, clock_ms=lambda: now)  # same packed entries as `packed`
    for _ in packed:
        await fixed.append("chk-script", "c", "text", "user", payload)
    pipe = r.pipeline(transaction=False)
    bulk_load(pipe, cfg, "chk-bulk", "c", packed, now, not isinstance(r, aioredis.RedisCluster))
    await pipe.execute()
    a, b = await snapshot(r, "chk-script"), await snapshot(r, "chk-bulk")
    assert a == b, f"bulk load differs from the script's layout:\n{a['m']} {a['state']}\n{b['m']} {b['state']}"
    win = await store.get_window("chk-bulk", "c", last_n=3)
    assert [e.id for e in win.channels["text"]] == [f"text:{entries + 18}", f"text:{entries + 19}",
                                                    f"text:{entries + 20}"]
    for p in ("chk-script", "chk-bulk"):
        await store.evict(p, "c")


async def preload(r: aioredis.Redis, cfg: ContextConfig, naive: Naive, principals: int, entries: int,
                  payload: bytes) -> None:
    """Every principal u<i> gets context "c" with `entries` entries in both layouts."""
    now = int(time.time() * 1000)
    packed = [pack_entry("user", payload, tokens=len(payload), ts_ms=now) for _ in range(entries)]
    text = payload.decode()
    naive_doc = orjson.dumps({"version": entries, "seq": entries,
                              "entries": [Naive.entry(text, s, now) for s in range(1, entries + 1)]})
    for start in range(0, principals, 200):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(principals, start + 200)):
            bulk_load(pipe, cfg, f"u{i}", "c", packed, now, not isinstance(r, aioredis.RedisCluster))
            pipe.set(Naive.key(f"u{i}", "c"), naive_doc)
        await pipe.execute()


LUA_BYTES = """#!lua name=lmbench_bytes
redis.register_function('lmbench_bytes_get', function(keys, args)
  local n = 0
  for _ = 1, tonumber(args[1]) do n = n + #redis.call('GET', keys[1]) end
  return n
end)
"""


async def lua_byte_cost(r: aioredis.Redis, n: int = 200) -> tuple[float, float, float]:
    """What Redis's Lua spends to make a string of a value a script reads: the time of a
    script that GETs a value ``n`` times, for 100 B and 100 KiB values. Returns (ns per
    byte, µs per 100 B, µs per 100 KiB). Every byte of an entry a script returns passes
    through such a string once (docs/context.md, "Where a read's time goes")."""
    await r.function_load(LUA_BYTES, replace=True)
    out = []
    for size in (100, 100 * 1024):
        await r.set("lmbench:bytes", b"x" * size)
        best = float("inf")
        for _ in range(3):  # the least of three: scheduling noise only ever adds
            t0 = time.perf_counter()
            assert await r.fcall("lmbench_bytes_get", 1, "lmbench:bytes", n) == n * size
            best = min(best, time.perf_counter() - t0)
        out.append(best / n)
    await r.delete("lmbench:bytes")
    await r.function_delete("lmbench_bytes")
    small, big = out
    return (big - small) / (100 * 1024 - 100) * 1e9, small * 1e6, big * 1e6


async def memory_per_entry(r: aioredis.Redis, cfg: ContextConfig, contexts: int) -> tuple[float, float]:
    """MEMORY USAGE (exact, SAMPLES 0) of the keys holding 100-entry contexts of 1 KiB entries,
    per entry / 1024, for the store and for the naive JSON documents."""
    payload = b"m" * 1024
    store, naive = ContextStore(r, cfg), Naive(r, 100)
    for c in range(contexts):
        for _ in range(100):
            await store.append("mem", f"c{c}", "text", "user", payload)
            await naive.append("mem", f"c{c}", payload.decode())
    used_store = sum([await r.memory_usage(k, samples=0) or 0 for k in keys.ctx_keys("mem")])
    used_naive = sum([await r.memory_usage(Naive.key("mem", f"c{c}"), samples=0) or 0 for c in range(contexts)])
    n = contexts * 100
    return used_store / (n * 1024), used_naive / (n * 1024)


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"
    except OSError:
        return "n/a"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", help="use this Redis (it is FLUSHED); default: a private redis-server")
    ap.add_argument("--principals", type=int, default=300)
    ap.add_argument("--entries", type=int, default=100, help="entries per context (window size)")
    ap.add_argument("--payload", type=int, default=128, help="bytes per entry in the throughput runs")
    ap.add_argument("--ops", type=int, help="operations per measurement (default 1000; 3000 with --full)")
    ap.add_argument("--concurrency", default="4,64")
    ap.add_argument("--repeat", type=int, default=2, help="runs of every measurement point")
    ap.add_argument("--last-n", type=int, default=20, help="entries get_window reads")
    ap.add_argument("--mem-contexts", type=int, default=10, help="100-entry contexts of 1 KiB entries")
    ap.add_argument("--full", action="store_true", help="10,000 principals, 3,000 ops per measurement (unless --ops)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="event loop of both sides (default: uvloop, the gateway's loop)")
    ap.add_argument("--cluster", action="store_true",
                    help="also run on a 3-master Redis Cluster (started here) and compare it with the single server")
    ap.add_argument("--cluster-url", help="with --cluster: use this cluster (any node; it is FLUSHED)")
    ap.add_argument("--evictor", action="store_true",
                    help="measure only how far over the global budget appends run between evictor sweeps")
    ap.add_argument("--evict-interval", type=float, default=1.0, help="with --evictor: global_evict_interval_s")
    return ap.parse_args()


def apply_profile(args: argparse.Namespace) -> None:
    """Fill in what ``--full`` and ``--ops`` leave to the profile."""
    if args.full:
        args.principals, args.mem_contexts = 10_000, 50
    if args.ops is None:
        args.ops = 3000 if args.full else 1000


def start_private_redis() -> tuple[subprocess.Popen, str, str]:
    """A redis-server of the bench's own in a temporary directory: (process, directory, URL)."""
    port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-bench-redis-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir,
                             "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)
    return proc, workdir, f"redis://127.0.0.1:{port}/0"


async def wait_for_redis(r: aioredis.Redis) -> None:
    for _ in range(200):
        try:
            await r.ping()
            return
        except Exception:  # noqa: BLE001
            await asyncio.sleep(0.05)


@dataclasses.dataclass
class Sides:
    """Everything a run measures, on one Redis: the store as the gateway uses it, the naive
    baseline, and the three reads that explain the store's read figures."""

    store: ContextStore
    naive: Naive
    uncached: ContextStore  # the same store without its read cache: every read fetches all it returns
    floor: Floor  # the bound of any one-script read that must fetch its entries
    one: OneValue  # the store's read bookkeeping, the window in one value


async def open_sides(r: aioredis.Redis, cfg: ContextConfig, entries: int) -> Sides:
    store, naive = ContextStore(r, cfg), Naive(r, entries)
    uncached = ContextStore(r, dataclasses.replace(cfg, read_cache_bytes=0))
    floor = Floor(r)
    await floor.load()
    one = OneValue(r, uncached)
    await one.load()
    return Sides(store, naive, uncached, floor, one)


async def load_data(r: aioredis.Redis, cfg: ContextConfig, sides: Sides, args: argparse.Namespace,
                    payload: bytes) -> None:
    """Check the bulk loader, then preload the measured and the warm-up principals in every layout."""
    await check_bulk_load(r, sides.store, args.entries, payload)
    t0 = time.perf_counter()
    await preload(r, cfg, sides.naive, args.principals + WARM_PRINCIPALS, args.entries, payload)
    await sides.one.prepare(args.principals + WARM_PRINCIPALS, args.entries, args.last_n)
    probe = f"u{args.principals}"  # a warm-up principal: measured ones stay unread
    want = (await sides.uncached.get_window(probe, "c", last_n=args.last_n)).channels["text"]
    assert await sides.one.get_window(probe, "c") == want, "the one-value bound reads other entries than the store"
    print(f"preloaded {args.principals} principals x {args.entries} entries x {args.payload} B "
          f"in {time.perf_counter() - t0:.1f}s (both layouts, pipelined bulk load)")


def operations(sides: Sides, payload: bytes, last_n: int) -> tuple[tuple[str, Any], ...]:
    """(name, operation on a principal) of every row, in the order they are measured."""
    text = payload.decode()
    return (
        ("store.append", lambda p: sides.store.append(p, "c", "text", "user", payload)),
        ("naive.append", lambda p: sides.naive.append(p, "c", text)),
        (f"store.get_window(last {last_n})", lambda p: sides.store.get_window(p, "c", last_n=last_n)),
        (f"naive.get_window(last {last_n})", lambda p: sides.naive.get_window(p, "c", last_n)),
        (f"uncached.get_window(last {last_n})", lambda p: sides.uncached.get_window(p, "c", last_n=last_n)),
        (f"floor.get_window(last {last_n})", lambda p: sides.floor.get_window(p, "c", last_n)),
        (f"onevalue.get_window(last {last_n})", lambda p: sides.one.get_window(p, "c")),
    )


async def warm_up(r: aioredis.Redis, ops: tuple[tuple[str, Any], ...], args: argparse.Namespace) -> None:
    """Every operation of both sides on principals of their own (u<principals>..), not recorded,
    so that the first measurement does not pay for what only a process's first operations pay
    (allocator growth, first-touch pages in Redis, connections) and no measured context is read
    before it is measured."""
    for name, op in ops:
        await measure(r, name, op, min(WARM_OPS, args.ops), 4, WARM_PRINCIPALS, seed=7, first=args.principals)


async def measure_all(r: aioredis.Redis, sides: Sides, ops: tuple[tuple[str, Any], ...],
                      args: argparse.Namespace) -> list[dict]:
    """Every operation at every concurrency, ``--repeat`` times; prints a line per measurement."""
    rows = []
    print("  run conc  operation                        ops/s    p50 ms   p99 ms  cmds/op  "
          "client-CPU us/op  redis-CPU us/op")
    for run in range(args.repeat):
        for conc in [int(x) for x in args.concurrency.split(",")]:
            for name, op in ops:
                rows.append(await measure_row(r, sides, name, op, args, run, conc))
    return rows


async def measure_row(r: aioredis.Redis, sides: Sides, name: str, op: Any, args: argparse.Namespace, run: int,
                      conc: int) -> dict:
    st = sides.store if name.startswith("store") else sides.uncached
    ours = name.startswith(("store", "uncached"))
    rt0, f0, u0, b0 = st.round_trips, st.entries_fetched, st.entries_reused, st.posted
    row = await measure(r, name, op, args.ops, conc, args.principals, seed=run * 1000 + conc)
    if ours:  # cross-check against the store's own call counter
        assert st.round_trips - rt0 == args.ops, "store made more than one call per op"
    row["conc"], row["run"] = conc, run + 1
    cache = ""
    if ours:  # the global accounting's ZADD / HINCRBY, in the same batches (no round trip of their own)
        cache = f"  +{(st.posted - b0) / args.ops:.2f} posted/op"
    if "get_window" in name and ours:
        cache += (f", entries/op fetched {(st.entries_fetched - f0) / args.ops:.1f}, "
                  f"from the read cache {(st.entries_reused - u0) / args.ops:.1f}")
    print(f"  {run + 1:<3} {conc:<5} {name:<31} {row['ops_s']:>7.0f} {row['p50_ms']:>9.2f} "
          f"{row['p99_ms']:>8.2f} {row['cmds_per_op']:>8.2f} {row['client_us']:>17.0f} "
          f"{row['server_us']:>16.0f}{cache}")
    return row


RATIO_LABELS = {"store": "{}", "uncached": "{}, no cache", "floor": "{}, fetch-only floor",
                "onevalue": "{}, one-value bound"}


def print_ratios(rows: list[dict], repeat: int, last_n: int) -> None:
    by = {(x["name"], x["conc"], x["run"]): x for x in rows}
    window = f"get_window(last {last_n})"
    print("\nratios store / naive (each run against the baseline measured next to it):")
    for run in range(1, repeat + 1):
        for conc in sorted({x["conc"] for x in rows}):
            for impl, what in (("store", "append"), ("store", window), ("uncached", window), ("floor", window),
                               ("onevalue", window)):
                s, n = by[(f"{impl}.{what}", conc, run)], by[(f"naive.{what}", conc, run)]
                s_cpu, n_cpu = s["client_us"] + s["server_us"], n["client_us"] + n["server_us"]
                label = RATIO_LABELS[impl].format(what)
                print(f"  run {run} c={conc:<3} {label:<37} throughput x{s['ops_s'] / n['ops_s']:.2f}   "
                      f"CPU/op (client+redis) x{n_cpu / s_cpu:.2f} less   "
                      f"p99 {s['p99_ms']:.2f} vs {n['p99_ms']:.2f} ms")


async def print_costs(r: aioredis.Redis, cfg: ContextConfig, mem_contexts: int) -> None:
    """Memory per entry of both layouts, what a byte costs a script's Lua, and Redis's memory."""
    mem_store, mem_naive = await memory_per_entry(r, cfg, mem_contexts)
    print(f"\nmemory per 1 KiB entry / payload: store {mem_store:.2f}x, naive JSON {mem_naive:.2f}x "
          f"({mem_contexts} contexts x 100 entries)")
    per_byte, small_us, big_us = await lua_byte_cost(r)
    print(f"Lua strings: {per_byte:.2f} ns per byte (a script reading a 100 KiB value {big_us:.1f} us, "
          f"100 B {small_us:.2f} us): every byte a script gets from Redis or builds pays it once")
    print(f"redis used_memory {(await r.info('memory'))['used_memory_human']}; load average at end: {loadavg()}")


async def run_bench(r: AsyncRedis, args: argparse.Namespace, *, costs: bool = True) -> list[dict]:
    await wait_for_redis(r)
    await for_each_primary(r, lambda node: node.flushall())
    print(f"load average at start: {loadavg()}; event loop: {args.loop}")
    cfg = ContextConfig(channel_max_entries=args.entries, audit_maxlen=10_000)
    sides = await open_sides(r, cfg, args.entries)
    payload = b"a" * args.payload
    await load_data(r, cfg, sides, args, payload)
    gc.collect()  # the preload's garbage, not the first measurement's pause
    ops = operations(sides, payload, args.last_n)
    await warm_up(r, ops, args)
    rows = await measure_all(r, sides, ops, args)
    print_ratios(rows, args.repeat, args.last_n)
    if costs:  # memory and Lua costs are a server's: measured on the single one
        await print_costs(r, cfg, args.mem_contexts)
    return rows


async def measure_overshoot(r: AsyncRedis, args: argparse.Namespace, seconds: float = 10.0) -> None:
    """64 callers append 1 KiB entries to 2,000 principals over a 16 MiB global budget while the
    evictor sweeps every ``--evict-interval``; the reported total is sampled every 10 ms. Prints
    the append rate, the largest excess over the budget (bytes, and against interval x rate)
    and the longest time spent over it (against the interval)."""
    await wait_for_redis(r)
    await for_each_primary(r, lambda node: node.flushall())
    budget = 16 * 1024 * 1024
    cfg = ContextConfig(global_budget_bytes=budget, principal_budget_bytes=256 * 1024, max_entry_bytes=4096,
                        global_evict_interval_s=args.evict_interval, global_lru_resolution_ms=100)
    store, payload, rnd = ContextStore(r, cfg), b"o" * 1024, random.Random(5)
    sweeper = asyncio.ensure_future(store.evictor(owner="bench").run())
    appended, stop = [0], time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < stop:
            await store.append(f"o{rnd.randrange(2000)}", "c", "text", "user", payload)
            appended[0] += 1

    async def sampler() -> tuple[int, float]:
        worst, longest, since = 0, 0.0, None
        while time.perf_counter() < stop:
            over = await store.global_bytes() - budget
            now = time.perf_counter()
            worst = max(worst, over)
            if over > 0:
                since = now if since is None else since
                longest = max(longest, now - since)
            else:
                since = None
            await asyncio.sleep(0.01)
        return worst, longest

    t0 = time.perf_counter()
    *_, (worst, longest) = await asyncio.gather(*(caller() for _ in range(64)), sampler())
    sweeper.cancel()
    rate = appended[0] / (time.perf_counter() - t0)
    bound = args.evict_interval * rate * (len(payload) + 40)
    print(f"global budget 16 MiB, evictor every {args.evict_interval} s: {rate:.0f} appends/s of 1 KiB; "
          f"largest excess {worst / 1024:.0f} KiB ({worst / bound:.2f} x interval x append rate), "
          f"longest over budget {longest:.2f} s ({longest / args.evict_interval:.2f} x interval)")


def print_modes(rows: dict[str, list[dict]], last_n: int) -> None:
    """The single server and the cluster side by side, and first reads against the floor in each."""
    cluster = {(x["name"], x["conc"], x["run"]): x for x in rows["cluster"]}
    print("\nsingle server vs 3-master cluster (same machine, same run):")
    print("  run conc  operation                       ops/s single  cluster   ratio | p99 ms single cluster"
          " | cmds/op single cluster")
    for x in rows["single"]:
        c = cluster[(x["name"], x["conc"], x["run"])]
        print(f"  {x['run']:<3} {x['conc']:<5} {x['name']:<31} {x['ops_s']:>7.0f} {c['ops_s']:>8.0f} "
              f"x{c['ops_s'] / x['ops_s']:>5.2f} | {x['p99_ms']:>13.2f} {c['p99_ms']:>7.2f} | "
              f"{x['cmds_per_op']:>14.2f} {c['cmds_per_op']:>7.2f}")
    window = f"get_window(last {last_n})"
    print("first reads, the store against the fetch-only floor measured next to it (target >= 0.80):")
    for mode, mine in rows.items():
        by = {(x["name"], x["conc"], x["run"]): x for x in mine}
        for (name, conc, run), x in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
            if name == f"store.{window}":
                floor = by[(f"floor.{window}", conc, run)]
                print(f"  {mode:<7} run {run} c={conc:<3} store/floor x{x['ops_s'] / floor['ops_s']:.2f}")


@contextlib.asynccontextmanager
async def redis_for(mode: str, args: argparse.Namespace) -> AsyncIterator[AsyncRedis]:
    """A client of the Redis a mode measures: the single server (``--redis-url``, else a
    private redis-server) or the cluster (``--cluster-url``, else a private 3-master one)."""
    proc = workdir = cluster = None
    if mode == "cluster":
        url = args.cluster_url
        if url is None:
            cluster = await asyncio.to_thread(LocalCluster(masters=3, replicas=0).start)
            url = cluster.url
        r: AsyncRedis = async_client(RedisConfig(url=url, cluster=True), max_connections=128)
    else:
        url = args.redis_url
        if url is None:
            proc, workdir, url = start_private_redis()
        r = aioredis.Redis.from_url(url, max_connections=128)
    try:
        yield r
    finally:
        await r.aclose()
        if cluster is not None:
            cluster.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(5)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


async def main(args: argparse.Namespace) -> int:
    apply_profile(args)
    rows: dict[str, list[dict]] = {}
    for mode in ("single", "cluster") if args.cluster else ("single",):
        if args.cluster:
            print(f"\n=== {mode} ===")
        async with redis_for(mode, args) as r:
            if args.evictor:
                await measure_overshoot(r, args)
                continue
            rows[mode] = await run_bench(r, args, costs=mode == "single")
    if args.cluster and not args.evictor:
        print_modes(rows, args.last_n)
    return 0


if __name__ == "__main__":
    opts = parse_args()
    if opts.loop == "asyncio":
        raise SystemExit(asyncio.run(main(opts)))
    try:
        import uvloop
    except ImportError:
        raise SystemExit("uvloop is not installed (it comes with uvicorn[standard]); run with --loop asyncio") from None
    raise SystemExit(uvloop.run(main(opts)))
