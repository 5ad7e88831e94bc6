"""Long-lived waits on Redis (GET /mcp event streams, WebSocket sessions, server->client requests
awaiting an answer) each hold a connection of the replica's blocking pool for their life. On a live
gateway with a small ``redis.max_connections``: once the streams of all principals together fill
that pool, one more is refused at once with 503 + Retry-After (not a stream that ends as it opens,
which its client would reopen in a loop), while ordinary requests are served and the pub/sub
channels (control, tasks) still resubscribe after losing their connection."""

from __future__ import annotations

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
