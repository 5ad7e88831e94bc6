"""A worker applies the trainer's weight deltas between batches and reports its version;
the gateway's pool routes ``min_model_version`` requests to it once it has caught up."""

from __future__ import annotations

import pytest
import torch
import yaml
import zmq

from gateway.workers import WorkerPool
from shared import crypto
from shared.model import build_model
from tests.conftest import wait_for
from tests.worker_support import spawn_worker, stop, write_config

publisher_mod = pytest.importorskip("services.trainer.publisher")


async def test_worker_applies_deltas_and_routes_by_version(tmp_path):
    path, cfg = write_config(tmp_path, 1, extra={"compression": {"algorithm": "lossless"}})
    model = build_model(cfg.model)
    params = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
    ctx = zmq.Context()
    pub = publisher_mod.DeltaPublisher(cfg, ctx, params, 0, model.model_id)
    proc = spawn_worker(path, 0)
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        prompt = {"op": "generate", "prompt": "The gateway", "max_tokens": 10, "temperature": 0.0, "entries": []}
        before = await pool.request(prompt)
        assert before["version"] == 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("head."):
                    p.add_(torch.randn_like(p) * 0.5)
        new = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
        pub.publish(new, 1)
        after = await pool.request(prompt, min_version=1)
        assert after["version"] == 1
        await wait_for(lambda: pool.links[0].version == 1, timeout_s=10, what="heartbeat to report version 1")
        ex = model.encode([], "The gateway", None, reserve_tokens=10)
        local = b"".join(s[0] for s in model.generate([ex], max_tokens=10, temperature=0.0))
        assert after["text"] == local.decode("utf-8", errors="replace"), "worker did not apply the delta exactly"
    finally:
        await pool.close()
        stop(proc)
        pub.close()
        ctx.term()


async def test_a_worker_that_cannot_open_deltas_leaves_routing_once_another_serves_newer(tmp_path):
    """Worker 0 holds another mesh's key ring (a copy from before a rotation, say): it can open
    no delta, not even a heartbeat, so it never learns it is behind and reports no lag. The pool
    must not keep sending it requests while worker 1 serves the trainer's newer weights."""
    path, cfg = write_config(tmp_path, 2, extra={"compression": {"algorithm": "lossless"},
                                                 "consistency": {"max_lag": 1}})
    other = yaml.safe_load(path.read_text())
    other["security"]["delta_key_file"] = str(tmp_path / "other-keys" / "delta.key")
    other_path = tmp_path / "other.yaml"
    other_path.write_text(yaml.safe_dump(other))
    crypto.ensure_keys(other["security"]["delta_key_file"], tmp_path / "other-keys" / "delta-sign.key")
    model = build_model(cfg.model)
    params = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
    ctx = zmq.Context()
    pub = publisher_mod.DeltaPublisher(cfg, ctx, params, 0, model.model_id)
    procs = [spawn_worker(other_path, 0), spawn_worker(path, 1)]
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(2, timeout_s=60)
        with torch.no_grad():
            for version in (1, 2, 3):
                for p in params.values():
                    p.add_(0.01)
                pub.publish(params, version)
        await wait_for(lambda: pool.links[1].version == 3, timeout_s=30, what="worker 1 to serve version 3")
        assert pool.links[0].version == 0 and pool.links[0].lag == 0, "worker 0 opened a delta of another ring"
        prompt = {"op": "score", "prompt": "The gateway", "target": " serves", "entries": []}
        served = [(await pool.request(prompt))["version"] for _ in range(6)]
        assert served == [3] * 6, "a worker serving weights three versions old answered"
        stale = procs.pop(0)
        stale.terminate()
        _, err = stale.communicate(timeout=30)
        assert "refuses delta packets (wrong_key" in err.decode(), "the stale worker's log does not say why"
    finally:
        await pool.close()
        for proc in procs:
            stop(proc)
        pub.close()
        ctx.term()
