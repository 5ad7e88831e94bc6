"""Messages an authenticated client crafts to break the gateway rather than to use it, sent to a
real gateway process over real sockets (HTTP and WebSocket): each is answered with the JSON-RPC
error and HTTP status that say what is wrong, nothing of it is kept, nothing is logged as a
crash, and the connection it came on keeps serving."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis as redis_sync
from raw_http import masked_text_frame, websocket
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from gateway.mcp.kernel import MAX_JSON_DEPTH
from shared import keys
from shared.config import load_config
from tests.conftest import wait_for_sync
from tests.gateway_support import LoggedGateway as Gateway
from tests.gateway_support import logged_gateway
from tests.test_gateway_http import ACCEPT, modern

KEY = "mallory-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gw(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with logged_gateway(redis_server, tmp_path_factory.mktemp("hostile") / "gateway.log",
                        api_keys=f"mallory:{KEY}", log_level="info") as gateway:
        yield gateway


@pytest.fixture
def store(redis_server: str, redis_url: str) -> Iterator[redis_sync.Redis]:
    """The gateway's Redis, emptied for this test (``redis_url`` flushes it)."""
    client = redis_sync.Redis.from_url(redis_server)
    yield client
    client.close()


def nested(depth: int) -> str:
    """A JSON value ``depth`` levels deep (lists and objects in turn)."""
    return "".join("[" if i % 2 else '{"k":' for i in range(depth)) + "1" + \
        "".join("]" if i % 2 else "}" for i in reversed(range(depth)))


def post(gw: Gateway, body: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(gw.base + "/mcp", content=body.encode(), timeout=10,
                      headers={"content-type": "application/json", "accept": ACCEPT, **AUTH, **(headers or {})})


def assert_too_deep(r: httpx.Response, rid: int | str | None) -> None:
    assert r.status_code == 400, r.text
    assert r.json() == {"jsonrpc": "2.0", "id": rid,
                        "error": {"code": -32600, "message": f"JSON nested deeper than {MAX_JSON_DEPTH} levels"}}


def log_size(gw: Gateway) -> int:
    return gw.log.stat().st_size


def assert_no_crash_logged(gw: Gateway, since: int) -> None:
    """Nothing the replica logged after byte ``since`` is an error or a traceback (``t_crash``'s
    error, logged last, is the marker that shows the log is the live one)."""
    body, headers = modern("tools/call", {"name": "t_crash", "arguments": {}})
    assert post(gw, orjson.dumps(body).decode(), headers).json()["error"] == {"code": -32603,
                                                                               "message": "Internal error"}

    def logged() -> str:
        return gw.log.read_bytes()[since:].decode(errors="replace")

    wait_for_sync(lambda: "secret internal detail" in logged(), timeout_s=10,
                  what="the crash marker to reach the gateway's log")
    lines = logged().splitlines()
    marker = next(i for i, line in enumerate(lines) if "internal error while serving tools/call" in line)
    before = "\n".join(lines[:marker])
    assert "Traceback" not in before and "ERROR" not in before, before[-3000:]


async def assert_still_serving(ws: ClientConnection) -> None:
    """The WebSocket that carried something hostile still serves a tool call."""
    body, _ = modern("tools/call", {"name": "t_echo", "arguments": {"text": "still here"}}, rid=4)
    await ws.send(orjson.dumps(body).decode())
    reply = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
    assert reply["result"]["content"][0]["text"] == "mallory:still here"


def test_deep_nesting_is_bad_input_on_both_revisions(gw: Gateway, store: redis_sync.Redis) -> None:
    since = log_size(gw)
    # far deeper than the decoder recurses, and deeper than what is kept can be encoded again
    for depth in (100_000, 300):
        legacy = '{"jsonrpc":"2.0","id":7,"method":"initialize","params":{"protocolVersion":"2025-11-25",' \
                 f'"capabilities":{nested(depth)}}}}}'
        r = post(gw, legacy)
        assert_too_deep(r, 7 if depth == 300 else None)
        assert "mcp-session-id" not in r.headers
    assert not store.keys(keys.session("mallory", "*"))  # no session was opened
    # 2026-07-28: answers to an input request, which a requestState would carry on
    body, headers = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}}, rid=8)
    text = orjson.dumps(body).decode().replace('"_meta"', f'"inputResponses":{{"q":{nested(300)}}},"_meta"')
    assert_too_deep(post(gw, text, headers), 8)
    # a notification has no id to answer with; a client's answer to a server request is named by its own
    assert_too_deep(post(gw, '{"jsonrpc":"2.0","method":"notifications/x","params":' + nested(200) + "}"), None)
    assert_too_deep(post(gw, '{"jsonrpc":"2.0","id":"srv-1","result":' + nested(200) + "}"), "srv-1")
    # as deep as allowed is served
    ok = '{"jsonrpc":"2.0","id":9,"method":"initialize","params":{"protocolVersion":"2025-11-25",' \
         f'"capabilities":{{"x":{nested(MAX_JSON_DEPTH - 3)}}}}}}}'
    r = post(gw, ok)
    assert r.status_code == 200 and r.headers["mcp-session-id"], r.text
    assert_too_deep(post(gw, ok.replace(nested(MAX_JSON_DEPTH - 3), nested(MAX_JSON_DEPTH - 2))), 9)
    assert_no_crash_logged(gw, since)


def test_integers_beyond_64_bits_are_bad_input(gw: Gateway, store: redis_sync.Redis) -> None:
    since = log_size(gw)
    expected = {"code": -32600, "message": "a number is an integer outside the 64-bit range"}
    for number in (str(2**64), str(-(2**63) - 1), "1" + "0" * 300):
        r = post(gw, '{"jsonrpc":"2.0","id":5,"method":"initialize","params":{"protocolVersion":"2025-11-25",'
                     f'"capabilities":{{"experimental":{{"n":{number}}}}}}}}}')
        assert r.status_code == 400 and r.json() == {"jsonrpc": "2.0", "id": 5, "error": expected}, (number, r.text)
    assert not store.keys(keys.session("mallory", "*"))
    body, headers = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}}, rid=6)
    text = orjson.dumps(body).decode().replace('"_meta"', f'"inputResponses":{{"q":{{"n":{2**70}}}}},"_meta"')
    r = post(gw, text, headers)
    assert r.status_code == 400 and r.json()["error"] == expected, r.text
    # the edges of the 64-bit ranges are numbers like any
    r = post(gw, '{"jsonrpc":"2.0","id":7,"method":"initialize","params":{"protocolVersion":"2025-11-25",'
                 f'"capabilities":{{"experimental":{{"n":[{2**64 - 1},{-(2**63)}]}}}}}}}}')
    assert r.status_code == 200 and r.headers["mcp-session-id"], r.text
    assert_no_crash_logged(gw, since)


def test_floats_beyond_64_bits_are_bad_input_not_parse_errors(gw: Gateway) -> None:
    """``1e400`` is valid JSON that no 64-bit float holds: an invalid request (with its id),
    where a body cut short in such a number is still a parse error."""
    since = log_size(gw)
    expected = {"code": -32600, "message": "a number is outside the range of a 64-bit float"}
    for number in ("1e400", "-1e400", "1" + "0" * 400 + ".5"):
        text = f'{{"jsonrpc":"2.0","id":1,"method":"ping","params":{{"a":{number}}}}}'
        r = post(gw, text)
        assert r.status_code == 400 and r.json() == {"jsonrpc": "2.0", "id": 1, "error": expected}, (number, r.text)
    r = post(gw, '{"jsonrpc":"2.0","id":1e400,"method":"ping"}')  # no id to answer with
    assert r.status_code == 400 and r.json() == {"jsonrpc": "2.0", "id": None, "error": expected}, r.text
    r = post(gw, '{"jsonrpc":"2.0","id":1,"method":"ping","params":{"a":1e400')
    assert r.status_code == 400 and r.json()["error"]["code"] == -32700, r.text

    async def over_websocket() -> None:
        async with ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=AUTH) as ws:
            await ws.send('{"jsonrpc":"2.0","id":"f","method":"ping","params":{"a":1e400}}')
            assert orjson.loads(await asyncio.wait_for(ws.recv(), 10)) == {"jsonrpc": "2.0", "id": "f",
                                                                           "error": expected}
            await assert_still_serving(ws)

    asyncio.run(over_websocket())
    assert_no_crash_logged(gw, since)


def test_deep_nesting_on_a_websocket_leaves_the_connection_serving(gw: Gateway) -> None:
    since = log_size(gw)

    async def scenario() -> None:
        async with ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=AUTH) as ws:
            for depth in (100_000, 300):
                await ws.send('{"jsonrpc":"2.0","id":3,"method":"ping","params":{"x":' + nested(depth) + "}}")
                error = orjson.loads(await asyncio.wait_for(ws.recv(), 10))["error"]
                assert error == {"code": -32600, "message": f"JSON nested deeper than {MAX_JSON_DEPTH} levels"}
            await assert_still_serving(ws)

    asyncio.run(scenario())
    assert_no_crash_logged(gw, since)


def test_a_second_initialize_on_a_websocket_is_refused_and_loses_nothing(gw: Gateway, store: redis_sync.Redis) -> None:
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}}}

    async def scenario() -> None:
        async with ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=AUTH) as ws:
            async def answer(message: dict) -> dict:
                await ws.send(orjson.dumps(message).decode())
                return orjson.loads(await asyncio.wait_for(ws.recv(), 10))

            assert (await answer(init))["result"]["protocolVersion"] == "2025-11-25"
            again = await answer({**init, "id": 2})
            assert again["error"]["code"] == -32600 and "one initialize per connection" in again["error"]["message"]
            assert len(store.keys(keys.session("mallory", "*"))) == 1  # no second session behind it
            # what the session subscribes to reaches this socket
            assert (await answer({"jsonrpc": "2.0", "id": 3, "method": "resources/subscribe",
                                  "params": {"uri": "test://r"}}))["result"] == {}
            await ws.send(orjson.dumps({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                                        "params": {"name": "t_touch", "arguments": {}}}).decode())
            got = [orjson.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
            assert {"jsonrpc": "2.0", "method": "notifications/resources/updated",
                    "params": {"uri": "test://r"}} in got, got
            assert any(m.get("id") == 4 and "result" in m for m in got), got

    asyncio.run(scenario())


def test_oversized_client_capabilities_are_refused_and_not_kept(gw: Gateway, store: redis_sync.Redis) -> None:
    """What a client declares about itself lives as long as its session (Redis and every replica's
    cache) or its listen stream and tasks: beyond ``gateway.max_client_capabilities_bytes`` it is
    refused, on both revisions and both transports, before anything is kept."""
    since = log_size(gw)
    limit = load_config(env={}).gateway.max_client_capabilities_bytes
    huge = {"experimental": {"x": "a" * 3_500_000}}

    def initialize(rid: int, capabilities: dict, info: dict | None = None) -> dict:
        return {"jsonrpc": "2.0", "id": rid, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": capabilities,
                           "clientInfo": info or {"name": "mallory", "version": "1"}}}

    for message, what in ((initialize(1, huge), "capabilities"),
                          (initialize(2, {}, {"name": "mallory", "version": "1", "x": "a" * 3_500_000}), "clientInfo"),
                          (initialize(3, {"experimental": {"x": "a" * limit}}), "capabilities")):
        r = post(gw, orjson.dumps(message).decode())
        assert r.status_code == 400 and "mcp-session-id" not in r.headers, r.text[:300]
        error = r.json()["error"]
        assert error["code"] == -32602 and what in error["message"] and str(limit) in error["message"], error
    assert not store.keys(keys.session("mallory", "*"))
    # under the bound is served as before
    r = post(gw, orjson.dumps(initialize(4, {"experimental": {"x": "a" * (limit // 2)}})).decode())
    assert r.status_code == 200 and r.headers["mcp-session-id"], r.text[:300]
    over_http = r.headers["mcp-session-id"]
    # 2026-07-28: a request's own capabilities, which a listen stream or a task holds while it lives
    for caps in (huge, {"sampling": {}, "experimental": {"x": "a" * limit}}):
        for method, params in (("tools/call", {"name": "t_echo", "arguments": {"text": "x"}}),
                               ("subscriptions/listen", {"notifications": {"toolsListChanged": True}})):
            body, headers = modern(method, params, rid=5, caps=caps)
            r = post(gw, orjson.dumps(body).decode(), headers)
            assert r.status_code == 400 and r.json()["error"]["code"] == -32602, r.text[:300]
    body, headers = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}}, rid=6)
    body["params"]["_meta"]["io.modelcontextprotocol/clientInfo"] = {"name": "m", "version": "1", "x": "a" * limit}
    r = post(gw, orjson.dumps(body).decode(), headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == -32602, r.text[:300]

    async def over_websocket() -> None:
        async with ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=AUTH) as ws:
            async def answer(message: dict) -> dict:
                await ws.send(orjson.dumps(message).decode())
                return orjson.loads(await asyncio.wait_for(ws.recv(), 10))

            assert (await answer(initialize(7, huge)))["error"]["code"] == -32602
            assert store.zcard(keys.principal_sessions("mallory")) == 1
            # the refused initialize opened nothing: the connection may still open its session
            assert (await answer(initialize(8, {})))["result"]["protocolVersion"] == "2025-11-25"
            assert store.zcard(keys.principal_sessions("mallory")) == 2

    asyncio.run(over_websocket())
    # a WebSocket session ends with its connection; the HTTP one opened above stays
    def sessions() -> set[str]:
        return {m.decode() for m in store.zrange(keys.principal_sessions("mallory"), 0, -1)}

    wait_for_sync(lambda: sessions() == {over_http}, timeout_s=30,
                  what=lambda: f"the closed WebSocket's session to be deleted (sessions held: {sessions()}, "
                               f"the HTTP one: {over_http})")
    assert_no_crash_logged(gw, since)


def test_websocket_sessions_closed_right_after_initialize_are_ended(gw: Gateway, store: redis_sync.Redis) -> None:
    """A client that closes as soon as its session is open closes while the connection's event
    pump is still starting: each connection must still end its session (and free its stream slot)."""
    since = log_size(gw)
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "mallory", "version": "1"}}}

    async def open_and_close() -> None:
        async with ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=AUTH) as ws:
            await ws.send(orjson.dumps(init).decode())
            assert "result" in orjson.loads(await asyncio.wait_for(ws.recv(), 10))

    for _ in range(10):
        asyncio.run(open_and_close())
    wait_for_sync(lambda: store.zcard(keys.principal_sessions("mallory")) == 0, timeout_s=30,
                  what=lambda: f"every closed WebSocket's session to end "
                               f"({store.zcard(keys.principal_sessions('mallory'))} of 10 still open)")
    assert_no_crash_logged(gw, since)


# Bodies that are not JSON at all, whatever their first character; then well-formed JSON that is
# not one JSON-RPC object.
NOT_JSON = ("[", "[1,", '[{"jsonrpc":"2.0"', "[" * 100, '[{"jsonrpc":"2.0","id":1,"method":"ping"}] x', "[1]]",
            '{"a":[', '"open', "nul", "1 2", '{"jsonrpc":"2.0","id":1,"method":"ping"}}')
WRONG_SHAPE = ('[{"jsonrpc":"2.0","id":1,"method":"ping"}]', "[]", "[1,2]", "1", '"x"', "null",
               "[" * 200 + "]" * 200)


def test_malformed_json_is_a_parse_error_and_wrong_shapes_are_invalid_requests(gw: Gateway) -> None:
    since = log_size(gw)
    parse_error = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}
    for text in NOT_JSON:
        r = post(gw, text)
        assert (r.status_code, r.json()) == (400, parse_error), (text[:40], r.text)
    for text in WRONG_SHAPE:
        r = post(gw, text)
        assert r.status_code == 400 and r.json()["error"]["code"] == -32600, (text[:40], r.text)
        assert "single JSON-RPC 2.0" in r.json()["error"]["message"], (text[:40], r.text)
    # deeper than the decoder goes: refused for its depth, as an object that deep is
    assert_too_deep(post(gw, "[" * 100_000), None)

    async def over_websocket() -> None:
        async with ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=AUTH) as ws:
            for text in NOT_JSON:
                await ws.send(text)
                assert orjson.loads(await asyncio.wait_for(ws.recv(), 10)) == parse_error, text[:40]
            for text in WRONG_SHAPE:
                await ws.send(text)
                assert orjson.loads(await asyncio.wait_for(ws.recv(), 10))["error"]["code"] == -32600, text[:40]
            await assert_still_serving(ws)

    asyncio.run(over_websocket())
    assert_no_crash_logged(gw, since)


def _raw_websocket(gw: Gateway) -> socket.socket:
    """A tiny receive buffer, so that a client that never reads shows at once."""
    return websocket(int(gw.base.rsplit(":", 1)[1]), KEY, 4096)


def test_a_websocket_client_that_stops_reading_is_dropped_with_its_work(redis_server: str, store: redis_sync.Redis,
                                                                        tmp_path: Path) -> None:
    """A client that sends requests and never reads their replies (nor the keepalive pings) fills
    the socket's buffers: the missed pong drops it at once, cancelling its requests and giving back
    its event_streams slot, instead of keeping the connection, the replies and the slot for good."""
    overrides = {"gateway": {"ws_ping_interval_s": 0.5, "ws_ping_timeout_s": 1.0}}
    with logged_gateway(redis_server, tmp_path / "gateway.log", api_keys=f"mallory:{KEY}", log_level="info",
                        overrides=overrides) as gw:
        since = log_size(gw)
        sock = _raw_websocket(gw)
        try:
            assert store.zcard(keys.stream_leases("mallory")) == 1
            sleep, _ = modern("tools/call", {"name": "t_sleep", "arguments": {"seconds": 600}}, rid=1)
            sock.sendall(masked_text_frame(orjson.dumps(sleep).decode()))
            wait_for_sync(lambda: store.lrange("test:t_sleep:started", 0, -1), what="the long call to start")
            for rid in range(2, 6):  # replies of 2 MiB each, more than the socket buffers hold
                echo, _ = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x" * (2 << 20)}}, rid=rid)
                sock.sendall(masked_text_frame(orjson.dumps(echo).decode()))
            wait_for_sync(lambda: store.zcard(keys.stream_leases("mallory")) == 0, timeout_s=30,
                          what="the silent client's connection to be dropped and its slot given back")
            assert store.lrange("test:t_sleep:ended", 0, -1) == [b"mallory"]  # its request's work was stopped
        finally:
            sock.close()
        assert_no_crash_logged(gw, since)
