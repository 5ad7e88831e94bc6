"""Under uvloop (the gateway's event loop) a write on a connection whose socket is already
closed raises RuntimeError where asyncio raises OSError; learnmesh's clients make it redis-py's
ConnectionError: the gateway answers it with 503, a cluster client retries it, and the next
command goes out on a fresh connection.
Real Redis, single server and cluster."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.redis_client import AsyncRedis


def _open_connections(client: AsyncRedis) -> list[Any]:
    if isinstance(client, aioredis.RedisCluster):
        return [c for node in client.get_nodes() for c in node._connections if c.is_connected]
    return [c for c in client.connection_pool._available_connections if c.is_connected]


def test_a_connection_closed_underneath_is_a_connection_error_and_retried(redis_target) -> None:
    async def scenario() -> bytes | None:
        client = redis_target.async_client()
        try:
            await client.set("lm:test:uvloop", "kept")
            closed = _open_connections(client)
            assert closed, "the client holds an open connection"
            for conn in closed:
                conn._writer.transport.abort()  # what a reset socket leaves behind
            try:
                return await client.get("lm:test:uvloop")  # a cluster client retries by itself
            except RedisConnectionError:
                return await client.get("lm:test:uvloop")  # the broken connection was dropped
        finally:
            await client.aclose()

    assert uvloop.run(scenario()) == b"kept"
