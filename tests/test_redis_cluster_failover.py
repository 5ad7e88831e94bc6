"""Failover drills on a real Redis Cluster (3 masters + 3 replicas, a cluster of this file's own):
a master killed with SIGKILL under a gateway's load (what must hold: tests/failover_drill.py), and
a pub/sub subscriber whose node dies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from shared.redis_local_cluster import LocalCluster, Node
from tests.conftest import wait_for
from tests.failover_drill import failover_drill


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
