"""A peer holding the worker key that asks the trainer for snapshots in a loop, over the
trainer's real snapshot socket: each connection is sent at most one snapshot per
``consistency.snapshot_interval_ms``, the requests between are merged and counted, and the
newest request of a connection is always answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import torch
import zmq

from services.trainer.publisher import DeltaPublisher
from shared import metrics, wire
from shared.config import Config, load_config
from shared.curve import CurveKeys
from shared.wire import MsgType
from shared.zmq_util import make_socket
from tests.conftest import free_port, wait_for_sync


def trainer_cfg(tmp_path: Path, interval_ms: int) -> Config:
    return load_config(env={}, overrides={
        "security": {"delta_key_file": str(tmp_path / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "compression": {"algorithm": "lossless", "block_size": 256, "chunk_elements": 2048},
        "consistency": {"delta_heartbeat_ms": 100, "snapshot_interval_ms": interval_ms},
        "zmq": {"keys_dir": str(tmp_path / "zmq")}})


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def counted(outcome: str) -> float:
    return metrics.DELTA_SNAPSHOT_REQUESTS.labels(outcome)._value.get()


def answered(dealer: zmq.Socket, into: dict[str, set[int]]) -> None:
    """Read the snapshot parts that arrived: request nonce -> part numbers (the nonce is in the
    envelope's clear header)."""
    while dealer.poll(0):
        mtype, header, payload = wire.decode(dealer.recv_multipart())
        assert mtype == MsgType.SNAPSHOT
        meta = orjson.loads(payload[0])["meta"]
        into.setdefault(meta["req"], set()).add(header["i"])


def complete(parts: dict[str, set[int]], req: str, n: int) -> bool:
    return parts.get(req) == set(range(n))


def asker(ctx: zmq.Context, cfg: Config) -> zmq.Socket:
    keys = CurveKeys.load(cfg.zmq, "worker")
    assert keys is not None
    return make_socket(ctx, zmq.DEALER, connect=cfg.security.snapshot_endpoint, curve=keys.client("trainer"),
                       max_frame_bytes=16 * 1024 * 1024)


def request(dealer: zmq.Socket, req: str) -> None:
    dealer.send_multipart(wire.encode(MsgType.SNAPSHOT_REQ, {"req": req, "worker": "w"}))


def test_a_peer_asking_in_a_loop_gets_one_snapshot_per_interval(tmp_path: Path, ctx: zmq.Context) -> None:
    cfg = trainer_cfg(tmp_path, interval_ms=600_000)  # longer than the test: only the first is due
    pub = DeltaPublisher(cfg, ctx, {"w": torch.randn(64, 64)}, 3, "m")
    dealer = asker(ctx, cfg)
    before = {k: counted(k) for k in ("served", "deferred", "coalesced")}
    try:
        nonces = [f"r{i:03d}" for i in range(50)]
        for req in nonces:
            request(dealer, req)
        wait_for_sync(lambda: sum(counted(k) - v for k, v in before.items()) == 50,
                      what="every request to be counted")
        n = len(pub._snap_cache.chunks) if pub._snap_cache is not None else 0
        assert n > 1  # several parts: the test sees whole snapshots, not messages
        parts: dict[str, set[int]] = {}
        wait_for_sync(lambda: (answered(dealer, parts), complete(parts, nonces[0], n))[1],
                      what="the first request's snapshot")
        assert counted("served") - before["served"] == 1
        assert counted("deferred") - before["deferred"] == 1
        assert counted("coalesced") - before["coalesced"] == 48
        # another connection is not held back by the first one's interval
        other = asker(ctx, cfg)
        request(other, "other")
        other_parts: dict[str, set[int]] = {}
        wait_for_sync(lambda: (answered(other, other_parts), complete(other_parts, "other", n))[1],
                      what="another connection's snapshot")
        other.close(0)
        answered(dealer, parts)
        assert set(parts) == {nonces[0]}, sorted(parts)
    finally:
        dealer.close(0)
        pub.close()


def test_the_newest_request_of_a_connection_is_answered_when_its_interval_ends(
        tmp_path: Path, ctx: zmq.Context) -> None:
    cfg = trainer_cfg(tmp_path, interval_ms=300)
    pub = DeltaPublisher(cfg, ctx, {"w": torch.randn(64, 64)}, 3, "m")
    dealer = asker(ctx, cfg)
    try:
        for req in ("first", "second", "newest"):
            request(dealer, req)
        parts: dict[str, set[int]] = {}
        wait_for_sync(lambda: (answered(dealer, parts), "newest" in parts and "first" in parts)[1],
                      what="the first and the newest request to be answered")
        n = len(pub._snap_cache.chunks) if pub._snap_cache is not None else 0
        wait_for_sync(lambda: (answered(dealer, parts), complete(parts, "newest", n))[1],
                      what="the newest request's whole snapshot")
    finally:
        dealer.close(0)
        pub.close()


def test_a_peer_that_asks_and_never_reads_holds_about_one_snapshot(tmp_path: Path, ctx: zmq.Context) -> None:
    """Its connection queues one snapshot's parts at the trainer: the parts of the snapshots
    asked for beyond that are dropped there, not held until the peer reads (or for ever)."""
    cfg = trainer_cfg(tmp_path, interval_ms=0)
    cfg = load_config(env={}, overrides={**cfg.to_dict(), "compression": {**cfg.to_dict()["compression"],
                                                                          "chunk_elements": 65536}})
    pub = DeltaPublisher(cfg, ctx, {"w": torch.randn(64, 65536)}, 3, "m")  # 64 parts of 256 KiB
    keys = CurveKeys.load(cfg.zmq, "worker")
    assert keys is not None
    dealer = make_socket(ctx, zmq.DEALER, connect=cfg.security.snapshot_endpoint, curve=keys.client("trainer"),
                         max_frame_bytes=16 * 1024 * 1024, hwm=1)  # reads one part, then no more
    served = counted("served")
    try:
        joins: list[str] = []
        wait_for_sync(lambda: (joins.append(f"join{len(joins)}"), request(dealer, joins[-1]), dealer.poll(50))[2],
                      what="the connection")
        for i in range(10):
            request(dealer, f"r{i}")
        wait_for_sync(lambda: counted("served") - served >= len(joins) + 10, what="every request to be served")
        parts: dict[str, set[int]] = {}
        quiet_polls = 0
        while quiet_polls < 20:  # read until nothing more comes: what the trainer queued is in
            if dealer.poll(100):
                answered(dealer, parts)
                quiet_polls = 0
            else:
                quiet_polls += 1
        whole = [req for req in parts if complete(parts, req, 64)]
        assert len(whole) <= 3, sorted((req, len(p)) for req, p in parts.items())
    finally:
        dealer.close(0)
        pub.close()


def test_a_subscriber_that_never_reads_holds_a_few_deltas(tmp_path: Path, ctx: zmq.Context) -> None:
    """A connection to the trainer's delta socket that stays up and reads nothing: the trainer
    queues a few deltas' chunks for it, and drops the rest instead of holding every delta."""
    cfg = trainer_cfg(tmp_path, interval_ms=0)
    cfg = load_config(env={}, overrides={**cfg.to_dict(), "compression": {**cfg.to_dict()["compression"],
                                                                          "chunk_elements": 65536}})
    params = {"w": torch.randn(16, 65536)}  # 16 chunk ranges
    pub = DeltaPublisher(cfg, ctx, params, 0, "m")
    keys = CurveKeys.load(cfg.zmq, "worker")
    assert keys is not None
    # it keeps the connection up with PINGs of its own, and never times out the trainer's, which
    # it does not read (libzmq aborts on a reconnect of a socket stalled that way: zeromq/libzmq#3937)
    sub = make_socket(ctx, zmq.SUB, connect=cfg.security.delta_pub_endpoint, curve=keys.client("trainer"),
                      max_frame_bytes=16 * 1024 * 1024, hwm=1, heartbeat_ms=(1000, 3_600_000))
    g = torch.Generator().manual_seed(1)
    try:
        wait_for_sync(lambda: sub.poll(50), what="the subscription")  # a heartbeat came: subscribed
        sub.recv_multipart()
        for version in range(1, 49):
            params["w"].add_(torch.randn(params["w"].shape, generator=g))  # every element changes
            pub.publish(params, version, lossless=True)
        chunks: dict[int, int] = {}

        def read_to_the_last_heartbeat() -> bool:
            """True once a heartbeat of the last version comes: what was queued before it is in."""
            while sub.poll(50):
                _, header, payload = wire.decode(sub.recv_multipart())
                if "v" in header:
                    chunks[header["v"]] = chunks.get(header["v"], 0) + 1
                elif orjson.loads(payload[0])["meta"]["version"] == 48:
                    return True
            return False

        wait_for_sync(read_to_the_last_heartbeat, timeout_s=60, what="what the trainer queued")
        whole = [v for v, n in chunks.items() if n == 16]
        assert len(whole) <= 20, sorted(chunks.items())
    finally:
        sub.close(0)
        pub.close()
