"""Frames crafted to break a ZeroMQ endpoint rather than to use it, sent to real worker
processes and the trainer's real sockets: a client holding no key cannot make a server buffer
a frame longer than the server reads, and a malformed message from a peer that holds a key is
answered or dropped, counted, logged once, and the endpoint serves on."""

from __future__ import annotations

import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from services.trainer.data import SampleSource
from services.trainer.publisher import DeltaPublisher
from shared import wire
from shared.config import Config, load_config
from shared.curve import CurveKeys
from shared.inference import max_frame_bytes
from shared.wire import MsgType
from shared.zmq_util import CONTROL_FRAME_BYTES, make_socket
from tests.conftest import free_port, wait_for_sync
from tests.security.zmq_support import metric
from tests.worker_support import spawn_worker, stop, write_config

CURVE_GREETING = (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + bytes(31))
"""A ZMTP 3.0 greeting of a client offering CURVE: what precedes its HELLO command."""


def bytes_read_before_refusal(endpoint: str, announced: int) -> int:
    """Open a TCP connection holding no CURVE key, send the greeting, then one command frame
    announcing ``announced`` bytes and stream its body; returns how much of it was sent when the
    server closed the connection (``announced`` when it read it all)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(CURVE_GREETING)
        conn.recv(64)
        conn.sendall(b"\x06" + struct.pack(">Q", announced))  # a command frame with a long size
        chunk, sent = bytes(1 << 20), 0
        try:
            while sent < announced:
                conn.sendall(chunk[: announced - sent])
                sent += min(len(chunk), announced - sent)
        except OSError:  # reset / broken pipe: the server closed it
            pass
        return sent


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Config, str]]:
    port = free_port()
    path, cfg = write_config(tmp_path, extra={"metrics": {"worker_port": port}})
    proc = spawn_worker(path, 0)
    try:
        yield proc, cfg, f"http://127.0.0.1:{port}/metrics"
    finally:
        stop(proc)


def gateway_dealer(ctx: zmq.Context, cfg: Config) -> zmq.Socket:
    keys = CurveKeys.load(cfg.zmq, "gateway")
    assert keys is not None
    return make_socket(ctx, zmq.DEALER, connect=cfg.worker.endpoints[0], curve=keys.client("worker"))


def ask(sock: zmq.Socket, frames: list[bytes], proc: subprocess.Popen | None = None) -> list[bytes]:
    """The answer to ``frames``; fails at once when ``proc`` (the worker) dies instead."""
    sock.send_multipart(frames)
    wait_for_sync(lambda: bool(sock.poll(50)) or (proc is not None and proc.poll() is not None), timeout_s=60,
                  what=f"an answer to {frames!r}")
    assert proc is None or proc.poll() is None, f"the worker died on {frames!r}"
    return sock.recv_multipart()


HOSTILE = [[b"\x07", b'{"id": [1]}'], [b"\x07", b'{"id": {"a": 1}}'], [b"\x07", b"{}"],
           [b"\x01", b'{"id": ["x"], "op": "generate", "prompt": "hi"}'],
           [b"\x06"], [b"\xff", b"{}"], [b"\x06\x06", b"{}"], [b"\x01", b"\x00\xff"], [b"\x01", b"[1]"],
           [b"\x28", b"{}"]]


def test_a_worker_answers_malformed_messages_counts_them_logs_once_and_serves_on(worker) -> None:
    proc, cfg, metrics_url = worker
    ctx = zmq.Context()
    dealer = gateway_dealer(ctx, cfg)
    try:
        assert ask(dealer, wire.encode(MsgType.HELLO, {}))[0] == bytes((MsgType.HEARTBEAT,))
        for frames in HOSTILE:
            kind, header, _ = wire.decode(ask(dealer, frames, proc))
            assert kind == MsgType.ERROR and header["code"] == "bad_input", (frames, header)
        assert wire.decode(ask(dealer, wire.encode(MsgType.HELLO, {})))[0] == MsgType.HEARTBEAT
        reply = ask(dealer, wire.encode(MsgType.INFER, {"id": "r1", "op": "generate", "prompt": "hi",
                                                        "max_tokens": 2, "stream": False, "entries": []}))
        assert wire.decode(reply)[1]["id"] == "r1"
        assert metric(metrics_url, "learnmesh_zmq_dropped_messages_total", link="infer") == len(HOSTILE)
    finally:
        dealer.close(0)
        ctx.term()
    proc.terminate()
    logged = proc.communicate(timeout=30)[1].decode()
    assert "Traceback" not in logged, logged[-3000:]
    assert 1 <= logged.count("dropped a message on the infer link") < len(HOSTILE), logged[-3000:]


def test_a_client_without_keys_cannot_make_a_worker_buffer_a_huge_frame(worker) -> None:
    proc, cfg, _ = worker
    ctx = zmq.Context()
    dealer = gateway_dealer(ctx, cfg)
    try:
        assert ask(dealer, wire.encode(MsgType.HELLO, {}))[0] == bytes((MsgType.HEARTBEAT,))
        announced = 4 * max_frame_bytes(cfg)
        for _ in range(3):
            assert bytes_read_before_refusal(cfg.worker.endpoints[0], announced) < announced // 2
        assert wire.decode(ask(dealer, wire.encode(MsgType.HELLO, {})))[0] == MsgType.HEARTBEAT
    finally:
        dealer.close(0)
        ctx.term()


def trainer_cfg(tmp_path: Path) -> Config:
    return load_config(env={}, overrides={
        "security": {"delta_key_file": str(tmp_path / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "compression": {"algorithm": "lossless", "block_size": 256, "chunk_elements": 2048},
        "consistency": {"delta_heartbeat_ms": 100},
        "zmq": {"keys_dir": str(tmp_path / "zmq")}})


@pytest.fixture
def trainer(tmp_path: Path, redis_url: str) -> Iterator[tuple[Config, DeltaPublisher, SampleSource]]:
    import redis

    cfg = trainer_cfg(tmp_path)
    ctx = zmq.Context()
    client = redis.Redis.from_url(redis_url)
    pub = DeltaPublisher(cfg, ctx, {"w": torch.randn(64, 32)}, 0, "m")
    source = SampleSource(cfg, client, ctx, {})
    try:
        yield cfg, pub, source
    finally:
        source.close()
        pub.close()
        client.close()
        ctx.destroy(0)


def test_a_client_without_keys_cannot_make_the_trainer_buffer_a_huge_frame(trainer) -> None:
    cfg, _, _ = trainer
    sec = cfg.security
    for endpoint in (sec.delta_pub_endpoint, sec.snapshot_endpoint, sec.ack_endpoint, cfg.trainer.samples_endpoint):
        # what the kernel buffers on the connection is sent before the server closes it
        assert bytes_read_before_refusal(endpoint, 4096 * CONTROL_FRAME_BYTES) < 256 * CONTROL_FRAME_BYTES, endpoint


def test_the_trainer_drops_malformed_requests_acks_and_wake_ups_counting_each(
        trainer, caplog: pytest.LogCaptureFixture) -> None:
    cfg, pub, source = trainer
    ctx = zmq.Context()
    worker_keys, gateway_keys = CurveKeys.load(cfg.zmq, "worker"), CurveKeys.load(cfg.zmq, "gateway")
    assert worker_keys is not None and gateway_keys is not None
    to_trainer = worker_keys.client("trainer")
    sec = cfg.security
    dealer = make_socket(ctx, zmq.DEALER, connect=sec.snapshot_endpoint, curve=to_trainer)
    push = make_socket(ctx, zmq.PUSH, connect=sec.ack_endpoint, curve=to_trainer)
    wakeups = make_socket(ctx, zmq.PUSH, connect=cfg.trainer.samples_endpoint, curve=gateway_keys.client("trainer"))
    garbage = [[b"\x29"], [b"\xff", b"{}"], [b"\x29", b"\x00"], [b"\x29", b"[]"], [b"\x2b", b"{}"],
               wire.encode(MsgType.SNAPSHOT_REQ, {"req": ["x"]}), wire.encode(MsgType.SNAPSHOT_REQ, {"req": "x" * 65}),
               wire.encode(MsgType.ACK, {"worker": ["w"], "version": 1}),
               wire.encode(MsgType.ACK, {"worker": "w", "version": "1"}),
               # versions no worker holds: they would hide that worker's real acks
               wire.encode(MsgType.ACK, {"worker": "w", "version": 2**40}),
               wire.encode(MsgType.ACK, {"worker": "w", "version": -1}),
               wire.encode(MsgType.ACK, {"worker": "w", "version": True})]
    try:
        caplog.set_level("WARNING")
        for frames in garbage:
            dealer.send_multipart(frames)
            push.send_multipart(frames)
            wakeups.send_multipart(frames)
        total = len(garbage)

        def drained() -> bool:
            source._drain(0)
            return (pub._dropped_requests.count, pub._dropped_acks.count, source.dropped.count) == (total,) * 3

        wait_for_sync(drained, what="every malformed message to be dropped")
        # far more worker ids than a trainer keeps acks of: the rest are dropped, counted
        for i in range(5000):
            push.send_multipart(wire.encode(MsgType.ACK, {"worker": f"w{i}", "version": 0}))
        wait_for_sync(lambda: pub._dropped_acks.count == total + 5000 - 4096, what="the acks beyond the bound")
        assert len(pub.acks()) == 4096
        # still serving: a well-formed snapshot request is answered
        dealer.send_multipart(wire.encode(MsgType.SNAPSHOT_REQ, {"req": "r" * 32, "worker": "w"}))
        assert dealer.poll(30_000) and wire.decode(dealer.recv_multipart())[0] == MsgType.SNAPSHOT
        lines = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
        assert {line.split(" link")[0].rsplit(" ", 1)[1] for line in lines} == {"acks", "samples", "snapshots"}
        assert len(lines) < 10, lines
    finally:
        for sock in (dealer, push, wakeups):
            sock.close(0)
        ctx.term()

