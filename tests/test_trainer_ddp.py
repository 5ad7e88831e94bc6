"""Two real gloo ranks: identical parameters after steps, with each comm hook and local SGD."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
import torch
from conftest import free_port, wait_for
from trainer_support import TrainerProc, committed, trainer_config

from gateway.tools.learning import SampleIngest
from services.trainer.tiny import build_tiny_model
from shared.samples import Sample

N = 48


# Plain all-reduce (no hook) with 2 ranks is covered by the dying-rank test in
# test_trainer_exactly_once.py; each run here costs two torch start-ups.
@pytest.mark.parametrize("mode", [{"comm_hook": "fp16", "grad_accum_steps": 2},
                                  {"comm_hook": "powersgd", "powersgd_rank": 1},
                                  {"local_sgd_period": 2}],
                         ids=["fp16+accumulation", "powersgd", "local-sgd"])
async def test_two_gloo_ranks_hold_identical_parameters(redis_url, tmp_path, mode):
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, checkpoint_every=4, **mode)
    redis = aioredis.Redis.from_url(redis_url)
    ingest = SampleIngest(redis, cfg)
    dump = tmp_path / "dump"
    dump.mkdir()
    proc = TrainerProc(cfg, tmp_path, env={"LEARNMESH_TRAINER_DUMP_DIR": str(dump)})
    try:
        samples = [Sample("example", input=f"q{i}?", target=f"answer {i % 7}") for i in range(N)]
        for i in range(0, N, 8):
            await ingest.submit("alice", samples[i:i + 8])
        await wait_for(lambda: int(committed(redis_url).get("seq", 0)) == N, timeout_s=120,
                       what=lambda: f"trainer to commit all samples\n{proc.output()}")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
        ingest.close()
        await redis.aclose()
    ranks = [torch.load(dump / f"rank{r}.pt") for r in range(2)]
    initial = dict(build_tiny_model().trainable_named_parameters())
    assert ranks[0].keys() == ranks[1].keys() == initial.keys()
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs between ranks"
    moved = sum(float((ranks[0][n] - initial[n].detach()).abs().sum()) for n in initial)
    assert moved > 0, "training did not change the parameters"
    assert int(committed(redis_url)["step"]) >= N // 8
