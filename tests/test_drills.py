"""Fault drills against one real ``learnmesh up`` mesh, short versions for CI.

Each drill runs mixed MCP load (legacy + 2026-07-28 + WebSocket clients: context_append,
generate, learn), injects its fault, waits for recovery and asserts that no acknowledged sample
is lost or trained twice; it prints one report line (requests failed, samples lost, time to
recover). ``bench/drills.py`` runs the same drills longer and prints a table.

The mesh runs once per Redis kind (``redis_modes()``): on a private redis-server with AOF
persistence (appendfsync always), and on the test session's Redis Cluster (3 masters + 3
replicas, where the sample log has 8 partitions). The tampered-deltas, kill -9 worker, kill -9
trainer and gateway-replica drills run on both; on the cluster the first three run with half the
load (six more redis-servers share the cores; the assertions are the same). The Redis-restart drill stops and
restarts the one server on the same port, so it runs on the single server only; its cluster
counterpart, a master killed under load while the cluster fails over by itself, is
tests/test_redis_cluster_failover.py; a rolling maintenance (every master handed to its replica with
CLUSTER FAILOVER under load: the sample log's partitions, the trainer's commit record and ledger
move with them) runs on the cluster only.

The trainer trains the head only here (fast on 2 CPU cores); tests/test_e2e_mesh.py covers
the full model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import mesh_drills as drills
from bench.mesh_support import Mesh, RedisServer
from tests.conftest import RedisTarget, redis_modes

# Seconds of load a drill runs on the cluster for each second it runs on the single server.
CLUSTER_LOAD_SCALE = 0.5


@pytest.fixture(scope="module")
def redis_persistent() -> Iterator[RedisServer]:
    server = RedisServer(persist=True)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module", params=redis_modes())
def mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The mesh on the persistent single server, or on the session's Redis Cluster (flushed)."""
    if request.param == "single":
        url = request.getfixturevalue("redis_persistent").url
    else:
        cluster: RedisTarget = request.getfixturevalue("redis_cluster")
        cluster.flush()
        url = cluster.url
    m = Mesh(Path(tmp_path_factory.mktemp(f"drills-{request.param}")), url, ["ann", "ben", "cat"],
             model={"trainable": "head"}, trainer={"checkpoint_every": 3})
    with m.running():
        yield m


def _load_s(mesh: Mesh, single_s: float) -> float:
    return single_s * CLUSTER_LOAD_SCALE if mesh.on_cluster else single_s


def _check(rep: drills.DrillReport, mesh: Mesh) -> None:
    print(rep.line())
    assert rep.samples_acked > 0, "the load acknowledged no samples"
    assert rep.samples_lost == 0, f"{rep.samples_lost} acknowledged samples were never trained\n{mesh.tail()}"
    assert rep.duplicates == 0, f"{rep.duplicates} samples were trained more than once"
    assert getattr(rep, "context_mismatches", 0) == 0, rep.notes


def test_tampered_deltas_are_rejected_and_counted(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_tampered_deltas(mesh, load_s=_load_s(mesh, 6)))
    _check(rep, mesh)
    assert rep.rejected > 0 and rep.failed == 0  # type: ignore[attr-defined]


def test_kill9_worker_under_load(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_worker_kill(mesh, load_s=_load_s(mesh, 8)))
    _check(rep, mesh)


def test_kill9_trainer_under_sample_load(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_trainer_kill(mesh, load_s=_load_s(mesh, 10)))
    _check(rep, mesh)
    assert rep.failed == 0, "a learn/generate failed while only the trainer was down"


def test_gateway_replica_stop_and_resume(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_gateway_replica(mesh, load_s=5))  # not shortened: B is down from 1 s to 3 s
    _check(rep, mesh)
    assert rep.recover_s > 0, "replica B never served the session again after it came back"


@pytest.mark.parametrize("mesh", [m for m in redis_modes() if m == "single"], indirect=True)
def test_redis_restart_under_load(mesh: Mesh, redis_persistent: RedisServer) -> None:
    rep = asyncio.run(drills.drill_redis_restart(mesh, redis_persistent, load_s=8))
    _check(rep, mesh)
    assert not rep.gateway_restarted, "the gateway had to be restarted to recover"  # type: ignore[attr-defined]


@pytest.mark.parametrize("mesh", [m for m in redis_modes() if m == "cluster"], indirect=True)
def test_rolling_failover_of_every_master(mesh: Mesh, redis_cluster: RedisTarget) -> None:
    if redis_cluster.cluster is None:
        pytest.skip("an external cluster: its nodes are not this session's to fail over")
    rep = asyncio.run(drills.drill_rolling_failover(mesh, redis_cluster.cluster, load_s=_load_s(mesh, 12)))
    _check(rep, mesh)
    assert not rep.restarted, rep.notes  # type: ignore[attr-defined]


def test_a_full_context_window_is_checked_from_its_oldest_entry() -> None:
    """A long drill appends more than a channel holds (`context.channel_max_entries`): the
    oldest acknowledged appends gave way by design, and the check asks for every one from the
    window's oldest entry on — one missing there is still found."""
    written = [f"ann:load-0:{n}" for n in range(1, 1501)]
    window = written[-1000:]
    assert drills._in_window(written, window, 1000) == window
    assert set(drills._in_window(written, window, 1000)) <= set(window)
    lost_inside = written[-1001:-500] + written[-499:]  # full, but one acknowledged append is not there
    assert len(lost_inside) == 1000
    assert not set(drills._in_window(written, lost_inside, 1000)) <= set(lost_inside)
    short = written[:10] + written[11:20]  # not full: every acknowledged append must be there
    assert not set(drills._in_window(written[:20], short, 1000)) <= set(short)
