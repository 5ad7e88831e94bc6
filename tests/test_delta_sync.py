"""Trainer -> worker delta sync over real ZeroMQ sockets: snapshot join, convergence through a
lossy relay (drop / duplicate / reorder), tampering on the wire, publisher restart, acks, lag."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from services.trainer.publisher import DeltaPublisher
from services.worker.updates import DeltaSubscriber
from shared import keys
from shared.config import Config, load_config
from shared.crypto import STREAM_HEARTBEAT
from shared.curve import CurveClient, CurveKeys, CurveServer
from shared.delta.codec import flatten
from shared.redis_client import close_sync
from shared.zmq_util import make_socket
from tests.conftest import RedisTarget, free_port, wait_for_sync


def make_cfg(tmp_path: Path, **compression) -> Config:
    comp = {"block_size": 256, "chunk_elements": 2048, "anchor_every": 0, "density": 0.05}
    comp.update(compression)
    return load_config(env={}, overrides={
        "security": {"delta_key_file": str(tmp_path / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "compression": comp,
        "zmq": {"keys_dir": str(tmp_path / "zmq")},
        "consistency": {"delta_heartbeat_ms": 100, "timeout_s": 2.0}})


def via(cfg: Config, endpoint: str) -> Config:
    """A worker's copy of ``cfg`` that subscribes to ``endpoint`` (a relay) for deltas."""
    return load_config(env={}, overrides={**cfg.to_dict(), "security": {**cfg.to_dict()["security"],
                                                                       "delta_pub_endpoint": endpoint}})


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(120, 50, generator=g), "b": torch.randn(3000, generator=g), "c": torch.randn(5, generator=g)}


def train_step(params: dict[str, torch.Tensor], g: torch.Generator) -> None:
    for p in params.values():
        mask = torch.rand(p.shape, generator=g) < 0.2
        p.add_(torch.randn(p.shape, generator=g) * 1e-2 * mask)


def served_equals_reference(pub: DeltaPublisher, params: dict[str, torch.Tensor]) -> bool:
    return torch.equal(flatten(params, pub.encoder.layout), pub.encoder.ref[: pub.encoder.layout.numel])


def as_worker(cfg: Config) -> CurveClient:
    """CURVE options of a socket that connects to the trainer's delta sockets as a worker."""
    keys = CurveKeys.load(cfg.zmq, "worker")
    assert keys is not None
    return keys.client("trainer")


def as_trainer(cfg: Config) -> CurveServer:
    """CURVE options of a socket that binds in the trainer's place (workers pin its key)."""
    keys = CurveKeys.load(cfg.zmq, "trainer")
    assert keys is not None
    return keys.server("deltas")


class Relay(threading.Thread):
    """SUB from the trainer's PUB, PUB to the worker: drops, duplicates and reorders packets.
    It holds the worker's and the trainer's CURVE keys: the network it stands for is hostile,
    not the links' authentication (tests/security covers that)."""

    def __init__(self, ctx: zmq.Context, cfg: Config, downstream: str, *, drop: float = 0.0,
                 dup: float = 0.0, reorder: float = 0.0, mutate: float = 0.0, garbage: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__(daemon=True)
        self.sub = make_socket(ctx, zmq.SUB, connect=cfg.security.delta_pub_endpoint, curve=as_worker(cfg))
        self.pub = make_socket(ctx, zmq.PUB, bind=downstream, curve=as_trainer(cfg))
        self.rng = random.Random(seed)
        self.drop, self.dup, self.reorder, self.mutate, self.garbage = drop, dup, reorder, mutate, garbage
        self.stop = threading.Event()
        self.counts = {"in": 0, "dropped": 0, "duplicated": 0, "reordered": 0, "mutated": 0, "garbage": 0}

    def run(self) -> None:
        held: list[bytes] | None = None
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(20):
                if held is not None:
                    self.pub.send_multipart(held)
                    held = None
                continue
            frames = self.sub.recv_multipart()
            self.counts["in"] += 1
            r = self.rng.random()
            if r < self.drop:
                self.counts["dropped"] += 1
                continue
            if self.rng.random() < self.garbage:
                self.counts["garbage"] += 1
                n = self.rng.randrange(1, 6)
                self.pub.send_multipart([self.rng.randbytes(self.rng.randrange(0, 64)) for _ in range(n)])
                self.pub.send_multipart([b"\x28", b"{}", *frames[2:]])
            if self.rng.random() < self.mutate:
                self.counts["mutated"] += 1
                f = bytearray(frames[3])
                f[self.rng.randrange(len(f))] ^= 0x40
                frames = [*frames[:3], bytes(f), *frames[4:]]
            if held is None and self.rng.random() < self.reorder:
                self.counts["reordered"] += 1
                held = frames
                continue
            self.pub.send_multipart(frames)
            if self.rng.random() < self.dup:
                self.counts["duplicated"] += 1
                self.pub.send_multipart(frames)
            if held is not None:
                self.pub.send_multipart(held)
                held = None
        self.sub.close(0)
        self.pub.close(0)


@pytest.fixture()
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # closes whatever a failed test left open instead of hanging in term()


def converge(sub: DeltaSubscriber, version: int, timeout_s: float = 15.0) -> None:
    wait_for_sync(lambda: (sub.poll(), sub.version == version and sub._pending_req is None)[1],
                  timeout_s=timeout_s, what=f"worker to reach version {version}")


def test_join_by_snapshot_then_follow_deltas_and_ack(tmp_path: Path, ctx: zmq.Context,
                                                     redis_target: RedisTarget) -> None:
    cfg = make_cfg(tmp_path)
    trainer = model(1)
    r = redis_target.sync_client()
    pub = DeltaPublisher(cfg, ctx, trainer, 10, "m", redis_client=r)
    g = torch.Generator().manual_seed(2)
    train_step(trainer, g)
    pub.publish(trainer, 11)  # before the worker exists: it must come from the snapshot
    worker = model(99)
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    try:
        converge(sub, 11)
        assert served_equals_reference(pub, worker) and sub.stats["anchors"] == 1
        for v in range(12, 30):
            train_step(trainer, g)
            pub.publish(trainer, v)
            converge(sub, v)
        assert served_equals_reference(pub, worker) and sub.lag == 0
        assert pub.encoder.residual_norm(trainer) < 0.5 * pub.encoder.residual_norm(model(1))
        wait_for_sync(lambda: pub.acks().get("w1") == 29, what="ack of version 29")
        assert pub.lag() == {"w1": 0}
        assert int(r.get(keys.MODEL_VERSION)) == 29
        assert sub.stats["rejected"] == {} and sub.stats["applied"] == 18
    finally:
        sub.close()
        pub.close()
        close_sync(r)


@pytest.mark.parametrize("algorithm", ["lossless", "topk"])
def test_converges_through_a_relay_that_drops_duplicates_and_reorders(
        tmp_path: Path, ctx: zmq.Context, algorithm: str) -> None:
    cfg = make_cfg(tmp_path, algorithm=algorithm)
    trainer = model(3)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    relay_ep = f"tcp://127.0.0.1:{free_port()}"
    relay = Relay(ctx, cfg, relay_ep, drop=0.1, dup=0.1, reorder=0.1, seed=4)
    relay.start()
    wcfg = via(cfg, relay_ep)
    worker = model(5)
    sub = DeltaSubscriber(wcfg, ctx, "w1", worker, 0)
    g = torch.Generator().manual_seed(6)
    try:
        converge(sub, 0)
        for v in range(1, 41):
            train_step(trainer, g)
            pub.publish(trainer, v)
            sub.poll()
        converge(sub, 40, timeout_s=30)
        assert relay.counts["dropped"] and relay.counts["duplicated"] and relay.counts["reordered"]
        assert sub.stats["resyncs"] >= 1
        assert served_equals_reference(pub, worker)
        if algorithm == "lossless":
            assert all(torch.equal(worker[k], trainer[k]) for k in trainer)
        else:
            assert pub.encoder.residual_norm(trainer) < pub.encoder.residual_norm(model(3)) * 0.5
    finally:
        relay.stop.set()
        relay.join(5)
        sub.close()
        pub.close()


def test_tampered_packets_are_counted_logged_and_never_applied(tmp_path: Path, ctx: zmq.Context,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="services.worker.updates")
    cfg = make_cfg(tmp_path, algorithm="lossless")
    trainer = model(7)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    relay_ep = f"tcp://127.0.0.1:{free_port()}"
    relay = Relay(ctx, cfg, relay_ep, mutate=0.3, garbage=0.3, seed=8)
    relay.start()
    wcfg = via(cfg, relay_ep)
    worker = model(9)
    sub = DeltaSubscriber(wcfg, ctx, "w1", worker, 0)
    g = torch.Generator().manual_seed(10)
    try:
        converge(sub, 0)
        for v in range(1, 21):
            train_step(trainer, g)
            pub.publish(trainer, v)
            sub.poll()
        converge(sub, 20, timeout_s=30)
        assert relay.counts["mutated"] > 0 and relay.counts["garbage"] > 0
        assert sum(sub.stats["rejected"].values()) >= relay.counts["garbage"]
        assert set(sub.stats["rejected"]) <= {"bad_signature", "tampered", "malformed", "truncated", "replayed"}
        assert all(torch.equal(worker[k], trainer[k]) for k in trainer)
        # one line per reason (a minute apart at most), naming it and no key material
        lines = [r.getMessage() for r in caplog.records if "refuses delta packets" in r.getMessage()]
        assert sorted(line.split("(")[1].split(",")[0] for line in lines) == sorted(sub.stats["rejected"])
        secrets = [v for v in json.loads(Path(cfg.security.delta_key_file).read_text())["keys"].values()]
        assert not any(key in line for line in lines for key in secrets)
    finally:
        relay.stop.set()
        relay.join(5)
        sub.close()
        pub.close()


def test_publisher_restart_makes_workers_resync(tmp_path: Path, ctx: zmq.Context) -> None:
    cfg = make_cfg(tmp_path)
    trainer = model(11)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    worker = model(12)
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    g = torch.Generator().manual_seed(13)
    try:
        converge(sub, 0)
        for v in range(1, 6):
            train_step(trainer, g)
            pub.publish(trainer, v)
        converge(sub, 5)
        pub.close()
        # the restarted trainer resumes from a checkpoint with different weights than the workers hold
        trainer = model(14)
        pub = DeltaPublisher(cfg, ctx, trainer, 5, "m")
        for v in range(6, 9):
            train_step(trainer, g)
            pub.publish(trainer, v)
            sub.poll()
        converge(sub, 8)
        assert sub.stats["resyncs"] >= 1
        assert served_equals_reference(pub, worker)
    finally:
        sub.close()
        pub.close()


def test_a_trainer_restarted_under_its_name_with_a_clock_behind_is_followed(tmp_path: Path, ctx: zmq.Context) -> None:
    """A trainer restarted with the same sender name (the same pid in a fresh container) on a host
    whose clock is behind starts a session that looks older than the one the workers follow:
    they resync by snapshot instead of refusing its every packet as stale."""
    cfg = make_cfg(tmp_path)
    trainer = model(23)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m", sender="trainer-1")
    worker = model(24)
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    g = torch.Generator().manual_seed(25)
    try:
        train_step(trainer, g)
        pub.publish(trainer, 1)
        converge(sub, 1)
        wait_for_sync(lambda: (sub.poll(), sub.opener.last_seq("trainer-1", STREAM_HEARTBEAT) is not None)[1],
                      what="a heartbeat of the first session")
        t0 = pub.sealer.t0
        pub.close()
        trainer = model(26)
        pub = DeltaPublisher(cfg, ctx, trainer, 1, "m", sender="trainer-1", start_thread=False)
        pub.sealer.t0 = t0 - 60 * 10**9  # a minute behind, from its first packet (a heartbeat) on
        pub.start()
        for v in range(2, 4):
            train_step(trainer, g)
            pub.publish(trainer, v)
            sub.poll()
        converge(sub, 3)
        assert served_equals_reference(pub, worker) and sub.stats["rejected"].get("stale", 0) >= 1
    finally:
        sub.close()
        pub.close()


def test_bandwidth_cap_sends_most_important_chunks_first(tmp_path: Path, ctx: zmq.Context) -> None:
    cfg = make_cfg(tmp_path, density=0.2, tuner="bytes", tuner_target=4000)
    cfg.scheduling.bandwidth_cap_bytes_s = 1  # budget floor below: min_bandwidth bytes per publish
    cfg.scheduling.min_bandwidth = 1500
    trainer = model(15)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    worker = model(16)
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    g = torch.Generator().manual_seed(17)
    try:
        converge(sub, 0)
        dropped = 0
        for v in range(1, 8):
            train_step(trainer, g)
            st = pub.publish(trainer, v)
            dropped += st.chunks_dropped
            converge(sub, v)
            assert served_equals_reference(pub, worker)
        assert dropped > 0 and st.bytes < 4000
        assert st.extra["tuner"]["mode"] == "bytes"
    finally:
        sub.close()
        pub.close()


def test_worker_with_another_layout_refuses_the_snapshot(tmp_path: Path, ctx: zmq.Context) -> None:
    cfg = make_cfg(tmp_path)
    pub = DeltaPublisher(cfg, ctx, model(18), 3, "m")
    worker = {"a": torch.zeros(50, 120), "b": torch.zeros(3000), "c": torch.zeros(5)}  # transposed "a"
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    try:
        wait_for_sync(lambda: (sub.poll(), sub.stats["rejected"].get("layout", 0) >= 1)[1],
                      what="layout rejection")
        assert sub.version == 0 and all(not t.any() for t in worker.values())
        assert sub.stats["anchors"] == 0
    finally:
        sub.close()
        pub.close()


def test_streamed_chunks_are_decoded_on_arrival_and_applied_together(tmp_path: Path, ctx: zmq.Context) -> None:
    """The trainer streams a delta chunk by chunk; the worker decodes each as it comes, but a
    request between two polls still sees one version: nothing moves until the last chunk."""
    cfg = make_cfg(tmp_path)
    trainer = model(19)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    tap = make_socket(ctx, zmq.SUB, connect=cfg.security.delta_pub_endpoint, curve=as_worker(cfg))
    relay_ep = f"tcp://127.0.0.1:{free_port()}"
    out = make_socket(ctx, zmq.PUB, bind=relay_ep, curve=as_trainer(cfg))
    wcfg = via(cfg, relay_ep)
    worker = model(20)
    sub = DeltaSubscriber(wcfg, ctx, "w1", worker, 0)
    g = torch.Generator().manual_seed(21)
    try:
        converge(sub, 0)
        wait_for_sync(lambda: (pub.heartbeat(), tap.poll(50))[1], what="tap subscribed")
        while tap.poll(0):
            tap.recv_multipart()
        train_step(trainer, g)
        st = pub.publish(trainer, 1)
        packets: list[list[bytes]] = []

        def tapped() -> bool:
            while tap.poll(50):
                frames = tap.recv_multipart()
                if b'"hb"' not in frames[1]:  # not a heartbeat
                    packets.append(frames)
            return len(packets) >= st.packets

        wait_for_sync(tapped, what="the delta's packets")
        assert len(packets) == st.packets == 5  # 9005 elements in ranges of 2048: one packet per range
        before = {k: v.clone() for k, v in worker.items()}
        wait_for_sync(lambda: (out.send(b"\x00", zmq.SNDMORE), out.send(b""), sub.poll(), True)[-1] and
                      sub.stats["rejected"].get("malformed", 0) > 0, what="worker reads the relay")
        for k, frames in enumerate(packets):
            out.send_multipart(frames)
            wait_for_sync(lambda k=k: (sub.poll(), sub.version == 1 or (sub._assembly is not None
                                                                       and sub._assembly.received == k + 1))[1],
                          what=f"chunk {k} decoded")
            if k < len(packets) - 1:
                assert sub.version == 0 and all(torch.equal(before[n], worker[n]) for n in worker)
                assert len(sub._assembly.decoded) == k + 1
        assert sub.version == 1 and served_equals_reference(pub, worker)
        assert set(sub.stats["rejected"]) == {"malformed"}  # only the probes
    finally:
        sub.close()
        pub.close()
        tap.close(0)
        out.close(0)


def test_a_worker_asks_a_returning_trainer_for_one_snapshot(tmp_path: Path, ctx: zmq.Context,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """While the trainer is away the worker's snapshot request waits for a connection instead of
    piling up in a queue, one per timeout, that a returning trainer would answer with a snapshot each;
    the worker says once that it cannot reach the trainer."""
    cfg = make_cfg(tmp_path)
    cfg = load_config(env={}, overrides={**cfg.to_dict(), "consistency": {**cfg.to_dict()["consistency"],
                                                                          "timeout_s": 0.1}})
    worker = model(21)
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0)
    caplog.set_level("INFO", logger="services.worker.updates")
    away_until = time.monotonic() + 30 * cfg.consistency.timeout_s  # the trainer is away 30 timeouts long
    while time.monotonic() < away_until:
        sub.poll()
        sub.wait(10)
    timeouts_while_away = sub.stats["snapshot_timeouts"]
    pub = DeltaPublisher(cfg, ctx, model(22), 7, "m", start_thread=False)
    answered = []
    answer = pub._answer_snapshot
    pub._answer_snapshot = lambda frames: (answered.append(1), answer(frames))[1]  # type: ignore[method-assign]
    pub.start()
    try:
        converge(sub, 7)
        assert served_equals_reference(pub, worker)
        # one request, and one more per request the returning trainer left unanswered a timeout long
        assert len(answered) <= 1 + sub.stats["snapshot_timeouts"] - timeouts_while_away, \
            (len(answered), timeouts_while_away)
        unreachable = [r for r in caplog.records if "cannot reach the trainer" in r.getMessage()]
        assert len(unreachable) == 1 and unreachable[0].levelname == "WARNING"
    finally:
        sub.close()
        pub.close()


def big_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(400, 500, generator=g)}


def test_a_busy_worker_holds_at_most_its_queue_bytes_of_deltas_then_loads_one_snapshot(
        tmp_path: Path, ctx: zmq.Context) -> None:
    """A worker in a long batch polls nothing: what the trainer publishes meanwhile waits in
    its inbox, never more than ``queue_bytes``; past that it is dropped and the worker catches
    up with one snapshot instead of decoding every delta."""
    cfg = make_cfg(tmp_path, algorithm="lossless", chunk_elements=65536)
    trainer = big_model(1)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    worker = big_model(2)
    sub = DeltaSubscriber(cfg, ctx, "w1", worker, 0, queue_bytes=1 << 20)
    g = torch.Generator().manual_seed(3)
    try:
        converge(sub, 0)
        sent = 0
        for v in range(1, 101):  # the batch: no poll
            train_step(trainer, g)
            sent += pub.publish(trainer, v).bytes
            if sent > 3 * sub.queue_bytes:
                break
        last = v
        wait_for_sync(lambda: sub._inbox.overflows >= 1, what="the inbox to pass its bound")
        converge(sub, last)
        assert served_equals_reference(pub, worker)
        assert 0 < sub._inbox.peak_bytes <= sub.queue_bytes == 1 << 20
        assert sub.stats["overflows"] >= 1 and sub.stats["anchors"] == 2, sub.stats
        assert sub.stats["applied"] < last - 1, sub.stats  # most were never decoded
        applied = sub.stats["applied"]
        train_step(trainer, g)
        pub.publish(trainer, last + 1)  # and deltas are followed again
        converge(sub, last + 1)
        assert sub.stats["applied"] == applied + 1 and served_equals_reference(pub, worker)
    finally:
        sub.close()
        pub.close()


def test_a_failure_of_the_inbox_thread_reaches_the_worker_once_and_reading_goes_on(
        tmp_path: Path, ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(tmp_path)
    trainer = model(31)
    pub = DeltaPublisher(cfg, ctx, trainer, 0, "m")
    sub = DeltaSubscriber(cfg, ctx, "w1", model(32), 0)
    watch = sub._inbox._watch
    poll_watch = watch.poll
    failed = threading.Event()

    def fail_once() -> None:
        if not failed.is_set():
            failed.set()
            raise OSError("injected")
        poll_watch()

    monkeypatch.setattr(watch, "poll", fail_once)
    try:
        wait_for_sync(lambda: sub._inbox._error is not None, what="the inbox thread to fail")
        with pytest.raises(RuntimeError, match="inbox thread stopped") as info:
            sub.poll()
        assert isinstance(info.value.__cause__, OSError)
        g = torch.Generator().manual_seed(33)
        train_step(trainer, g)
        pub.publish(trainer, 1)
        converge(sub, 1)
    finally:
        sub.close()
        pub.close()
