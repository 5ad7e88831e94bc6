"""Least privilege for delta keys: the trainer alone holds the Ed25519 signing key; a worker
loads the ring (AES keys, verify keys) and nothing else, even from a key file of an earlier
version that still holds the private key; a delta signed by any other key is refused; the
AES and signing keys rotate under a running worker, and a rotated-out AES key is refused once
its grace period is over. Real worker processes, real sockets, real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import torch
import zmq

from gateway.workers import WorkerPool
from services.supervisor import prepare_keys
from services.trainer.operations import TrainerOps
from services.trainer.publisher import DeltaPublisher
from shared import keys, wire
from shared.config import Config, load_config
from shared.crypto import STREAM_DELTA, EnvelopeSealer, KeyRing, SigningKey
from shared.model import build_model
from shared.redis_client import close_sync
from shared.text import as_str
from tests.conftest import RedisTarget, free_port, wait_for
from tests.worker_support import ROOT, spawn_worker, stop, write_config

PROMPT = {"op": "generate", "prompt": "The gateway", "max_tokens": 6, "temperature": 0.0, "entries": []}


def _legacy_key_file(path: Path) -> SigningKey:
    """A delta key file as versions before the split wrote it: the private key inside."""
    signing = SigningKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps({"active": "k1", "keys": {"k1": os.urandom(32).hex()},
                                   "sign_private": signing.private.private_bytes_raw().hex(),
                                   "sign_public": signing.public.public_bytes_raw().hex()}))
    path.chmod(0o600)
    return signing


def _model_params(cfg: Config) -> tuple[dict[str, torch.Tensor], str, torch.nn.Module]:
    model = build_model(cfg.model)
    return {n: p.detach().clone() for n, p in model.trainable_named_parameters()}, model.model_id, model


def _nudged(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("head."):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return {n: p.detach().clone() for n, p in model.trainable_named_parameters()}


def _rejected(metrics_url: str, reason: str) -> float:
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith(f'learnmesh_delta_rejected_total{{reason="{reason}"}} '):
            return float(line.rpartition(" ")[2])
    return 0.0


async def test_a_worker_given_the_old_combined_file_holds_no_signing_key(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path, 1, extra={"compression": {"algorithm": "lossless"}})
    legacy = _legacy_key_file(Path(cfg.security.delta_key_file))
    params, model_id, model = _model_params(cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    probe = subprocess.Popen([sys.executable, "-m", "tests.security.worker_probe", str(path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ctx = zmq.Context()
    pool = WorkerPool(cfg)
    pub = None
    try:
        assert probe.stdout is not None
        loaded = json.loads(await asyncio.wait_for(asyncio.to_thread(probe.stdout.readline), 120))
        assert loaded == {"private_keys_made": [], "ring_fields_holding_one": [], "signing_keys_alive": 0,
                          "verify_keys": [legacy.id], "signer": legacy.id}
        # the trainer starts on the same old file: it splits it and signs with the same key
        pub = DeltaPublisher(cfg, ctx, params, 0, model_id)
        assert "sign_private" not in orjson.loads(Path(cfg.security.delta_key_file).read_bytes())
        assert SigningKey.load(cfg.security.signing_key_path).id == legacy.id
        await pool.start()
        await pool.wait_live(1, timeout_s=60)
        pub.publish(_nudged(model, 1), 1)
        assert (await pool.request(PROMPT, min_version=1))["version"] == 1
    finally:
        await pool.close()
        if pub is not None:
            pub.close()
        ctx.term()
        stop(probe)
        if probe.stdout is not None:
            probe.stdout.close()


async def test_a_delta_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    """A host that has the ring (every worker has) and even the trainer's CURVE key, but not the
    trainer's signing key, publishes a delta and answers the worker's snapshot request with
    weights of its own: the worker applies neither, then follows the real trainer."""
    metrics_port = free_port()
    path, cfg = write_config(tmp_path, 1, extra={"compression": {"algorithm": "lossless"},
                                                 "metrics": {"worker_port": metrics_port},
                                                 "consistency": {"timeout_s": 1.0}})
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    params, model_id, model = _model_params(cfg)
    ctx = zmq.Context()
    real = DeltaPublisher(cfg, ctx, params, 0, model_id)  # makes the keys
    real.close()
    stolen_ring = tmp_path / "stolen" / "delta.key"
    stolen_ring.parent.mkdir()
    stolen_ring.write_bytes(Path(cfg.security.delta_key_file).read_bytes())
    stolen_ring.chmod(0o600)
    rogue_cfg = load_config(env={}, overrides={**cfg.to_dict(), "security": {
        **cfg.to_dict()["security"], "delta_key_file": str(stolen_ring)}})
    forged = _nudged(model, 7)
    rogue = DeltaPublisher(rogue_cfg, ctx, forged, 5, model_id)  # its own signing key, the trainer's ring
    assert rogue.sealer.signer is not None and rogue.sealer.signer.id not in KeyRing.load(
        cfg.security.delta_key_file).verify_keys
    proc = spawn_worker(path, 0)
    pool = WorkerPool(cfg)
    await pool.start()
    pub = None
    try:
        await pool.wait_live(1, timeout_s=60)
        await wait_for(lambda: _rejected(metrics_url, "bad_signature") >= 1, timeout_s=30,
                       what="the worker to refuse the rogue snapshot")
        rogue.publish(forged, 6)
        await wait_for(lambda: (rogue.heartbeat(), _rejected(metrics_url, "bad_signature") >= 3)[1], timeout_s=30,
                       what="the worker to refuse the rogue delta and heartbeats")
        assert (await pool.request(PROMPT))["version"] == 0, "the worker serves weights it was never sent"
        rogue.close()
        pub = DeltaPublisher(cfg, ctx, params, 0, model_id)
        pub.publish(_nudged(model, 8), 1)
        # the worker asks the real trainer for a snapshot at its next retry (consistency.timeout_s)
        await wait_for(lambda: pool.links[0].version == 1, timeout_s=30, what="the worker to follow the trainer")
        assert (await pool.request(PROMPT, min_version=1))["version"] == 1
    finally:
        await pool.close()
        for publisher in (rogue, pub):
            if publisher is not None:
                publisher.close()
        ctx.term()
        stop(proc)


async def test_keys_rotate_under_a_running_worker_and_a_retired_key_is_refused(redis_target: RedisTarget,
                                                                              tmp_path: Path) -> None:
    metrics_port = free_port()
    path, cfg = write_config(tmp_path, 1, redis_url=redis_target.url, extra={
        "compression": {"algorithm": "lossless"}, "metrics": {"worker_port": metrics_port},
        "security": {"delta_key_grace_s": 2}})
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    params, model_id, model = _model_params(cfg)
    ring_path = Path(cfg.security.delta_key_file)
    ctx = zmq.Context()
    r = redis_target.sync_client()
    pub = DeltaPublisher(cfg, ctx, params, 0, model_id, redis_client=r)
    ops = TrainerOps(cfg, r, pub)
    proc = spawn_worker(path, 0)
    pool = WorkerPool(cfg)
    await pool.start()
    version = 0

    async def publish_and_serve() -> None:
        nonlocal version
        version += 1
        pub.publish(_nudged(model, version), version)
        assert (await pool.request(PROMPT, min_version=version))["version"] == version

    def rotate(kind: str) -> dict[str, str]:
        rid = as_str(r.xadd(keys.DELTA_KEY_ROTATE, {"by": "admin:test", "kind": kind}))  # what the admin API writes
        ops.poll()
        status = {as_str(k): as_str(v) for k, v in r.hgetall(keys.DELTA_KEY_STATUS).items()}
        assert status["last_request"] == rid and "error" not in status, status
        return status

    def send_on_the_trainers_pub(frames: list[bytes]) -> None:
        with pub._lock:  # the publisher's thread sends heartbeats on the same socket
            pub._pub.send_multipart(frames)

    try:
        await pool.wait_live(1, timeout_s=60)
        await publish_and_serve()
        old_kid = KeyRing.load(ring_path).active
        assert pub.sealer.signer is not None
        old_signer = pub.sealer.signer.id
        both = rotate("both")
        assert both["key_id"] != old_kid and both["signing_key_id"] != old_signer
        await publish_and_serve()  # the worker reloads the ring for the new key ids

        # a packet sealed with the first AES key, by the trainer's current signing key, after the grace
        ring = KeyRing.load(ring_path)
        deadline_ms = ring.retiring[old_kid]
        await wait_for(lambda: time.time() * 1000 > deadline_ms, timeout_s=10, what="the grace period to end")
        ring.active = old_kid
        late = EnvelopeSealer(ring, pub.sender, signer=pub.sealer.signer)
        meta = {"model": model_id, "base": version, "version": version + 1, "i": 0, "n": 1, "codec": {}}
        frames = wire.encode(wire.MsgType.DELTA, {"v": version + 1}, late.seal(STREAM_DELTA, meta, b"x"))
        before = _rejected(metrics_url, "retired_key")
        await wait_for(lambda: (send_on_the_trainers_pub(frames), _rejected(metrics_url, "retired_key") > before)[1],
                       timeout_s=20, what="the worker to refuse the retired key")
        await publish_and_serve()  # and it goes on with the current keys

        signing = rotate("signing")
        assert signing["key_id"] == both["key_id"] and signing["signing_key_id"] != both["signing_key_id"]
        await publish_and_serve()
        assert SigningKey.load(cfg.security.signing_key_path).id == signing["signing_key_id"]
        assert old_kid not in KeyRing.load(ring_path).keys, "a key past its grace leaves the ring at the next rotation"
    finally:
        await pool.close()
        pub.close()
        ctx.term()
        stop(proc)
        close_sync(r)


def test_learnmesh_up_splits_an_old_combined_key_file_before_anything_starts(tmp_path: Path) -> None:
    legacy = _legacy_key_file(tmp_path / "keys" / "delta.key")
    prepare_keys(load_config(env={}), tmp_path)
    ring = orjson.loads((tmp_path / "keys" / "delta.key").read_bytes())
    assert "sign_private" not in ring and ring["signer"] == legacy.id
    assert SigningKey.load(tmp_path / "keys" / "delta-sign.key").id == legacy.id
    assert oct((tmp_path / "keys" / "delta-sign.key").stat().st_mode & 0o777) == oct(0o600)
    assert sorted(p.name for p in (tmp_path / "keys" / "zmq").glob("*.key_secret")) == [
        "gateway.key_secret", "trainer.key_secret", "worker.key_secret"]
