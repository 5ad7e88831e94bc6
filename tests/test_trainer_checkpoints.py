"""What the trainer does with a checkpoint directory an operator finds damaged: an unreadable
newest checkpoint, none readable at all, checkpoints of another model, a full disk, a Redis that
lost the model version (the version floor kept beside the checkpoints). Each case
through ``learnmesh trainer`` (torchrun, real Redis): a log line naming the file and what to do,
and the exactly-once invariant kept (services/trainer/ledger.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_trainer_exactly_once import _assert_exactly_once, _ckpts, _preload
from trainer_support import (
    TrainerProc,
    async_redis,
    committed,
    sync_redis_open,
    trained_total,
    trainer_config,
)

from gateway.tools.learning import SampleIngest
from services.trainer import version_floor
from services.trainer.checkpoint import CheckpointError, load_bytes
from shared import keys
from shared.config import Config
from shared.samples import Example
from tests.conftest import free_port, wait_for


async def _train(cfg: Config, tmp_path: Path, total: int) -> None:
    """``learnmesh trainer`` until ``total`` samples are committed, then a clean stop."""
    proc = TrainerProc(cfg, tmp_path)
    try:
        await wait_for(lambda: trained_total(committed(cfg.redis.url)) == total, timeout_s=90,
                       what=f"{total} samples trained")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()


async def _exit_code(proc: TrainerProc) -> int:
    try:
        return await asyncio.to_thread(proc.proc.wait, 120)
    finally:
        proc.close()


async def test_an_unreadable_newest_checkpoint_is_set_aside_and_the_steps_after_the_older_one_train_again(
        redis_url, tmp_path):
    cfg = trainer_config(redis_url, tmp_path, free_port(), checkpoint_every=4, batch_size=2, checkpoint_keep=2)
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    try:  # one log entry per sample: a trim to the newest checkpoint removes entries the older one needs
        acked = [i for n in range(20) for i in (await ingest.submit("alice", [Example(input=f"q{n}", target="a")]))["ids"]]
    finally:
        ingest.close()
        await redis.aclose()
    await _train(cfg, tmp_path, 20)
    older, newest = _ckpts(cfg)[-2:]
    newest.write_bytes(newest.read_bytes()[:1000])  # a write cut short by something other than us
    proc = TrainerProc(cfg, tmp_path)
    try:
        await wait_for(lambda: f"checkpoint {newest} cannot be read" in proc.output(), timeout_s=60,
                       what="the unreadable checkpoint named in the log")
        await wait_for(lambda: int(committed(redis_url)["epoch"]) == 2 and trained_total(committed(redis_url)) == 20,
                       timeout_s=60, what="the steps after the older checkpoint trained again")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
    assert f"resuming from the older {older.name}" in proc.output()
    assert newest.with_name(newest.name + ".unreadable").exists()
    _assert_exactly_once(redis_url, acked)


async def test_no_readable_checkpoint_stops_the_trainer_naming_the_files_and_keeps_the_ledger(redis_url, tmp_path):
    cfg = trainer_config(redis_url, tmp_path, free_port(), checkpoint_every=2, batch_size=2, max_restarts=0)
    acked = await _preload(redis_url, cfg, 12)
    await _train(cfg, tmp_path, 12)
    for path in _ckpts(cfg):
        path.write_bytes(b"")
    before = committed(redis_url)
    proc = TrainerProc(cfg, tmp_path)
    assert await _exit_code(proc) != 0
    out = proc.output()
    assert f"no checkpoint in {cfg.trainer.checkpoint_dir} (trainer.checkpoint_dir) can be read" in out, out
    assert all(p.name in out for p in _ckpts(cfg))
    assert committed(redis_url) == before, "the commit record must not be rolled back to untrained weights"
    _assert_exactly_once(redis_url, acked)


async def test_a_checkpoint_of_another_model_is_named_with_what_to_do(redis_url, tmp_path):
    cfg = trainer_config(redis_url, tmp_path, free_port(), checkpoint_every=2, batch_size=2, max_restarts=0)
    await _preload(redis_url, cfg, 8)
    await _train(cfg, tmp_path, 8)
    newest = _ckpts(cfg)[-1]
    before = committed(redis_url)
    wide = trainer_config(redis_url, tmp_path, free_port(), checkpoint_every=2, batch_size=2, max_restarts=0,
                          model_factory="tests.trainer_support:wide_tiny_model")
    proc = TrainerProc(wide, tmp_path)
    assert await _exit_code(proc) != 0
    out = proc.output()
    assert f"checkpoint {newest} does not fit the model this configuration builds" in out, out
    assert "size mismatch for embed.weight" in out and "set trainer.checkpoint_dir" in out
    assert committed(redis_url) == before


async def test_a_full_checkpoint_disk_fails_the_rank_naming_the_file_and_leaves_no_partial_file(redis_url, tmp_path):
    cfg = trainer_config(redis_url, tmp_path, free_port(), checkpoint_every=2, batch_size=2, max_restarts=0)
    acked = await _preload(redis_url, cfg, 8)
    proc = TrainerProc(cfg, tmp_path, max_file_bytes=150_000)  # a checkpoint of the tiny model is ~290 kB
    assert await _exit_code(proc) != 0
    out = proc.output()
    ckpt_dir = Path(cfg.trainer.checkpoint_dir)
    assert f"cannot write checkpoint {ckpt_dir / 'ckpt-0000000002.pt'}" in out, out
    assert f"Free space in {ckpt_dir} (trainer.checkpoint_dir)" in out
    assert not list(ckpt_dir.glob("*ckpt-*")), "a partial checkpoint stays behind, filling the disk"
    await _train(cfg, tmp_path, 8)  # space again: the steps after the last checkpoint train again
    _assert_exactly_once(redis_url, acked)


async def test_versions_never_go_back_when_redis_lost_them_and_the_trainer_resumes_an_older_checkpoint(
        redis_target, tmp_path):
    """A Redis without persistence restarts (the model version and the commit record are gone)
    and the trainer restarts from a checkpoint older than its last published version: the
    version it publishes is still above every version published before (the floor beside the
    checkpoints), so no version number ever names two sets of weights."""
    cfg = trainer_config(redis_target.url, tmp_path, free_port(), checkpoint_every=4, batch_size=2)
    await _preload(redis_target.url, cfg, 14)
    first = TrainerProc(cfg, tmp_path)
    try:
        await wait_for(lambda: trained_total(committed(redis_target.url)) == 14, timeout_s=90,
                       what="14 samples trained")
        first.kill9()  # no checkpoint at the stop: the newest is older than the last version published
    finally:
        first.close()
    published = _model_version(redis_target)
    checkpointed = max(int(load_bytes(p.read_bytes())["version"]) for p in _ckpts(cfg))
    assert checkpointed < published
    redis_target.flush()
    second = TrainerProc(cfg, tmp_path)
    try:
        await wait_for(lambda: _model_version(redis_target) > 0, timeout_s=90, what="the restarted trainer's version")
        assert _model_version(redis_target) > published, second.output()
        assert second.term() == 0, second.output()
    finally:
        second.close()


def _model_version(target) -> int:
    with sync_redis_open(target.url) as r:
        return int(r.get(keys.MODEL_VERSION) or 0)


def test_a_version_floor_that_is_not_a_number_is_named_with_what_to_do(tmp_path):
    (tmp_path / version_floor.FILE_NAME).write_text("garbage")
    with pytest.raises(CheckpointError, match=r"version-floor does not hold a version .*Write in it a number"):
        version_floor.VersionFloor(tmp_path)


def test_the_version_floor_is_reserved_ahead_and_written_only_when_passed(tmp_path):
    floor = version_floor.VersionFloor(tmp_path / "ckpt")
    assert floor.reserved == 0
    floor.reserve(3)
    path = tmp_path / "ckpt" / version_floor.FILE_NAME
    assert floor.reserved == int(path.read_text()) == 3 + version_floor.RESERVE_BLOCK
    before = path.stat().st_ino  # a write replaces the file
    floor.reserve(3 + version_floor.RESERVE_BLOCK)
    assert path.stat().st_ino == before
    assert version_floor.VersionFloor(tmp_path / "ckpt").reserved == 3 + version_floor.RESERVE_BLOCK
