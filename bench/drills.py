"""Fault drills, longer than the CI versions in tests/test_drills.py, with a summary table.

One mesh (``learnmesh up``: tiny model, 2 workers, trainer with 2 gloo ranks) on a private
redis-server with AOF persistence; each drill runs mixed MCP load (legacy sessions,
2026-07-28 stateless, WebSocket), injects its fault, waits for recovery and counts requests
failed, samples lost (acknowledged but never trained — must be 0), samples trained twice,
and the time to recover.

    .venv/bin/python bench/drills.py [--load-s 30] [--only worker,trainer,redis,gateway,tamper]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import mesh_drills as drills  # noqa: E402
from bench.mesh_support import Mesh, RedisServer  # noqa: E402

ALL = ("tamper", "worker", "trainer", "gateway", "redis")


async def run(args: argparse.Namespace) -> list[drills.DrillReport]:
    redis = RedisServer(persist=True)
    redis.start()
    mesh = Mesh(Path(tempfile.mkdtemp(prefix="lm-drills-")), redis.url, ["ann", "ben", "cat", "dan"],
                model={"trainable": args.trainable}, trainer={"checkpoint_every": 5})
    reports: list[drills.DrillReport] = []
    try:
        t0 = time.monotonic()
        mesh.start()
        print(f"mesh up in {time.monotonic() - t0:.1f}s; logs under {mesh.var / 'logs'}", flush=True)
        chosen = [d for d in ALL if d in args.only.split(",")]
        for name in chosen:
            if name == "tamper":
                rep = await drills.drill_tampered_deltas(mesh, load_s=args.load_s)
            elif name == "worker":
                rep = await drills.drill_worker_kill(mesh, load_s=args.load_s)
            elif name == "trainer":
                rep = await drills.drill_trainer_kill(mesh, load_s=args.load_s)
            elif name == "gateway":
                rep = await drills.drill_gateway_replica(mesh, load_s=args.load_s)
            else:
                rep = await drills.drill_redis_restart(mesh, redis, load_s=args.load_s, outage_s=args.outage_s)
            print(rep.line(), flush=True)
            reports.append(rep)
    finally:
        mesh.stop()
        redis.close()
    return reports


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-s", type=float, default=30.0, help="seconds of load per drill")
    p.add_argument("--outage-s", type=float, default=5.0, help="how long Redis stays down")
    p.add_argument("--only", default=",".join(ALL))
    p.add_argument("--trainable", default="head", choices=["head", "all", "lora"])
    args = p.parse_args()
    reports = asyncio.run(run(args))
    print(f"\n{'drill':<30} {'requests':>9} {'failed':>7} {'acked':>6} {'lost':>5} {'dup':>4} {'recover s':>10}")
    for r in reports:
        print(f"{r.name:<30} {r.requests:>9} {r.failed:>7} {r.samples_acked:>6} {r.samples_lost:>5} "
              f"{r.duplicates:>4} {r.recover_s:>10.1f}")
    return 0 if all(r.samples_lost == 0 and r.duplicates == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
