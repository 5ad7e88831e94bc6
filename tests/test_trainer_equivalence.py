"""The distributed step against one process, through the real ``Trainer.train_step``: two
gloo ranks (plain DDP, and with gradient accumulation) end with the parameters a single rank
reaches on the same batches; with local SGD the ranks hold their mean after every H steps,
only that mean is published, and an operator rollback returns on every rank.

Each rank is a spawned process building a real ``Trainer`` with ``build_trainer`` (rank 0
with Redis, its sample source and the delta publisher); batches are handed to
``train_step`` as rank 0 would broadcast them, instead of being read from the log.

Every target has the same length: the tiny model's loss is a mean over target tokens, so a
batch's loss is then the mean of its samples' losses, and train_step's weighting of each
shard (its loss times len(shard) / total * world) adds up to exactly the one-process loss.

One Redis server only: what is under test is arithmetic, and Redis only holds what rank 0's
leader records of each step (commit record, ledger, published versions); those same leader calls
run on a Redis Cluster, behind a partitioned sample log, in test_trainer_ddp.py (two gloo ranks,
each comm hook and local SGD) and test_trainer_served_learned.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from trainer_support import trainer_config

from services.trainer.checkpoint import load_bytes
from services.trainer.data import TrainRecord, decode_batch, encode_batch
from services.trainer.dist import RankGroup
from services.trainer.loop import Trainer
from services.trainer.main import build_trainer
from services.trainer.stepper import make_optimizer
from services.trainer.tiny import build_tiny_model
from shared.config import Config, load_config
from shared.samples import Example, LoggedSample
from tests.conftest import free_port

BATCH_SIZES = [8, 7, 3, 8]  # 7 and 3: uneven shards; 3 with accumulation: an empty micro-batch
H = 2  # local SGD period
RANK_TIMEOUT_S = 30  # process-group timeout inside the ranks: a deadlock fails, not hangs
SPAWN_TIMEOUT_S = 120


def _batches() -> list[bytes]:
    out, seq = [], 0
    for size in BATCH_SIZES:
        records = []
        for _ in range(size):
            seq += 1
            sample = Example(input=f"question {seq}?", target=f"answer {seq % 7}")
            records.append(TrainRecord(LoggedSample(f"s{seq}", seq, "alice", sample, f"{seq}-0"), None))
        out.append(encode_batch("train", records))
    return out


def _records(data: bytes) -> list[TrainRecord]:
    return decode_batch(data)[1]


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.stepper.model.trainable_named_parameters()}


def _config(redis_url: str, tmp_path: Path, name: str, **trainer: Any) -> tuple[Config, Path]:
    d = tmp_path / name
    d.mkdir()
    cfg = trainer_config(redis_url, d, free_port(), checkpoint_every=1000, init_timeout_s=RANK_TIMEOUT_S, **trainer)
    path = d / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return cfg, path


# ---------------------------------------------------------------- inside a spawned rank


def _rank_main(rank: int, world: int, master_port: int, cfg_path: str, scenario: str, out: str) -> None:
    from services.trainer.dist import RankEnv, init_distributed, leave, teardown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    cfg = load_config(cfg_path, env={})
    trainer = build_trainer(cfg, init_distributed(cfg, RankEnv(rank, world, rank, world)), lambda: False)
    try:
        dumps = _SCENARIOS[scenario](trainer)
        torch.save(dumps, Path(out) / f"rank{rank}.pt")
    finally:
        trainer.close()
        teardown()
    leave(0)  # as a trainer rank leaves: past gloo's static destructors


def _train(trainer: Trainer) -> dict[str, Any]:
    for data in _batches():
        trainer.train_step(_records(data))
    return {"params": _params(trainer)}


def _capture_published(trainer: Trainer) -> list[dict[str, Any]]:
    """What rank 0 hands the real publisher, with the step it was handed at."""
    sent: list[dict[str, Any]] = []
    if trainer.leader is None:
        return sent
    publisher = trainer.leader.publisher
    publish = publisher.publish

    def capture(named_params: dict[str, torch.Tensor], version: int, **kw: Any) -> Any:
        sent.append({"step": trainer.step, "anchor": bool(kw.get("anchor")),
                     "params": {n: t.clone() for n, t in named_params.items()}})
        return publish(named_params, version, **kw)

    publisher.publish = capture  # type: ignore[method-assign]
    return sent


def _local_sgd(trainer: Trainer) -> dict[str, Any]:
    published = _capture_published(trainer)
    batches = _batches()
    out: dict[str, Any] = {}
    for data in batches[:H]:
        trainer.train_step(_records(data))
    out["averaged"] = _params(trainer)
    path = trainer.save_checkpoint()  # every rank calls it, as run() does
    command = b""
    if trainer.leader is not None:
        assert path is not None
        out["checkpoint"] = load_bytes(Path(path).read_bytes())
        out["version"] = trainer.leader.version
        command = json.dumps({"cmd": "rollback", "id": "rb", "to_version": trainer.leader.version, "path": path}).encode()
    trainer.train_step(_records(batches[H]))
    out["drifted"] = _params(trainer)
    # an operator rollback to the checkpoint, resolved on rank 0 and broadcast as run() does
    trainer.run_commands([json.loads(trainer.group.broadcast_bytes(command))])
    out["rolled_back"] = _params(trainer)
    trainer.train_step(_records(batches[H + 1]))
    out["after"] = _params(trainer)
    out["published"] = published
    return out


_SCENARIOS = {"train": _train, "local_sgd": _local_sgd}


def _spawn(world: int, cfg_path: Path, scenario: str, out: Path) -> list[dict[str, Any]]:
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), str(cfg_path), scenario, str(out)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"ranks did not finish within {SPAWN_TIMEOUT_S}s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _one_process(cfg: Config) -> dict[str, torch.Tensor]:
    trainer = build_trainer(cfg, RankGroup(0, 1, torch.device("cpu")), lambda: False)
    try:
        return _train(trainer)["params"]
    finally:
        trainer.close()


# ---------------------------------------------------------------- checks


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max((float((a[n] - b[n]).norm() / b[n].norm()), n) for n in a)


def _moved(params: dict[str, torch.Tensor]) -> float:
    initial = dict(build_tiny_model().trainable_named_parameters())
    return sum(float((params[n] - initial[n].detach()).abs().sum()) for n in initial)


@pytest.mark.parametrize("grad_accum_steps", [1, 2], ids=["plain", "accumulation"])
def test_two_ranks_match_one_process(redis_url, tmp_path, grad_accum_steps):
    _, two_path = _config(redis_url, tmp_path, "two", ranks=2, grad_accum_steps=grad_accum_steps)
    ranks = _spawn(2, two_path, "train", tmp_path / "two")
    one_cfg, _ = _config(redis_url, tmp_path, "one", ranks=1)
    one = _one_process(one_cfg)
    for name in one:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), f"{name} differs between ranks"
    rel, name = _max_rel_diff(ranks[0]["params"], one)
    assert rel <= 1e-5, f"2 ranks vs 1 process: {name} differs by {rel:.2e} (relative)"
    assert _moved(one) > 0, "training did not change the parameters"


def _local_sgd_reference(cfg: Config, world: int) -> dict[str, torch.Tensor]:
    """H local steps per rank on its shard, weighted as train_step weights it, then the mean."""
    models = [build_tiny_model() for _ in range(world)]
    optims = [make_optimizer([p for _, p in m.trainable_named_parameters()], cfg.trainer) for m in models]
    for data in _batches()[:H]:
        items = [(r, pair) for r in _records(data) if (pair := r.logged.sample.training_pair())]
        for rank, (model, (opt, sched)) in enumerate(zip(models, optims, strict=True)):
            mine = items[rank::world]
            use = mine or items[:1]
            batch = model.collate([model.encode(r.context, *pair) for r, pair in use])
            (model.loss(batch) * (len(mine) / len(items) * world if mine else 0.0)).backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.trainer.clip_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    named = [dict(m.trainable_named_parameters()) for m in models]
    return {n: torch.stack([p[n].detach() for p in named]).sum(0) / world for n in named[0]}


def test_local_sgd_averages_publishes_the_average_and_rolls_back(redis_url, tmp_path):
    cfg, path = _config(redis_url, tmp_path, "local", ranks=2, local_sgd_period=H)
    ranks = _spawn(2, path, "local_sgd", tmp_path / "local")
    r0, r1 = ranks

    # after H steps on different shards every rank holds the mean of the ranks' local models
    for name in r0["averaged"]:
        assert torch.equal(r0["averaged"][name], r1["averaged"][name]), f"{name} not averaged after {H} steps"
    rel, name = _max_rel_diff(r0["averaged"], _local_sgd_reference(cfg, 2))
    assert rel <= 1e-5, f"averaged {name} is not the ranks' mean ({rel:.2e} relative)"
    assert any(not torch.equal(r0["drifted"][n], r1["drifted"][n]) for n in r0["drifted"]), \
        "ranks should drift apart on the step after an average"

    # rank 0 publishes only weights every rank held: at start, then each average
    initial = {n: p.detach() for n, p in build_tiny_model().trainable_named_parameters()}
    by_step = {(e["step"], e["anchor"]): e["params"] for e in r0["published"]}
    expect = {(1, False): initial, (2, False): r0["averaged"], (H + 1, False): r0["averaged"],
              (H + 1, True): r0["averaged"]}  # the rollback's anchor: the checkpointed average
    assert set(expect) <= set(by_step), sorted(by_step)
    for key, params in expect.items():
        for name in params:
            assert torch.equal(by_step[key][name], params[name]), f"publish at {key}: {name} is not the consensus"

    # the checkpoint is that average, marked as exactly the version published with it
    assert r0["checkpoint"]["published_version"] == r0["version"]
    for name, tensor in r0["averaged"].items():
        assert torch.equal(r0["checkpoint"]["model"][name], tensor), name

    # the rollback returned on every rank (no rank left in a collective) with the checkpoint loaded
    for rank in ranks:
        for name, tensor in r0["averaged"].items():
            assert torch.equal(rank["rolled_back"][name], tensor), f"rank's {name} after rollback"
    for name in r0["after"]:
        assert torch.equal(r0["after"][name], r1["after"][name]), f"{name} differs after the next average"
