"""Sustained mixed load against a whole mesh (``learnmesh up``): many concurrent MCP sessions
(2025-11-25 sessions, 2026-07-28 stateless and WebSocket) doing context_append / generate /
learn for ``--duration`` seconds.

Reports: throughput and p50/p99 per operation, with the ratio to the same operation measured
by one client on the idle mesh first (the baseline, same run); Redis memory and the context
store's bytes against the configured global context budget (must stay within); gateway and
worker RSS sampled over time (first / last / max: must not grow without bound); and the
step->serving latency under load (a version appears in Redis -> every worker reports it).

    .venv/bin/python bench/bench_mesh.py [--duration 60] [--clients 24] [--trainable head|all]
        [--budget-kb 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.mesh_drills import Load  # noqa: E402
from bench.mesh_support import Mesh, RedisServer  # noqa: E402
from shared import keys  # noqa: E402


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Sampler(threading.Thread):
    """Every ``interval_s``: Redis memory, context bytes, RSS of gateway and workers; and,
    at a finer grain, when each model version appears in Redis and at every worker."""

    def __init__(self, mesh: Mesh, interval_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.mesh, self.interval_s = mesh, interval_s
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.version_seen: dict[int, float] = {}
        self.version_served: dict[int, float] = {}

    def run(self) -> None:
        r = self.mesh.redis()
        next_sample = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            v = self.mesh.trainer_version()
            self.version_seen.setdefault(v, now)
            served = self.mesh.worker_versions()
            if served and len(served) >= self.mesh.workers:
                low = min(served)
                for seen in list(self.version_seen):
                    if seen <= low:
                        self.version_served.setdefault(seen, time.monotonic())
            if now >= next_sample:
                next_sample = now + self.interval_s
                mem = r.info("memory")
                total = r.hget(keys.CTX_GLOBAL_BYTES, "\0total")
                pids = {"gateway": self.mesh.child_pid("gateway"),
                        **{f"worker-{i}": self.mesh.child_pid(f"worker-{i}") for i in range(self.mesh.workers)}}
                self.samples.append({"t": now, "redis_used": int(mem["used_memory"]),
                                     "ctx_bytes": int(total or 0), **{k: rss_kb(p) for k, p in pids.items()}})
            time.sleep(0.1)
        r.close()

    def step_to_serving(self) -> list[float]:
        return [self.version_served[v] - t for v, t in self.version_seen.items() if v in self.version_served and v > 0]


async def baseline(mesh: Mesh, seconds: float) -> dict[str, list[float]]:
    load = Load(mesh, clients=1, kinds=("modern",), learn_every=1)
    load.start()
    await asyncio.sleep(seconds)
    await load.finish()
    return load.latency


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    redis = RedisServer()
    redis.start()
    work = Path(tempfile.mkdtemp(prefix="lm-bench-mesh-"))
    budget = args.budget_kb * 1024
    principals = [f"bench{i}" for i in range(max(2, args.clients // 3))]
    mesh = Mesh(work, redis.url, principals, model={"trainable": args.trainable},
                context={"global_budget_bytes": budget, "principal_budget_bytes": max(budget // len(principals), 8192),
                         "max_entry_bytes": 4096, "channel_max_bytes": 65536})
    try:
        t0 = time.monotonic()
        mesh.start()
        print(f"mesh up in {time.monotonic() - t0:.1f}s (2 workers, trainer 2 gloo ranks, {args.trainable})",
              flush=True)
        base = await baseline(mesh, args.baseline_s)
        sampler = Sampler(mesh)
        sampler.start()
        load = Load(mesh, clients=args.clients, learn_every=2)
        t_start = time.monotonic()
        load.start()
        await asyncio.sleep(args.duration)
        await load.finish()
        elapsed = time.monotonic() - t_start
        await asyncio.sleep(3)  # let the last version reach the workers
        sampler.stop.set()
        sampler.join(10)
        return report(args, mesh, load, base, sampler, elapsed, budget)
    finally:
        mesh.stop()
        redis.close()


def report(args: argparse.Namespace, mesh: Mesh, load: Load, base: dict[str, list[float]], sampler: Sampler,
           elapsed: float, budget: int) -> dict[str, Any]:
    out: dict[str, Any] = {"duration_s": round(elapsed, 1), "clients": args.clients, "ops": {}}
    print(f"\n{args.clients} concurrent MCP clients for {elapsed:.0f}s "
          f"(legacy sessions, 2026-07-28 stateless, WebSocket); failures: {dict(load.failures) or 0}")
    print(f"{'operation':<10} {'ok':>7} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'idle p50':>9} {'p50/idle':>9}")
    for op in ("context", "generate", "learn"):
        lat = load.latency.get(op, [])
        idle = statistics.median(base[op]) if base.get(op) else float("nan")
        row = {"ok": len(lat), "ops_s": len(lat) / elapsed, "p50_ms": pct(lat, 0.5) * 1e3,
               "p99_ms": pct(lat, 0.99) * 1e3, "idle_p50_ms": idle * 1e3}
        out["ops"][op] = row
        print(f"{op:<10} {row['ok']:>7} {row['ops_s']:>8.1f} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} "
              f"{row['idle_p50_ms']:>9.1f} {row['p50_ms'] / row['idle_p50_ms']:>8.1f}x")
    s = sampler.samples
    peak_ctx = max(x["ctx_bytes"] for x in s)
    peak_redis = max(x["redis_used"] for x in s)
    out["context_bytes_max"], out["context_budget"], out["redis_used_max"] = peak_ctx, budget, peak_redis
    print(f"\ncontext store: max {peak_ctx / 1024:.0f} KiB held vs global budget {budget / 1024:.0f} KiB "
          f"({'within' if peak_ctx <= budget else 'OVER'}); redis used_memory max {peak_redis / 2**20:.1f} MiB "
          f"(includes the sample log, sessions and audit stream)")
    print(f"{'process':<10} {'RSS first':>10} {'RSS last':>10} {'RSS max':>10}  (MiB, {len(s)} samples)")
    out["rss_mib"] = {}
    for name in ["gateway"] + [f"worker-{i}" for i in range(mesh.workers)]:
        series = [x[name] / 1024 for x in s if x.get(name)]
        out["rss_mib"][name] = {"first": series[0], "last": series[-1], "max": max(series)}
        print(f"{name:<10} {series[0]:>10.1f} {series[-1]:>10.1f} {max(series):>10.1f}")
    lat = sampler.step_to_serving()
    out["step_to_serving_s"] = {"n": len(lat), "p50": pct(lat, 0.5), "max": max(lat) if lat else float("nan")}
    print(f"\nstep->serving under load: {len(lat)} versions, p50 {pct(lat, 0.5) * 1e3:.0f} ms, "
          f"max {(max(lat) if lat else float('nan')) * 1e3:.0f} ms (resolution ~100 ms + worker heartbeat 200 ms); "
          f"trainer at v{mesh.trainer_version()}, {len(load.acked)} samples acknowledged")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--baseline-s", type=float, default=5.0)
    p.add_argument("--trainable", default="head", choices=["head", "all", "lora"])
    p.add_argument("--budget-kb", type=int, default=64, help="context.global_budget_bytes for the run")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
