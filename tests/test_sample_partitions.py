"""The partitioned sample log (trainer.sample_partitions): writers append to their principal's
partition, the trainer's sample source reads every partition oldest-first, and the per-partition
positions it hands out resume exactly where they stopped. Runs on one server (4 partitions) and
on a cluster (the partitions on several masters)."""

from __future__ import annotations

import dataclasses

import zmq
from trainer_support import trainer_config

from gateway.tools.learning import SampleIngest
from services.trainer.data import SampleSource
from shared import keys
from shared.redis_client import close_sync
from shared.samples import Example, partition_of, sample_partitions
from tests.conftest import RedisTarget, free_port

TEACHERS = ["alice", "bob", "carol", "dave", "erin", "frank"]


def _config(redis_target: RedisTarget, tmp_path, partitions: int):
    cfg = trainer_config(redis_target.url, tmp_path, free_port())
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, sample_partitions=partitions))


async def test_every_partition_is_read_in_order_and_positions_resume_exactly(redis_target: RedisTarget,
                                                                           tmp_path) -> None:
    cfg = _config(redis_target, tmp_path, 4)
    assert sample_partitions(cfg) == 4
    used = {partition_of(t, 4) for t in TEACHERS}
    assert len(used) >= 3, "the teachers spread over the partitions"
    redis = redis_target.async_client()
    ingest = SampleIngest(redis, cfg)  # type: ignore[arg-type]
    sync = redis_target.sync_client()
    ctx = zmq.Context()
    try:
        acked = []
        for i in range(12):
            teacher = TEACHERS[i % len(TEACHERS)]
            out = await ingest.submit(teacher, [Example(input=f"{teacher}{i}", target="a")])
            acked.append((out["ids"][0], teacher))
            part = partition_of(teacher, 4)
            assert out["learned"].endswith(f".{part}") == (part != 0)
        for part in used:
            assert sync.xlen(keys.sample_log(part)) > 0
        source = SampleSource(cfg, sync, ctx, {}, partitions=4)
        try:
            first = source.next_batch(7, 100, lambda: False)
            positions = source.positions()
        finally:
            source.close()
        assert [s.id for s in first] != [] and len(first) == 7
        assert {s.id for s in first} <= {i for i, _ in acked}
        for part, pos in positions.items():  # each partition's position is its last sample handed out
            mine = [s for s in first if s.partition == part]
            assert pos.seq == (mine[-1].seq if mine else 0)
            assert [s.seq for s in mine] == list(range(1, len(mine) + 1)), "dense and in order per partition"

        # A fresh endpoint: ZeroMQ releases a closed socket's port on its I/O thread, so binding
        # the same port again at once can find it still taken.
        again = dataclasses.replace(cfg, trainer=dataclasses.replace(
            cfg.trainer, samples_endpoint=f"tcp://127.0.0.1:{free_port()}"))
        resumed = SampleSource(again, sync, ctx, positions, partitions=4)
        try:
            rest = resumed.next_batch(100, 100, lambda: False)
        finally:
            resumed.close()
        ids = [s.id for s in first] + [s.id for s in rest]
        assert sorted(ids) == sorted(i for i, _ in acked), "every sample handed out exactly once"
        assert max(_ms(s.entry) for s in first) <= min(_ms(s.entry) for s in rest), "oldest entries first"
    finally:
        ctx.term()
        ingest.close()
        close_sync(sync)
        await redis.aclose()


def _ms(entry_id: str) -> int:
    return int(entry_id.partition("-")[0])


async def test_entries_are_counted_in_the_log_they_were_read_from(redis_target: RedisTarget, tmp_path) -> None:
    """A log made (or made again: a Redis that lost its data) between the trainer's look at the
    logs' identities and its read of their entries: the entries are counted in the log they came
    from, never in the one the trainer knew before nor in none, so a restarted trainer resumes
    in the right log."""
    cfg = _config(redis_target, tmp_path, 1)
    redis = redis_target.async_client()
    ingest = SampleIngest(redis, cfg)  # type: ignore[arg-type]
    sync = redis_target.sync_client()
    ctx = zmq.Context()
    source = SampleSource(cfg, sync, ctx, {}, partitions=1)
    try:
        assert not source.check_log()  # no log yet
        first = await ingest.submit("alice", [Example(input=f"a{i}", target="a") for i in range(3)])
        first_log = first["learned"].partition(".")[0]
        got = source.next_batch(2, 100, lambda: False)  # read without another look at the identities
        assert [s.seq for s in got] == [1, 2]
        assert source.positions()[0].log == first_log

        redis_target.flush()  # the log is lost, and made again, before the trainer looks again
        again = await ingest.submit("alice", [Example(input=f"b{i}", target="b") for i in range(5)])
        again_log = again["learned"].partition(".")[0]
        assert again_log != first_log
        source._backlog = True  # the next call reads at once, as after a wake-up
        got = source.next_batch(10, 100, lambda: False)
        assert [s.seq for s in got] == [1, 2, 3, 4, 5], "the new log from its start, not after seq 2 of the old"
        assert {s.id for s in got} == set(again["ids"])
        assert source.positions()[0].log == again_log
    finally:
        source.close()
        ctx.term()
        ingest.close()
        close_sync(sync)
        await redis.aclose()
