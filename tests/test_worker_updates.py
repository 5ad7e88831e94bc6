"""A worker applies the trainer's weight deltas between batches and reports its version;
the gateway's pool routes ``min_model_version`` requests to it once it has caught up."""

from __future__ import annotations

import contextlib
import subprocess
import threading

import pytest
import torch
import yaml
import zmq

from gateway.workers import WorkerPool
from shared import crypto
from shared.keys import TRAINER_STATUS
from shared.model import build_model
from shared.redis_client import close_sync
from tests.conftest import RedisTarget, wait_for
from tests.worker_support import spawn_worker, stop, write_config

publisher_mod = pytest.importorskip("services.trainer.publisher")


def _greedy(model, prompt: str, max_tokens: int) -> str:
    """What the in-process ``model`` answers ``prompt`` greedily: a worker serving the same weights
    answers the same text."""
    ex = model.encode([], prompt, None, reserve_tokens=max_tokens)
    return b"".join(s[0] for s in model.generate([ex], max_tokens=max_tokens, temperature=0.0)).decode(
        "utf-8", errors="replace")


async def test_worker_applies_deltas_and_routes_by_version(tmp_path):
    path, cfg = write_config(tmp_path, 1, extra={"compression": {"algorithm": "lossless"}})
    model = build_model(cfg.model)
    params = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
    ctx = zmq.Context()
    pub = publisher_mod.DeltaPublisher(cfg, ctx, params, 0, model.model_id)
    proc = spawn_worker(path, 0)
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        prompt = {"op": "generate", "prompt": "The gateway", "max_tokens": 10, "temperature": 0.0, "entries": []}
        before = await pool.request(prompt)
        assert before["version"] == 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("head."):
                    p.add_(torch.randn_like(p) * 0.5)
        new = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
        pub.publish(new, 1)
        after = await pool.request(prompt, min_version=1)
        assert after["version"] == 1
        await wait_for(lambda: pool.links[0].version == 1, timeout_s=10, what="heartbeat to report version 1")
        assert after["text"] == _greedy(model, "The gateway", 10), "worker did not apply the delta exactly"
    finally:
        await pool.close()
        stop(proc)
        pub.close()
        ctx.term()


async def test_a_worker_that_cannot_open_deltas_leaves_routing_once_another_serves_newer(tmp_path):
    """Worker 0 holds another mesh's key ring (a copy from before a rotation, say): it can open
    no delta, not even a heartbeat, so it never learns it is behind and reports no lag. The pool
    must not keep sending it requests while worker 1 serves the trainer's newer weights."""
    path, cfg = write_config(tmp_path, 2, extra={"compression": {"algorithm": "lossless"},
                                                 "consistency": {"max_lag": 1}})
    other = yaml.safe_load(path.read_text())
    other["security"]["delta_key_file"] = str(tmp_path / "other-keys" / "delta.key")
    other_path = tmp_path / "other.yaml"
    other_path.write_text(yaml.safe_dump(other))
    crypto.ensure_keys(other["security"]["delta_key_file"], tmp_path / "other-keys" / "delta-sign.key")
    model = build_model(cfg.model)
    params = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
    ctx = zmq.Context()
    pub = publisher_mod.DeltaPublisher(cfg, ctx, params, 0, model.model_id)
    procs = [spawn_worker(other_path, 0), spawn_worker(path, 1)]
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(2, timeout_s=60)
        with torch.no_grad():
            for version in (1, 2, 3):
                for p in params.values():
                    p.add_(0.01)
                pub.publish(params, version)
        await wait_for(lambda: pool.links[1].version == 3, timeout_s=30, what="worker 1 to serve version 3")
        assert pool.links[0].version == 0 and pool.links[0].lag == 0, "worker 0 opened a delta of another ring"
        prompt = {"op": "score", "prompt": "The gateway", "target": " serves", "entries": []}
        served = [(await pool.request(prompt))["version"] for _ in range(6)]
        assert served == [3] * 6, "a worker serving weights three versions old answered"
        stale = procs.pop(0)
        stale.terminate()
        _, err = stale.communicate(timeout=30)
        assert "refuses delta packets (wrong_key" in err.decode(), "the stale worker's log does not say why"
    finally:
        await pool.close()
        for proc in procs:
            stop(proc)
        pub.close()
        ctx.term()


class _Log:
    """A process's stderr, read line by line on a thread of its own while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        with contextlib.suppress(ValueError, OSError):  # closed as the process is stopped
            for line in iter(proc.stderr.readline, b""):
                self.lines.append(line.decode(errors="replace"))

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)


def _published(redis_target: RedisTarget, version: int) -> None:
    """The trainer's status in Redis, as a trainer that has published ``version`` leaves it."""
    r = redis_target.sync_client()
    try:
        r.hset(TRAINER_STATUS, mapping={"version": version, "step": version, "seq": version})
    finally:
        close_sync(r)


@pytest.mark.parametrize("told_by", ["redis", "await_snapshot"])
async def test_a_worker_joining_a_mesh_that_has_learned_serves_the_trainers_weights_first(tmp_path, redis_target,
                                                                                          told_by):
    """A restarted mesh must not answer from the base weights while its trainer restores what it
    learned: a worker whose Redis names a published version answers no gateway before it holds
    the trainer's snapshot, so its first heartbeat and first answer already carry that version.
    So does one told by ``worker.await_snapshot`` (`learnmesh up` beside a checkpoint) where
    Redis lost the trainer's status."""
    path, cfg = write_config(tmp_path, 1, redis_url=redis_target.url, extra={"compression": {"algorithm": "lossless"}},
                             worker={"await_snapshot": told_by == "await_snapshot"})
    if told_by == "redis":
        _published(redis_target, 3)
    model = build_model(cfg.model)
    params = {n: p.detach().clone() for n, p in model.trainable_named_parameters()}
    with torch.no_grad():
        for p in params.values():
            p.add_(0.01)
    ctx = zmq.Context()
    pub = publisher_mod.DeltaPublisher(cfg, ctx, params, 3, model.model_id)  # not answering snapshots yet
    proc = spawn_worker(path, 0)
    log = _Log(proc)
    pool = WorkerPool(cfg)
    try:
        await wait_for(lambda: log.has("taking its snapshot before serving"), timeout_s=60,
                       what="the worker to wait for the trainer's snapshot")
        await pool.start()
        pub.start()  # the trainer answers now
        await pool.wait_live(1, timeout_s=60)
        assert pool.links[0].version == 3, "a worker answered a gateway before it held the trainer's weights"
        prompt = {"op": "generate", "prompt": "The gateway", "max_tokens": 8, "temperature": 0.0, "entries": []}
        res = await pool.request(prompt)
        assert res["version"] == 3
        with torch.no_grad():
            for name, p in model.trainable_named_parameters():
                p.copy_(params[name])
        assert res["text"] == _greedy(model, "The gateway", 8), "the first answer is not the trainer's weights'"
    finally:
        await pool.close()
        stop(proc)
        pub.close()
        ctx.term()


async def test_a_worker_whose_trainer_does_not_answer_serves_the_base_weights_after_its_wait(tmp_path, redis_target):
    """With no trainer answering (down for good, or another machine's), the wait is bounded by
    ``worker.snapshot_wait_s``: then the worker serves version 0 and its log says why."""
    path, cfg = write_config(tmp_path, 1, redis_url=redis_target.url, worker={"snapshot_wait_s": 1.0})
    _published(redis_target, 3)
    proc = spawn_worker(path, 0)
    log = _Log(proc)
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        res = await pool.request({"op": "score", "prompt": "The gateway", "target": " serves", "entries": []})
        assert res["version"] == 0
        await wait_for(lambda: log.has("no snapshot from the trainer within 1s (worker.snapshot_wait_s) although "
                                       "the trainer has published version 3: serving the base weights"),
                       timeout_s=10, what="the worker's log to say it serves the base weights")
    finally:
        await pool.close()
        stop(proc)
