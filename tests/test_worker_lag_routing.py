"""A worker whose heartbeat says it is more than ``consistency.max_lag`` versions behind the
trainer leaves the gateway's routing pool until it catches up, and a request that kills the
workers it is sent to stops moving on after ``worker.max_request_losses`` of them (real
WorkerPool, real ZeroMQ sockets; the workers are small ROUTER loops that speak the worker wire
protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from gateway.workers import WorkerPool, WorkerRequestError
from shared import keys as rkeys
from shared import wire
from shared.config import ZmqConfig, load_config
from shared.curve import CurveKeys
from shared.wire import MsgType
from shared.zmq_util import make_socket
from tests.conftest import RedisTarget, free_port, wait_for


class ScriptedWorker:
    """Answers HELLO with a HEARTBEAT carrying the lag it is told to report, and every INFER
    with a RESULT naming itself; counts the requests it served."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str, keys: CurveKeys) -> None:
        self.name = name
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock = make_socket(ctx, zmq.ROUTER, bind=self.endpoint, curve=keys.server("infer"))
        self.lag = 0
        self.version = 7
        self.served = 0
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            peer, *frames = await self.sock.recv_multipart()
            msg_type, header, _ = wire.decode(frames)
            if msg_type == MsgType.HELLO:
                reply = wire.encode(MsgType.HEARTBEAT, {"worker": self.name, "version": self.version, "lag": self.lag,
                                                        "load": 0})
            elif msg_type == MsgType.INFER and header.get("prompt") == "poison":
                self.sock.close(linger=0)  # the request kills this worker: no answer, no heartbeat
                return
            elif msg_type == MsgType.INFER:
                self.served += 1
                reply = wire.encode(MsgType.RESULT, {"id": header["id"], "version": 7, "worker": self.name})
            else:
                continue
            await self.sock.send_multipart([peer, *reply])


async def test_lagging_worker_leaves_the_pool_until_it_catches_up(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    keys = CurveKeys.load(ZmqConfig(keys_dir=str(tmp_path / "zmq")), "worker")
    assert keys is not None
    a, b = ScriptedWorker(ctx, "a", keys), ScriptedWorker(ctx, "b", keys)
    cfg = load_config(env={}, overrides={"consistency": {"max_lag": 2},
                                         "worker": {"endpoints": [a.endpoint, b.endpoint],
                                                    "heartbeat_interval_ms": 50},
                                         "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    for w in (a, b):
        w.task = asyncio.create_task(w.run())
    pool = WorkerPool(cfg, zmq_ctx=ctx)
    await pool.start()
    try:
        await pool.wait_live(2, timeout_s=10)

        async def served_by() -> list[str]:
            return [(await pool.request({"op": "generate"}))["worker"] for _ in range(6)]

        assert set(await served_by()) == {"a"}  # equal load: the lower index wins ties

        a.lag = 3  # over max_lag: a leaves the pool, b takes everything
        await wait_for(lambda: pool.links[0].lag == 3, what="a's heartbeat to report lag 3")
        assert set(await served_by()) == {"b"}
        assert pool.status()[0]["lag"] == 3

        b.lag = 5  # both lag: serving goes on with the live workers rather than failing
        await wait_for(lambda: pool.links[1].lag == 5, what="b's heartbeat to report lag 5")
        assert set(await served_by()) == {"a"}

        a.lag, b.lag = 2, 5  # a caught up to within max_lag (2 <= 2): back in the pool, b out
        await wait_for(lambda: pool.links[0].lag == 2, what="a's heartbeat to report lag 2")
        assert set(await served_by()) == {"a"}
        assert a.served + b.served == 24
    finally:
        await _close(pool, (a, b), ctx)


async def test_a_request_that_kills_its_workers_fails_instead_of_taking_the_pool_down(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    keys = CurveKeys.load(ZmqConfig(keys_dir=str(tmp_path / "zmq")), "worker")
    assert keys is not None
    workers = [ScriptedWorker(ctx, name, keys) for name in ("a", "b", "c")]
    cfg = load_config(env={}, overrides={"worker": {"endpoints": [w.endpoint for w in workers],
                                                    "heartbeat_interval_ms": 50, "heartbeat_timeout_ms": 400},
                                         "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    assert cfg.worker.max_request_losses == 2
    for w in workers:
        w.task = asyncio.create_task(w.run())
    pool = WorkerPool(cfg, zmq_ctx=ctx)
    await pool.start()
    try:
        await pool.wait_live(3, timeout_s=10)
        with pytest.raises(WorkerRequestError, match="in flight on 2 inference workers") as err:
            await pool.request({"op": "generate", "prompt": "poison"}, timeout_s=20)
        assert err.value.code == "worker_lost"
        assert [link.alive for link in pool.links] == [False, False, True], "the third never got it"
        assert (await pool.request({"op": "generate", "prompt": "hello"}))["worker"] == "c"
    finally:
        await _close(pool, workers, ctx)


async def _close(pool: WorkerPool, workers: Sequence[ScriptedWorker], ctx: zmq.asyncio.Context) -> None:
    await pool.close()
    for w in workers:
        assert w.task is not None
        w.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await w.task
        w.sock.close(linger=0)
    ctx.term()


async def test_a_worker_claiming_a_version_the_trainer_never_published_draws_no_traffic(
        tmp_path: Path, redis_target: RedisTarget, caplog: pytest.LogCaptureFixture) -> None:
    """A process holding the worker key that claims version 2**62 would make every honest
    worker look lagging and take all requests; the claim is bounded by the trainer's latest
    version in Redis, so it is the one treated as lagging (and logged once)."""
    ctx = zmq.asyncio.Context()
    keys = CurveKeys.load(ZmqConfig(keys_dir=str(tmp_path / "zmq")), "worker")
    assert keys is not None
    liar, honest = ScriptedWorker(ctx, "liar", keys), ScriptedWorker(ctx, "honest", keys)
    liar.version = 2**62
    cfg = load_config(env={}, overrides={"consistency": {"max_lag": 2},
                                         "worker": {"endpoints": [liar.endpoint, honest.endpoint],
                                                    "heartbeat_interval_ms": 50, "discovery": False},
                                         "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    redis = redis_target.async_client()
    await redis.set(rkeys.MODEL_VERSION, 7)
    for w in (liar, honest):
        w.task = asyncio.create_task(w.run())
    pool = WorkerPool(cfg, zmq_ctx=ctx, redis=redis)
    await pool.start()
    try:
        await pool.wait_live(2, timeout_s=10)
        await wait_for(lambda: pool.published_version == 7, what="the pool to read the model version")
        served = [(await pool.request({"op": "generate"}))["worker"] for _ in range(6)]
        assert set(served) == {"honest"}

        def claims() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "claims model version" in r.getMessage()]

        # routing bounds the claim at once; the warning follows the re-read of the trainer's
        # version that the claim sets off, which a loaded machine may finish after those requests
        await wait_for(lambda: bool(claims()), what="the warning of the claim")
        assert len(claims()) == 1 and claims()[0].levelname == "WARNING", claims()

        await redis.set(rkeys.MODEL_VERSION, 8)  # the trainer publishes 8; the first heartbeat of it is believed
        honest.version = 8
        assert (await pool.request({"op": "generate"}, min_version=8))["worker"] == "honest"

        liar.version = 8  # a claim that is possible is believed again
        await wait_for(lambda: pool.links[0].version == 8 and not pool.overclaims(pool.links[0]),
                       what="the liar's next heartbeat")
        assert {(await pool.request({"op": "generate"}))["worker"] for _ in range(6)} == {"liar"}  # lower index
        assert len(claims()) == 1
    finally:
        await _close(pool, (liar, honest), ctx)
        await redis.aclose()
