"""Workers that join and leave by themselves: real `learnmesh worker` processes announce
themselves in a real Redis (a single server, then a cluster), and a gateway's WorkerPool with
no configured endpoint follows the announcements under traffic."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import signal
import socket
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import yaml
import zmq.asyncio
from redis.cluster import key_slot

from gateway.workers import NoWorker, WorkerPool
from services import supervisor
from services.worker.main import Worker, worker_id_of
from shared import keys, worker_registry
from shared.config import ConfigError, RedisConfig, load_config
from shared.control import now_ms
from shared.model import build_model
from shared.redis_client import async_client, close_sync
from shared.redis_embed import start_redis
from shared.redis_local_cluster import LocalCluster
from shared.worker_registry import Registration, RegistrationError, advertised_endpoint
from shared.zmq_util import bind_address
from tests.conftest import RedisTarget, free_port, wait_for, wait_for_sync
from tests.worker_support import FakeWorker, spawn_worker, stop, write_config

DISCOVERY = {"endpoints": [], "register_interval_ms": 200, "registration_ttl_ms": 1000,
             "max_batch_size": 4, "request_timeout_s": 60.0}


def gen(i: int) -> dict:
    return {"op": "generate", "prompt": f"traffic {i}", "max_tokens": 16, "temperature": 1.0, "seed": i,
            "entries": []}


class Traffic:
    """``n`` callers sending requests back to back until stopped; every outcome is kept."""

    def __init__(self, pool: WorkerPool, n: int = 4) -> None:
        self.pool = pool
        self.served: list[str] = []  # worker id of every answered request, in order
        self.failures: list[BaseException] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._caller(c)) for c in range(n)]

    async def _caller(self, c: int) -> None:
        i = c
        while not self._stop.is_set():
            try:
                self.served.append(str((await self.pool.request(gen(i)))["worker"]))
            except Exception as exc:  # every failure is a finding of the test
                self.failures.append(exc)
            i += 100

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 120)


async def _started_pool(cfg: Any, redis: Any, caplog: Any) -> WorkerPool:
    caplog.set_level("INFO", logger="learnmesh.workers")
    pool = WorkerPool(cfg, redis=redis)
    await pool.start()
    return pool


async def _traffic_on(pool: WorkerPool, *, workers: int, callers: int, served: int) -> Traffic:
    """Once ``workers`` workers are live, ``callers`` callers sending until ``served`` answers came."""
    await pool.wait_live(workers, timeout_s=90)
    traffic = Traffic(pool, n=callers)
    await wait_for(lambda: len(traffic.served) >= served, timeout_s=60, what=f"{served} requests served")
    return traffic


async def _wind_down(pool: WorkerPool, redis: Any, procs: list[Any], traffic: Traffic | None) -> None:
    if traffic is not None and not traffic._stop.is_set():
        await traffic.stop()
    await pool.close()
    await redis.aclose()
    for p in procs:
        stop(p, signal.SIGKILL)


def _endpoints(pool: WorkerPool) -> set[str]:
    return {link.endpoint for link in pool.links}


async def test_a_worker_started_under_traffic_joins_and_a_killed_one_leaves(tmp_path, redis_target: RedisTarget):
    path, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_target.url)
    build_model(cfg.model)  # warm the shared weight cache before the workers start
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    logs = [open(tmp_path / f"worker-{i}.log", "wb") for i in range(3)]  # noqa: SIM115 - closed below
    procs = [spawn_worker(path, i, endpoints[i], logs[i]) for i in range(2)]
    redis = redis_target.async_client()
    pool = WorkerPool(cfg, redis=redis)
    assert pool.links == []  # nothing configured: every worker comes from its announcement
    await pool.start()
    traffic = None
    try:
        await pool.wait_live(2, timeout_s=90)
        traffic = Traffic(pool)
        await wait_for(lambda: len(traffic.served) >= 8, timeout_s=60, what="traffic on the first two workers")

        procs.append(spawn_worker(path, 2, endpoints[2], logs[2]))
        await wait_for(lambda: "worker-2" in traffic.served, timeout_s=90, what="the third worker to take requests")
        [third] = [w for w in pool.status() if w["endpoint"] == endpoints[2]]
        assert third["source"] == "discovered" and third["id"] == "worker-2" and third["capacity"] == 4

        procs[0].send_signal(signal.SIGKILL)
        await wait_for(lambda: endpoints[0] not in _endpoints(pool), timeout_s=30,
                       what="the killed worker to leave the pool")
        after = len(traffic.served)
        await wait_for(lambda: len(traffic.served) >= after + 12, timeout_s=60, what="traffic after the kill")
        await traffic.stop()
        assert traffic.failures == [], traffic.failures
        assert set(traffic.served[after:]) <= {"worker-1", "worker-2"}
        assert await redis.exists(keys.worker_registration("worker-0")) == 0  # expired: nobody renewed it

        stop(procs[1])  # a clean stop withdraws the announcement at once
        assert await redis.exists(keys.worker_registration("worker-1")) == 0
        await wait_for(lambda: endpoints[1] not in _endpoints(pool), timeout_s=10,
                       what="the stopped worker to leave the pool")
        assert _endpoints(pool) == {endpoints[2]}
        assert (await pool.request(gen(0)))["worker"] == "worker-2"
    finally:
        await _wind_down(pool, redis, procs, traffic)
        for log in logs:
            log.close()


async def test_a_worker_stopped_under_traffic_loses_no_request(tmp_path, redis_target: RedisTarget, caplog):
    """SIGTERM under traffic: the worker tells the gateways it is leaving and refuses what still
    arrives, so every request is answered or retried at once, none waits for the heartbeat
    timeout to find it lost, and the pool does not mistake the stop for Redis losing keys."""
    path, cfg = write_config(tmp_path, 0, worker={**DISCOVERY, "heartbeat_timeout_ms": 600_000},
                             redis_url=redis_target.url)
    build_model(cfg.model)
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    procs = [spawn_worker(path, i, endpoints[i]) for i in range(2)]
    redis = redis_target.async_client()
    pool = await _started_pool(cfg, redis, caplog)
    traffic = None
    try:
        traffic = await _traffic_on(pool, workers=2, callers=6, served=30)
        report = keys.component_status("worker:worker-0")
        await wait_for(lambda: redis.exists(report), timeout_s=30, what="worker-0's status report")
        procs[0].send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(procs[0].wait, 30) == 0
        # its self-report goes with it: /admin/workers stops listing it at once, not after the TTL
        assert not await redis.exists(report) and not await redis.sismember(keys.STATUS_INDEX, "worker:worker-0")
        assert await redis.exists(keys.component_status("worker:worker-1")), "the other worker's report stays"
        await wait_for(lambda: endpoints[0] not in _endpoints(pool), timeout_s=30, what="the stopped worker to leave")
        after = len(traffic.served)
        await wait_for(lambda: len(traffic.served) >= after + 30, timeout_s=60, what="traffic after the stop")
        await traffic.stop()
        assert traffic.failures == [], traffic.failures
        logged = [r.getMessage() for r in caplog.records]
        # told by its last heartbeat or by its announcement withdrawn, whichever the pool read first
        # (under load either may come first): an orderly leave either way, never a lost worker
        assert (f"worker worker-0 ({endpoints[0]}) is stopping; no new requests go there" in logged
                or any(m.startswith(f"worker worker-0 ({endpoints[0]}) is no longer announced") for m in logged)), logged
        assert not [m for m in logged if "missed heartbeats" in m or "still answers" in m], logged
    finally:
        await _wind_down(pool, redis, procs, traffic)


async def test_a_worker_serves_on_while_redis_is_paused_then_restarted_empty(tmp_path, caplog):
    """Redis stops answering (paused, its host unreachable), then comes back empty (restarted
    without persistence): the worker answers heartbeats and requests all along, announces
    itself again by itself, and the gateway's pool keeps it throughout: no request fails."""
    port = free_port()
    url, server = start_redis(tmp_path / "redis-a", port)
    path, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=url)
    build_model(cfg.model)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_worker(path, 0, endpoint)
    redis = async_client(RedisConfig(url=url), socket_timeout=2.0)
    pool = await _started_pool(cfg, redis, caplog)
    traffic = None
    try:
        traffic = await _traffic_on(pool, workers=1, callers=2, served=4)
        server.send_signal(signal.SIGSTOP)  # every Redis command of the worker now waits for its timeout
        paused_at, paused_s = len(traffic.served), time.monotonic()
        await wait_for(lambda: len(traffic.served) >= paused_at + 20 and time.monotonic() > paused_s + 8,
                       timeout_s=120, what="requests served while Redis does not answer (a few of its timeouts)")
        server.kill()
        server.send_signal(signal.SIGCONT)
        server.wait(10)
        url_b, server = start_redis(tmp_path / "redis-b", port)  # the same address, nothing in it
        sync = redis_sync.Redis.from_url(url_b)
        wait_for_sync(lambda: sync.hget(keys.worker_registration("worker-0"), "endpoint") == endpoint.encode(),
                      timeout_s=30, what="the worker to announce itself again")
        sync.close()
        again = len(traffic.served)
        await wait_for(lambda: len(traffic.served) >= again + 20, timeout_s=60, what="traffic after the restart")
        await traffic.stop()
        assert traffic.failures == [], traffic.failures
        assert _endpoints(pool) == {endpoint}
        assert not [r for r in caplog.records if "missed heartbeats" in r.getMessage()]
    finally:
        await _wind_down(pool, redis, [proc], traffic)
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)


async def test_announcements_follow_redis_and_static_endpoints_stay(tmp_path, redis_target: RedisTarget):
    """The pool's discovered part is exactly the live announcements: an expired or malformed
    one gives no connection, an announced static endpoint is not connected twice, and a
    static worker stays in the pool though nothing announces it."""
    static = f"tcp://127.0.0.1:{free_port()}"
    _, cfg = write_config(tmp_path, 0, worker={**DISCOVERY, "endpoints": [static]}, redis_url=redis_target.url)
    sync = redis_target.sync_client()
    redis = redis_target.async_client()
    pool = WorkerPool(cfg, redis=redis)
    await pool.start()
    try:
        a, b = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        worker_registry.register(sync, Registration("a", a, capacity=8, heartbeat_ms=now_ms()), ttl_ms=60_000)
        # long enough to be seen joining on a loaded machine, short enough to watch it expire
        worker_registry.register(sync, Registration("b", b, heartbeat_ms=now_ms()), ttl_ms=3000)
        worker_registry.register(sync, Registration("same", static, heartbeat_ms=now_ms()), ttl_ms=60_000)
        sync.hset(keys.worker_registration("bad"), mapping={"endpoint": "tcp://0.0.0.0:1"})
        sync.zadd(keys.WORKERS_INDEX, {"bad": now_ms()})
        await wait_for(lambda: _endpoints(pool) == {static, a, b}, what="the announced workers to join")
        by_endpoint = {link.endpoint: link for link in pool.links}
        assert by_endpoint[static].static and not by_endpoint[a].static and not by_endpoint[b].static
        assert by_endpoint[a].capacity == 8 and not by_endpoint[a].alive  # nothing answers there
        await wait_for(lambda: _endpoints(pool) == {static, a}, what="the expired announcement to leave")
        worker_registry.withdraw(sync, "a")
        await wait_for(lambda: _endpoints(pool) == {static}, what="the withdrawn announcement to leave")
        indices = [link.index for link in pool.links]
        worker_registry.register(sync, Registration("a", a, heartbeat_ms=now_ms()), ttl_ms=60_000)
        await wait_for(lambda: _endpoints(pool) == {static, a}, what="the worker to join again")
        sync.zadd(keys.WORKERS_INDEX, {"long-gone": now_ms() - 1000})
        await wait_for(lambda: sync.zscore(keys.WORKERS_INDEX, "long-gone") is None,
                       what="a reader to trim the index")
        assert sync.zscore(keys.WORKERS_INDEX, "a") is not None
        assert pool.links[-1].index not in indices  # a new connection, never a reused index
    finally:
        await pool.close()
        await redis.aclose()
        close_sync(sync)


async def test_hostile_announcements_are_skipped_once_each_and_discovery_goes_on(tmp_path, redis_target: RedisTarget,
                                                                              caplog):
    """Announcements written straight into Redis by something other than a worker (bytes that are
    not text, a host ZeroMQ refuses, a capacity that would draw every request, a key that is not
    a hash): each is ignored
    with one log line naming the worker id and why, and workers announced later still join."""
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_target.url)
    sync = redis_target.sync_client()
    redis = redis_target.async_client()
    ok, later, taken = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    hostile = {"not-text": {"endpoint": b"tcp://\xff:5000"}, "dash-host": {"endpoint": "tcp://-:5000"},
               "huge": {"endpoint": taken, "capacity": str(10**30)}, "words": {"endpoint": taken, "capacity": "many"}}
    for worker_id, fields in hostile.items():
        sync.hset(keys.worker_registration(worker_id), mapping=fields)  # type: ignore[arg-type]
        sync.zadd(keys.WORKERS_INDEX, {worker_id: now_ms()})
    sync.set(keys.worker_registration("a-string"), "tcp://127.0.0.1:1")
    sync.zadd(keys.WORKERS_INDEX, {b"\xff\xfe": now_ms(), "a}b{c": now_ms(), "a-string": now_ms()})
    pool = WorkerPool(cfg, redis=redis)
    caplog.set_level("INFO", logger="learnmesh.workers")
    await pool.start()
    try:
        worker_registry.register(sync, Registration("ok", ok, heartbeat_ms=now_ms()), ttl_ms=60_000)
        await wait_for(lambda: _endpoints(pool) == {ok}, what="the good announcement to join")
        worker_registry.register(sync, Registration("later", later, heartbeat_ms=now_ms()), ttl_ms=60_000)
        await wait_for(lambda: _endpoints(pool) == {ok, later}, what="an announcement made later to join")
        ignored = [r.getMessage() for r in caplog.records if "ignoring the announcement" in r.getMessage()]
        for worker_id in ("not-text", "dash-host", "huge", "words", "b'\\xff\\xfe'", "b'a}b{c'", "a-string"):
            assert len([m for m in ignored if f"worker {worker_id}:" in m]) == 1, (worker_id, ignored)
        assert sync.zscore(keys.WORKERS_INDEX, b"\xff\xfe") is None  # no worker has such an id
        assert {link.capacity for link in pool.links} == {1}
        sync.delete(keys.WORKERS_INDEX)
        sync.set(keys.WORKERS_INDEX, "not a sorted set")  # the whole index unreadable: the pool stays
        why = "cannot read the worker announcements (ResponseError: WRONGTYPE"
        await wait_for(lambda: any(why in r.getMessage() for r in caplog.records),
                       what="the gateway to say why it cannot read the announcements")
        assert _endpoints(pool) == {ok, later}
    finally:
        await pool.close()
        await redis.aclose()
        close_sync(sync)


async def test_announcements_beyond_max_discovered_are_ignored_and_the_pool_keeps_its_workers(
        tmp_path, redis_target: RedisTarget, caplog):
    """Someone who can write to Redis announces more workers than worker.max_discovered: the
    gateway connects to that many, keeps the ones it already has, takes newcomers in worker id
    order (every gateway makes the same choice) and says so in one throttled warning naming the
    count; a place that frees up goes to the next newcomer."""
    _, cfg = write_config(tmp_path, 0, worker={**DISCOVERY, "max_discovered": 3}, redis_url=redis_target.url)
    sync = redis_target.sync_client()
    redis = redis_target.async_client()
    endpoints = {worker_id: f"tcp://127.0.0.1:{free_port()}" for worker_id in ("z-first", "e", "d", "c", "b", "a")}

    def announce(worker_id: str) -> None:
        worker_registry.register(sync, Registration(worker_id, endpoints[worker_id], heartbeat_ms=now_ms()),
                                 ttl_ms=60_000)

    def pool_of(*worker_ids: str) -> set[str]:
        return {endpoints[w] for w in worker_ids}

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "beyond worker.max_discovered" in r.getMessage()]
    pool = await _started_pool(cfg, redis, caplog)
    try:
        announce("z-first")
        await wait_for(lambda: _endpoints(pool) == pool_of("z-first"), what="the first worker to join")
        for worker_id in ("e", "d", "c", "b", "a"):
            announce(worker_id)
        await wait_for(lambda: _endpoints(pool) == pool_of("z-first", "a", "b"), what="the pool to fill up")
        for _ in range(3):  # every later read makes the same choice
            await pool.follow_announcements(await worker_registry.registered(redis))
            assert _endpoints(pool) == pool_of("z-first", "a", "b")
        assert warned()[0] == ("ignoring 3 worker announcements beyond worker.max_discovered (3 of 6 announced "
                               "are in the pool)")
        assert all("more like it since the last such line" in line for line in warned()[1:])  # throttled
        worker_registry.withdraw(sync, "a")
        await wait_for(lambda: _endpoints(pool) == pool_of("z-first", "b", "c"), what="the next newcomer to join")
    finally:
        await _wind_down(pool, redis, [], None)
        close_sync(sync)


async def test_announced_workers_that_never_answer_are_reported_once_and_get_nothing(tmp_path,
                                                                                   redis_target: RedisTarget, caplog):
    """One announcement names a closed port, another a process that accepts connections and never
    says a word: each gets one warning, no request goes there (no worker: a clear answer), and a
    worker announced later serves without a restart of the gateway."""
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_target.url)
    sync = redis_target.sync_client()
    redis = redis_target.async_client()
    closed = f"tcp://127.0.0.1:{free_port()}"
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    mute_endpoint = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
    ctx = zmq.asyncio.Context()
    good = f"tcp://127.0.0.1:{free_port()}"
    worker = None
    pool = await _started_pool(cfg, redis, caplog)
    try:
        for worker_id, endpoint in (("closed", closed), ("mute", mute_endpoint)):
            worker_registry.register(sync, Registration(worker_id, endpoint, heartbeat_ms=now_ms()), ttl_ms=60_000)

        def silent() -> list[str]:
            return [r.getMessage() for r in caplog.records if "has not answered a heartbeat" in r.getMessage()]
        await wait_for(lambda: len(silent()) == 2, what="both silent workers to be reported")
        assert sorted(silent()) == [
            f"worker {worker_id} at {endpoint} has not answered a heartbeat since it was announced; nothing is routed "
            "there until it does (is that address reachable from this gateway?)"
            for worker_id, endpoint in sorted((("closed", closed), ("mute", mute_endpoint)))]
        with pytest.raises(NoWorker, match="no inference worker is available"):
            await pool.request(gen(0))
        worker = FakeWorker(ctx, cfg, good, "good")
        worker_registry.register(sync, Registration("good", good, heartbeat_ms=now_ms()), ttl_ms=60_000)
        assert (await pool.request(gen(1), timeout_s=30))["worker"] == "good"
        assert len(silent()) == 2
    finally:
        await _wind_down(pool, redis, [], None)
        if worker is not None:
            await worker.close()
        ctx.term()
        mute.close()
        close_sync(sync)


async def test_the_index_forgets_expired_workers_whatever_their_clocks_say(redis_target: RedisTarget):
    """A live worker whose clock is decades slow stays announced, and entries left by workers
    gone for good (thousands of them) leave the index at the first read, whether their clocks
    ran slow or fast or just stopped: no gateway reads them again at every interval."""
    sync = redis_target.sync_client()
    redis = redis_target.async_client()
    try:
        worker_registry.register(sync, Registration("slow", f"tcp://127.0.0.1:{free_port()}", heartbeat_ms=1),
                                 ttl_ms=60_000)
        sync.zadd(keys.WORKERS_INDEX, {"gone-ahead": now_ms() + 10**9, "gone-behind": 1})  # their hashes expired
        sync.zadd(keys.WORKERS_INDEX, {f"gone-{i}": now_ms() for i in range(3000)})  # a crash loop's leftovers
        for _ in range(3):
            assert [reg.worker_id for reg in await worker_registry.registered(redis)] == ["slow"]
        assert sync.zrange(keys.WORKERS_INDEX, 0, -1) == [b"slow"]
    finally:
        await redis.aclose()
        close_sync(sync)


async def test_a_worker_that_still_answers_outlives_a_redis_that_lost_its_announcement(tmp_path,
                                                                                     redis_target: RedisTarget):
    """Redis restarted without persistence (or flushed): the announcements are gone until the
    workers renew them. A worker that still answers keeps serving meanwhile; one that is never
    announced again leaves once ``registration_ttl_ms`` has passed."""
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_target.url)
    ctx = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = FakeWorker(ctx, cfg, endpoint, "w")
    sync = redis_target.sync_client()
    redis = redis_target.async_client()
    pool = WorkerPool(cfg, redis=redis)
    await pool.start()
    try:
        worker_registry.register(sync, Registration("w", endpoint, heartbeat_ms=now_ms()), ttl_ms=60_000)
        await pool.wait_live(1, timeout_s=30)
        sync.delete(keys.worker_registration("w"))
        sync.delete(keys.WORKERS_INDEX)
        await pool.follow_announcements(await worker_registry.registered(redis))  # what every read finds now
        assert _endpoints(pool) == {endpoint}
        assert (await pool.request(gen(0), timeout_s=10))["worker"] == "w"
        await wait_for(lambda: endpoint not in _endpoints(pool), what="the worker never announced again to leave")
    finally:
        await pool.close()
        await worker.close()
        ctx.term()
        await redis.aclose()
        close_sync(sync)


async def test_a_worker_restarted_on_its_endpoint_within_the_heartbeat_timeout_gets_its_requests_again(tmp_path):
    """A worker process replaced on the same endpoint faster than ``heartbeat_timeout_ms`` (a
    supervisor or pod restarting it): what the old process had in flight is lost with it, and
    the gateway retries it as soon as the new process's first heartbeat names another process."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    _, cfg = write_config(tmp_path, 0, worker={"endpoints": [endpoint], "heartbeat_timeout_ms": 600_000,
                                               "request_timeout_s": 600.0})
    ctx = zmq.asyncio.Context()
    old = FakeWorker(ctx, cfg, endpoint, "w", instance="old")
    old.answers = lambda header: False  # accepts requests, dies before answering
    pool = WorkerPool(cfg)
    await pool.start()
    new = None
    try:
        await pool.wait_live(1, timeout_s=30)
        request = asyncio.create_task(pool.request(gen(0)))
        await wait_for(lambda: old.unanswered, what="the old process to take the request")
        await old.close()
        new = FakeWorker(ctx, cfg, endpoint, "w", instance="new")
        assert (await asyncio.wait_for(request, 120))["worker"] == "w"
        assert len(new.unanswered) == 0 and pool.links[0].alive
    finally:
        await pool.close()
        for w in (old, new):
            if w is not None:
                await w.close()
        ctx.term()


async def test_a_gateway_whose_redis_is_away_says_so_once_and_follows_it_when_it_comes(tmp_path, caplog):
    """Redis not there yet (or gone) as the gateway follows the announcements: one warning that
    says the pool stays as it is, and the workers announced once Redis answers join."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=url)
    redis = async_client(RedisConfig(url=url), socket_timeout=2.0)
    pool = await _started_pool(cfg, redis, caplog)
    ctx = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = FakeWorker(ctx, cfg, endpoint, "w")
    server = None
    try:
        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if "cannot read the worker announcements" in r.getMessage()]
        await wait_for(warned, what="the gateway to say it cannot read the announcements")
        _, server = start_redis(tmp_path / "redis", port)
        sync = redis_sync.Redis.from_url(url)
        worker_registry.register(sync, Registration("w", endpoint, heartbeat_ms=now_ms()), ttl_ms=60_000)
        sync.close()
        await pool.wait_live(1, timeout_s=30)
        assert warned() == ["cannot read the worker announcements (ConnectionError); routing to the 0 workers known "
                            "until Redis answers"]
        assert "worker announcements readable again: 1 announced" in [r.getMessage() for r in caplog.records]
    finally:
        await _wind_down(pool, redis, [], None)
        await worker.close()
        ctx.term()
        if server is not None:
            server.kill()
            server.wait(10)


async def test_discovery_off_ignores_announcements(tmp_path, redis_target: RedisTarget):
    _, cfg = write_config(tmp_path, 0, worker={**DISCOVERY, "discovery": False}, redis_url=redis_target.url)
    sync = redis_target.sync_client()
    worker_registry.register(sync, Registration("a", f"tcp://127.0.0.1:{free_port()}", heartbeat_ms=now_ms()),
                             ttl_ms=60_000)
    redis = redis_target.async_client()
    pool = WorkerPool(cfg, redis=redis)
    await pool.start()
    try:
        assert await worker_registry.registered(redis)  # the announcement is there to be read
        assert "workers-discovery" not in {t.get_name() for t in pool._tasks}
        assert pool.links == []
    finally:
        await pool.close()
        await redis.aclose()
        close_sync(sync)


def test_a_worker_binding_any_port_announces_the_port_it_got(tmp_path, redis_target: RedisTarget):
    _, cfg = write_config(tmp_path, 0, worker={**DISCOVERY, "id": "w-{host}-{index}"}, redis_url=redis_target.url)
    worker = Worker(cfg, "tcp://127.0.0.1:*", worker_id_of(cfg.worker.id, 3), updates=False)
    sync = redis_target.sync_client()
    try:
        port = int(worker.endpoint.rsplit(":", 1)[1])
        assert worker.advertised == f"tcp://127.0.0.1:{port}" and port > 0
        assert worker.worker_id == f"w-{socket.gethostname()}-3"
        worker._start_registrar()
        raw = sync.hgetall(keys.worker_registration(worker.worker_id))
        assert raw[b"endpoint"] == worker.advertised.encode() and raw[b"capacity"] == b"4"
        assert 0 < sync.pttl(keys.worker_registration(worker.worker_id)) <= 1000
        wait_for_sync(lambda: worker.registrar.renewals >= 3, what="the registration to be renewed")
        sync.delete(keys.worker_registration(worker.worker_id))  # Redis restarted empty, or flushed
        sync.delete(keys.WORKERS_INDEX)
        wait_for_sync(lambda: sync.zscore(keys.WORKERS_INDEX, worker.worker_id) is not None
                      and sync.hget(keys.worker_registration(worker.worker_id), "endpoint") == raw[b"endpoint"],
                      what="the worker to announce itself again")
        worker.registrar.close()
        assert not sync.exists(keys.worker_registration(worker.worker_id))
        assert sync.zscore(keys.WORKERS_INDEX, worker.worker_id) is None
    finally:
        worker.sock.close(linger=0)
        if worker._redis is not None:  # the registrar's client, as the worker's run() closes it
            close_sync(worker._redis)
        close_sync(sync)


def test_two_workers_given_one_id_do_not_take_turns_at_its_announcement(tmp_path, redis_target: RedisTarget, caplog):
    """A second worker started with an id a live one already announces (a copied config) is not
    announced and says why; gateways keep one endpoint for the id instead of switching between
    the two at every renewal. Once the first stops, or dies and its announcement expires (a
    worker restarted at once on a new port), the other is announced."""
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_target.url)
    first, second, third = (Worker(cfg, "tcp://127.0.0.1:*", "twin", updates=False) for _ in range(3))
    sync = redis_target.sync_client()
    key = keys.worker_registration("twin")
    caplog.set_level("INFO", logger="learnmesh.worker")
    try:
        first._start_registrar()
        second._start_registrar()
        wait_for_sync(lambda: first.registrar.renewals >= 5, what="the first worker to renew")
        assert second.registrar.renewals == 0 and sync.hget(key, "endpoint") == first.advertised.encode()
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert errors == [f"worker twin at {second.advertised} is not announced: worker id 'twin' is announced by "
                          f"another process at {first.advertised}: give each worker its own worker.id (this one "
                          "is announced once that announcement expires or is withdrawn)"]
        first.registrar.close()  # a clean stop hands the id over
        wait_for_sync(lambda: sync.hget(key, "endpoint") == second.advertised.encode(),
                      what="the second worker to be announced")
        second.registrar._stop.set()  # dies without withdrawing: its announcement expires
        second.registrar._thread.join()
        third._start_registrar()
        wait_for_sync(lambda: sync.hget(key, "endpoint") == third.advertised.encode(),
                      what="the worker started in its place to be announced")
        second.registrar.close()  # withdraws only what it holds
        assert sync.hget(key, "endpoint") == third.advertised.encode()
        third.registrar.close()
        assert not sync.exists(key) and sync.zscore(keys.WORKERS_INDEX, "twin") is None
        sync.set(keys.WORKERS_INDEX, "not a sorted set")  # written by hand: the worker says what is wrong
        third.registrar._renew()
        assert caplog.records[-1].getMessage() == "worker twin could not renew its registration: ResponseError: " \
                                                  "WRONGTYPE Operation against a key holding the wrong kind of value"
        sync.delete(keys.WORKERS_INDEX)
    finally:
        for w in (first, second, third):
            if w.registrar is not None:
                w.registrar.close()
            w.sock.close(linger=0)
        close_sync(sync)


def test_a_worker_restarted_on_its_own_endpoint_is_announced_at_once(tmp_path, redis_target: RedisTarget, caplog):
    """`learnmesh up` or a pod restarts a crashed worker on the endpoint it had: its id is free
    at once (the port is its own), not only once the dead process's announcement expires, and no
    error is logged about another process."""
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_target.url)
    dead = Worker(cfg, "tcp://127.0.0.1:*", "w", updates=False)
    sync = redis_target.sync_client()
    caplog.set_level("INFO", logger="learnmesh.worker")
    restarted = None
    try:
        dead._start_registrar()
        dead.registrar._stop.set()  # killed: it renews no more and withdraws nothing
        dead.registrar._thread.join()
        dead.sock.close(linger=0)
        # ZeroMQ closes the listener in its I/O thread, shortly after close() (a new process
        # would find the port free at once: the old one's exit freed it)
        restarted = wait_for_sync(lambda: _bound_worker(cfg, dead.endpoint), timeout_s=10,
                                  what=f"{dead.endpoint} to be free again")
        restarted._start_registrar()  # the first renewal happens here
        assert restarted.registrar.renewals == 1
        assert sync.hget(keys.worker_registration("w"), "instance") == restarted.instance.encode()
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
    finally:
        for w in (dead, restarted):
            if w is not None:
                if w.registrar is not None:
                    w.registrar.close()
                w.sock.close(linger=0)
        close_sync(sync)


def _bound_worker(cfg, endpoint: str) -> Worker | None:
    try:
        return Worker(cfg, endpoint, "w", updates=False)
    except zmq.ZMQError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return None


@pytest.mark.parametrize("kind", [m for m in ("single", "cluster") if m in os.environ.get(
    "LEARNMESH_TEST_REDIS_MODES", "single,cluster")])
async def test_a_worker_started_before_its_redis_serves_and_announces_itself_once_it_answers(tmp_path, kind):
    """No Redis (or no node of its cluster) answers as a worker starts: it serves its socket at
    once, says in one line that it cannot announce itself yet, and announces itself as soon as
    Redis answers, without exiting (nothing has to restart it)."""
    cluster = None
    if kind == "single":
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
    else:
        cluster = LocalCluster(masters=3, replicas=0).start()
        url = cluster.url
        for node in cluster.nodes:  # the whole cluster down, as after a power cut
            cluster.kill(node)
    path, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=url)
    build_model(cfg.model)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_worker(path, 0, endpoint)
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in proc.stderr), daemon=True)
    reader.start()
    pool = WorkerPool(cfg, endpoints=[endpoint])  # a gateway that knows the endpoint without Redis
    await pool.start()
    server = None

    def waiting() -> list[str]:
        return [line for line in lines if "cannot announce itself yet" in line]
    try:
        await wait_for(lambda: waiting() or proc.poll() is not None, timeout_s=90,
                       what="the worker to say it cannot announce itself yet")
        assert proc.poll() is None, f"the worker exited: {lines[-1:]}"
        await pool.wait_live(1, timeout_s=30)
        assert (await pool.request(gen(0), timeout_s=30))["worker"] == "worker-0"
        if cluster is None:
            _, server = start_redis(tmp_path / "redis", port)
        else:
            for node in cluster.nodes:
                cluster.restart(node)
            cluster.wait_ok()
        sync = redis_sync.Redis.from_url(url) if cluster is None else \
            redis_sync.RedisCluster.from_url(cluster.seed_url)
        await wait_for(lambda: sync.hget(keys.worker_registration("worker-0"), "endpoint") == endpoint.encode(),
                       timeout_s=60, what="the worker to announce itself")
        sync.close()
        assert proc.poll() is None
        assert len(waiting()) == 1 and "Traceback" not in "".join(lines)
    finally:
        await pool.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        reader.join(10)
        stop(proc)
        if server is not None:
            server.kill()
            server.wait(10)
        if cluster is not None:
            cluster.stop()


def test_a_worker_beyond_the_configured_endpoints_is_told_how_to_start(tmp_path):
    """A worker added by hand (`learnmesh worker --index 2` beside two configured ones): one line
    that says which option starts it, no traceback."""
    path, _ = write_config(tmp_path, 0, worker={"endpoints": ["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"]})
    proc = spawn_worker(path, 2)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert stderr.decode().strip().splitlines() == [
        "learnmesh: configuration error: worker --index 2 is outside worker.endpoints (2 configured): pass "
        "--endpoint (tcp://127.0.0.1:* binds a free port and announces it) or list one more endpoint"]


def test_advertised_endpoints():
    assert advertised_endpoint("tcp://10.1.2.3:5601", "", "redis") == "tcp://10.1.2.3:5601"
    wildcard = advertised_endpoint("tcp://0.0.0.0:5601", "", "127.0.0.1")
    assert wildcard == "tcp://127.0.0.1:5601"  # the machine's address toward Redis
    assert advertised_endpoint("tcp://0.0.0.0:5601", "tcp://{host}:{port}", "x") == \
        f"tcp://{socket.gethostname()}:5601"
    assert advertised_endpoint("tcp://0.0.0.0:5601", "tcp://worker-7.svc:7000", "x") == "tcp://worker-7.svc:7000"
    for template in ("tcp://0.0.0.0:{port}", "tcp://*:5601", "ipc:///tmp/w", "tcp://host"):
        with pytest.raises(RegistrationError):
            advertised_endpoint("tcp://0.0.0.0:5601", template, "x")
    with pytest.raises(RegistrationError, match="only tcp"):
        advertised_endpoint("ipc:///tmp/w", "", "x")


def test_a_wildcard_worker_on_a_host_without_a_resolvable_name_is_told_to_set_advertise(monkeypatch):
    """Neither a route toward Redis nor the host's own name gives an address: one clear error
    naming the setting, not a resolver traceback."""
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(RegistrationError, match="set worker.advertise") as err:
        advertised_endpoint("tcp://0.0.0.0:5601", "", "redis.invalid")
    assert "no-such-host.invalid" in str(err.value) and "redis.invalid" in str(err.value)


def test_a_worker_advertising_a_wildcard_is_a_configuration_error(tmp_path, redis_url):
    with pytest.raises(ConfigError, match="worker.advertise"):  # as the configuration loads
        write_config(tmp_path, 0, worker={**DISCOVERY, "advertise": "tcp://*:{port}"}, redis_url=redis_url)
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_url)
    cfg.worker.advertise = "tcp://*:{port}"  # set past the loader: the worker still refuses it
    with pytest.raises(ConfigError, match="worker.advertise"):
        Worker(cfg, "tcp://127.0.0.1:*", "w", updates=False)


def test_worker_ids_and_keys_stay_in_one_slot_each():
    assert worker_id_of("", 2) == "worker-2"
    assert worker_id_of("pod-{index}", 5) == "pod-5"
    reg = keys.worker_registration("worker-abc")
    assert key_slot(reg.encode()) == key_slot(b"worker-abc") and "{worker-abc}" in reg
    for bad in ("a{b}", "x y", "{ip}"):
        with pytest.raises(ConfigError, match="worker.*id"):
            load_config(env={}, overrides={"worker": {"id": bad}})
    with pytest.raises(ConfigError, match="registration_ttl_ms"):
        load_config(env={}, overrides={"worker": {"register_interval_ms": 1000, "registration_ttl_ms": 1500}})


def test_learnmesh_up_lets_the_gateway_discover_its_workers(tmp_path: Path):
    cfg = load_config(env={}, overrides={"redis": {"url": "redis://127.0.0.1:1/0"}})
    paths = supervisor.child_configs(cfg, Namespace(workers=3, ranks=1), tmp_path, {"demo": "k" * 24}, "a" * 24)
    gateway = yaml.safe_load(paths["gateway"].read_text())["worker"]
    worker = yaml.safe_load(paths["worker"].read_text())["worker"]
    assert gateway["endpoints"] == [] and gateway["discovery"]
    assert len(worker["endpoints"]) == 3 and worker["register"]  # each binds its own, then announces it


def test_every_zeromq_endpoint_binds_loopback_unless_configured_otherwise():
    cfg = load_config(env={})
    for where, endpoint in (("worker.endpoints", cfg.worker.endpoints[0]),
                            ("trainer.samples_endpoint", cfg.trainer.samples_endpoint),
                            ("security.delta_pub_endpoint", cfg.security.delta_pub_endpoint),
                            ("security.snapshot_endpoint", cfg.security.snapshot_endpoint),
                            ("security.ack_endpoint", cfg.security.ack_endpoint)):
        assert bind_address(endpoint, cfg.zmq.bind_host).startswith("tcp://127.0.0.1:"), where
    assert cfg.gateway.host == cfg.metrics.bind_host == "127.0.0.1"
    assert bind_address("tcp://trainer:5611", "0.0.0.0") == "tcp://0.0.0.0:5611"
    assert bind_address("ipc:///run/x", "0.0.0.0") == "ipc:///run/x"


@pytest.mark.parametrize(("bind_host", "endpoint", "warned"), [
    ("", "tcp://0.0.0.0:*", True),  # Redis on loopback: its address toward Redis is 127.0.0.1
    ("0.0.0.0", "tcp://127.0.0.1:*", True),  # every interface bound, the loopback name announced
    ("", "tcp://127.0.0.1:*", False),  # loopback bound and announced: a one-host mesh
])
def test_a_worker_listening_beyond_loopback_but_announcing_loopback_says_so(tmp_path, redis_url, caplog,
                                                                          bind_host, endpoint, warned):
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_url, extra={"zmq": {"bind_host": bind_host}})
    caplog.set_level("WARNING", logger="learnmesh.worker")
    worker = Worker(cfg, endpoint, "w", updates=False)
    try:
        port = worker.endpoint.rsplit(":", 1)[1]
        assert worker.advertised == f"tcp://127.0.0.1:{port}"
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ([f"worker w listens on tcp://0.0.0.0:{port} but announces tcp://127.0.0.1:{port}, which "
                          "only gateways on the worker's own machine can reach: set worker.advertise (e.g. tcp://{host}:{port}) "
                          "to an address other hosts reach"] if warned else [])
    finally:
        worker.sock.close(linger=0)


def test_a_worker_binding_every_interface_announces_the_name_it_is_configured_with(tmp_path, redis_url):
    _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=redis_url,
                          extra={"zmq": {"bind_host": "0.0.0.0"}})
    port = free_port()
    worker = Worker(cfg, f"tcp://worker-a.example:{port}", "w", updates=False)
    try:
        assert worker.endpoint == f"tcp://0.0.0.0:{port}"
        assert worker.advertised == f"tcp://worker-a.example:{port}"
    finally:
        worker.sock.close(linger=0)


# redis-py's asyncio cluster client drops a lost master from its map without closing the
# connection it held to it (aclose() closes the nodes still mapped). The drill runs on an event
# loop of its own, so that connection is collected here, where it belongs, once the loop is
# closed, rather than warned of at the end of the run.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_announcements_on_a_lost_master_keep_their_workers_and_the_others_are_followed(tmp_path, caplog):
    """A cluster master lost with its replicas holds some workers' announcements. The others are
    read and followed as ever (a worker started now joins), and a worker whose announcement
    cannot be read keeps its place while it answers: the read failed as a whole, so no worker
    joined or left, and once the cluster answered "slot not served" the live worker on it was
    taken for one that withdrew and left the pool."""
    async def drill() -> None:
        cluster = LocalCluster(masters=3, replicas=0, options=("--cluster-require-full-coverage", "no")).start()
        ctx = zmq.asyncio.Context()
        fakes: list[FakeWorker] = []
        try:
            _, cfg = write_config(tmp_path, 0, worker=DISCOVERY, redis_url=cluster.url)
            sync = redis_sync.RedisCluster.from_url(cluster.seed_url)

            def owner(key: str) -> int:
                return int(sync.nodes_manager.get_node_from_slot(key_slot(key.encode())).port)

            def master_of(worker_id: str) -> int:
                return owner(keys.worker_registration(worker_id))

            index_master = owner(keys.WORKERS_INDEX)
            names = [f"w{i}" for i in range(200)]
            lost = next(n for n in names if master_of(n) != index_master)
            others = [n for n in names if master_of(n) not in (master_of(lost),)][:3]
            endpoints = {w: f"tcp://127.0.0.1:{free_port()}" for w in (lost, *others)}
            for worker_id in (lost, others[0]):
                fakes.append(FakeWorker(ctx, cfg, endpoints[worker_id], worker_id))
                worker_registry.register(sync, Registration(worker_id, endpoints[worker_id], heartbeat_ms=now_ms()),
                                         ttl_ms=600_000)
            redis = async_client(RedisConfig(url=cluster.url))
            pool = await _started_pool(cfg, redis, caplog)
            try:
                await pool.wait_live(2, timeout_s=30)
                victim = master_of(lost)
                close_sync(sync)  # a blocking cluster client forgets a lost node's pool: closed before
                cluster.kill(next(node for node in cluster.nodes if node.port == victim))
                live = next(node for node in cluster.running())
                sync = redis_sync.RedisCluster.from_url(f"redis://{live.address}/0")

                def flagged_failed() -> bool:
                    with live.client(socket_timeout=2) as c:
                        nodes = c.execute_command("CLUSTER", "NODES")
                    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
                    return any(f":{victim}@" in line and ",fail" in line and "fail?" not in line
                               for line in text.splitlines())

                for worker_id in others[1:]:  # started while that master is down: each joins
                    if worker_id == others[-1]:  # the last once the cluster has flagged that master failed
                        await wait_for(lambda: asyncio.to_thread(flagged_failed), timeout_s=30,
                                       what="the cluster to flag the master failed")
                    fakes.append(FakeWorker(ctx, cfg, endpoints[worker_id], worker_id))
                    # in a thread: the blocking client may wait on the lost master, the pool must not
                    await asyncio.to_thread(worker_registry.register, sync, Registration(
                        worker_id, endpoints[worker_id], heartbeat_ms=now_ms()), ttl_ms=600_000)
                    await wait_for(lambda w=worker_id: endpoints[w] in {link.endpoint for link in pool.live()},
                                   timeout_s=30, what=f"{worker_id} to join while a master is down")
                link = next(link for link in pool.links if link.worker_id == lost)
                assert link.alive and link.unannounced_since is None
                assert _endpoints(pool) == set(endpoints.values())
            finally:
                await pool.close()
                await redis.aclose()
                close_sync(sync)
        finally:
            for fake in fakes:
                await fake.close()
            ctx.destroy(0)
            cluster.stop()

    asyncio.run(drill())
    gc.collect()
