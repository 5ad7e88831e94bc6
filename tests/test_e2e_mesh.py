"""The whole loop as a user sees it, against real ``learnmesh up`` processes.

One mesh (tiny model, 2 workers, a trainer with 2 gloo ranks, its Redis a single server, then a cluster; every port
free) serves many concurrent MCP clients with distinct principals over the 2025-11-25
session revision, the 2026-07-28 stateless revision and WebSocket. They write contexts,
generate with them, teach facts with ``learn`` and read their contexts back. Afterwards:

* every acknowledged sample id is in the trainer's ledger exactly once;
* every client's context holds exactly what that client wrote (and nobody else can read it);
* every worker serves the trainer's latest version, bit-exactly its weights once it idles;
* the taught facts score much better (``score`` with the ``learned`` token), untaught
  sentences of the same style much less, and held-out sentences barely move.
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path
from typing import Any

import pytest

from bench.mesh_support import McpError, McpHttp, McpWs, Mesh, wait_until
from services.trainer import ledger
from shared import keys
from shared.config import load_config
from shared.redis_client import close_sync
from shared.samples import sample_partitions
from tests.conftest import RedisTarget

FACTS = [("The capital of Zorbland is", " Quixville."), ("The moon of Plimptar is called", " Oodle."),
         ("Professor Wimble's favourite colour is", " teal.")]
# Same style, never taught: learning must be specific to what was taught.
CONTROL = [("The capital of Vexmoor is", " Drellton."), ("The moon of Karrimat is called", " Pibble."),
           ("Doctor Hask's favourite colour is", " mauve.")]
# Held out: corpus-like text, never taught; replay and rehearsal keep it where it was.
HELD_OUT = [("The sun rises in the", " east."), ("Water is made of hydrogen and", " oxygen."),
            ("When the ship sings to the river, a client", " is kind.")]
HELD_OUT_RISE = 0.10
PRINCIPALS = [f"user{i}" for i in range(6)]
SESSIONS_PER_KIND = 4  # x3 kinds (legacy HTTP, 2026-07-28 HTTP, WebSocket) = 12 concurrent clients
TURNS = 3
# What the trainer trains: "all" exercises the multimodal model as the demo does; override with
# LEARNMESH_E2E_TRAINABLE=head for a faster run.
TRAINABLE = os.environ.get("LEARNMESH_E2E_TRAINABLE", "all")


@pytest.fixture
def mesh(tmp_path: Path, redis_target: RedisTarget) -> Any:
    m = Mesh(tmp_path, redis_target.url, PRINCIPALS, workers=2, ranks=2,
             model={"trainable": TRAINABLE})
    with m.running():
        yield m


async def _client(kind: str, mesh: Mesh, principal: str) -> Any:
    key = mesh.api_keys[principal]
    if kind == "ws":
        return await McpWs(mesh.base, key).open()
    return await McpHttp(mesh.base, key, legacy=(kind == "legacy")).open()


async def _fact_nll(client: Any, facts: list[tuple[str, str]] = FACTS, **wait: Any) -> tuple[float, int]:
    total, served = 0.0, 0
    for prompt, target in facts:
        r = await client.call("score", {"prompt": prompt, "target": target, **wait})
        total += r["nll"]
        served = max(served, r["model_version"])
    return total / len(facts), served


async def _session(kind: str, n: int, mesh: Mesh) -> dict[str, Any]:
    """One client: writes its context, generates with it, learns, reads the context back."""
    principal = PRINCIPALS[n % len(PRINCIPALS)]
    client = await _client(kind, mesh, principal)
    ctx_id = f"{kind}-{n}"
    written: list[str] = []
    acked: list[str] = []
    try:
        for t in range(TURNS):
            text = f"{principal}/{ctx_id} turn {t}"
            r = await client.call("context_append", {"context_id": ctx_id, "modality": "text", "role": "user",
                                                     "text": text})
            written.append(text)
            assert r["context_id"] == ctx_id
            g = await client.call("generate", {"context_id": ctx_id, "prompt": "and then?", "max_tokens": 4,
                                               "temperature": 0.0, "append": False})
            assert g["model_version"] >= 0 and g["tokens"] >= 0
            samples = [{"kind": "example", "input": p, "target": tgt} for p, tgt in FACTS]
            samples.append({"kind": "example", "input": f"{principal} says", "target": f" turn {t}",
                            "context_id": ctx_id, "version": r["version"]})
            ack = await client.call("learn", {"samples": samples})
            assert len(ack["ids"]) == len(samples)
            acked.extend(ack["ids"])
            last_token = ack["learned"]
        got = await client.call("context_get", {"context_id": ctx_id})
        return {"principal": principal, "ctx": ctx_id, "written": written, "acked": acked,
                "read": [e.get("text") for e in got["entries"]], "kind": kind, "learned": last_token}
    finally:
        await client.close()


async def _run(mesh: Mesh) -> None:
    probe = await McpHttp(mesh.base, mesh.api_keys[PRINCIPALS[0]]).open()
    try:
        nll_before, v_before = await _fact_nll(probe)
        control_before, _ = await _fact_nll(probe, CONTROL)
        held_before, _ = await _fact_nll(probe, HELD_OUT)
        results = await asyncio.gather(*(_session(kind, n, mesh) for kind in ("legacy", "modern", "ws")
                                         for n in range(SESSIONS_PER_KIND)))

        # exactly once: every acknowledged id is in the ledger once, and nothing else is
        acked = [i for r in results for i in r["acked"]]
        assert len(acked) == len(set(acked)) == 3 * SESSIONS_PER_KIND * TURNS * (len(FACTS) + 1)
        r = mesh.redis()
        try:
            def all_trained() -> bool:
                return set(acked) <= set(ledger.trained_ids(r))
            await asyncio.to_thread(wait_until, all_trained, 180, "every acknowledged sample in the ledger", 0.5)
            counts = collections.Counter(ledger.trained_ids(r))
            assert {i: c for i, c in counts.items() if c != 1} == {}, "a sample was trained more than once"
            assert set(counts) == set(acked), "the ledger holds ids nobody acknowledged"
            partitions = sample_partitions(load_config(env={}, overrides={"redis": {"url": mesh.redis_url}}))
            handed_out = sum(int(r.get(keys.sample_seq(p)) or 0) for p in range(partitions))
            assert handed_out == len(acked), "the log handed out seqs nobody holds"
        finally:
            close_sync(r)

        # every context holds exactly what its owner wrote, in order; nobody else can name it
        for res in results:
            assert res["read"] == res["written"], (res["kind"], res["ctx"], res["read"])
        intruder = await McpHttp(mesh.base, mesh.api_keys[PRINCIPALS[1]]).open()
        try:
            with pytest.raises(McpError):
                await intruder.call("context_get", {"context_id": "legacy-0"})  # user0's context
        finally:
            await intruder.close()

        # once training pauses, every worker serves exactly the trainer's weights (same digest)
        await asyncio.to_thread(wait_until, lambda: _bit_exact(mesh), 60, "workers bit-exact with the trainer", 0.1)
        latest = mesh.trainer_version()
        assert latest > v_before

        # the taught facts score much better on a model that includes them, and specifically
        newest = max(results, key=lambda res: int(res["learned"].rpartition(".")[2]))["learned"]
        nll_after, v_after = await _fact_nll(probe, after_learn=newest)
        control_after, _ = await _fact_nll(probe, CONTROL, after_learn=newest)
        held_after, _ = await _fact_nll(probe, HELD_OUT, after_learn=newest)
        assert v_after >= latest
        taught_fall = (nll_before - nll_after) / nll_before
        control_fall = (control_before - control_after) / control_before
        print(f"e2e: {len(results)} clients, {len(acked)} samples trained once each, versions {v_before}->{v_after}, "
              f"facts NLL {nll_before:.3f} -> {nll_after:.3f} ({taught_fall:.0%} lower), control {control_before:.3f} "
              f"-> {control_after:.3f} ({control_fall:.0%}), held-out {held_before:.3f} -> {held_after:.3f}")
        assert taught_fall > 0.5, (nll_before, nll_after)
        assert control_fall < taught_fall / 2, (control_before, control_after, taught_fall)
        assert held_after < held_before * (1 + HELD_OUT_RISE), (held_before, held_after)
    finally:
        await probe.close()


def _bit_exact(mesh: Mesh) -> bool:
    r = mesh.redis()
    try:
        digest = r.hget(keys.component_status("delta"), "weights_digest")
        served = [r.hget(keys.component_status(f"worker:{w['id']}"), "weights_digest")
                  for w in mesh.workers_status().get("workers", [])]
    finally:
        close_sync(r)
    return bool(digest) and len(served) >= mesh.workers and all(d == digest for d in served)


def test_whole_loop_many_clients(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))
    trainer_log = mesh.child_log("trainer")
    assert "rank 1 failed" not in trainer_log and "rank 0 failed" not in trainer_log, trainer_log[-3000:]
    assert mesh.starts("trainer") == 1 and mesh.starts("worker-0") == 1, "a child crashed and was restarted"
