"""The gateway's uvicorn protocol that sends each response in one write (gateway/transports/http_protocol.py):
the transport wrapper on its own, then a real gateway process serving keep-alive requests, a
WebSocket session (the upgraded connection keeps the wrapper) and a legacy session end to end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from gateway.transports.http_protocol import FLUSH_AT_BYTES, CoalescingTransport
from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_writes_of_one_iteration_leave_as_one() -> None:
    raw = FakeTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"")
    t.write(b"{}")
    assert raw.writes == [] and t.get_write_buffer_size() == 21
    await asyncio.sleep(0)
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
    t.write(b"a")
    t.close()  # close flushes what is pending first
    assert raw.writes[-1] == b"a" and raw.closed
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # everything else is the real transport's


async def test_large_output_is_not_held_back() -> None:
    raw = FakeTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"h")
    t.write(b"x" * FLUSH_AT_BYTES)  # the real transport's own buffer limits must see it at once
    assert raw.writes == [b"h" + b"x" * FLUSH_AT_BYTES] and t.get_write_buffer_size() == 0
    await asyncio.sleep(0)
    assert len(raw.writes) == 1


async def test_abort_drops_pending_writes() -> None:
    raw = FakeTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"never sent")
    t.abort()
    await asyncio.sleep(0)
    assert raw.writes == [] and raw.aborted


@pytest.fixture
def gateway(redis_url: str) -> Iterator[str]:
    port = free_port()
    proc = start_gateway(port, redis_url)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def test_keep_alive_websocket_and_legacy_session_through_the_protocol(gateway: str) -> None:
    url = f"http://{gateway}/mcp"
    head = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
            "mcp-method": "tools/call", "mcp-name": "t_echo"}
    with httpx.Client(timeout=10) as c:  # one connection: responses must not bleed into each other
        for i in range(6):
            args = {"text": f"n{i}"} if i % 2 else {}  # {} misses the required "text": rejected every time
            r = c.post(url, headers=head, content=orjson.dumps({
                "jsonrpc": "2.0", "id": i, "method": "tools/call",
                "params": {"name": "t_echo", "arguments": args, "_meta": META}}))
            assert int(r.headers["content-length"]) == len(r.content) and r.json()["id"] == i
            if i % 2:
                assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == f"local:n{i}"
            else:
                assert r.status_code == 400 and r.json()["error"]["code"] == -32602
        init = c.post(url, headers={"accept": "application/json, text/event-stream"}, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        sid = init.headers["mcp-session-id"]
        legacy = {"accept": "application/json, text/event-stream", "mcp-session-id": sid,
                  "mcp-protocol-version": "2025-11-25"}
        assert c.post(url, headers=legacy, json={"jsonrpc": "2.0", "id": 2, "method": "ping"}).json()["result"] == {}
        assert c.delete(url, headers=legacy).status_code == 200
        assert c.post(url, headers=legacy, json={"jsonrpc": "2.0", "id": 3, "method": "ping"}).status_code == 404
    with ws_connect(f"ws://{gateway}/mcp/ws", subprotocols=["mcp"], open_timeout=10) as ws:
        for i in range(3):
            ws.send(orjson.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                  "params": {"name": "t_echo", "arguments": {"text": "ws"}, "_meta": META}}).decode())
            got = orjson.loads(ws.recv(timeout=10))
            assert got["id"] == i and got["result"]["content"][0]["text"] == "local:ws"
