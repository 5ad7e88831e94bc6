"""Context store benchmark: learnmesh's one-script-per-operation store against the naive
baseline used by popular agent-memory servers (one JSON document per context: GET, modify
in the client, SET), measured in the same run on the same Redis.

Prints, per implementation, operation and concurrency: ops/s, p50/p99 latency and Redis
commands per operation (round trips, from INFO total_commands_processed); then memory per
entry against raw payload bytes for 1 KiB entries; then the ratios.

Default run is short (about a minute): ``--principals 300 --payload 128``. The issue's full
size is ``--full`` (10,000 principals, 100-entry contexts; needs ~1 GB of Redis memory and
several minutes to preload).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import orjson
import redis.asyncio as aioredis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shared.config import ContextConfig  # noqa: E402
from shared.context_store import ContextStore  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Naive:
    """One JSON document per context; read-modify-write from the client (2 round trips)."""

    def __init__(self, r: aioredis.Redis, window: int) -> None:
        self.r = r
        self.window = window

    async def append(self, principal: str, cid: str, text: str) -> None:
        key = f"naive:{principal}:{cid}"
        raw = await self.r.get(key)
        doc = orjson.loads(raw) if raw else {"version": 0, "entries": []}
        doc["version"] += 1
        doc["entries"].append({"role": "user", "modality": "text", "text": text, "ts_ms": int(time.time() * 1000),
                               "tokens": len(text)})
        doc["entries"] = doc["entries"][-self.window:]
        await self.r.set(key, orjson.dumps(doc))

    async def get_window(self, principal: str, cid: str, last_n: int) -> list:
        raw = await self.r.get(f"naive:{principal}:{cid}")
        return orjson.loads(raw)["entries"][-last_n:]


async def commands(r: aioredis.Redis) -> int:
    """Commands clients sent (script-internal calls excluded): one per round trip here."""
    stats = await r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in (
        "cmdstat_evalsha", "cmdstat_eval", "cmdstat_get", "cmdstat_set"))


async def measure(r, name: str, op, n_ops: int, concurrency: int, principals: int) -> dict:
    lat: list[float] = []
    queue = list(range(n_ops))
    rnd = random.Random(7)

    async def worker() -> None:
        while queue:
            queue.pop()
            p = f"u{rnd.randrange(principals)}"
            t0 = time.perf_counter()
            await op(p)
            lat.append(time.perf_counter() - t0)

    c0 = await commands(r)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    c1 = await commands(r)
    lat.sort()
    return {"name": name, "ops_s": n_ops / wall, "p50_ms": lat[len(lat) // 2] * 1e3,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "cmds_per_op": (c1 - c0) / n_ops}


async def preload(store: ContextStore, naive: Naive, r: aioredis.Redis, principals: int, entries: int,
                  payload: bytes) -> None:
    """Fill every principal's context "c" with `entries` entries, pipelining the store's own script."""
    script = store._script  # same script and arguments as ContextStore.append, pipelined for speed
    from shared import keys
    from shared.context_store import pack_entry
    cfg = store.cfg
    text = payload.decode()
    naive_doc = orjson.dumps({"version": entries, "entries": [
        {"role": "user", "modality": "text", "text": text, "ts_ms": 0, "tokens": len(text)}] * entries})
    for start in range(0, principals, 50):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(principals, start + 50)):
            p = f"u{i}"
            ks = [*keys.ctx_keys(p), keys.CTX_GLOBAL_BYTES, keys.CTX_GLOBAL_LRU, keys.AUDIT_STREAM]
            for _ in range(entries):
                packed = pack_entry("user", payload, tokens=len(payload), ts_ms=int(time.time() * 1000))
                argv = ["append", p, int(time.time() * 1000), cfg.channel_max_entries, cfg.channel_max_bytes,
                        cfg.principal_budget_bytes, cfg.global_budget_bytes, cfg.idle_ttl_s * 1000,
                        cfg.versions_retained, cfg.audit_maxlen, "c", "text", packed, ""]
                await script(keys=ks, args=argv, client=pipe)
            pipe.set(f"naive:{p}:c", naive_doc)
        await pipe.execute()


async def memory_per_entry(r: aioredis.Redis, cfg: ContextConfig, contexts: int) -> tuple[float, float]:
    """MEMORY USAGE (exact, SAMPLES 0) of the keys holding 100-entry contexts of 1 KiB entries,
    per entry / 1024, for the store and for the naive JSON documents."""
    from shared import keys
    payload = b"m" * 1024
    store, naive = ContextStore(r, cfg), Naive(r, 100)
    for c in range(contexts):
        for _ in range(100):
            await store.append("mem", f"c{c}", "text", "user", payload)
            await naive.append("mem", f"c{c}", payload.decode())
    used_store = sum([await r.memory_usage(k, samples=0) or 0 for k in keys.ctx_keys("mem")])
    used_naive = sum([await r.memory_usage(f"naive:mem:c{c}", samples=0) or 0 for c in range(contexts)])
    n = contexts * 100
    return used_store / (n * 1024), used_naive / (n * 1024)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", help="use this Redis (it is FLUSHED); default: a private redis-server")
    ap.add_argument("--principals", type=int, default=300)
    ap.add_argument("--entries", type=int, default=100, help="entries per context (window size)")
    ap.add_argument("--payload", type=int, default=128, help="bytes per entry in the throughput runs")
    ap.add_argument("--ops", type=int, default=1000, help="operations per measurement")
    ap.add_argument("--concurrency", default="4,64")
    ap.add_argument("--mem-contexts", type=int, default=10, help="100-entry contexts of 1 KiB entries")
    ap.add_argument("--full", action="store_true", help="10,000 principals, 5,000 ops per measurement")
    args = ap.parse_args()
    if args.full:
        args.principals, args.ops, args.mem_contexts = 10_000, 5000, 50
    proc = workdir = None
    url = args.redis_url
    if url is None:
        port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-bench-redis-")
        proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                                 "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir,
                                 "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
    r = aioredis.Redis.from_url(url, max_connections=128)
    try:
        for _ in range(200):
            try:
                await r.ping()
                break
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.05)
        await r.flushdb()
        cfg = ContextConfig(channel_max_entries=args.entries, audit_maxlen=10_000)
        store, naive = ContextStore(r, cfg), Naive(r, args.entries)
        payload = b"a" * args.payload
        t0 = time.perf_counter()
        await preload(store, naive, r, args.principals, args.entries, payload)
        print(f"preloaded {args.principals} principals x {args.entries} entries x {args.payload} B "
              f"in {time.perf_counter() - t0:.1f}s (both layouts)")
        text = payload.decode()
        rows = []
        for conc in [int(x) for x in args.concurrency.split(",")]:
            for name, op in (
                ("store.append", lambda p: store.append(p, "c", "text", "user", payload)),
                ("naive.append", lambda p: naive.append(p, "c", text)),
                ("store.get_window(last 20)", lambda p: store.get_window(p, "c", last_n=20)),
                ("naive.get_window(last 20)", lambda p: naive.get_window(p, "c", 20)),
            ):
                rt0 = store.round_trips
                row = await measure(r, name, op, args.ops, conc, args.principals)
                if name.startswith("store"):  # cross-check against the store's own call counter
                    assert store.round_trips - rt0 == args.ops, "store made more than one call per op"
                row["conc"] = conc
                rows.append(row)
                print(f"  c={conc:<3} {name:<28} {row['ops_s']:>8.0f} ops/s  p50 {row['p50_ms']:6.2f} ms  "
                      f"p99 {row['p99_ms']:6.2f} ms  redis commands/op {row['cmds_per_op']:.2f}")
        by = {(x["name"], x["conc"]): x for x in rows}
        print("\nratios (store / naive baseline, same run):")
        for conc in sorted({x["conc"] for x in rows}):
            for op in ("append", "get_window(last 20)"):
                s, n = by[(f"store.{op}", conc)], by[(f"naive.{op}", conc)]
                print(f"  c={conc:<3} {op:<20} throughput x{s['ops_s'] / n['ops_s']:.1f}   "
                      f"p99 {s['p99_ms']:.2f} vs {n['p99_ms']:.2f} ms")
        mem_store, mem_naive = await memory_per_entry(r, cfg, args.mem_contexts)
        print(f"\nmemory per 1 KiB entry / payload: store {mem_store:.2f}x, naive JSON {mem_naive:.2f}x "
              f"({args.mem_contexts} contexts x 100 entries)")
    finally:
        await r.aclose()
        if proc is not None:
            proc.terminate()
            proc.wait(5)
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
