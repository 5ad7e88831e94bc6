"""The gateway's worker pool reads on after a message it cannot read: it reports the bad frame
(log and metric) and still delivers the worker's next good message (real WorkerPool, a real
ZeroMQ ROUTER socket playing the worker)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from gateway.workers import WorkerPool
from shared import wire
from shared.config import load_config
from shared.curve import CurveKeys
from shared.wire import MsgType
from shared.zmq_util import make_socket
from tests.conftest import free_port

BAD_MESSAGES = (
    pytest.param([bytes((int(MsgType.HEARTBEAT),)), b'{"worker": "w", "load": "many"}'], id="heartbeat-bad-load"),
    pytest.param([bytes((int(MsgType.HEARTBEAT),)), b'{"worker": "w", "lag": [1]}'], id="heartbeat-bad-lag"),
    pytest.param([bytes((int(MsgType.RESULT),)), b"not json"], id="header-not-json"),
    pytest.param([b"\xff", b"{}"], id="unknown-type"),
)


def _dropped() -> float:
    return REGISTRY.get_sample_value("learnmesh_worker_bad_messages_total") or 0.0


@pytest.mark.parametrize("bad", BAD_MESSAGES)
async def test_a_malformed_message_is_reported_and_the_next_one_delivered(
        bad: list[bytes], caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(env={}, overrides={"worker": {"endpoints": [endpoint], "heartbeat_interval_ms": 50},
                                         "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    keys = CurveKeys.load(cfg.zmq, "worker")
    assert keys is not None
    worker = make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=keys.server("infer"))
    pool = WorkerPool(cfg, zmq_ctx=ctx)
    dropped_before = _dropped()
    await pool.start()
    try:
        with caplog.at_level(logging.WARNING, logger="learnmesh.workers"):
            peer, *frames = await asyncio.wait_for(worker.recv_multipart(), 10)
            assert wire.decode(frames)[0] == MsgType.HELLO
            await worker.send_multipart([peer, *bad])
            await worker.send_multipart([peer, *wire.encode(MsgType.HEARTBEAT, {"worker": "w", "version": 3,
                                                                                "load": 1, "lag": 0})])
            await pool.wait_live(1, timeout_s=10)
        link = pool.links[0]
        assert (link.worker_id, link.version, link.reported_load) == ("w", 3, 1)
        assert _dropped() == dropped_before + 1
        assert any("malformed message from worker" in r.getMessage() for r in caplog.records)

        async def serve_one() -> None:  # the reader still routes results to their requests
            while True:
                peer, *frames = await worker.recv_multipart()
                msg_type, header, _ = wire.decode(frames)
                if msg_type == MsgType.INFER:
                    await worker.send_multipart([peer, *bad])
                    await worker.send_multipart(
                        [peer, *wire.encode(MsgType.RESULT, {"id": header["id"], "version": 3, "text": "ok"})])
                    return

        server = asyncio.create_task(serve_one())
        result = await pool.request({"op": "generate"}, timeout_s=10)
        await server
        assert result["text"] == "ok"
        assert _dropped() == dropped_before + 2
    finally:
        await pool.close()
        worker.close(linger=0)
        ctx.term()
