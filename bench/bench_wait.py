"""What ``redis.wait_replicas: 1`` costs a context append: the same store with and without
``WAIT`` for one replica, on the same Redis in the same run (interleaved).

Two deployments, each of this benchmark's own on this machine: one redis-server with one
replica, and a 3-master Redis Cluster with one replica per master. Per deployment and caller
count: appends of 128 B to the 100-entry windows of ``--principals`` principals (shipped context
settings otherwise), ``--ops`` per run; throughput, p50 and p99 of each side, and the ratio
of the waiting store to the plain one.

    .venv/bin/python bench/bench_wait.py [--ops 3000] [--concurrency 4,64] [--repeat 2] [--principals 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

import uvloop
from redis.exceptions import RedisError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_context import loadavg, measure  # noqa: E402

from shared.config import ContextConfig, RedisConfig  # noqa: E402
from shared.context import ContextStore  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.redis_client import AsyncRedis, async_client, for_each_primary  # noqa: E402
from shared.redis_local_cluster import LocalCluster  # noqa: E402

PAYLOAD = b"w" * 128


def start_pair() -> tuple[list[subprocess.Popen], str, str]:
    """A redis-server and its replica: (processes, directory, master URL)."""
    workdir = tempfile.mkdtemp(prefix="lm-bench-wait-")
    master, replica = free_port(), free_port()
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir,
              "--maxmemory-policy", "noeviction"]
    server = shutil.which("redis-server") or "redis-server"
    procs = [subprocess.Popen([server, "--port", str(master), *common], stdout=subprocess.DEVNULL),
             subprocess.Popen([server, "--port", str(replica), "--replicaof", "127.0.0.1", str(master), *common],
                              stdout=subprocess.DEVNULL)]
    return procs, workdir, f"redis://127.0.0.1:{master}/0"


async def replicas_linked(r: AsyncRedis, timeout_s: float = 30.0) -> None:
    """Until every master has a replica in sync (so WAIT 1 can be answered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            counts = await for_each_primary(r, lambda node: node.info("replication"))
            if all(isinstance(c.get("slave0"), dict) and c["slave0"].get("state") == "online" for c in counts):
                return
        except (RedisError, OSError):  # not up yet
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the replicas did not come online")
        await asyncio.sleep(0.1)


async def measure_deployment(name: str, redis_cfg: RedisConfig, args: argparse.Namespace) -> list[tuple]:
    r = async_client(redis_cfg, max_connections=128)
    rows = []
    try:
        await replicas_linked(r)
        cfg = ContextConfig(channel_max_entries=100)
        sides = {"wait 0": ContextStore(r, cfg),
                 "wait 1": ContextStore(r, cfg, redis_cfg=dataclasses.replace(redis_cfg, wait_replicas=1))}
        for conc in args.concurrency:
            best: dict[str, dict] = {}
            for run in range(args.repeat):
                for side, store in sides.items():
                    async def append(p: str, store: ContextStore = store) -> None:
                        await store.append(p, "bench", "text", "user", PAYLOAD)
                    got = await measure(r, side, append, args.ops, conc, args.principals, seed=run)
                    if side not in best or got["ops_s"] > best[side]["ops_s"]:
                        best[side] = got
            rows.append((name, conc, best["wait 0"], best["wait 1"], loadavg()))
    finally:
        await r.aclose()
    return rows


async def main(args: argparse.Namespace) -> int:
    print(f"context appends with and without WAIT 1, load {loadavg()} at start", flush=True)
    rows = []
    procs, workdir, url = start_pair()
    try:
        rows += await measure_deployment("one server + 1 replica", RedisConfig(url=url), args)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)
    cluster = await asyncio.to_thread(LocalCluster(masters=3, replicas=1).start)
    try:
        rows += await measure_deployment("cluster 3 + 3 replicas", RedisConfig(url=cluster.url), args)
    finally:
        cluster.stop()
    print(f"\n{args.ops} appends of {len(PAYLOAD)} B per run, best of {args.repeat}, {args.principals} principals, "
          f"{os.cpu_count()} CPUs\n")
    print(f"{'deployment':24} {'callers':>7} | {'wait 0 ops/s':>12} {'p50 ms':>7} {'p99 ms':>7} | "
          f"{'wait 1 ops/s':>12} {'p50 ms':>7} {'p99 ms':>7} | {'wait1/wait0':>11} | load")
    for name, conc, plain, waited, load in rows:
        print(f"{name:24} {conc:>7} | {plain['ops_s']:12.0f} {plain['p50_ms']:7.2f} {plain['p99_ms']:7.2f} | "
              f"{waited['ops_s']:12.0f} {waited['p50_ms']:7.2f} {waited['p99_ms']:7.2f} | "
              f"{waited['ops_s'] / plain['ops_s']:10.2f}x | {load}")
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[4, 64])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--principals", type=int, default=1000)
    return ap.parse_args()


if __name__ == "__main__":
    sys.exit(uvloop.run(main(parse_args())))
