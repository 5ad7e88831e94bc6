"""A worker applies the trainer's weight deltas between batches and reports its version;
the gateway's pool routes ``min_model_version`` requests to it once it has caught up."""

from __future__ import annotations

import pytest
import torch
import zmq

from gateway.workers import WorkerPool
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
