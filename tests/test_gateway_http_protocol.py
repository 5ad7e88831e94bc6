"""The gateway's uvicorn protocol that sends each response in one write (gateway/transports/http_protocol.py):
the transport wrapper on its own, the installed uvicorn serving the gateway with it (one write
per response, or the test fails), then a real gateway process serving keep-alive requests, a
WebSocket session (the upgraded connection keeps the wrapper) and a legacy session end to end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from websockets.sync.client import connect as ws_connect

from gateway.app import create_app
from gateway.server import uvicorn_settings
from gateway.transports.http_protocol import FLUSH_AT_BYTES, CoalescingTransport, GatewayHttpProtocol
from shared.config import load_config
from tests.conftest import RedisTarget, free_port, wait_for
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


class RecordingTransport:
    """The socket's transport as the coalescing wrapper sees it: every write it is handed."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def _response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    return head + await reader.readexactly(length)


async def test_the_installed_uvicorn_sends_each_response_in_one_write(redis_url: str) -> None:
    """GatewayHttpProtocol leans on uvicorn internals (HttpToolsProtocol's ``loop``
    and ``transport``, responses written through that transport within one loop iteration).
    On the installed uvicorn a replica's settings must select it and each response of the
    real gateway must reach the socket's transport as one write. If this fails, the gateway
    silently lost its fast path: check the uvicorn pin in pyproject.toml."""
    cfg = load_config(env={}, overrides={"redis": {"url": redis_url},
                                         "gateway": {"port": free_port(), "request_state_keys": ["00" * 32]}})
    settings = uvicorn_settings(cfg)
    assert issubclass(settings["http"], GatewayHttpProtocol)
    seen: list[RecordingTransport] = []

    class Recorded(settings["http"]):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            seen.append(RecordingTransport(transport))  # type: ignore[arg-type]
            super().connection_made(seen[-1])  # type: ignore[arg-type]

    config = uvicorn.Config(create_app(cfg), **{**settings, "http": Recorded, "log_config": None})
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or serving.done(), timeout_s=30, what="uvicorn to start")
        assert server.started, serving.exception() if serving.done() else "not started"
        reader, writer = await asyncio.open_connection(cfg.gateway.host, cfg.gateway.port)
        host = f"host: {cfg.gateway.host}:{cfg.gateway.port}\r\n".encode()
        listing = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": META}})
        requests = [b"GET /healthz HTTP/1.1\r\n" + host + b"\r\n",
                    b"POST /mcp HTTP/1.1\r\n" + host + b"accept: application/json, text/event-stream\r\n"
                    b"content-type: application/json\r\nmcp-protocol-version: " + MODERN.encode() +
                    b"\r\nmcp-method: tools/list\r\ncontent-length: %d\r\n\r\n" % len(listing) + listing]
        responses = []
        for request in requests:  # one keep-alive connection
            writer.write(request)
            responses.append(await asyncio.wait_for(_response(reader), 10))
        writer.close()
        await writer.wait_closed()
        assert responses[0].startswith(b"HTTP/1.1 200") and responses[0].endswith(b'{"status":"ok"}')
        assert responses[1].startswith(b"HTTP/1.1 200") and b'"tools":[' in responses[1]
        assert len(seen) == 1 and seen[0].writes == responses, (
            f"uvicorn {uvicorn.__version__}: responses left in {len(seen[0].writes) if seen else 0} writes, "
            f"not {len(responses)}: the one-write fast path no longer applies")
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 15)


@pytest.fixture
def gateway(redis_target: RedisTarget) -> Iterator[str]:
    port = free_port()
    proc = start_gateway(port, redis_target.url)
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


def test_the_startup_heap_is_left_out_of_collections() -> None:
    import gc

    from gateway.server import freeze_startup_heap

    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules and objects loaded so far
        assert len(gc.get_objects()) < frozen  # what the collector still scans is what comes after
    finally:
        gc.unfreeze()


async def test_a_request_that_ends_with_its_client_is_cancelled_by_the_connection_not_a_task() -> None:
    """Under the gateway's protocol a 2026-07-28 call runs in its request's own task and the
    connection cancels it when it goes (no second task reading receive()); a cancellation
    that is not the connection's (the server stopping) still propagates."""
    from gateway.transports.http_protocol import DISCONNECT, Disconnect
    from gateway.transports.streamable_http import _until_disconnect

    async def never_read() -> dict:
        raise AssertionError("receive() read: the connection's Disconnect was not used")

    started, cleaned = asyncio.Event(), []

    async def serving() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)  # what a tools/call does when cancelled: tell its worker
        return "answered"

    watch = Disconnect()
    call = asyncio.create_task(_until_disconnect(serving(), never_read, {DISCONNECT: watch}))
    await started.wait()
    watch.fire()
    assert await asyncio.wait_for(call, 5) is None and cleaned == [True]
    assert call.cancelling() == 0  # the request's task goes on as if never cancelled

    async def quick() -> str:
        return "answered"

    assert await _until_disconnect(quick(), never_read, {DISCONNECT: Disconnect()}) == "answered"
    started.clear()
    server_stop = asyncio.create_task(_until_disconnect(serving(), never_read, {DISCONNECT: Disconnect()}))
    await started.wait()
    server_stop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await server_stop
