"""Under uvloop (the gateway's event loop) a write on a connection whose socket is already
closed raises RuntimeError where asyncio raises OSError; learnmesh's clients make it redis-py's
ConnectionError: the gateway answers it with 503, a cluster client retries it, and the next
command goes out on a fresh connection. So does a write on a connection another task
disconnected meanwhile (redis-py leaves an AttributeError there).
Real Redis, single server and cluster."""

from __future__ import annotations

import asyncio
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


def test_a_connection_disconnected_during_a_write_is_a_connection_error(redis_target) -> None:
    """A cluster client that finds a node failing disconnects all of that node's connections,
    one still in its handshake included: the handshake's write then finds no stream writer.
    That must read as a lost connection (503, retried), not an internal error."""

    async def scenario() -> BaseException | None:
        client = redis_target.async_client(socket_timeout=5)
        try:
            await client.ping()
            conn = _open_connections(client)[0]
            # The write runs on a later loop turn (inside wait_for): disconnect before it does.
            write = asyncio.ensure_future(conn.send_packed_command(conn.pack_command("PING"), check_health=False))
            await asyncio.sleep(0)
            await conn.disconnect(nowait=True)
            try:
                await write
            except BaseException as exc:  # noqa: BLE001 - what escapes is the point
                return exc
            return None
        finally:
            await client.aclose()

    escaped = asyncio.run(scenario())
    assert isinstance(escaped, RedisConnectionError), repr(escaped)
