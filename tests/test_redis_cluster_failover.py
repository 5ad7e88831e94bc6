"""Failover drills on a real Redis Cluster (3 masters + 3 replicas, a cluster of this file's own):
a master killed with SIGKILL under a gateway's load (what must hold: tests/failover_drill.py), and
a pub/sub subscriber whose node dies.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis.exceptions import RedisError

from shared.redis_local_cluster import LocalCluster, Node
from tests.conftest import wait_for
from tests.failover_drill import _master_of, failover_drill


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(masters=3, replicas=1).start()
    try:
        yield c
    finally:
        c.stop()


async def test_a_killed_master_fails_over_under_load_and_loses_no_acknowledged_append(cluster, tmp_path) -> None:
    print((await failover_drill(cluster, cluster.url, tmp_path)).line())


def _subscribed_node(cluster: LocalCluster, channel: str) -> Node | None:
    """The node holding a subscription to ``channel`` (PUBSUB NUMSUB counts local subscribers)."""
    for node in cluster.running():
        with node.client(socket_timeout=2) as c:
            if dict(c.pubsub_numsub(channel)).get(channel.encode(), 0):
                return node
    return None


async def test_a_subscriber_whose_node_dies_follows_the_channel_on_another_node() -> None:
    from gateway.pubsub import follow
    from shared.config import RedisConfig
    from shared.redis_client import async_client

    channel = "lm:drill:channel"
    cluster = LocalCluster(masters=3, replicas=1).start()
    client = async_client(RedisConfig(url=cluster.url), socket_timeout=None)
    publisher = async_client(RedisConfig(url=cluster.url), socket_timeout=2)
    got: list[bytes] = []
    subscribed = asyncio.Event()
    lost: list[bool] = []

    async def on_subscribed() -> None:
        subscribed.set()

    task = asyncio.create_task(follow(client, channel, got.append, on_subscribed=on_subscribed,
                                      on_lost=lambda: lost.append(True), what="drill channel"))
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        await publisher.publish(channel, b"before")
        await wait_for(lambda: got == [b"before"], timeout_s=10, what="the first message")
        node = _subscribed_node(cluster, channel)
        assert node is not None
        subscribed.clear()
        cluster.kill(node)
        await asyncio.to_thread(cluster.wait_ok, 60)
        await asyncio.wait_for(subscribed.wait(), 20)
        assert lost == [True]
        assert _subscribed_node(cluster, channel) not in (None, node)

        async def delivered() -> bool:
            await publisher.publish(channel, b"after")  # a node that just failed over may still refuse it
            return b"after" in got
        await wait_for(delivered, timeout_s=20, interval_s=0.2, what="a message after the node died")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await publisher.aclose()
        cluster.stop()


PRINCIPALS = [f"p{i}" for i in range(12)]


async def _populate(url: str) -> dict[str, str]:
    """A legacy session, a context and an audit record for every principal (spread over the
    masters by their hash tags); returns each principal's session id."""
    from gateway.mcp.sessions import SessionRegistry
    from shared import audit
    from shared.config import ContextConfig, GatewayConfig, RedisConfig
    from shared.context import ContextStore
    from shared.redis_client import async_client

    redis = async_client(RedisConfig(url=url))
    try:
        registry, store = SessionRegistry(redis, redis, GatewayConfig()), ContextStore(redis, ContextConfig())
        sids = {}
        for p in PRINCIPALS:
            sids[p] = (await registry.create(p, "2025-11-25", {})).id
            await store.append(p, "c", "text", "user", b"hello")
            await audit.audit(redis, principal=p, action="drill.mark")
        assert set(await store.principals()) == set(PRINCIPALS)  # the stamps are written
        return sids
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()


async def _report_workers(url: str) -> list[str]:
    """Self-reports of 12 workers (spread over the masters by their keys), as workers write them."""
    from shared import keys
    from shared.config import RedisConfig
    from shared.redis_client import async_client

    redis = async_client(RedisConfig(url=url))
    try:
        names = [f"worker:drill-{i}" for i in range(12)]
        for name in names:
            await redis.hset(keys.component_status(name), mapping={"version": "0", "ts_ms": "1"})
            await redis.sadd(keys.STATUS_INDEX, name)
        return names
    finally:
        await redis.aclose()


def _admin_get(srv: Any, path: str, **params: Any) -> httpx.Response:
    from tests.admin_support import VIEWER_KEY, bearer

    return httpx.get(srv.url + path, params=params, headers=bearer(VIEWER_KEY), timeout=30)


def _partial(body: dict[str, Any], victim: Node) -> None:
    assert body["partial"] is True, body
    [lost] = body["unreachable"]
    assert lost["node"] == victim.address and lost["slots"], body


async def test_admin_listings_answer_with_the_masters_left_while_one_is_down() -> None:
    """A master killed with no replica to take over (`cluster-require-full-coverage no`): the
    listings over every master answer 200 with what the other masters hold, marked partial and
    naming the lost master and its slots; with every master down they answer 503."""
    from shared import keys
    from tests.admin_support import live_gateway

    cluster = LocalCluster(masters=3, replicas=0, options=("--cluster-require-full-coverage", "no")).start()
    try:
        sids = await _populate(cluster.url)
        victim = _master_of(cluster, keys.ctx_meta("p0"))
        lost = lambda key: _master_of(cluster, key).port == victim.port  # noqa: E731
        on_lost_session = {p for p in PRINCIPALS if lost(keys.session(p, sids[p]))}
        on_lost_shard = {p for p in PRINCIPALS if lost(keys.ctx_global_lru(keys.ctx_global_shard(p)))}
        on_lost_meta = {p for p in PRINCIPALS if lost(keys.ctx_meta(p))}
        on_lost_audit = {p for p in PRINCIPALS if lost(keys.audit_stream(p))}
        workers = await _report_workers(cluster.url)
        readable = set() if lost(keys.STATUS_INDEX) else {w for w in workers if not lost(keys.component_status(w))}
        with live_gateway(cluster.url, redis={"socket_timeout_s": 1.0}) as srv:
            full = (await asyncio.to_thread(_admin_get, srv, "/admin/sessions")).json()
            assert full["partial"] is False and full["unreachable"] == [] and full["count"] == len(PRINCIPALS)
            cluster.kill(victim)
            survivors = cluster.running()
            await wait_for(lambda: all(_flagged_failed(n, victim) for n in survivors), timeout_s=30,
                           what="the cluster to mark the master failed")

            sessions = await asyncio.to_thread(_admin_get, srv, "/admin/sessions")
            assert sessions.status_code == 200, sessions.text
            _partial(sessions.json(), victim)
            assert {s["principal"] for s in sessions.json()["sessions"]} == set(PRINCIPALS) - on_lost_session

            contexts = await asyncio.to_thread(_admin_get, srv, "/admin/contexts")
            assert contexts.status_code == 200, contexts.text
            _partial(contexts.json(), victim)
            rows = {r["principal"]: r["bytes"] for r in contexts.json()["principals"]}
            assert set(rows) == set(PRINCIPALS) - on_lost_shard
            assert {p for p, b in rows.items() if b is None} == on_lost_meta & set(rows)

            listed = await asyncio.to_thread(_admin_get, srv, "/admin/workers")
            assert listed.status_code == 200, listed.text  # the workers whose reports are readable
            _partial(listed.json(), victim)
            assert {f"worker:{w['id']}" for w in listed.json()["workers"]} & set(workers) == readable

            audit = await asyncio.to_thread(_admin_get, srv, "/admin/audit", action="drill.mark")
            assert audit.status_code == 200, audit.text
            _partial(audit.json(), victim)
            assert {e["principal"] for e in audit.json()["entries"]} == set(PRINCIPALS) - on_lost_audit

            summary = await asyncio.to_thread(_admin_get, srv, "/admin/summary")
            assert summary.status_code == 200, summary.text  # the dashboard shows what it can
            body = summary.json()
            for part in ("sessions", "contexts"):  # partial, or not read at all (a key of the lost master)
                if part not in body["unavailable"]:
                    _partial(body[part], victim)
            assert all(body[part] is None for part in body["unavailable"]), body
            assert "who" not in body["unavailable"] and len(body["unavailable"]) < 9, body

            for node in survivors:
                cluster.kill(node)
            for path in ("/admin/sessions", "/admin/contexts", "/admin/audit", "/admin/workers", "/admin/summary"):
                gone = await asyncio.to_thread(_admin_get, srv, path)
                assert gone.status_code == 503, (path, gone.text)
    finally:
        cluster.stop()


async def test_with_full_coverage_off_a_master_lost_for_good_leaves_the_others_served() -> None:
    """The Kubernetes redis.conf (`cluster-require-full-coverage no`): a master killed with no
    replica to take over. The principals on the other masters are still read and written, the
    gateway stays ready, and its listings show their share, marked partial."""
    from redis.exceptions import RedisClusterException

    from shared import keys
    from shared.config import ContextConfig, RedisConfig
    from shared.context import ContextStore
    from shared.redis_client import async_client
    from tests.admin_support import live_gateway

    cluster = LocalCluster(masters=3, replicas=0, options=("--cluster-require-full-coverage", "no")).start()
    redis = async_client(RedisConfig(url=cluster.url, socket_timeout_s=1.0))
    store = ContextStore(redis, ContextConfig())
    try:
        await _populate(cluster.url)
        victim = _master_of(cluster, keys.ctx_meta("p0"))
        lost = {p for p in PRINCIPALS if _master_of(cluster, keys.ctx_meta(p)).port == victim.port}
        assert lost != set(PRINCIPALS)
        with live_gateway(cluster.url, redis={"socket_timeout_s": 1.0}) as srv:
            cluster.kill(victim)
            survivors = cluster.running()
            await wait_for(lambda: all(_flagged_failed(n, victim) for n in survivors), timeout_s=30,
                           what="the cluster to mark the master failed")
            for p in PRINCIPALS:
                if p in lost:
                    with pytest.raises((RedisError, RedisClusterException, OSError)):
                        await store.append(p, "c", "text", "user", b"after")
                    continue
                await store.append(p, "c", "text", "user", b"after")
                window = await store.get_window(p, "c")
                assert [e.content for e in window.channels["text"]] == [b"hello", b"after"], p
            ready = await asyncio.to_thread(httpx.get, srv.url + "/readyz", timeout=10)
            assert ready.status_code == 200, ready.text
            contexts = await asyncio.to_thread(_admin_get, srv, "/admin/contexts")
            assert contexts.status_code == 200, contexts.text
            _partial(contexts.json(), victim)
            summary = await asyncio.to_thread(_admin_get, srv, "/admin/summary")
            assert summary.status_code == 200, summary.text
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()
        cluster.stop()


def _flagged_failed(node: Node, victim: Node) -> bool:
    """Whether ``node`` holds ``victim`` as failed (not only suspected: ``fail?``)."""
    with node.client(socket_timeout=1) as c:
        lines = c.execute_command("CLUSTER", "NODES")
    text = lines.decode() if isinstance(lines, bytes) else str(lines)
    return any(f":{victim.port}@" in line and "fail" in line.split()[2].split(",") for line in text.splitlines())


async def test_a_silent_master_costs_one_timeout_and_leaves_the_others_served() -> None:
    """A master that is frozen rather than dead (SIGSTOP: connections open, nothing answered —
    a frozen host, a cut network) and no replica to take over: the other masters' keys are still
    served (the frozen one was the client's default node), and listings over every master
    answer, partial, after one socket timeout instead of redis-py's retries of every key on the
    frozen master in turn (over a minute for the audit)."""
    from shared import audit, keys
    from shared.config import RedisConfig
    from shared.redis_client import Reach, async_client
    from tests.admin_support import live_gateway

    cluster = LocalCluster(masters=3, replicas=0, options=("--cluster-require-full-coverage", "no")).start()
    redis = async_client(RedisConfig(url=cluster.url), socket_timeout=1.0, socket_connect_timeout=1.0)
    victim: Node | None = None
    try:
        await _populate(cluster.url)
        await redis.initialize()
        default = redis.get_default_node()
        victim = next(n for n in cluster.nodes if n.port == default.port)
        names = [f"k{i}" for i in range(40)]
        elsewhere = [k for k in names if _master_of(cluster, k).port != victim.port]
        there = next(k for k in names if _master_of(cluster, k).port == victim.port)
        audited = {p for p in PRINCIPALS if _master_of(cluster, keys.audit_stream(p)).port != victim.port}
        with live_gateway(cluster.url, redis={"socket_timeout_s": 1.0}) as srv:
            victim.proc.send_signal(signal.SIGSTOP)
            with pytest.raises((RedisError, OSError)):
                await redis.get(there)
            for k in elsewhere:  # after the map was read again with the default node frozen
                await redis.set(k, "v")
                assert await redis.get(k) == b"v"
            reach = Reach(redis)
            entries = await asyncio.wait_for(audit.query(redis, action="drill.mark", reach=reach), 30)
            assert [u["node"] for u in reach.as_json()["unreachable"]] == [victim.address]
            assert {e["principal"] for e in entries} == audited
            for path in ("/admin/audit", "/admin/sessions", "/admin/contexts", "/admin/summary"):
                resp = await asyncio.to_thread(_admin_get, srv, path)  # its 30 s timeout: a hang fails here
                assert resp.status_code == 200, (path, resp.text)
                body = resp.json()
                if path == "/admin/summary":
                    assert body["unavailable"] or body["sessions"]["partial"] or body["contexts"]["partial"], body
                else:
                    _partial(body, victim)
    finally:
        if victim is not None:
            victim.proc.send_signal(signal.SIGCONT)
        await redis.aclose()
        cluster.stop()
