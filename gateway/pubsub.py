"""Following a Redis pub/sub channel for the life of a replica: the one reconnect loop behind
the control channel (gateway/state.py) and the tasks channel (gateway/tasks.py).

On a Redis Cluster a classic PUBLISH reaches every node, replicas included, so a subscriber
needs one plain connection to any node: each (re)subscription takes the next node of the
cluster's map, so a node that died (or was failed over) is left for the next one at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisClusterException, RedisError

from shared.aio import pause, stop_if_cancelled
from shared.redis_client import AsyncRedis, node_client

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
POLL_S = 1.0


async def follow(redis: AsyncRedis, channel: str, on_message: Callable[[bytes], None], *,
                 on_subscribed: Callable[[], Awaitable[None]], on_lost: Callable[[], None], what: str) -> None:
    """Hand every message published on ``channel`` to ``on_message`` until cancelled, subscribing
    again with backoff when Redis goes away. Messages published while unsubscribed are lost:
    ``on_subscribed`` runs after every (re)subscription so the caller can catch up on what they
    would have said; ``on_lost`` runs when the subscription breaks. ``redis`` must have no
    socket timeout (a quiet channel is not a dead one)."""
    backoff_s = FIRST_BACKOFF_S
    attempt = 0
    while True:
        pubsub: PubSub | None = None
        node: aioredis.Redis | None = None
        try:
            pubsub, node = await _subscriber(redis, attempt)
            await pubsub.subscribe(channel)
            await on_subscribed()
            backoff_s = FIRST_BACKOFF_S
            while True:
                stop_if_cancelled()
                msg = await pubsub.get_message(timeout=POLL_S)
                if msg is not None and msg.get("type") == "message":
                    on_message(msg["data"])
        except asyncio.CancelledError:
            raise
        except (RedisError, RedisClusterException, OSError) as exc:
            on_lost()
            attempt += 1
            log.warning("%s lost (%s); retrying", what, type(exc).__name__)
        finally:
            with contextlib.suppress(Exception):
                if pubsub is not None:
                    await pubsub.aclose()
                if node is not None:
                    await node.aclose()
        await pause(backoff_s)
        backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)


async def _subscriber(redis: AsyncRedis, attempt: int) -> tuple[PubSub, aioredis.Redis | None]:
    """A pub/sub of ``redis``; on a cluster, of the ``attempt``-th node of its map (and that
    node's own client, for the caller to close)."""
    if not isinstance(redis, aioredis.RedisCluster):
        return redis.pubsub(ignore_subscribe_messages=True), None
    await redis.initialize()
    nodes = sorted(redis.get_nodes(), key=lambda n: n.name)
    node = node_client(redis, nodes[attempt % len(nodes)])
    return node.pubsub(ignore_subscribe_messages=True), node
