"""Unauthenticated memory exhaustion: one body limit for every route, enforced before routing
and before the body is read, and admin authentication before the body
(gateway/transports/edge.py). The gateway must answer while the attacker is still sending."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import orjson
import pytest
from raw_http import connection, read_response, read_until_closed
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from gateway.admin.auth import admin_key_required
from gateway.transports.http_protocol import LINGER_MAX_BYTES
from tests.conftest import RedisTarget, free_port
from tests.gateway_support import start_gateway, stop

LIMIT = 64 * 1024
HEADER_LIMIT = 16 * 1024
ADMIN_KEY = "admin-key-0123456789"
MCP_KEY = "mcp-key-0123456789"
HUGE = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def port(redis_target_module: RedisTarget) -> Iterator[int]:
    p = free_port()
    proc = start_gateway(p, redis_target_module.url, overrides={"gateway": {
        "max_body_bytes": LIMIT, "max_header_bytes": HEADER_LIMIT,
        "admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"}}}})
    yield p
    stop(proc)


def _head(method: str, path: str, *lines: str) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + "".join(f"{line}\r\n" for line in lines) + "\r\n").encode()


@pytest.mark.parametrize("path", ["/admin/keys", "/admin/samples", "/admin/config", "/admin/no-such-route"])
def test_unauthenticated_admin_upload_is_refused_before_its_body(port: int, path: str) -> None:
    """Headers only, within the limit: the 401 must come without the gateway waiting for the body."""
    with connection(port) as s:
        s.sendall(_head("POST", path, f"Content-Length: {LIMIT - 1}"))
        status, headers, body = read_response(s)
        assert status == 401 and headers["www-authenticate"] == "Bearer", body
        assert headers["connection"] == "close"
        assert read_until_closed(s) == b""


@pytest.mark.parametrize("path,auth", [("/admin/keys", ""), ("/admin/keys", ADMIN_KEY), ("/mcp", ""),
                                       ("/healthz", "")])
def test_declared_huge_body_is_refused_at_once(port: int, path: str, auth: str) -> None:
    """64 MiB announced, 1 KiB sent: 413 while the rest is still unsent, and the connection ends."""
    lines = [f"Content-Length: {HUGE}"] + ([f"Authorization: Bearer {auth}"] if auth else [])
    with connection(port) as s:
        s.sendall(_head("POST", path, *lines) + b"x" * 1024)
        status, headers, body = read_response(s)
        assert status == 413 and headers["connection"] == "close", body
        if path == "/mcp":  # MCP clients read a JSON-RPC error
            assert orjson.loads(body)["error"]["code"] == -32600
        assert read_until_closed(s) == b""


@pytest.mark.parametrize("path", ["/mcp", "/admin/keys"])
def test_a_client_that_sends_its_whole_refused_body_still_reads_the_answer(port: int, path: str) -> None:
    """A client that writes its whole body before it reads (as HTTP client libraries do): the
    413 was sent while the body was still coming; a close then would reset the connection and
    discard the answer. The gateway drops the rest of the body and closes once the client has
    sent it, so the client reads the 413 and its JSON-RPC error."""
    lines = [f"Content-Length: {32 * LIMIT}", f"Authorization: Bearer {ADMIN_KEY}" if path != "/mcp" else "X-A: b"]
    with connection(port) as s:
        s.sendall(_head("POST", path, *lines))
        for _ in range(32 * LIMIT // 8192):
            s.sendall(b"x" * 8192)
        s.shutdown(socket.SHUT_WR)
        status, headers, body = read_response(s)
        assert status == 413 and headers["connection"] == "close", body
        if path == "/mcp":
            assert orjson.loads(body)["error"]["code"] == -32600
        assert read_until_closed(s) == b""


@pytest.mark.parametrize("path,auth", [("/admin/keys", ADMIN_KEY), ("/mcp", "")])
def test_chunked_body_is_cut_off_at_the_limit(port: int, path: str, auth: str) -> None:
    """A body whose length no header states: the gateway answers 413 once one byte past the
    limit has arrived, although the body never ends, and closes the connection."""
    lines = ["Transfer-Encoding: chunked", "Accept: application/json, text/event-stream"]
    lines += [f"Authorization: Bearer {auth}"] if auth else []
    chunk = 16 * 1024
    body = (b"%x\r\n" % chunk + b"a" * chunk + b"\r\n") * (LIMIT // chunk) + b"1\r\na\r\n"
    with connection(port) as s:
        s.sendall(_head("POST", path, *lines) + body)
        status, headers, answer = read_response(s)
        assert status == 413 and headers["connection"] == "close", answer
        assert read_until_closed(s) == b""


@pytest.mark.parametrize("path", ["/healthz", "/mcp", "/mcp/ws"])
def test_headers_past_their_limit_are_refused_while_they_are_sent(port: int, path: str) -> None:
    """A header that does not end: 431 once the request's headers pass ``max_header_bytes``,
    without waiting for the header deadline, and the connection ends (nothing more is buffered)."""
    with connection(port) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ".encode() + b"a" * (HEADER_LIMIT + 1024))
        status, headers, _ = read_response(s, timeout_s=5)  # the header deadline is 10 s
        assert status == 431 and headers["connection"] == "close"
        assert read_until_closed(s) == b""
    # headers past the limit that arrive complete, in one segment: 431 all the same
    with connection(port) as s:
        s.sendall(_head("GET", path, "X-Big: " + "a" * (HEADER_LIMIT + 1024)))
        status, headers, _ = read_response(s, timeout_s=5)
        assert status == 431 and headers["connection"] == "close"
        assert read_until_closed(s) == b""
    # headers within the limit, the request split over many segments, are served
    with connection(port) as s:
        head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
            b"X-Big-%d: %s\r\n" % (i, b"b" * 1000) for i in range(HEADER_LIMIT // 1100)) + b"\r\n"
        for i in range(0, len(head), 1000):
            s.sendall(head[i:i + 1000])
        status, _, body = read_response(s)
        assert status == 200 and orjson.loads(body) == {"status": "ok"}


@pytest.fixture(scope="module")
def keyed_port(redis_server: str) -> Iterator[int]:
    """A gateway with an MCP key: /mcp refuses callers without it."""
    p = free_port()
    proc = start_gateway(p, redis_server, api_keys=f"alice:{MCP_KEY}", overrides={"gateway": {
        "max_body_bytes": LIMIT, "max_header_bytes": HEADER_LIMIT}})
    yield p
    stop(proc)


@pytest.mark.parametrize("method,path,lines,status", [
    ("POST", "/mcp", [], 401),  # no credentials
    ("POST", "/mcp", [f"Authorization: Bearer {MCP_KEY}", "Origin: http://attacker.example"], 403),
    ("PUT", "/mcp", [f"Authorization: Bearer {MCP_KEY}"], 405),
    ("DELETE", "/mcp", [f"Authorization: Bearer {MCP_KEY}", "Mcp-Session-Id: gone"], 404),
    ("POST", "/nowhere", [], 404),  # a route that reads no body
], ids=["unauthenticated", "foreign-origin", "method", "delete", "other-route"])
def test_an_answer_before_the_body_ends_the_connection(keyed_port: int, method: str, path: str, lines: list[str],
                                                       status: int) -> None:
    """Answered before its body was read, a request's connection is not kept for the next one:
    what the client still sends is dropped for a bounded linger, then the connection closes. Kept,
    it was read and dropped until the body deadline: an endless chunked body, gigabytes a second,
    from a client without a key."""
    with connection(keyed_port) as s:
        s.sendall(_head(method, path, "Transfer-Encoding: chunked", *lines))
        answered, headers, _ = read_response(s)
        assert answered == status and headers["connection"] == "close", (answered, headers)
        chunks = (b"%x\r\n" % 65536 + b"a" * 65536 + b"\r\n") * 16
        sent = 0
        with pytest.raises(OSError):  # reset or broken pipe: the gateway has closed
            while sent < 8 * LINGER_MAX_BYTES:
                s.sendall(chunks)
                sent += len(chunks)
        assert sent < 2 * LINGER_MAX_BYTES


def test_a_body_within_the_limit_is_served(port: int, redis_target_module: RedisTarget) -> None:
    redis_target_module.flush()
    payload = orjson.dumps({"name": "ops-1", "role": "viewer"})
    with connection(port) as s:
        s.sendall(_head("POST", "/admin/keys", f"Authorization: Bearer {ADMIN_KEY}",
                        f"Content-Length: {len(payload)}") + payload)
        status, _, body = read_response(s)
        assert status == 201, body


def test_websocket_message_over_the_limit_closes_the_socket(port: int) -> None:
    with ws_connect(f"ws://127.0.0.1:{port}/mcp/ws", subprotocols=["mcp"], open_timeout=10) as ws:
        ws.send("x" * (LIMIT + 1))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


@pytest.mark.parametrize("method,path,needed", [
    ("POST", "/admin/keys", True), ("GET", "/admin/summary", True), ("GET", "/admin", False), ("GET", "/admin/", False), ("POST", "/admin", True),
    ("GET", "/admin/ui", False), ("GET", "/admin/ui/app.js", False), ("HEAD", "/admin/openapi.json", False),
    ("POST", "/admin/ui", True), ("GET", "/admin/ui/../keys", True), ("GET", "/admin/ui/a/b", True),
    ("GET", "/administrator", False), ("POST", "/mcp", False)])
def test_which_paths_need_an_admin_key_before_the_body(method: str, path: str, needed: bool) -> None:
    assert admin_key_required(method, path) is needed
