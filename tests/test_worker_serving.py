"""Workers through real ZeroMQ: `learnmesh worker` subprocesses and the gateway's WorkerPool."""

from __future__ import annotations

import asyncio
import io
import signal

import PIL.Image
import pytest
import zmq.asyncio
from prometheus_client import REGISTRY

from gateway.workers import _PROBE as PROBE
from gateway.workers import NoWorker, WorkerPool, WorkerRequestError, WorkerTimeout
from shared.model import build_model
from tests.conftest import free_port, wait_for
from tests.worker_support import FakeWorker, spawn_worker, stop, write_config


def gen(prompt: str = "hello", **kw) -> dict:
    return {"op": "generate", "prompt": prompt, "max_tokens": kw.pop("max_tokens", 8),
            "temperature": kw.pop("temperature", 0.0), "entries": [], **kw}


@pytest.fixture
def one_worker(tmp_path):
    path, cfg = write_config(tmp_path, 1, worker={"max_wait_ms": 300.0, "max_batch_size": 8})
    model = build_model(cfg.model)  # warm the shared weight cache before the worker starts
    proc = spawn_worker(path, 0)
    yield cfg, model
    stop(proc)


async def test_generate_stream_score_and_batching(one_worker):
    cfg, model = one_worker
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        streamed: list[str] = []

        async def on_token(text, header):
            streamed.append(text)

        res = await pool.request(gen("The gateway", max_tokens=12), on_token=on_token)
        assert res["version"] == 0 and res["model_id"] == model.model_id
        assert "".join(streamed) == res["text"] and 1 <= res["tokens"] <= 12
        assert res["finish_reason"] in ("stop", "length")
        # the in-process model gives the same greedy text: the worker really runs this model
        ex = model.encode([], "The gateway", None, reserve_tokens=12)
        local = b"".join(s[0] for s in model.generate([ex], max_tokens=12, temperature=0.0))
        assert res["text"] == local.decode("utf-8", errors="replace")

        results = await asyncio.gather(*(pool.request(gen(f"p{i}", seed=i, temperature=1.0)) for i in range(8)))
        assert max(r["batch"] for r in results) > 1, "concurrent requests were not batched"

        score = await pool.request({"op": "score", "prompt": "The gateway", "target": " is calm.", "entries": []})
        assert score["nll"] > 0 and score["tokens"] == len(" is calm.") + 1
        # what the pool asks a benched worker after its cool-off is a request a worker serves
        assert (await pool.request(dict(PROBE)))["tokens"] == 1

        for bad, match in ((gen(""), "prompt"), (gen(max_tokens=10_000), "max_tokens"),
                           ({"op": "score", "prompt": "x", "entries": []}, "target")):
            with pytest.raises(WorkerRequestError, match=match) as err:
                await pool.request(bad)
            assert err.value.code == "bad_input"
        img = {**gen(), "entries": [{"id": "image:1", "modality": "image", "role": "user", "ts_ms": 1}]}
        with pytest.raises(WorkerRequestError, match="image could not be decoded"):
            await pool.request(img, [b"\x89PNG broken"])
        status = pool.status()
        assert status[0]["alive"] and status[0]["id"] == "worker-0" and status[0]["last_heartbeat"]
    finally:
        await pool.close()


async def test_one_principals_queue_does_not_hold_back_anothers_requests(one_worker):
    """A worker takes requests into batches round-robin across the principals the gateway names:
    with alice's many long generations queued, bob's short generation and carol's score (another
    op) each wait for at most the batch running when they arrive and one more, not behind every
    request alice queued first. The bound allows one batch more: on a loaded machine the worker
    may take a batch of alice's before the others reach it (they are sent together, not received
    together), still far from the six batches a first-come queue would put ahead of them."""
    cfg, _ = one_worker
    per_batch = cfg.worker.max_batch_size
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        done: list[str] = []

        async def ask(principal: str, header: dict) -> None:
            await pool.request({**header, "principal": principal})
            done.append(principal)

        alice = [ask("alice", gen(f"alice {i}", max_tokens=60, temperature=1.0, seed=i)) for i in range(6 * per_batch)]
        others = [ask("bob", gen("bob", max_tokens=4)),
                  ask("carol", {"op": "score", "prompt": "carol", "target": " asks", "entries": []})]
        # one event loop turn sends them all in this order: alice's are queued before the others
        await asyncio.wait_for(asyncio.gather(*alice, *others), 120)
        for who in ("bob", "carol"):
            ahead = done[:done.index(who)].count("alice")
            assert ahead < 3 * per_batch, f"{who} waited behind {ahead} of alice's requests: {done}"
    finally:
        await pool.close()


def _png(pixels: int) -> bytes:
    side = int(pixels ** 0.5)
    with io.BytesIO() as out:
        PIL.Image.new("RGB", (side, side), (10, 20, 30)).save(out, "PNG")
        return out.getvalue()


async def test_one_principals_images_do_not_hold_back_anothers(one_worker):
    """A worker decodes context media on one thread, principals taking turns: with alice's six
    requests of large images arriving first, bob's small image is decoded after at most the one
    being decoded and one more of alice's, not after all six."""
    cfg, _ = one_worker
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        big, small = _png(cfg.model.max_image_pixels // 3), _png(64 * 64)
        image = [{"id": "image:1", "modality": "image", "role": "user", "ts_ms": 1}]
        done: list[str] = []

        async def ask(principal: str, i: int, png: bytes) -> None:
            await pool.request({**gen(f"{principal} {i}", max_tokens=2), "entries": image, "principal": principal},
                               [png])
            done.append(principal)

        alice = [ask("alice", i, big) for i in range(6)]
        # one event loop turn sends them all in this order: alice's are queued before bob's
        await asyncio.wait_for(asyncio.gather(*alice, ask("bob", 0, small)), 120)
        ahead = done[:done.index("bob")].count("alice")
        assert ahead <= 2, f"bob waited behind {ahead} of alice's requests: {done}"
    finally:
        await pool.close()


async def test_a_request_over_what_a_worker_reads_is_refused_before_it_is_sent(one_worker):
    """A worker drops the connection of a peer that sends a frame over its limit, and every other
    request in flight on it: the pool refuses such a request itself, and the others are served."""
    cfg, _ = one_worker
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        long_prompt = gen("x" * (pool.max_frame + 1))
        img = {**gen(), "entries": [{"id": "image:1", "modality": "image", "role": "user", "ts_ms": 1}]}
        for header, frames in ((long_prompt, None), (img, [b"\0" * (pool.max_frame + 1)])):
            others = [asyncio.create_task(pool.request(gen(f"other {i}", max_tokens=4))) for i in range(4)]
            with pytest.raises(WorkerRequestError, match=f"at most {pool.max_frame}") as err:
                await pool.request(header, frames)
            assert err.value.code == "bad_input"
            assert all(r["tokens"] >= 1 for r in await asyncio.gather(*others))
        assert pool.status()[0]["alive"]
    finally:
        await pool.close()


async def test_min_model_version_waits_then_fails_clearly(one_worker, tmp_path):
    cfg, _ = one_worker
    cfg.consistency.timeout_s = 0.3
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=60)
        with pytest.raises(NoWorker, match="model version 5"):
            await pool.request(gen(), min_version=5)
        assert (await pool.request(gen(), min_version=0))["version"] == 0
    finally:
        await pool.close()


async def test_no_worker_is_a_clear_error(tmp_path):
    _, cfg = write_config(tmp_path, 1)
    pool = WorkerPool(cfg, endpoints=[f"tcp://127.0.0.1:{free_port()}"])
    await pool.start()
    try:
        with pytest.raises(NoWorker, match="retry") as err:
            await asyncio.wait_for(pool.request(gen()), 10)
        assert err.value.retry_after_s >= 1
    finally:
        await pool.close()


async def test_kill_one_of_two_workers_under_load(tmp_path):
    path, cfg = write_config(tmp_path, 2, worker={"max_batch_size": 4, "request_timeout_s": 40.0})
    build_model(cfg.model)
    procs = [spawn_worker(path, 0), spawn_worker(path, 1)]
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(2, timeout_s=60)
        tasks = [asyncio.create_task(pool.request(gen(f"load {i}", max_tokens=100, temperature=1.0, seed=i)))
                 for i in range(16)]
        await wait_for(lambda: len(pool.links[0].inflight) > 0, timeout_s=20, what="requests on worker 0")
        procs[0].send_signal(signal.SIGKILL)
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        failures = [r for r in done if isinstance(r, BaseException)]
        assert all(isinstance(f, (NoWorker, WorkerRequestError)) for f in failures), failures
        assert len(failures) == 0, f"requests should have been retried on the survivor: {failures}"
        assert all(r["text"] is not None for r in done)
        assert not pool.links[0].alive
        stop(procs[0], signal.SIGKILL)  # reap the killed process
        procs[0] = spawn_worker(path, 0)  # restart: it rejoins without touching the pool
        await pool.wait_live(2, timeout_s=60)
        await wait_for(lambda: pool.links[0].alive, timeout_s=30, what="worker 0 to rejoin")
        assert (await pool.request(gen("after restart"))) ["version"] == 0
    finally:
        await pool.close()
        for p in procs:
            stop(p, signal.SIGKILL)


async def test_a_worker_that_answers_heartbeats_but_drops_requests_is_benched_then_probed(tmp_path, caplog):
    """A worker whose serving loop is wedged still answers HELLO. After
    worker.max_consecutive_timeouts requests in a row time out there with no answer between, it
    gets no request for worker.bench_cooloff_s (one warning), the request still in flight there is
    retried at once on the other worker, and the admin listing says benched. After the cool-off
    the gateway probes it, and no caller's request goes there meanwhile: a probe unanswered within
    worker.request_timeout_s benches it again without another warning; an answered one brings it
    back. Real ZeroMQ sockets play both workers; the wedged one reports itself the less loaded, so
    routing alone would keep choosing it."""
    _, cfg = write_config(tmp_path, 2, worker={"max_consecutive_timeouts": 2, "bench_cooloff_s": 1.0,
                                               "request_timeout_s": 1.0})
    ctx = zmq.asyncio.Context()
    wedged = FakeWorker(ctx, cfg, cfg.worker.endpoints[0], "wedged")
    wedged.answers = lambda header: False
    other = FakeWorker(ctx, cfg, cfg.worker.endpoints[1], "other")
    other.load = 50
    pool = WorkerPool(cfg)
    caplog.set_level("INFO", logger="learnmesh.workers")
    await pool.start()
    link = pool.links[0]

    def benched_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "requests in a row time out" in r.getMessage()]

    def probes() -> list[str]:
        return [rid for rid in wedged.unanswered if rid.startswith("probe-")]
    try:
        await pool.wait_live(2, timeout_s=30)
        await wait_for(lambda: pool.links[1].reported_load == 50, what="the other worker's load")
        with pytest.raises(WorkerTimeout):
            await pool.request(gen("first"), timeout_s=0.5)
        held = asyncio.create_task(pool.request(gen("held"), timeout_s=20))
        await wait_for(lambda: len(wedged.unanswered) == 2, what="a request held by the wedged worker")
        with pytest.raises(WorkerTimeout):
            await pool.request(gen("second"), timeout_s=0.5)
        assert (await asyncio.wait_for(held, 30))["worker"] == "other"
        for i in range(3):
            assert (await pool.request(gen(f"benched {i}"), timeout_s=5))["worker"] == "other"
        assert len(wedged.unanswered) == 3
        assert {w["id"]: w["benched"] for w in pool.status()} == {"wedged": True, "other": False}
        assert REGISTRY.get_sample_value("learnmesh_workers_benched") == 1.0
        assert benched_warnings() == [
            f"worker wedged ({link.endpoint}) let 2 requests in a row time out while it answers heartbeats; no "
            "requests go there for 1s, then a probe (retrying its 1 requests in flight elsewhere)"]

        first_bench = link.benched_until
        assert first_bench is not None
        await wait_for(lambda: len(probes()) == 1, timeout_s=10, what="a probe after the cool-off")
        for i in range(3):  # while the probe is out, callers are still served elsewhere
            assert (await pool.request(gen(f"probed {i}"), timeout_s=5))["worker"] == "other"
        await wait_for(lambda: (link.benched_until or 0) > first_bench + 1.0, timeout_s=10,
                       what="the unanswered probe to bench it again")
        assert link.probe is None or link.probe[0] != probes()[0]
        assert [rid for rid in wedged.unanswered if not rid.startswith("probe-")] == wedged.unanswered[:3]
        assert len(benched_warnings()) == 1

        wedged.answers = lambda header: True  # unwedged
        await wait_for(lambda: link.benched_until is None, timeout_s=10, what="an answered probe to bring it back")
        assert {w["id"]: w["benched"] for w in pool.status()} == {"wedged": False, "other": False}
        assert REGISTRY.get_sample_value("learnmesh_workers_benched") == 0.0
        assert (await pool.request(gen("back"), timeout_s=5))["worker"] == "wedged"
        assert f"worker wedged ({link.endpoint}) answers requests again; back in the routing pool" in \
            [r.getMessage() for r in caplog.records]
    finally:
        await pool.close()
        await wedged.close()
        await other.close()
        ctx.term()


async def test_when_every_worker_is_benched_requests_still_go_to_one(tmp_path):
    """A bench may be mistaken (one long batch): with nothing else to route to, a benched worker
    still gets requests, and its first answer brings it back."""
    _, cfg = write_config(tmp_path, 1, worker={"max_consecutive_timeouts": 1, "bench_cooloff_s": 600.0})
    ctx = zmq.asyncio.Context()
    only = FakeWorker(ctx, cfg, cfg.worker.endpoints[0], "only")
    only.answers = lambda header: False
    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=30)
        with pytest.raises(WorkerTimeout):
            await pool.request(gen("stuck"), timeout_s=0.5)
        assert pool.status()[0]["benched"] is True
        only.answers = lambda header: True
        assert (await pool.request(gen("served"), timeout_s=5))["worker"] == "only"
        assert pool.status()[0]["benched"] is False
    finally:
        await pool.close()
        await only.close()
        ctx.term()
