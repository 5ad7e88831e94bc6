"""Fault drills, longer than the CI versions in tests/test_drills.py, with a summary table.

One mesh (``learnmesh up``: tiny model, 2 workers, trainer with 2 gloo ranks) on a private
redis-server with AOF persistence; each drill runs mixed MCP load (legacy sessions,
2026-07-28 stateless, WebSocket), injects its fault, waits for recovery and counts requests
failed, samples lost (acknowledged but never trained — must be 0), samples trained twice,
and the time to recover.

``--cluster``: the same mesh on a real local Redis Cluster (3 masters + 3 replicas,
shared/redis_local_cluster.py, stopped at the end). tamper, worker, trainer and gateway run as
on one server. ``redis`` (stop and restart the one server) becomes the failover drill
(tests/failover_drill.py): once the mesh is stopped, a gateway of its own serves context
appends and legacy sessions with ``redis.wait_replicas: 1`` while a master is killed with
SIGKILL; the cluster promotes its replica, the killed node comes back as a replica, and no
acknowledged append may be lost. Its row: answers the clients got, 503s while the slots had no
master (or the new master no replica), appends acknowledged, lost (0, or the run fails), and
seconds until the cluster was ok again; it runs until those conditions hold, not ``--load-s``.

    .venv/bin/python bench/drills.py [--load-s 30] [--only worker,trainer,redis,gateway,tamper] [--cluster]
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
from shared.redis_local_cluster import LocalCluster  # noqa: E402

ALL = ("tamper", "worker", "trainer", "gateway", "redis")


async def _mesh_drill(name: str, mesh: Mesh, redis: RedisServer | None,
                      args: argparse.Namespace) -> drills.DrillReport:
    if name == "tamper":
        return await drills.drill_tampered_deltas(mesh, load_s=args.load_s)
    if name == "worker":
        return await drills.drill_worker_kill(mesh, load_s=args.load_s)
    if name == "trainer":
        return await drills.drill_trainer_kill(mesh, load_s=args.load_s)
    if name == "gateway":
        return await drills.drill_gateway_replica(mesh, load_s=args.load_s)
    assert redis is not None  # the restart drill needs the one server (see run)
    return await drills.drill_redis_restart(mesh, redis, load_s=args.load_s, outage_s=args.outage_s)


async def _failover(cluster: LocalCluster, workdir: Path) -> drills.DrillReport:
    """The cluster's counterpart of the restart drill (see the module docstring)."""
    from tests.failover_drill import failover_drill  # the drill lives with the tests that assert it

    workdir.mkdir(parents=True, exist_ok=True)
    rep = await failover_drill(cluster, cluster.url, workdir)
    print(rep.line(), flush=True)
    return drills.DrillReport("kill -9 redis master", requests=rep.answers, failed=rep.unavailable,
                              failures={"503": rep.unavailable} if rep.unavailable else {},
                              samples_acked=rep.acked, recover_s=rep.failed_over_s,
                              notes="acked: context appends (WAIT 1 replica)")


async def run(args: argparse.Namespace) -> tuple[list[drills.DrillReport], bool]:
    """The reports of the drills that ran, and whether every drill ran to its end."""
    chosen = [d for d in ALL if d in args.only.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="lm-drills-"))
    redis: RedisServer | None = None
    cluster: LocalCluster | None = None
    if args.cluster:
        cluster = LocalCluster(masters=3, replicas=1).start()
        url = cluster.url
    else:
        redis = RedisServer(persist=True)
        redis.start()
        url = redis.url
    reports: list[drills.DrillReport] = []
    try:
        on_mesh = [d for d in chosen if not (cluster is not None and d == "redis")]
        if on_mesh:
            mesh = Mesh(workdir, url, ["ann", "ben", "cat", "dan"],
                        model={"trainable": args.trainable}, trainer={"checkpoint_every": 5})
            try:
                t0 = time.monotonic()
                mesh.start()
                print(f"mesh up in {time.monotonic() - t0:.1f}s; logs under {mesh.var / 'logs'}", flush=True)
                for name in on_mesh:
                    rep = await _mesh_drill(name, mesh, redis, args)
                    print(rep.line(), flush=True)
                    reports.append(rep)
            finally:
                mesh.stop()
        if cluster is not None and "redis" in chosen:
            try:
                reports.append(await _failover(cluster, workdir / "failover"))
            except AssertionError as exc:
                print(f"drill kill -9 redis master: FAILED: {str(exc)[:2000]}", flush=True)
                return reports, False
    finally:
        if cluster is not None:
            cluster.stop()
        if redis is not None:
            redis.close()
    return reports, True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-s", type=float, default=30.0, help="seconds of load per drill")
    p.add_argument("--outage-s", type=float, default=5.0, help="how long Redis stays down (one server)")
    p.add_argument("--only", default=",".join(ALL))
    p.add_argument("--trainable", default="head", choices=["head", "all", "lora"])
    p.add_argument("--cluster", action="store_true",
                   help="run on a local Redis Cluster (3 masters + 3 replicas); redis: the failover drill")
    args = p.parse_args()
    reports, completed = asyncio.run(run(args))
    where = ("a local Redis Cluster (3 masters + 3 replicas)" if args.cluster
             else "one redis-server (AOF, appendfsync always)")
    print(f"\nRedis: {where}")
    print(f"{'drill':<30} {'requests':>9} {'failed':>7} {'acked':>6} {'lost':>5} {'dup':>4} {'recover s':>10}")
    for r in reports:
        print(f"{r.name:<30} {r.requests:>9} {r.failed:>7} {r.samples_acked:>6} {r.samples_lost:>5} "
              f"{r.duplicates:>4} {r.recover_s:>10.1f}")
    ok = completed and all(r.samples_lost == 0 and r.duplicates == 0 for r in reports)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
