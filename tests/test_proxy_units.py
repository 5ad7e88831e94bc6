"""The proxy's parts that need no upstream: the breaker's states and the changes it tells of, name
and URI mapping, SSE line splitting across chunk boundaries (the rules the integration tests rely
on), and the HTTP pool's reuse of idle connections (against a local socket server)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.proxy import http1, names
from gateway.proxy.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from gateway.proxy.http1 import Origin
from gateway.proxy.wire import _lines, _sse_messages


def test_breaker_opens_probes_once_and_closes_or_reopens() -> None:
    breaker = Breaker(failures=2, reset_s=3600.0)
    breaker.failed()
    assert breaker.state == CLOSED and breaker.admit()
    breaker.failed()
    assert breaker.state == OPEN and not breaker.admit() and breaker.retry_in_s() > 3500
    probing = Breaker(failures=1, reset_s=0.0)  # open for no time: half-open at once
    probing.failed()
    assert probing.state == HALF_OPEN
    assert probing.admit() and not probing.admit()  # one probe call at a time
    probing.failed()  # the probe failed: open again (and, with reset_s 0, half-open again)
    assert probing.failures == 2 and probing.admit()
    probing.abandoned()  # the probe got no slot and never reached the upstream: another may probe
    assert probing.admit()
    probing.succeeded()
    assert probing.state == CLOSED and probing.failures == 0 and probing.admit() and probing.admit()


def test_breaker_tells_of_state_changes_only() -> None:
    moves: list[str] = []
    breaker = Breaker(failures=2, reset_s=3600.0, on_change=lambda: moves.append(breaker.state))
    for _ in range(3):
        breaker.succeeded()  # calls that pass move nothing
    breaker.failed()
    assert moves == []
    breaker.failed()
    breaker.failed()  # a call in flight when it opened fails too: still open, nothing to tell
    assert moves == [OPEN]
    breaker.succeeded()
    assert moves == [OPEN, CLOSED]
    probing = Breaker(failures=1, reset_s=0.0, on_change=lambda: moves.append("moved"))
    moves.clear()
    probing.failed()  # open, then half-open once read
    assert probing.state == HALF_OPEN and moves == ["moved", "moved"]


@pytest.mark.parametrize("uri", ["test://r", "file:///a b/c?x=1#f", "https://h/p?q=%2F", "urn:x:y"])
def test_resource_uris_map_back_exactly(uri: str) -> None:
    wrapped = names.wrap_uri("weather", uri)
    assert wrapped.startswith("upstream://weather/") and "/" not in wrapped[len("upstream://weather/"):]
    assert names.unwrap_uri(wrapped) == ("weather", uri)


def test_templates_keep_their_variables_and_names_their_namespace() -> None:
    template = names.wrap_template("w", "file:///{dir}/data?id={id}")
    assert "{dir}" in template and "{id}" in template
    assert names.unwrap_uri(template.replace("{dir}", "a").replace("{id}", "7")) == ("w", "file:///a/data?id=7")
    assert names.unwrap_uri("context://c1/text") is None and names.unwrap_uri("upstream://") is None
    assert names.exposed("weather", "forecast") == "weather.forecast" and names.exposed("", "forecast") == "forecast"


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


@pytest.mark.parametrize("parts", [
    [b'data: {"a":1}\r\n\r\ndata: {"b":2}\r\n\r\n'],
    [b'data: {"a":1}\r', b'\n\r', b'\ndata: {"b"', b':2}\r\n', b'\r\n'],
    [b'event: message\ndata: {"a":1}\n\n', b': comment\n', b'data: {"b":2}\n\n'],
])
async def test_sse_messages_survive_any_chunking(parts: list[bytes]) -> None:
    got = [m async for m in _sse_messages(_lines(_chunks(parts)))]
    assert got == [{"a": 1}, {"b": 2}]


async def _peers_of_two_requests(origin: Origin, server_peers: list[int]) -> list[int]:
    for _ in range(2):
        async with await origin.open(b"GET", {}, None) as resp:
            assert resp.status == 200 and await resp.read(1024) == b"ok"
    return server_peers


@pytest.mark.parametrize("idle_limit_s, connections", [(http1.MAX_IDLE_S, 1), (-1.0, 2)])
async def test_an_idle_connection_is_reused_only_while_young(monkeypatch: pytest.MonkeyPatch,
                                                             idle_limit_s: float, connections: int) -> None:
    """A kept-alive connection idle past MAX_IDLE_S is closed, not written to (-1: every idle
    connection is past it): a server may be closing it just then."""
    monkeypatch.setattr(http1, "MAX_IDLE_S", idle_limit_s)
    peers: list[int] = []
    ended: list[int] = []  # connections whose client hung up
    all_ended = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while await reader.readuntil(b"\r\n\r\n"):
                peers.append(writer.get_extra_info("peername")[1])
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()
        await writer.wait_closed()
        ended.append(1)
        if len(ended) == len(set(peers)):
            all_ended.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    origin = Origin(f"http://127.0.0.1:{port}/mcp", {}, connect_timeout_s=5)
    try:
        seen = await _peers_of_two_requests(origin, peers)
        assert len(seen) == 2 and len(set(seen)) == connections
    finally:
        origin.close()
        await asyncio.wait_for(all_ended.wait(), 10)  # the server saw every connection closed
        server.close()
        await server.wait_closed()
