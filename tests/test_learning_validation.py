"""The gateway side of samples: validation errors write nothing; a good batch is logged
(acknowledged with ids after the write) and pushed to the trainer's PULL socket."""

from __future__ import annotations

import pytest
import zmq
from trainer_support import trainer_config

from gateway.errors import INVALID_PARAMS, McpError, wire_error
from gateway.tools.learning import SampleIngest
from shared import keys, wire
from shared.context import ContextStore
from shared.curve import CurveKeys
from shared.samples import SampleError, parse_sample, partition_of, sample_id
from shared.zmq_util import make_socket
from tests.conftest import free_port


@pytest.fixture
async def ingest(redis_target, tmp_path):
    cfg = trainer_config(redis_target.url, tmp_path, free_port(), max_sample_bytes=512, sample_hwm=4)
    redis = redis_target.async_client()
    store = ContextStore(redis, cfg.context)
    ing = SampleIngest(redis, cfg, store)
    yield ing
    ing.close()
    await store.aclose()  # its batches before the client (ContextStore.aclose)
    await redis.aclose()


def _alice_log(ing: SampleIngest) -> str:
    return keys.sample_log(partition_of("alice", ing.partitions))


async def _nothing_written(ing: SampleIngest) -> None:
    for part in range(ing.partitions):
        assert await ing.redis.exists(keys.sample_log(part), keys.sample_seq(part)) == 0


BAD = {
    "empty target": {"input": "q", "target": ""},
    "blank target": {"input": "q", "target": "   "},
    "missing target": {"input": "q"},
    "target not a string": {"input": "q", "target": 3},
    "unknown field": {"input": "q", "target": "a", "weight": 2},
    "unknown kind": {"kind": "dream", "input": "q", "target": "a"},
    "oversized": {"input": "q", "target": "x" * 600},
    "version without context": {"input": "q", "target": "a", "version": 1},
    "context without version": {"input": "q", "target": "a", "context_id": "c1"},
    "negative version": {"input": "q", "target": "a", "context_id": "c1", "version": -1},
    "version zero": {"input": "q", "target": "a", "context_id": "c1", "version": 0},  # versions start at 1
    "feedback without verdict": {"kind": "feedback", "generation_id": "g1", "input": "q"},
    "bad preference": {"kind": "feedback", "generation_id": "g1", "input": "q", "preference": "meh"},
    "up-vote without output": {"kind": "feedback", "generation_id": "g1", "input": "q", "preference": "up"},
    "unknown modality": {"input": "q", "target": "a", "context_id": "c1", "version": 1, "modalities": ["smell"]},
}


@pytest.mark.parametrize("name", list(BAD))
async def test_malformed_samples_are_refused_and_nothing_is_written(ingest, name):
    with pytest.raises(SampleError) as err:
        ingest.parse(BAD[name])
    wire = wire_error(err.value, ingest.cfg)
    assert wire.code == INVALID_PARAMS
    # a lone sample's error names no place in a batch (no "index": null)
    assert wire.data is None or wire.data.get("index") is not None
    await _nothing_written(ingest)


async def test_one_bad_sample_refuses_the_whole_batch(ingest):
    batch = [{"input": "q1", "target": "a1"}, {"input": "q2", "target": ""}]
    with pytest.raises(SampleError) as err:
        ingest.parse({"samples": batch})
    wire = wire_error(err.value, ingest.cfg)
    assert wire.code == INVALID_PARAMS and wire.data == {"index": 1}
    for bad in ({"samples": []}, {"samples": "x"}, {"samples": batch[:1], "input": "q"}):
        with pytest.raises(SampleError):
            ingest.parse(bad)
    await _nothing_written(ingest)


async def test_unknown_context_or_version_is_refused_and_nothing_is_written(ingest):
    res = await ingest.store.append("alice", "c1", "text", "user", b"hello")
    version = res.version if hasattr(res, "version") else await ingest.store.version("alice", "c1")
    for cid, ver in (("c1", version + 5), ("nope", 1)):
        samples = ingest.parse({"samples": [{"input": "q", "target": "a"},
                                            {"input": "q", "target": "a", "context_id": cid, "version": ver}]})
        with pytest.raises(McpError) as err:
            await ingest.submit("alice", samples)
        assert err.value.code == INVALID_PARAMS
    # another principal cannot name alice's context either
    samples = ingest.parse({"input": "q", "target": "a", "context_id": "c1", "version": version})
    with pytest.raises(McpError):
        await ingest.submit("mallory", samples)
    await _nothing_written(ingest)
    out = await ingest.submit("alice", samples)
    assert out["seqs"] == [1] and await ingest.redis.xlen(_alice_log(ingest)) == 1


async def test_accepted_samples_are_logged_then_pushed_with_backpressure_reported(ingest):
    samples = ingest.parse({"samples": [{"input": f"q{i}", "target": "a"} for i in range(3)]})
    out = await ingest.submit("alice", samples)
    assert out["queued"] is False  # no trainer connected: reported, and the log still has them
    part = partition_of("alice", ingest.partitions)
    entries = await ingest.redis.xrange(keys.sample_log(part))
    assert len(entries) == 1 and [sample_id(entries[0][0].decode(), i, part) for i in range(3)] == out["ids"]
    assert out["seqs"] == [1, 2, 3]
    ctx = zmq.Context()
    trainer = CurveKeys.load(ingest.cfg.zmq, "trainer")
    assert trainer is not None
    pull = make_socket(ctx, zmq.PULL, bind=ingest.cfg.trainer.samples_endpoint, curve=trainer.server("samples"))
    try:
        import asyncio
        for _ in range(500):  # wait for the PUSH side to see the connection
            out = await ingest.submit("alice", samples[:1])
            if out["queued"]:
                break
            await asyncio.sleep(0.01)
        assert out["queued"]
        assert pull.poll(5000)
        kind, header, blobs = wire.decode(pull.recv_multipart())
        # a wake-up naming the log and its last seq: the samples themselves stay in the log
        assert kind == wire.MsgType.SAMPLE and header == {"log": out["learned"].split(".")[0], "seq": out["seqs"][-1],
                                                            "part": part}
        assert blobs == []
    finally:
        pull.close(0)
        ctx.term()


def test_feedback_samples_train_the_corrected_or_approved_answer():
    s = parse_sample({"kind": "feedback", "generation_id": "g", "input": "2+2", "corrected": "4"}, max_bytes=999)
    assert s.training_pair() == ("2+2", "4")
    s = parse_sample({"generation_id": "g", "input": "hi", "output": "hello", "preference": "up"}, max_bytes=999)
    assert s.kind == "feedback" and s.training_pair() == ("hi", "hello")
    s = parse_sample({"generation_id": "g", "input": "hi", "output": "meh", "preference": "down"}, max_bytes=999)
    assert s.training_pair() is None
    with pytest.raises(SampleError):
        parse_sample({"kind": "feedback", "generation_id": "g", "input": "q", "target": "a"}, max_bytes=999)


def test_unreadable_log_entries_are_skipped_not_fatal() -> None:
    """A poison entry in the durable log (old format, damaged) must not crash the trainer."""
    import orjson

    from shared.samples import parse_entry

    good = {b"p": b"alice", b"seq": b"7", b"n": b"1",
            b"s": orjson.dumps([{"kind": "example", "input": "a", "target": "b"}])}
    assert [s.seq for s in parse_entry(b"1-0", good)] == [7]
    for bad in ({b"p": b"alice", b"sample": b"{}"},                       # an older one-sample format
                {b"p": b"alice", b"seq": b"x", b"s": b"[]"},                # damaged seq
                {b"p": b"alice", b"seq": b"1", b"s": b"not json"},          # damaged payload
                {b"p": b"alice", b"seq": b"1", b"s": orjson.dumps(["str"])}):  # wrong shape
        assert parse_entry(b"2-0", bad) == []


async def test_a_batch_naming_more_context_than_is_copied_never_holds_it_all(ingest):
    """The windows a batch names are kept only while they fit in trainer.max_context_copy_bytes:
    a batch naming 24 windows of 192 KiB (4.5 MiB) over a 256 KiB cap holds about one window and
    the cap at a time, not every window until the end."""
    import tracemalloc

    ingest.cfg.trainer.max_context_copy_bytes = 256 * 1024
    chunk = b"x" * (64 * 1024)
    samples = []
    for i in range(24):
        for _ in range(3):
            res = await ingest.store.append("alice", f"c{i}", "text", "user", chunk)
        samples.append(parse_sample({"input": "q", "target": "a", "context_id": f"c{i}", "version": res.version},
                                    max_bytes=512, modalities=ingest.cfg.context.modalities))
    tracemalloc.start()
    try:
        windows = await ingest.check_contexts("alice", samples, batch=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert windows is None  # over the cap: the trainer reads them from the store
    assert peak < 2 * 1024 * 1024, f"{peak} bytes held while checking 4.5 MiB of windows"
    small = await ingest.check_contexts("alice", samples[:1], batch=True)
    assert small is not None and len(small) == 1  # one window fits: it is copied with the samples
