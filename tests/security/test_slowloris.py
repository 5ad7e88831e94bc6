"""Slowloris: connections that never finish their headers, or their body, are closed by a real
gateway within its configured read deadlines (gateway/transports/http_protocol.py), while a
request that is merely slow to be answered keeps its connection."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from raw_http import WAIT_S, connection, read_response, read_until_closed

from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import start_gateway, stop

DEADLINE_S = 0.5  # small, so the test waits little; the waits below allow far longer
ACCEPT = "application/json, text/event-stream"
LEGACY = "2025-11-25"


class Gateway:
    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.mcp = f"http://127.0.0.1:{port}/mcp"
        self.log = log


@pytest.fixture(scope="module")
def gw(redis_target_module: RedisTarget, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    port = free_port()
    log = tmp_path_factory.mktemp(f"slowloris-{redis_target_module.kind}") / "gateway.log"
    with log.open("wb") as out:
        proc = start_gateway(port, redis_target_module.url, output=out, overrides={
            "gateway": {"header_timeout_s": DEADLINE_S, "body_timeout_s": DEADLINE_S}})
        yield Gateway(port, log)
        stop(proc)


def test_unfinished_headers_are_closed(gw: Gateway) -> None:
    socks = [socket.create_connection(("127.0.0.1", gw.port), timeout=WAIT_S) for _ in range(20)]
    try:
        for i, s in enumerate(socks):
            s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow-%d: a" % i)
        for s in socks:
            answer = read_until_closed(s)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("trickle", [b"", b"\r\n"], ids=["silent", "bare-crlf"])
def test_connections_that_send_no_request_are_closed(gw: Gateway, trickle: bytes) -> None:
    with connection(gw.port) as s:
        s.sendall(trickle)
        assert read_until_closed(s) == b""


def test_unfinished_body_is_cut_off_without_an_error_logged(gw: Gateway) -> None:
    with connection(gw.port) as s:
        s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Accept: application/json\r\nContent-Length: 100\r\n\r\n{\"jsonrpc\"")
        answer = read_until_closed(s)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    # a request served after the cut-off one is logged in order; nothing before it may be an error
    assert httpx.post(gw.mcp, json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                    "params": {"name": "t_crash", "arguments": {},
                                               "_meta": _modern_meta()}},
                      headers=_modern_headers("tools/call", "t_crash")).status_code == 200
    wait_for_sync(lambda: "secret internal detail" in gw.log.read_text(errors="replace"), timeout_s=WAIT_S,
                  what="the crash to reach the log (proof the log is captured)")
    before_crash = gw.log.read_text(errors="replace").split("internal error while serving")[0].rsplit("\n", 1)[0]
    assert "Exception in ASGI application" not in before_crash and "Traceback" not in before_crash, before_crash


def test_a_request_slow_to_answer_keeps_its_connection(gw: Gateway) -> None:
    """A legacy tools/call waiting for the client's sampling answer sends nothing and receives
    nothing for longer than the header deadline: it must still get its result."""
    init = httpx.post(gw.mcp, headers={"accept": ACCEPT}, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {"sampling": {}},
                   "clientInfo": {"name": "t", "version": "1"}}})
    sid = init.headers["mcp-session-id"]
    headers = {"accept": ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": LEGACY}
    events: list[dict[str, Any]] = []
    asked = threading.Event()

    def call() -> None:
        with httpx.stream("POST", gw.mcp, headers=headers, timeout=WAIT_S, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "t_ask", "arguments": {}}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip():
                    events.append(orjson.loads(line[5:]))
                    asked.set()

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert asked.wait(WAIT_S), "the tool did not ask the client"
        # a clock without sleeping: once a fresh slowloris connection has been closed, the
        # header deadline has passed for the waiting call too
        with connection(gw.port) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            read_until_closed(s)
        question = events[0]
        answered = httpx.post(gw.mcp, headers=headers, json={
            "jsonrpc": "2.0", "id": question["id"],
            "result": {"role": "assistant", "content": {"type": "text", "text": "late"}, "model": "m"}})
        assert answered.status_code == 202, answered.text
    finally:
        caller.join(WAIT_S)
    assert not caller.is_alive()
    assert events[-1] == {"jsonrpc": "2.0", "id": 2, "result": {"content": [{"type": "text", "text": "got late"}]}}


def test_keep_alive_requests_are_served(gw: Gateway) -> None:
    with connection(gw.port) as s:
        for _ in range(3):
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, _, body = read_response(s)
            assert status == 200 and orjson.loads(body) == {"status": "ok"}


def _modern_meta() -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


def _modern_headers(method: str, name: str) -> dict[str, str]:
    return {"accept": ACCEPT, "mcp-protocol-version": "2026-07-28", "mcp-method": method, "mcp-name": name}
