"""A 2026-07-28 ``subscriptions/listen`` stream whose client does not keep up: once more
notifications wait for it than its queue holds, the stream ends, answered with its result (as on
shutdown) so the client listens again and re-lists, rather than dropping notes and going on with
gaps. Live gateway, real Redis; the notes arrive over the control channel as another replica's
would, and the client is a socket that stops reading."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import redis as redis_sync

from shared import keys
from tests.gateway_support import LoggedGateway, logged_gateway
from tests.test_gateway_http import modern
from tests.waiting import wait_for_sync

URI = "test://r/" + "x" * 8000  # large notes fill the socket's buffers sooner
NOTES = 3000  # past the socket buffers (a few MB) and the stream's queue (1000)
WAIT_S = 30.0


@pytest.fixture(scope="module")
def gateway(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedGateway]:
    with logged_gateway(redis_server, tmp_path_factory.mktemp("listen") / "gateway.log") as gw:
        yield gw


def listen_request(port: int) -> bytes:
    body, headers = modern("subscriptions/listen", {"notifications": {"resourceSubscriptions": [URI]}}, rid=7)
    data = json.dumps(body).encode()
    lines = ["POST /mcp HTTP/1.1", f"host: 127.0.0.1:{port}", "content-type: application/json",
             f"content-length: {len(data)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def read_until(sock: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    while marker not in got:
        chunk = sock.recv(1 << 20)
        assert chunk, got[-300:]
        got += chunk
    return got


def test_a_listen_stream_that_falls_behind_ends_with_its_result(gateway: LoggedGateway, redis_server: str) -> None:
    port = int(gateway.base.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(listen_request(port))
        read_until(sock, b"notifications/subscriptions/acknowledged")
        note = json.dumps({"t": "res", "p": "local", "u": URI}).encode()  # what a replica publishes
        publisher = redis_sync.Redis.from_url(redis_server)
        try:
            pipe = publisher.pipeline(transaction=False)
            for _ in range(NOTES):
                pipe.publish(keys.GATEWAY_CONTROL_CHANNEL, note)
            pipe.execute()
        finally:
            publisher.close()
        wait_for_sync(lambda: b"fell 1000 notifications behind" in gateway.log.read_bytes(), timeout_s=WAIT_S,
                      what="the gateway's warning that the stream fell behind")
        got = read_until(sock, b'"id":7,"result"')  # the stream's answer: the client listens again
        assert b'"error"' not in got
        assert got.count(b"notifications/resources/updated") < NOTES
    finally:
        sock.close()
