"""Long-lived waits on Redis (GET /mcp event streams, WebSocket sessions, server->client requests
awaiting an answer) each hold a connection of the replica's blocking pool for their life. On a live
gateway with a small ``redis.max_connections``: once the streams of all principals together fill
that pool, one more is refused at once with 503 + Retry-After (not a stream that ends as it opens,
which its client would reopen in a loop), while ordinary requests are served and the pub/sub
channels (control, tasks) still resubscribe after losing their connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import httpx
import pytest
import redis as redis_sync
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from shared import keys
from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop
from tests.test_gateway_http import ACCEPT, modern, rpc
from tests.waiting import wait_for_sync

POOL = 10
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
WAIT_S = 15.0


@pytest.fixture(scope="module")
def port(redis_server: str) -> Iterator[int]:
    p = free_port()
    proc = start_gateway(p, redis_server, api_keys=f"alice:{ALICE},bob:{BOB}",
                         overrides={"redis": {"max_connections": POOL}})
    yield p
    stop(proc)


def session(port: int, key: str) -> str:
    r = httpx.post(f"http://127.0.0.1:{port}/mcp", headers={"accept": ACCEPT, "authorization": f"Bearer {key}"},
                   json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                           "clientInfo": {"name": "t", "version": "1"}}))
    return r.headers["mcp-session-id"]


def stream_request(port: int, key: str, sid: str) -> bytes:
    return (f"GET /mcp HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\naccept: text/event-stream\r\n"
            f"authorization: Bearer {key}\r\nmcp-session-id: {sid}\r\nmcp-protocol-version: 2025-11-25\r\n\r\n").encode()


@contextlib.contextmanager
def open_streams(port: int, key: str, n: int) -> Iterator[list[socket.socket]]:
    """``n`` GET streams of ``key``'s sessions, each open (its first event received)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
            socks.append(sock)
            sock.sendall(stream_request(port, key, session(port, key)))
            got = b""
            while b"data: \n\n" not in got:
                chunk = sock.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got
        yield socks
    finally:
        for sock in socks:
            sock.close()


def get_stream(port: int, key: str) -> httpx.Response:
    with httpx.stream("GET", f"http://127.0.0.1:{port}/mcp", timeout=WAIT_S,
                      headers={"accept": "text/event-stream", "authorization": f"Bearer {key}",
                               "mcp-session-id": session(port, key), "mcp-protocol-version": "2025-11-25"}) as r:
        if r.status_code != 200:
            r.read()
        return r


def subscribers(redis_url: str, channel: str) -> int:
    client = redis_sync.Redis.from_url(redis_url)
    try:
        return int(dict(client.pubsub_numsub(channel))[channel.encode()])
    finally:
        client.close()


def test_streams_past_the_pool_are_refused_and_nothing_else_is_starved(port: int, redis_server: str) -> None:
    with open_streams(port, ALICE, POOL) as streams:
        refused = get_stream(port, BOB)  # another principal: the pool is the replica's
        assert refused.status_code == 503, (refused.status_code, refused.headers)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == -32050 and "max_connections" in refused.json()["error"]["message"]
        with pytest.raises(InvalidStatus) as handshake, ws_connect(
                f"ws://127.0.0.1:{port}/mcp/ws", subprotocols=["mcp"], open_timeout=WAIT_S,
                additional_headers={"authorization": f"Bearer {BOB}"}):
            pass
        assert handshake.value.response.status_code == 503
        body, headers = modern("tools/list")
        for _ in range(20):  # ordinary requests are served all the while
            r = httpx.post(f"http://127.0.0.1:{port}/mcp", json=body, timeout=WAIT_S,
                           headers={**headers, "authorization": f"Bearer {BOB}"})
            assert r.status_code == 200 and r.json()["result"]["tools"], r.text
        # the channels lose their connections and get new ones, the pool of streams full as it is
        admin = redis_sync.Redis.from_url(redis_server)
        try:
            admin.client_kill_filter(_type="pubsub")
        finally:
            admin.close()
        for channel in (keys.GATEWAY_CONTROL_CHANNEL, keys.TASKS_CHANNEL):
            wait_for_sync(lambda ch=channel: subscribers(redis_server, ch) >= 1, timeout_s=WAIT_S,
                          what=f"a subscriber of {channel} again")
        streams.pop().close()  # one stream ends: its connection serves the next one
        wait_for_sync(lambda: get_stream(port, BOB).status_code == 200, timeout_s=WAIT_S,
                      what="a stream opened once another closed")


def test_a_small_pool_serves_bursts_of_context_calls_beside_its_automatic_pipelines(redis_server: str) -> None:
    """The context store's and the limits' automatic pipelines keep their connections between
    batches; ``redis.max_connections`` is what the requests may hold beside them, so a pool of 2
    serves a burst of appends and reads with none refused for want of a connection, and sessions
    start after it."""
    p = free_port()
    proc = start_gateway(p, redis_server, api_keys=f"alice:{ALICE},bob:{BOB}",
                         overrides={"redis": {"max_connections": 2}})
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=WAIT_S) as client:
                async def call(i: int) -> httpx.Response:
                    key = (ALICE, BOB)[i % 2]
                    name, arguments = (("context_append", {"context_id": f"c{i % 5}", "modality": "text",
                                                           "text": f"turn {i}"}) if i % 3 else
                                       ("context_get", {"context_id": "c0"}))
                    body, headers = modern("tools/call", {"name": name, "arguments": arguments}, rid=i)
                    return await client.post("/mcp", json=body, headers={**headers, "authorization": f"Bearer {key}"})
                for i in (5, 10):  # appends to c0 of bob and of alice: it exists before any read of it
                    assert (await call(i)).status_code == 200
                return await asyncio.gather(*(call(i) for i in range(96)))

        for r in asyncio.run(burst()):
            assert r.status_code == 200, (r.status_code, r.text)
            result = r.json()["result"]
            assert not result.get("isError"), result
        assert session(p, ALICE) and session(p, BOB)
    finally:
        stop(proc)
