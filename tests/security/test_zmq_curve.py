"""Every ZeroMQ link is CurveZMQ-authenticated both ways: a process that is not in the mesh
(no allow-listed key, or no CURVE at all) gets nothing from a worker, the trainer's samples
PULL or its delta sockets, and the real peers keep working beside it; a process that takes a
worker's port (or another mesh's worker) gets no request, and the gateway says so in its log
and metrics. Real worker, trainer and gateway processes, real sockets, real Redis (the
trainer's samples link also on a Redis Cluster, whose sample log is partitioned)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import orjson
import pytest
import torch
import zmq
from prometheus_client import REGISTRY

from gateway.tools.learning import SampleIngest
from gateway.workers import NoWorker, WorkerPool
from services.trainer import ledger
from services.trainer.publisher import DeltaPublisher
from services.worker.updates import DeltaSubscriber
from shared import wire
from shared.config import ConfigError, ZmqConfig, load_config
from shared.curve import CurveKeys, HandshakeWatch, write_keypair
from shared.model import build_model
from shared.samples import Example
from shared.wire import MsgType
from shared.zmq_util import make_socket
from tests.conftest import RedisTarget, free_port, wait_for, wait_for_sync
from tests.security.zmq_support import FAILED, Outsider, bind_when_free, metric, send_all
from tests.trainer_support import TrainerProc, async_redis, sync_redis_open, trained, trainer_config
from tests.worker_support import ROOT, spawn_worker, stop, write_config


def gen(prompt: str = "hello") -> dict:
    return {"op": "generate", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "entries": []}


def keys(cfg, role: str) -> CurveKeys:
    k = CurveKeys.load(cfg.zmq, role)
    assert k is not None
    return k


def outcome(event: int) -> str:
    """``refused``: the server's allow-list said no; ``failed``: no CURVE handshake was possible
    (which end gave up first decides whether libzmq reports a protocol error or no detail)."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return "connected"
    return "refused" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "failed"


async def handshakes(outsiders: list[Outsider]) -> list[str]:
    return [outcome(await asyncio.to_thread(o.handshake)) for o in outsiders]


def requests_served(url: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in httpx.get(url, timeout=5).text.splitlines()
               if line.startswith('learnmesh_worker_requests_total{op="generate"'))


async def test_a_worker_answers_allow_listed_gateways_only(tmp_path: Path) -> None:
    metrics_port = free_port()
    path, cfg = write_config(tmp_path, 1, extra={"metrics": {"worker_port": metrics_port}})
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    build_model(cfg.model)
    proc = spawn_worker(path, 0)
    pool = WorkerPool(cfg)
    ctx = zmq.Context()
    endpoint = cfg.worker.endpoints[0]
    outsiders = [Outsider(ctx, zmq.DEALER, endpoint, curve_server_key=keys(cfg, "gateway").server_key("worker")),
                 Outsider(ctx, zmq.DEALER, endpoint),
                 # a key the mesh knows, but not one allowed on this link: workers do not call workers
                 Outsider(ctx, zmq.DEALER, endpoint, curve_server_key=keys(cfg, "worker").server_key("worker"),
                          keypair=(keys(cfg, "worker").own.public, keys(cfg, "worker").own.secret))]
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        send_all(outsiders, wire.encode(MsgType.HELLO, {"gateway": "outsider"}))
        send_all(outsiders, wire.encode(MsgType.INFER, {**gen("tell me the other principals' context"),
                                                       "id": "stolen"}))
        assert await handshakes(outsiders) == ["refused", "failed", "refused"]
        assert (await pool.request(gen()))["version"] == 0  # the gateway is still served
        assert [o.received() for o in outsiders] == [[], [], []]
        assert requests_served(metrics_url) == 1, "the worker ran a request that was not the gateway's"
        assert metric(metrics_url, "learnmesh_zmq_auth_refused_total", domain="infer") >= 2
    finally:
        for o in outsiders:
            o.close()
        ctx.term()
        await pool.close()
        stop(proc)


async def test_the_trainer_takes_sample_wakeups_from_gateways_only(redis_target: RedisTarget, tmp_path: Path) -> None:
    redis_url = redis_target.url
    cfg = trainer_config(redis_url, tmp_path, free_port())
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    trainer = TrainerProc(cfg, tmp_path)
    ctx = zmq.Context()
    endpoint = cfg.trainer.samples_endpoint
    worker = keys(cfg, "worker")
    outsiders = [Outsider(ctx, zmq.PUSH, endpoint, curve_server_key=keys(cfg, "gateway").server_key("trainer")),
                 Outsider(ctx, zmq.PUSH, endpoint),
                 Outsider(ctx, zmq.PUSH, endpoint, curve_server_key=worker.server_key("trainer"),
                          keypair=(worker.own.public, worker.own.secret))]
    acked: list[str] = []
    try:
        acked += (await ingest.submit("alice", [Example(input="q1", target="a1")]))["ids"]
        await wait_for(lambda: trained(redis_url) == 1, timeout_s=120,
                       what=lambda: f"the first sample trained\n{trainer.output()}")
        forged = wire.encode(MsgType.SAMPLE, {"p": "mallory", "entry": "9-0", "ids": ["9-0:0"], "seqs": [2],
                                              "log": "x"}, [orjson.dumps({"input": "q", "target": "evil"})])
        send_all(outsiders, forged)
        assert await handshakes(outsiders) == ["refused", "failed", "refused"]
        async def wake_up_queued() -> bool:
            # the gateway's link may be re-handshaking right after the outsiders were refused:
            # a wake-up that found no ready peer is not queued (its sample stays durable)
            reply = await ingest.submit("alice", [Example(input="q2", target="a2")])
            acked.extend(reply["ids"])
            return bool(reply["queued"])

        await wait_for(wake_up_queued, timeout_s=30, interval_s=0.2,
                       what="the gateway's wake-up to still reach the trainer")
        await wait_for(lambda: trained(redis_url) >= len(acked), timeout_s=60,
                       what=lambda: f"the later samples trained\n{trainer.output()}")
        assert trainer.term() == 0, trainer.output()
        assert trainer.output().count("refused a CURVE client on the samples link") == 2, trainer.output()
    finally:
        for o in outsiders:
            o.close()
        ctx.term()
        trainer.close()
        ingest.close()
        await redis.aclose()
    with sync_redis_open(redis_url) as r:
        assert sorted(ledger.trained_ids(r)) == sorted(acked)


def _refused(domain: str) -> float:
    return REGISTRY.get_sample_value("learnmesh_zmq_auth_refused_total", {"domain": domain}) or 0.0


def test_delta_sockets_serve_allow_listed_workers_only(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={
        "security": {"delta_key_file": str(tmp_path / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "compression": {"algorithm": "lossless", "block_size": 256, "chunk_elements": 2048},
        "consistency": {"delta_heartbeat_ms": 100, "timeout_s": 2.0},
        "zmq": {"keys_dir": str(tmp_path / "zmq")}})
    ctx = zmq.Context()
    g = torch.Generator().manual_seed(3)
    trainer = {"w": torch.randn(64, 32, generator=g)}
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    worker = {"w": torch.zeros(64, 32)}
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    trainer_key = keys(cfg, "worker").server_key("trainer")
    gw = keys(cfg, "gateway")
    sec = cfg.security
    refused_before = _refused("deltas")
    outsiders = [Outsider(ctx, zmq.SUB, sec.delta_pub_endpoint, curve_server_key=trainer_key),
                 Outsider(ctx, zmq.SUB, sec.delta_pub_endpoint),
                 Outsider(ctx, zmq.SUB, sec.delta_pub_endpoint, curve_server_key=trainer_key,
                          keypair=(gw.own.public, gw.own.secret)),  # a gateway key is no worker key
                 Outsider(ctx, zmq.DEALER, sec.snapshot_endpoint, curve_server_key=trainer_key),
                 Outsider(ctx, zmq.DEALER, sec.snapshot_endpoint),
                 Outsider(ctx, zmq.PUSH, sec.ack_endpoint, curve_server_key=trainer_key)]
    try:
        send_all(outsiders[3:5], wire.encode(MsgType.SNAPSHOT_REQ, {"req": "x" * 32, "worker": "mallory"}))
        send_all(outsiders[5:], wire.encode(MsgType.ACK, {"worker": "mallory", "version": 10**9}))
        assert [outcome(o.handshake()) for o in outsiders] == ["refused", "failed", "refused"] * 2
        wait_for_sync(lambda: (sub.poll(), sub._pending_req is None)[1], what="the worker's snapshot")
        trainer["w"].add_(1.0)
        pub.publish(trainer, 1)
        wait_for_sync(lambda: (sub.poll(), sub.version == 1)[1], what="the worker to apply version 1")
        assert torch.equal(worker["w"], trainer["w"])
        pub.heartbeat()
        wait_for_sync(lambda: "w1" in pub.acks(), what="the worker's ack")
        assert [o.received() for o in outsiders] == [[]] * 6
        assert "mallory" not in pub.acks()
        assert _refused("deltas") - refused_before >= 4
    finally:
        for o in outsiders:
            o.close()
        sub.close()
        pub.close()
        ctx.term()


@pytest.mark.parametrize("curve_impostor", [False, True], ids=["no-curve", "own-key"])
class ReturningWorker(threading.Thread):
    """The real worker's side of the link (its keys, its allow-list), answering HELLO and INFER."""

    def __init__(self, ctx: zmq.Context, cfg, endpoint: str) -> None:
        super().__init__(daemon=True)
        server = keys(cfg, "worker").server("infer")
        self.sock = bind_when_free(lambda: make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=server))
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, *frames = self.sock.recv_multipart()
            kind, header, _ = wire.decode(frames)
            if kind == MsgType.HELLO:
                reply = wire.encode(MsgType.HEARTBEAT, {"worker": "real", "version": 3, "load": 0, "lag": 0})
            elif kind == MsgType.INFER:
                reply = wire.encode(MsgType.RESULT, {"id": header["id"], "version": 3, "text": "ok"})
            else:
                continue
            self.sock.send_multipart([peer, *reply])
        self.sock.close(0)


def _handshake_failures() -> float:
    return sum(REGISTRY.get_sample_value("learnmesh_zmq_handshake_failed_total", {"peer": "worker", "reason": r})
               or 0.0 for r in ("no_detail", "protocol", "refused"))


@pytest.mark.parametrize("curve_impostor", [False, True], ids=["no-curve", "own-key"])
async def test_a_process_on_a_workers_port_gets_no_request(tmp_path: Path, curve_impostor: bool,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The worker is down and something else binds its port: it answers every HELLO with a
    heartbeat claiming version 10^9, if anything reaches it. Nothing does; and once the real
    worker is back on the port, the gateway uses it again."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    _, cfg = write_config(tmp_path, 1, worker={"endpoints": [endpoint], "heartbeat_interval_ms": 50,
                                               "heartbeat_timeout_ms": 300})
    ctx = zmq.Context()
    impostor = Outsider(ctx, zmq.ROUTER, endpoint, bind=True, curve_server=curve_impostor)
    failed_before = _handshake_failures()
    pool = WorkerPool(cfg)
    await pool.start()
    real = None
    try:
        with caplog.at_level(logging.WARNING, logger="learnmesh.curve"):
            assert await asyncio.to_thread(impostor.handshake) in FAILED
            await wait_for(lambda: pool.links[0].handshake_failing, what="the gateway to report the handshake")
            with pytest.raises(NoWorker):
                await pool.request(gen("my secret context"), min_version=10**9, timeout_s=5)
        assert impostor.received() == []
        assert not pool.links[0].alive and pool.links[0].version == 0
        assert pool.status()[0]["handshake_failing"] is True
        assert _handshake_failures() > failed_before
        assert any(f"CURVE handshake with worker {endpoint} failed" in r.getMessage() for r in caplog.records)

        impostor.close()
        real = ReturningWorker(ctx, cfg, endpoint)
        real.start()
        await pool.wait_live(1, timeout_s=20)
        assert (await pool.request(gen()))["text"] == "ok"
        assert pool.status()[0]["handshake_failing"] is False
    finally:
        await pool.close()
        if real is not None:
            real.stop.set()
            real.join(5)
        else:
            impostor.close()
        ctx.term()


def test_a_gateway_does_not_use_another_meshs_worker(redis_url: str, tmp_path: Path) -> None:
    """Two meshes on one host with the default endpoints: ours has no worker running, theirs
    has one on the port ours is configured for. Our gateway never sends it a request."""
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    their_path, their_cfg = write_config(theirs, 1)
    endpoint = their_cfg.worker.endpoints[0]
    port = free_port()
    our_path, our_cfg = write_config(ours, 1, redis_url=redis_url, worker={"endpoints": [endpoint]},
                                     extra={"gateway": {"port": port}})
    build_model(their_cfg.model)
    worker = spawn_worker(their_path, 0)
    log_path = tmp_path / "gateway.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    with log_path.open("wb") as log:
        gateway = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(our_path), "gateway"],
                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def handshake_failures() -> float:
            try:
                text = httpx.get(base + "/metrics", timeout=2).text
            except httpx.HTTPError:
                return 0.0
            return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                       if line.startswith('learnmesh_zmq_handshake_failed_total{peer="worker"'))

        wait_for_sync(handshake_failures, timeout_s=120, interval_s=0.2,
                      what=lambda: f"the gateway to count a failed handshake\n{log_path.read_text()}")
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 1},
                           "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                                     "io.modelcontextprotocol/clientCapabilities": {}}}}
        r = httpx.post(base + "/mcp", json=body, timeout=30, headers={
            "accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
            "mcp-method": "tools/call", "mcp-name": "generate"})
        assert "no inference worker is available" in r.text, r.text
        assert f"CURVE handshake with worker {endpoint} failed" in log_path.read_text()
        assert worker.poll() is None, "their worker is unaffected"
    finally:
        gateway.terminate()
        gateway.wait(30)
        stop(worker)
    assert our_cfg.zmq.keys_dir != their_cfg.zmq.keys_dir


def test_a_client_key_rotates_without_restarting_the_server(tmp_path: Path) -> None:
    """`learnmesh keys --rotate-zmq gateway`: the server admits the new key and, until
    gateway.previous.key is deleted, the old one; then the old one is refused."""
    zcfg = ZmqConfig(keys_dir=str(tmp_path / "zmq"))
    trainer, old = keys_of(zcfg, "trainer"), keys_of(zcfg, "gateway")
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pull = make_socket(ctx, zmq.PULL, bind=endpoint, curve=trainer.server("samples"))
    server_key = old.server_key("trainer")

    def connects(keypair: tuple[bytes, bytes]) -> int:
        client = Outsider(ctx, zmq.PUSH, endpoint, curve_server_key=server_key, keypair=keypair)
        try:
            return client.handshake()
        finally:
            client.close()

    try:
        write_keypair(zcfg.keys_dir, "gateway", keep_previous=True)
        new = CurveKeys(zcfg.keys_dir, "gateway")
        assert new.own.public != old.own.public
        assert connects((new.own.public, new.own.secret)) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert connects((old.own.public, old.own.secret)) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        (Path(zcfg.keys_dir) / "gateway.previous.key").unlink()
        assert outcome(connects((old.own.public, old.own.secret))) == "refused"
        assert connects((new.own.public, new.own.secret)) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        pull.close(0)
        ctx.term()


def test_a_secret_key_others_can_read_stops_the_process_with_the_fix(tmp_path: Path) -> None:
    zcfg = ZmqConfig(keys_dir=str(tmp_path / "zmq"))
    keys_of(zcfg, "worker")
    secret = Path(zcfg.keys_dir) / "worker.key_secret"
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {secret}"):
        CurveKeys.load(zcfg, "worker")
    secret.unlink()
    with pytest.raises(ConfigError, match="learnmesh keys"):
        CurveKeys.load(zcfg, "worker")


def keys_of(zcfg: ZmqConfig, role: str) -> CurveKeys:
    k = CurveKeys.load(zcfg, role)
    assert k is not None
    return k


def test_a_link_a_plain_socket_broke_is_connected_again(tmp_path: Path) -> None:
    """libzmq gives up on an endpoint for good after a failed handshake with a server that does
    not speak CURVE; the handshake watch connects it again, so the real trainer is reached once
    it is back (here: a worker's ack socket)."""
    zcfg = ZmqConfig(keys_dir=str(tmp_path / "zmq"))
    worker, trainer = keys_of(zcfg, "worker"), keys_of(zcfg, "trainer")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    squatter = Outsider(ctx, zmq.PULL, endpoint, bind=True)
    watch = HandshakeWatch(ctx, "trainer", endpoint)
    push = make_socket(ctx, zmq.PUSH, connect=endpoint, curve=worker.client("trainer"), monitor=watch.address)
    watch.attach(push)
    real = None
    try:
        assert squatter.handshake() in FAILED
        wait_for_sync(lambda: (watch.poll(), watch.failing)[1], what="the watch to see the failure")
        squatter.close()
        real = bind_when_free(lambda: make_socket(ctx, zmq.PULL, bind=endpoint, curve=trainer.server("deltas")))
        ack = wire.encode(MsgType.ACK, {"worker": "w", "version": 1})

        def acked() -> bool:  # a worker acks every version it applies: send until one arrives
            watch.poll()
            with contextlib.suppress(zmq.Again):
                push.send_multipart(ack, zmq.NOBLOCK)
            return bool(real.poll(20))

        wait_for_sync(acked, timeout_s=15, what="the real trainer to get an ack")
        assert wire.decode(real.recv_multipart())[1] == {"worker": "w", "version": 1}
        wait_for_sync(lambda: (watch.poll(), not watch.failing)[1], what="the watch to see the handshake succeed")
    finally:
        watch.close()
        push.close(0)
        if real is not None:
            real.close(0)
        squatter.close()
        ctx.term()


def test_key_files_may_hold_the_bare_z85_keys(tmp_path: Path) -> None:
    """A container secret arrives as one environment value: `PUBLIC SECRET` on one line is a
    secret key file, `PUBLIC` a public one; they interoperate with the certificates."""
    d = tmp_path / "zmq"
    d.mkdir()
    for role in ("gateway", "worker", "trainer"):
        public, secret = zmq.curve_keypair()
        (d / f"{role}.key_secret").write_bytes(public + b" " + secret + b"\n")
        (d / f"{role}.key_secret").chmod(0o600)
        (d / f"{role}.key").write_bytes(public)
    zcfg = ZmqConfig(keys_dir=str(d))
    trainer, gateway = keys_of(zcfg, "trainer"), keys_of(zcfg, "gateway")
    assert gateway.server_key("trainer") == trainer.own.public
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pull = make_socket(ctx, zmq.PULL, bind=endpoint, curve=trainer.server("samples"))
    client = Outsider(ctx, zmq.PUSH, endpoint, curve_server_key=gateway.server_key("trainer"),
                      keypair=(gateway.own.public, gateway.own.secret))
    try:
        assert client.handshake() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        (d / "gateway.key").write_bytes(b"not a key")
        with pytest.raises(ConfigError, match="cannot read CURVE public key"):
            gateway.server_key("gateway")
    finally:
        client.close()
        pull.close(0)
        ctx.term()
