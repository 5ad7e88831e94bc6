"""Exactly-once training per sample id across kill -9, and a dying rank under torchrun, each on a
single Redis and on a Redis Cluster (where the sample log has 8 partitions)."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

from trainer_support import (
    TrainerProc,
    async_redis,
    committed,
    log_entries,
    sync_redis,
    trained_total,
    trainer_config,
)

from gateway.tools.learning import SampleIngest
from services.trainer import checkpoint, ledger
from shared.redis_client import close_sync
from shared.samples import Example, partition_of, sample_partitions
from tests.conftest import free_port, wait_for

TEACHERS = ["alice", "bob", "carol", "dave", "erin"]


def _ckpts(cfg) -> list[Path]:
    return sorted(Path(cfg.trainer.checkpoint_dir).glob("ckpt-*.pt"))


def _assert_exactly_once(redis_url: str, acked: list[str]) -> None:
    r = sync_redis(redis_url)
    try:
        counts = collections.Counter(ledger.trained_ids(r))
    finally:
        close_sync(r)
    twice = [i for i, c in counts.items() if c > 1]
    assert not twice, f"trained more than once: {twice[:5]}"
    missing = set(acked) - set(counts)
    assert not missing, f"{len(missing)} acknowledged samples never trained"
    assert set(counts) == set(acked)


async def test_kill9_mid_stream_trains_every_acknowledged_id_exactly_once(redis_target, tmp_path):
    redis_url = redis_target.url
    # replays on: extra passes must never enter the ledger or move the offset
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=1, checkpoint_every=3, batch_size=4,
                         replay_passes=3, rehearsal_per_step=2)
    partitions = sample_partitions(cfg)
    assert partitions == (8 if redis_target.is_cluster else 1)
    assert partitions == 1 or len({partition_of(t, partitions) for t in TEACHERS}) > 2, "spread over partitions"
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    acked: list[str] = []
    total = 160

    async def stream(start: int, stop: int) -> None:
        for i in range(start, stop, 4):  # several principals: on a cluster, several log partitions
            out = await ingest.submit(TEACHERS[i // 4 % len(TEACHERS)], [Example(input=f"k{j}", target=f"v{j % 5}")
                                                                         for j in range(i, min(stop, i + 4))])
            acked.extend(out["ids"])
            await asyncio.sleep(0.005)

    first = TrainerProc(cfg, tmp_path)
    second = None
    try:
        feeder = asyncio.create_task(stream(0, 100))
        # kill -9 after a checkpoint and some uncheckpointed steps, while samples still arrive
        await wait_for(lambda: _ckpts(cfg) and int(committed(redis_url).get("step", 0)) % 3 != 0,
                       timeout_s=90, what="a checkpoint followed by uncheckpointed steps")
        first.kill9()
        await feeder
        await stream(100, total)
        before = committed(redis_url)
        second = TrainerProc(cfg, tmp_path)
        await wait_for(lambda: trained_total(committed(redis_url)) == total, timeout_s=240,
                       what="the restarted trainer to catch up")
        assert second.term() == 0, second.output()
    finally:
        first.close()
        if second is not None:
            second.close()
        ingest.close()
        await redis.aclose()
    after = committed(redis_url)
    assert int(after["epoch"]) == int(before["epoch"]) + 1
    assert int(after["version"]) > int(before["version"]), "versions must stay monotonic across the restart"
    assert len(acked) == total
    _assert_exactly_once(redis_url, acked)
    r = sync_redis(redis_url)
    try:  # checkpoints trimmed the log entries they fully contain
        assert 0 < log_entries(r, sample_partitions(cfg)) < total // 4
    finally:
        close_sync(r)


async def _preload(redis_url: str, cfg, n: int) -> list[str]:
    """``n`` samples from every teacher in turn (on a cluster, spread over several log partitions)."""
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    ids: list[str] = []
    try:
        for start in range(0, n, 4):
            out = await ingest.submit(TEACHERS[start // 4 % len(TEACHERS)],
                                      [Example(input=f"x{i}", target=f"y{i % 3}") for i in range(start, min(n, start + 4))])
            ids.extend(out["ids"])
    finally:
        ingest.close()
        await redis.aclose()
    return ids


async def test_a_dying_rank_restarts_the_group_from_the_checkpoint(redis_target, tmp_path):
    redis_url = redis_target.url
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, checkpoint_every=2, batch_size=2,
                         max_restarts=1)
    acked = await _preload(redis_url, cfg, 40)
    marker = tmp_path / "fault-fired"
    proc = TrainerProc(cfg, tmp_path, kill=f"1:3:{marker}")
    try:
        await wait_for(lambda: trained_total(committed(redis_url)) == 40, timeout_s=150,
                       what="training to finish after the restart")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
    assert marker.exists(), "the fault never fired"
    assert "the rank group was restarted (restart 1 of 1)" in proc.output()
    assert int(committed(redis_url)["epoch"]) == 2
    _assert_exactly_once(redis_url, acked)


async def test_a_rank_that_keeps_dying_fails_the_job_instead_of_hanging(redis_target, tmp_path):
    redis_url = redis_target.url
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, checkpoint_every=50, batch_size=2,
                         max_restarts=0, step_timeout_s=10)
    await _preload(redis_url, cfg, 20)
    proc = TrainerProc(cfg, tmp_path, kill=f"1:1:{tmp_path / 'marker'}")
    try:
        code = await asyncio.to_thread(proc.proc.wait, 120)
    finally:
        proc.close()
    assert code != 0
    assert "trainer failed" in proc.output()


def test_a_checkpoint_write_cut_short_leaves_no_file_behind_the_next_save(tmp_path):
    """A kill -9 while rank 0 writes a checkpoint leaves its temp file (never loaded: only
    ``ckpt-<step>.pt`` names are); the next save removes it, so crashes do not fill the disk."""
    partial = tmp_path / ".ckpt-0000000007.pt.tmp"
    partial.write_bytes(b"half a checkpoint")
    assert checkpoint.latest(tmp_path) is None
    checkpoint.save(tmp_path, 9, {"step": 9}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000009.pt"]
    found = checkpoint.latest(tmp_path)
    assert found is not None and checkpoint.load_bytes(found[1])["step"] == 9
