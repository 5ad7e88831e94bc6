"""Two real gloo ranks: identical parameters after steps, with each comm hook and local SGD;
and how NCCL ranks are placed on a machine's GPUs (pure logic: no GPU here).

On a Redis Cluster (a sample log in partitions, the ledger in one slot) the gloo ranks run with
local SGD only: rank 0's Redis calls are the same whatever the hook, and local SGD is the case
where they diverge most from the steps (a commit every step, a publish only every H steps)."""

from __future__ import annotations

import pytest
import torch
from trainer_support import TrainerProc, async_redis, committed, trained, trainer_config

from gateway.tools.learning import SampleIngest
from services.trainer import dist as trainer_dist
from services.trainer.dist import RankEnv, gpu_index, ranks_for_gpus
from services.trainer.launcher import local_ranks
from services.trainer.tiny import build_tiny_model
from shared.config import ConfigError, load_config
from shared.samples import Example
from tests.conftest import free_port, redis_modes, wait_for

N = 48
PRINCIPALS = ["alice", "bob", "carol"]


MODES = {"fp16+accumulation": {"comm_hook": "fp16", "grad_accum_steps": 2},
         "powersgd": {"comm_hook": "powersgd", "powersgd_rank": 1},
         "local-sgd": {"local_sgd_period": 2}}
CLUSTER_MODES = {"local-sgd"}


# Plain all-reduce (no hook) with 2 ranks is covered by the dying-rank test in
# test_trainer_exactly_once.py; each run here costs two torch start-ups.
@pytest.mark.parametrize(("redis_target", "mode"),
                         [pytest.param(kind, mode, id=f"{kind}-{name}") for kind in redis_modes()
                          for name, mode in MODES.items() if kind == "single" or name in CLUSTER_MODES],
                         indirect=["redis_target"])
async def test_two_gloo_ranks_hold_identical_parameters(redis_target, tmp_path, mode):
    redis_url = redis_target.url
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, checkpoint_every=4, **mode)
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    dump = tmp_path / "dump"
    dump.mkdir()
    proc = TrainerProc(cfg, tmp_path, dump_dir=dump)
    try:
        samples = [Example(input=f"q{i}?", target=f"answer {i % 7}") for i in range(N)]
        for i in range(0, N, 8):  # several principals: on a cluster, several log partitions
            await ingest.submit(PRINCIPALS[i // 8 % len(PRINCIPALS)], samples[i:i + 8])
        await wait_for(lambda: trained(redis_url) == N, timeout_s=120,
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


def test_nccl_rank_uses_the_gpu_of_its_local_rank():
    assert [gpu_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    assert gpu_index(1, 2, 8) == 1  # a node with spare GPUs


@pytest.mark.parametrize(("local_rank", "local_world", "gpus"), [(0, 2, 1), (1, 2, 1), (0, 4, 0), (2, 1, 2)],
                         ids=["2-ranks-1-gpu", "second-rank-1-gpu", "no-gpu", "local-rank-past-the-gpus"])
def test_more_nccl_ranks_than_gpus_fail_naming_the_setting(local_rank, local_world, gpus):
    with pytest.raises(ConfigError, match=r"trainer\.ranks") as err:
        gpu_index(local_rank, local_world, gpus)
    assert f"{gpus} visible GPU" in str(err.value)


def test_rank_env_reads_the_local_world_size(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert RankEnv.from_environ() == RankEnv(5, 8, 1, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert RankEnv.from_environ().local_world == 2  # at least this rank and the ones below it


@pytest.mark.parametrize(("ranks", "backend", "gpus", "spawned"),
                         [(4, "nccl", 2, 2), (4, "auto", 2, 2), (2, "nccl", 8, 2), (4, "gloo", 2, 4),
                          (4, "auto", 0, 4), (3, "nccl", 0, 3)],
                         ids=["nccl-capped", "auto-capped", "nccl-enough", "gloo", "auto-cpu", "nccl-no-cuda"])
def test_nccl_ranks_are_capped_at_the_gpu_count(caplog, ranks, backend, gpus, spawned):
    assert ranks_for_gpus(ranks, backend, gpus) == spawned
    capped = [r for r in caplog.records if "trainer.ranks" in r.getMessage()]
    assert bool(capped) == (spawned < ranks)


def test_the_launcher_starts_at_most_one_nccl_rank_per_gpu(monkeypatch):
    monkeypatch.setattr(trainer_dist, "local_gpu_count", lambda: 1)
    cfg = load_config(env={}, overrides={"trainer": {"ranks": 2, "backend": "nccl"}})
    assert local_ranks(cfg) == 1
    cfg.trainer.backend = "gloo"
    assert local_ranks(cfg) == 2
