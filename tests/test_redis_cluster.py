"""Redis Cluster mode of shared/redis_client.py against a real cluster (and one server)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis as redis_sync
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import keys
from shared.config import ConfigError, ContextConfig, RedisConfig
from shared.context.store import ContextStore
from shared.net import free_port
from shared.redis_client import (
    async_client,
    check_access,
    close_sync,
    for_each_primary,
    is_cluster,
    server_url,
    sync_client,
)
from tests.conftest import RedisTarget, wait_for


def test_cluster_is_named_by_scheme_or_key() -> None:
    assert is_cluster(RedisConfig(url="redis+cluster://h:7000/0"))
    assert is_cluster(RedisConfig(url="redis://h:7000/0", cluster=True))
    assert not is_cluster(RedisConfig(url="redis://h:7000/0"))
    assert server_url(RedisConfig(url="rediss+cluster://u:p@h:7000/0")) == "rediss://u:p@h:7000/0"
    assert server_url(RedisConfig(url="redis://h:1/0", cluster=True)) == "redis://h:1/0"


def test_tls_files_accept_a_tls_cluster_url() -> None:
    cfg = RedisConfig(url="rediss+cluster://h:7000/0", tls_ca_file="/ca.pem")
    assert cfg.tls_ca_file == "/ca.pem"


async def test_clients_and_every_primary(redis_target: RedisTarget) -> None:
    r = redis_target.async_client()
    try:
        assert isinstance(r, aioredis.RedisCluster) == redis_target.is_cluster
        for i in range(50):  # keys spread over every master of a cluster
            await r.set(f"k{i}", i)
        sizes = await for_each_primary(r, lambda node: node.dbsize())
        assert sum(sizes) == 50
        assert len(sizes) == (3 if redis_target.is_cluster else 1)
        assert all(n > 0 for n in sizes)
    finally:
        await r.aclose()
    sync = redis_target.sync_client()
    try:
        assert isinstance(sync, redis_sync.RedisCluster) == redis_target.is_cluster
        assert sync.get("k7") == b"7"
    finally:
        close_sync(sync)


async def test_a_cluster_client_whose_default_node_cannot_answer_serves_the_other_slots(
        redis_cluster: RedisTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a lost connection the client reads the slot map again; the command table it read
    once is not asked of the default node again (the first master of its map: it may be the one
    that is down, and that read failing used to fail every later command, live slots' too)."""
    r = redis_cluster.async_client()
    try:
        await r.set("k1", 1)
        default = r.get_default_node()
        real = AsyncClusterNode.execute_command

        async def down_for_command(node: AsyncClusterNode, *args: object, **kw: object) -> object:
            if node is default and args and args[0] == "COMMAND":
                raise RedisConnectionError(f"Error 111 connecting to {node.name}")
            return await real(node, *args, **kw)

        monkeypatch.setattr(AsyncClusterNode, "execute_command", down_for_command)
        r._initialize = True  # what a lost connection leaves
        assert await r.get("k1") == b"1"
    finally:
        await r.aclose()


def test_check_access(redis_target: RedisTarget) -> None:
    assert check_access(redis_target.config) is True
    gone = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", cluster=redis_target.is_cluster)
    assert check_access(gone, timeout_s=0.5) is False


def test_a_cluster_node_named_as_one_server_stops_the_process_with_one_line(redis_target: RedisTarget) -> None:
    """`redis://node:port` without `redis.cluster`: the first command on another node's slot would
    fail with MOVED deep inside a process's start; the check at start names the setting instead."""
    plain = redis_target.url.replace("+cluster://", "://", 1)
    if not redis_target.is_cluster:
        assert check_access(RedisConfig(url=plain)) is True
        return
    with pytest.raises(ConfigError, match=r"is a node of a Redis Cluster: set redis.cluster: true or a "
                                          r"redis\+cluster:// URL"):
        check_access(RedisConfig(url=plain))
    assert check_access(RedisConfig(url=plain, cluster=True)) is True


async def test_a_process_reaches_the_cluster_through_cluster_nodes_while_the_url_node_is_down(
        redis_target: RedisTarget) -> None:
    """The node `redis.url` names may be the master that just failed: a process (re)starting then
    reaches the cluster through `redis.cluster_nodes` (here the url names a port nothing answers)."""
    if not redis_target.is_cluster:
        with pytest.raises(ConfigError, match="cluster_nodes need a cluster"):
            RedisConfig(url=redis_target.url, cluster_nodes=["127.0.0.1:7000"])
        return
    live = redis_target.url.split("://", 1)[1].split("/", 1)[0]
    down = f"redis+cluster://127.0.0.1:{free_port()}/0"
    assert check_access(RedisConfig(url=down), timeout_s=0.5) is False
    cfg = RedisConfig(url=down, cluster_nodes=[live])
    assert check_access(cfg, timeout_s=5) is True
    sync = sync_client(cfg)
    try:
        sync.set("lm:{seed}:k", "v")
    finally:
        close_sync(sync)
    r = async_client(cfg)
    try:
        assert await r.get("lm:{seed}:k") == b"v"
    finally:
        await r.aclose()


def test_a_cluster_url_naming_a_single_server_stops_the_process_with_one_line(redis_target: RedisTarget) -> None:
    """`redis+cluster://` (or `redis.cluster: true`) pointed at a server without cluster mode: the
    cluster client cannot read a slot map there, which looks like an outage, and the process would
    wait for a cluster that never comes; the check at start names the setting instead."""
    if redis_target.is_cluster:
        return
    plain = RedisConfig(url=redis_target.url)
    for cfg in (RedisConfig(url=plain.url.replace("://", "+cluster://", 1)), RedisConfig(url=plain.url, cluster=True)):
        with pytest.raises(ConfigError, match=r"is a single server, not a node of a Redis Cluster: drop "
                                              r"redis.cluster or the \+cluster URL scheme"):
            check_access(cfg)
    assert check_access(plain) is True


def test_the_admin_config_shows_the_cluster_mode_a_cluster_url_selects(redis_cluster: RedisTarget) -> None:
    """A `redis+cluster://` URL alone selects cluster mode: a gateway started with it shows
    `redis.cluster: true` in its effective configuration, the mode it runs in."""
    from tests.admin_support import VIEWER_KEY, bearer, live_gateway

    assert redis_cluster.url.startswith("redis+cluster://")
    with live_gateway(redis_cluster.url) as srv:
        resp = httpx.get(srv.url + "/admin/config", headers=bearer(VIEWER_KEY), timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["config"]["redis"]["cluster"] is True
    assert resp.json()["config"]["redis"]["url"] == redis_cluster.url


async def test_a_resharding_leaves_the_context_writes_of_slots_that_stay_put_in_flight(
        redis_cluster: RedisTarget) -> None:
    """A resharding moves slots under a running gateway: its other commands meet MOVED, and
    redis-py's default answers every fifth MOVED by closing every connection of the client, those
    the context store's pipeline holds to masters whose slots never moved too. Appends in flight
    on them then failed with "redis closed the connection" (503 to a client whose master was fine)."""
    cluster = redis_cluster.cluster
    if cluster is None:
        pytest.skip("moves slots of a cluster of this test session's own")
    r = redis_cluster.async_client()
    store = ContextStore(r, ContextConfig(), redis_cfg=redis_cluster.config)
    try:
        await store.append("steady", "c", "text", "user", b"warm")
        steady_slot = r.keyslot(keys.ctx_meta("steady"))
        moved = [f"lm:{{reshard-{i}}}:k" for i in range(64) if r.keyslot(f"lm:{{reshard-{i}}}:k") != steady_slot][:8]
        for key in moved:
            await r.set(key, "v")  # the client's map now has these slots where they are
        primaries = cluster.primaries()
        for key in moved:
            owner = r.nodes_manager.get_node_from_slot(r.keyslot(key)).port
            target = next(node for node in primaries if node.port != owner)
            await asyncio.to_thread(cluster.move_slot, r.keyslot(key), target)

        failures: list[BaseException] = []
        appended = 0
        done = asyncio.Event()

        async def append_until_done() -> None:
            nonlocal appended
            while not done.is_set():
                try:
                    await store.append("steady", "c", "text", "user", b"x" * 32)
                    appended += 1
                except Exception as exc:  # noqa: BLE001 - every failure is the finding
                    failures.append(exc)

        writers = [asyncio.create_task(append_until_done()) for _ in range(16)]
        await wait_for(lambda: appended >= 16, timeout_s=10, what="appends under way")
        for key in moved:  # each meets MOVED: the map the client holds is stale for them
            assert await r.get(key) == b"v"
        at_last_redirect = appended
        await wait_for(lambda: appended >= at_last_redirect + 16, timeout_s=10, what="appends after the redirects")
        done.set()
        await asyncio.gather(*writers)
        assert [f"{type(exc).__name__}: {exc}" for exc in failures] == []
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await r.aclose()


async def test_a_closed_cluster_client_stays_closed(redis_cluster: RedisTarget) -> None:
    """redis-py reads the slot map again for a command sent after ``aclose()`` and opens new
    connections, which nothing closes then (a task still running as a process stops). learnmesh's
    cluster client refuses the command instead, as a lost connection, and opens nothing."""
    r = redis_cluster.async_client(client_name="lm-closed-cluster-client")
    await r.set("lm:{closed}:k", "v")
    await r.aclose()
    with pytest.raises(RedisConnectionError, match="closed"):
        await r.get("lm:{closed}:k")
    assert r.nodes_manager.default_node is None
    for node in redis_cluster.cluster.running() if redis_cluster.cluster else []:
        with node.client(socket_timeout=2) as c:
            assert not [x for x in c.client_list() if x.get("name") == "lm-closed-cluster-client"]
