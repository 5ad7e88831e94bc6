"""The operator control plane acts on a real trainer process (docs/operations.md): pause and
resume, checkpoint now, runtime compression change, delta key rotation while a subscriber
keeps applying deltas, and rollback to a retained version that subscribers then serve.

Commands are written to Redis exactly as gateway/admin/trainer.py writes them (the API itself
is tested in tests/test_admin_api.py); one trainer run covers the sequence to keep it fast."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import orjson
import redis as redis_sync
import torch
import zmq
from trainer_support import TrainerProc, async_redis, sync_redis, trainer_config

from gateway.tools.learning import SampleIngest
from services.trainer.checkpoint import load_bytes
from services.trainer.tiny import build_tiny_model
from services.worker.updates import DeltaSubscriber
from shared import keys
from shared.redis_client import close_sync
from shared.samples import Example
from tests.conftest import free_port, wait_for


def _h(r: redis_sync.Redis, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(key).items()}


def _command(r: redis_sync.Redis, cmd: str, **args: object) -> str:
    cid = uuid.uuid4().hex
    r.xadd(keys.TRAINER_CONTROL, {k: str(v) for k, v in {"id": cid, "cmd": cmd, "by": "admin:test", **args}.items()})
    return cid


def _ack(r: redis_sync.Redis, cid: str) -> dict | None:
    raw = r.hget(keys.TRAINER_CONTROL_ACK, cid)
    return json.loads(raw) if raw else None


async def test_control_plane_steers_a_running_trainer(redis_target, tmp_path):
    redis_url = redis_target.url
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=1, batch_size=4, checkpoint_every=1000,
                         checkpoint_keep=5)
    r = sync_redis(redis_url)
    aredis = async_redis(redis_url)
    ingest = SampleIngest(aredis, cfg)
    ctx = zmq.Context()
    n = 0

    async def feed(count: int) -> None:
        nonlocal n
        for _ in range(count):
            await ingest.submit("ops", [Example(input=f"q{n + j}", target=f"a{(n + j) % 7}")
                                        for j in range(4)])
            n += 4

    def step() -> int:
        return int(_h(r, keys.TRAINER_STATUS).get("step", 0))

    proc = TrainerProc(cfg, tmp_path)
    sub = None
    try:
        await feed(3)
        await wait_for(lambda: step() >= 3, timeout_s=60, what="first steps")
        model = build_tiny_model(cfg.model)
        params = {k: p.detach().clone() for k, p in model.trainable_named_parameters()}
        sub = DeltaSubscriber(cfg, ctx, "ctl-test", params, 0, model_id=model.model_id)

        # ---- pause: samples arrive, the step count stays; resume: it advances
        r.set(keys.TRAINER_PAUSED, "{}")
        await wait_for(lambda: _h(r, keys.TRAINER_STATUS).get("paused") == "1", timeout_s=20, what="paused")
        paused_at = step()
        await feed(3)
        t0 = int(_h(r, keys.TRAINER_STATUS)["updated_ms"])
        await wait_for(lambda: int(_h(r, keys.TRAINER_STATUS)["updated_ms"]) > t0 + 1500, timeout_s=20,
                       what="the paused trainer to keep reporting")
        sub.poll()
        assert step() == paused_at
        r.delete(keys.TRAINER_PAUSED)
        await wait_for(lambda: step() >= paused_at + 3, timeout_s=30, what="steps after resume")

        # ---- checkpoint now
        before = set(Path(cfg.trainer.checkpoint_dir).glob("ckpt-*.pt"))
        cid = _command(r, "checkpoint")
        await wait_for(lambda: _ack(r, cid), timeout_s=20, what="checkpoint ack")
        ack = _ack(r, cid)
        assert ack["ok"] is True and Path(ack["path"]).exists() and Path(ack["path"]) not in before
        kept_version = ack["version"]
        kept = load_bytes(Path(ack["path"]).read_bytes())
        assert kept["published_version"] == kept_version

        # ---- runtime config: the publisher encodes at the new density
        r.hset(keys.RUNTIME_CONFIG, "compression", orjson.dumps({"density": 0.5, "tuner": "off"}))
        r.incr(keys.RUNTIME_CONFIG_REV)
        await feed(2)
        await wait_for(lambda: _h(r, keys.component_status("delta")).get("density_target") == "0.5",
                       timeout_s=20, what="delta status at the new density")
        assert float(_h(r, keys.component_status("delta"))["compression_ratio"]) > 0

        # ---- key rotation: new key id in use, the subscriber keeps applying deltas
        old_kid = json.loads(Path(cfg.security.delta_key_file).read_text())["active"]
        r.xadd(keys.DELTA_KEY_ROTATE, {"by": "admin:test"})
        await wait_for(lambda: _h(r, keys.DELTA_KEY_STATUS).get("key_id"), timeout_s=20, what="rotation done")
        new_kid = _h(r, keys.DELTA_KEY_STATUS)["key_id"]
        assert new_kid != old_kid
        assert json.loads(Path(cfg.security.delta_key_file).read_text())["active"] == new_kid
        applied = sub.stats["applied"]
        await feed(3)
        await wait_for(lambda: (sub.poll(), _h(r, keys.component_status("delta")).get("key_id") == new_kid
                                and sub.version == int(r.get(keys.MODEL_VERSION)))[1],
                       timeout_s=30, what="the subscriber to follow deltas under the new key")
        assert sub.stats["applied"] > applied
        assert "wrong_key" not in sub.stats["rejected"]
        # once idle, the residual goes out losslessly as one more version (the publish that reports
        # the weights' digest): /admin/trainer names that version too, not the last step's
        def idle_synced() -> bool:
            delta = _h(r, keys.component_status("delta"))
            return bool(delta.get("weights_digest")) and delta.get("version") == r.get(keys.MODEL_VERSION).decode() \
                == _h(r, keys.TRAINER_STATUS).get("version")
        await wait_for(idle_synced, timeout_s=20, what="the trainer's status to name the version of its idle sync")
        # and that report (the digest showing workers serve exactly the trainer's weights) stays
        # while the trainer idles, not only for its TTL after the last publish
        # (refreshed: its TTL rises above the lowest seen since, which it decays to between
        # refreshes; the first reading may itself be a full TTL, read the moment it was set)
        lowest = [r.pttl(keys.component_status("delta"))]

        def refreshed() -> bool:
            ttl_ms = r.pttl(keys.component_status("delta"))
            rose = 0 < lowest[0] < ttl_ms
            lowest[0] = min(lowest[0], ttl_ms)
            return rose
        await wait_for(refreshed, timeout_s=15, what="the idle trainer to keep its delta report alive")

        # ---- rollback: an unretained version is refused; a retained one is served as a new version
        bad = _command(r, "rollback", to_version=10_000)
        await wait_for(lambda: _ack(r, bad), timeout_s=20, what="rollback refusal")
        assert _ack(r, bad)["ok"] is False and "not retained" in _ack(r, bad)["error"]
        r.set(keys.TRAINER_PAUSED, "{}")  # commands still run while paused; no step follows the rollback
        await wait_for(lambda: _h(r, keys.TRAINER_STATUS).get("paused") == "1", timeout_s=20, what="paused")
        current = int(r.get(keys.MODEL_VERSION))
        cid = _command(r, "rollback", to_version=kept_version)
        await wait_for(lambda: _ack(r, cid), timeout_s=20, what="rollback ack")
        ack = _ack(r, cid)
        assert ack["ok"] is True and ack["new_version"] > current
        assert _h(r, keys.TRAINER_STATUS)["version"] == str(ack["new_version"])
        await wait_for(lambda: (sub.poll(), sub.version == ack["new_version"])[1], timeout_s=30,
                       what="the subscriber to reach the rolled-back version")
        for name, tensor in sub.params.items():
            assert torch.equal(tensor, kept["model"][name]), name
        log = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.MODEL_VERSION_LOG)]
        rolled = [e for e in log if e.get("rollback_of") == str(kept_version)]
        assert rolled and rolled[-1]["anchor"] == "1" and rolled[-1]["version"] == str(ack["new_version"])
        # step->serving latency from the subscriber's acks reaches the dashboard's feed
        assert float(_h(r, keys.component_status("delta"))["sync_latency_ms"]) >= 0
        assert proc.term() == 0, proc.output()
    finally:
        if sub is not None:
            sub.close()
        proc.close()
        ingest.close()
        ctx.term()
        close_sync(r)
        await aredis.aclose()
