"""Fault drills against one real ``learnmesh up`` mesh, short versions for CI.

The mesh runs on a private redis-server with AOF persistence (appendfsync always) so the
Redis drill can stop and restart it on the same port. Each drill runs mixed MCP load
(legacy + 2026-07-28 + WebSocket clients: context_append, generate, learn), injects its
fault, waits for recovery and asserts that no acknowledged sample is lost or trained twice;
it prints one report line (requests failed, samples lost, time to recover).
``bench/drills.py`` runs the same drills longer and prints a table.

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


@pytest.fixture(scope="module")
def redis_persistent() -> Iterator[RedisServer]:
    server = RedisServer(persist=True)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, redis_persistent: RedisServer) -> Iterator[Mesh]:
    m = Mesh(Path(tmp_path_factory.mktemp("drills")), redis_persistent.url, ["ann", "ben", "cat"],
             model={"trainable": "head"}, trainer={"checkpoint_every": 3})
    with m.running():
        yield m


def _check(rep: drills.DrillReport, mesh: Mesh) -> None:
    print(rep.line())
    assert rep.samples_acked > 0, "the load acknowledged no samples"
    assert rep.samples_lost == 0, f"{rep.samples_lost} acknowledged samples were never trained\n{mesh.tail()}"
    assert rep.duplicates == 0, f"{rep.duplicates} samples were trained more than once"
    assert getattr(rep, "context_mismatches", 0) == 0, rep.notes


def test_tampered_deltas_are_rejected_and_counted(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_tampered_deltas(mesh, load_s=6))
    _check(rep, mesh)
    assert rep.rejected > 0 and rep.failed == 0  # type: ignore[attr-defined]


def test_kill9_worker_under_load(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_worker_kill(mesh, load_s=8))
    _check(rep, mesh)


def test_kill9_trainer_under_sample_load(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_trainer_kill(mesh, load_s=10))
    _check(rep, mesh)
    assert rep.failed == 0, "a learn/generate failed while only the trainer was down"


def test_gateway_replica_stop_and_resume(mesh: Mesh) -> None:
    rep = asyncio.run(drills.drill_gateway_replica(mesh, load_s=5))
    _check(rep, mesh)


def test_redis_restart_under_load(mesh: Mesh, redis_persistent: RedisServer) -> None:
    rep = asyncio.run(drills.drill_redis_restart(mesh, redis_persistent, load_s=8))
    _check(rep, mesh)
    assert not rep.gateway_restarted, "the gateway had to be restarted to recover"  # type: ignore[attr-defined]
