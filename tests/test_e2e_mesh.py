"""The whole loop as a user sees it, against real ``learnmesh up`` processes.

One mesh (tiny model, 2 workers, a trainer with 2 gloo ranks, private Redis, every port
free) serves many concurrent MCP clients with distinct principals over the 2025-11-25
session revision, the 2026-07-28 stateless revision and WebSocket. They write contexts,
generate with them, teach facts with ``learn`` and read their contexts back. Afterwards:

* every acknowledged sample id is in the trainer's ledger exactly once;
* every client's context holds exactly what that client wrote (and nobody else can read it);
* every worker serves the trainer's latest version;
* the taught facts score better (``score`` with ``min_model_version``).
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path
from typing import Any

import pytest
from mesh_support import McpError, McpHttp, McpWs, Mesh, wait_until

from services.trainer import ledger
from shared import keys

FACTS = [("The capital of Zorbland is", " Quixville."), ("The moon of Plimptar is called", " Oodle."),
         ("Professor Wimble's favourite colour is", " teal.")]
# Held out: never taught; their loss may move a little but must not blow up.
HELD_OUT = [("The sun rises in the", " east."), ("Water is made of hydrogen and", " oxygen.")]
HELD_OUT_BOUND = 1.5
PRINCIPALS = [f"user{i}" for i in range(6)]
SESSIONS_PER_KIND = 4  # x3 kinds (legacy HTTP, 2026-07-28 HTTP, WebSocket) = 12 concurrent clients
TURNS = 3
# What the trainer trains: "all" exercises the multimodal model as the demo does; override with
# LEARNMESH_E2E_TRAINABLE=head for a faster run.
TRAINABLE = os.environ.get("LEARNMESH_E2E_TRAINABLE", "all")


@pytest.fixture
def mesh(tmp_path: Path, redis_url: str) -> Any:
    m = Mesh(tmp_path, redis_url, PRINCIPALS, workers=2, ranks=2,
             model={"trainable": TRAINABLE}, trainer={"lr": 0.003, "batch_size": 8})
    with m.running():
        yield m


async def _client(kind: str, mesh: Mesh, principal: str) -> Any:
    key = mesh.api_keys[principal]
    if kind == "ws":
        return await McpWs(mesh.base, key).open()
    return await McpHttp(mesh.base, key, legacy=(kind == "legacy")).open()


async def _fact_nll(client: Any, min_version: int, facts: list[tuple[str, str]] = FACTS) -> tuple[float, int]:
    total, served = 0.0, 0
    for prompt, target in facts:
        r = await client.call("score", {"prompt": prompt, "target": target, "min_model_version": min_version})
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
        got = await client.call("context_get", {"context_id": ctx_id})
        return {"principal": principal, "ctx": ctx_id, "written": written, "acked": acked,
                "read": [e.get("text") for e in got["entries"]], "kind": kind}
    finally:
        await client.close()


async def _run(mesh: Mesh) -> None:
    probe = await McpHttp(mesh.base, mesh.api_keys[PRINCIPALS[0]]).open()
    try:
        nll_before, v_before = await _fact_nll(probe, 0)
        held_before, _ = await _fact_nll(probe, 0, HELD_OUT)
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
            assert int(r.get(keys.SAMPLE_SEQ) or 0) == len(acked), "the log handed out seqs nobody holds"
        finally:
            r.close()

        # every context holds exactly what its owner wrote, in order; nobody else can name it
        for res in results:
            assert res["read"] == res["written"], (res["kind"], res["ctx"], res["read"])
        intruder = await McpHttp(mesh.base, mesh.api_keys[PRINCIPALS[1]]).open()
        try:
            with pytest.raises(McpError):
                await intruder.call("context_get", {"context_id": "legacy-0"})  # user0's context
        finally:
            await intruder.close()

        # workers converge to the trainer's version
        await asyncio.to_thread(wait_until, mesh.converged, 60, "workers at the trainer's version", 0.25)
        latest = mesh.trainer_version()
        assert latest > v_before

        # the taught facts score better on a model that includes them
        nll_after, v_after = await _fact_nll(probe, latest)
        held_after, _ = await _fact_nll(probe, latest, HELD_OUT)
        assert v_after >= latest
        print(f"e2e: {len(results)} clients, {len(acked)} samples trained once each, versions {v_before}->{v_after}, "
              f"facts mean NLL {nll_before:.3f} -> {nll_after:.3f}, held-out {held_before:.3f} -> {held_after:.3f}")
        assert nll_after < nll_before - 0.05, (nll_before, nll_after)
        assert held_after < held_before * HELD_OUT_BOUND, (held_before, held_after)
    finally:
        await probe.close()


def test_whole_loop_many_clients(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))
    trainer_log = mesh.child_log("trainer")
    assert "rank 1 failed" not in trainer_log and "rank 0 failed" not in trainer_log, trainer_log[-3000:]
    assert mesh.starts("trainer") == 1 and mesh.starts("worker-0") == 1, "a child crashed and was restarted"
