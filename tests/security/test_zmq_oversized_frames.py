"""A server that sends a frame longer than its client reads, over real sockets: a worker
answering the gateway, and a trainer publishing to a worker (a misconfigured peer holding the
right key, or any process on the port when CURVE is off). The client closes that connection
without buffering the frame, reports it (log and ``learnmesh_zmq_connections_broken_total``),
connects again, and loses nothing else: the gateway's other requests in flight there are
retried and answered, the worker hears the trainer again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from gateway.workers import WorkerPool, WorkerRequestError
from services.worker.updates import DeltaSubscriber
from shared import wire
from shared.config import load_config
from shared.curve import CurveKeys
from shared.inference import max_reply_frame_bytes
from shared.wire import MsgType
from shared.zmq_util import make_socket
from tests.conftest import free_port, wait_for_sync


def broken(peer: str) -> float:
    return REGISTRY.get_sample_value("learnmesh_zmq_connections_broken_total", {"peer": peer}) or 0.0


async def test_a_worker_reply_over_the_bound_breaks_only_its_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(env={}, overrides={"worker": {"endpoints": [endpoint], "heartbeat_interval_ms": 100,
                                                    "max_request_losses": 2},
                                         "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    keys = CurveKeys.load(cfg.zmq, "worker")
    assert keys is not None
    worker = make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=keys.server("infer"))
    huge = "x" * (max_reply_frame_bytes(cfg) + 1)
    held: list[tuple[bytes, str]] = []  # the "slow" requests, answered after the next "huge" one

    async def serve() -> None:
        """A worker that answers "huge" with a RESULT longer than a gateway reads."""
        while True:
            peer, *frames = await worker.recv_multipart()
            msg_type, header, _ = wire.decode(frames)
            if msg_type == MsgType.HELLO:
                await worker.send_multipart([peer, *wire.encode(MsgType.HEARTBEAT, {"worker": "w", "version": 1})])
            elif msg_type == MsgType.INFER and header["prompt"] == "slow" and not held:
                held.append((peer, header["id"]))
            elif msg_type == MsgType.INFER:
                text = huge if header["prompt"] == "huge" else f"ok {header['prompt']}"
                await worker.send_multipart([peer, *wire.encode(MsgType.RESULT, {"id": header["id"], "version": 1,
                                                                                 "text": text})])
                for old_peer, rid in held:  # to the connection the huge reply broke: never delivered
                    await worker.send_multipart([old_peer, *wire.encode(MsgType.RESULT, {"id": rid, "text": "late"})])

    server = asyncio.create_task(serve())
    pool = WorkerPool(cfg, zmq_ctx=ctx)
    before = broken("worker")
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=10)
        with caplog.at_level(logging.WARNING, logger="learnmesh.curve"):
            slow = asyncio.create_task(pool.request({"op": "generate", "prompt": "slow"}, timeout_s=30))
            async def slow_arrived() -> None:
                while not held:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(slow_arrived(), 10)
            with pytest.raises(WorkerRequestError) as refused:
                await pool.request({"op": "generate", "prompt": "huge"}, timeout_s=30)
            assert refused.value.code == "worker_lost"
            # the request that shared the broken connection is retried on the new one
            assert (await asyncio.wait_for(slow, 30))["text"] == "ok slow"
        assert broken("worker") >= before + 2  # the huge reply broke each connection it was sent on
        assert any("closed the connection to worker" in r.getMessage() and "over" in r.getMessage()
                   for r in caplog.records)
        # the link serves on
        assert (await pool.request({"op": "generate", "prompt": "after"}, timeout_s=30))["text"] == "ok after"
    finally:
        server.cancel()
        await pool.close()
        worker.close(linger=0)
        ctx.term()


@pytest.fixture
def sync_ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_a_delta_frame_over_the_bound_breaks_the_workers_connection_which_comes_back(
        tmp_path: Path, sync_ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    from shared.crypto import MAX_SEALED_FRAME_BYTES

    cfg = load_config(env={}, overrides={
        "security": {"delta_key_file": str(tmp_path / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    trainer_keys = CurveKeys.load(cfg.zmq, "trainer")
    assert trainer_keys is not None
    pub = make_socket(sync_ctx, zmq.PUB, bind=cfg.security.delta_pub_endpoint, curve=trainer_keys.server("deltas"))
    sub = DeltaSubscriber(cfg, sync_ctx, "w1", {"w": torch.zeros(4)}, 0)
    before = broken("trainer")
    huge = [bytes((int(MsgType.DELTA),)), b"{}", bytes(MAX_SEALED_FRAME_BYTES + 1)]
    try:
        caplog.set_level(logging.WARNING, logger="learnmesh.curve")

        def sent_and_polled(msg: list[bytes], done: object) -> bool:
            pub.send_multipart(msg)  # a PUB drops it until the worker's subscription is in
            sub.poll()
            sub.wait(50)
            return bool(done())

        wait_for_sync(lambda: sent_and_polled(huge, lambda: broken("trainer") > before),
                      what="the worker to close the connection the huge frame came on")
        assert sub.stats["rejected"] == {}  # nothing of it was read
        assert any("closed the connection to trainer" in r.getMessage() for r in caplog.records)
        small = wire.encode(MsgType.DELTA, {}, [b"not an envelope"])
        wait_for_sync(lambda: sent_and_polled(small, lambda: sub.stats["rejected"].get("truncated")),
                      what="the worker to hear the trainer's socket again")
    finally:
        sub.close()
        pub.close(0)
