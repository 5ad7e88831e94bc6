"""The MCP kernel and the one error map, through one in-process gateway (create_app, real Redis):
HTTP and WebSocket answer a malformed message with the same JSON-RPC error, every Retry-After
the gateway gives comes from ``redis.retry_after_s``, and a tool's output is checked against
its outputSchema (``generate`` included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

from gateway.app import create_app
from gateway.errors import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    RESOURCE_NOT_FOUND,
    SERVICE_UNAVAILABLE,
    ToolError,
    Unavailable,
    http_error,
    tool_error_text,
    wire_error,
)
from gateway.mcp.sessions import SessionLimit, SessionNotFound
from gateway.tools.inference import GENERATE_OUTPUT
from gateway.workers import NoWorker, WorkerRequestError, WorkerTimeout
from shared.config import Config, load_config
from shared.context import ContextError, ContextNotFound, VersionUnavailable

MODERN = "2026-07-28"
ACCEPT = "application/json, text/event-stream"
PV = "io.modelcontextprotocol/protocolVersion"
CAPS = "io.modelcontextprotocol/clientCapabilities"
RETRY_AFTER_S = 7  # not the default, so a hard-coded wait cannot pass


@pytest.fixture
def redis_url(redis_target) -> str:
    """Every test here runs on a single server and on a cluster (tests/conftest.py)."""
    return redis_target.url


def _config(redis_url: str) -> Config:
    return load_config(env={}, overrides={"redis": {"url": redis_url, "retry_after_s": RETRY_AFTER_S},
                                          "gateway": {"request_state_keys": ["00" * 32]},
                                          "worker": {"endpoints": []}})


@pytest.fixture
def client(redis_url: str) -> Iterator[TestClient]:
    app = create_app(_config(redis_url))

    @app.registry.tool("t_down", description="a backend is down", input_schema={"type": "object"})
    async def down(ctx: Any, args: dict) -> dict:
        raise Unavailable("backend away")

    @app.registry.tool("t_no_worker", description="no worker", input_schema={"type": "object"})
    async def no_worker(ctx: Any, args: dict) -> dict:
        raise NoWorker("no inference worker is available; retry shortly")

    @app.registry.tool("t_echo", description="echo", input_schema={"type": "object"})
    async def echo(ctx: Any, args: dict) -> dict:
        return {"content": [{"type": "text", "text": "ok"}]}

    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        yield c


def _call(tool: str, meta: dict) -> dict:
    return {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": tool, "arguments": {},
                                                                           "_meta": meta}}


def _over_http(c: TestClient, body: dict) -> tuple[int, dict]:
    version = body["params"]["_meta"].get(PV, MODERN)
    headers = {"accept": ACCEPT, "mcp-protocol-version": str(version), "mcp-method": body["method"],
               "mcp-name": body["params"]["name"]}
    r = c.post("/mcp", content=orjson.dumps(body), headers=headers)
    return r.status_code, r.json()


def _over_ws(c: TestClient, body: dict) -> dict:
    with c.websocket_connect("/mcp/ws", subprotocols=["mcp"], headers={"host": "127.0.0.1:8000"}) as ws:
        ws.send_text(orjson.dumps(body).decode())
        answer: dict = orjson.loads(ws.receive_text())
        return answer


MALFORMED = {
    "no client capabilities": ({PV: MODERN}, INVALID_PARAMS),
    "capabilities not an object": ({PV: MODERN, CAPS: "all"}, INVALID_PARAMS),
    "unsupported revision": ({PV: "2099-01-01", CAPS: {}}, -32022),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_http_and_websocket_answer_a_malformed_envelope_alike(client: TestClient, case: str) -> None:
    meta, code = MALFORMED[case]
    status, over_http = _over_http(client, _call("t_echo", meta))
    over_ws = _over_ws(client, _call("t_echo", meta))
    assert status == 400 and over_http["error"]["code"] == code, over_http
    assert over_ws["error"]["code"] == code, over_ws
    assert over_ws == over_http  # the same id, code, message and data


def test_a_well_formed_envelope_is_served_on_both(client: TestClient) -> None:
    meta = {PV: MODERN, CAPS: {}}
    status, over_http = _over_http(client, _call("t_echo", meta))
    assert status == 200 and over_http == _over_ws(client, _call("t_echo", meta))
    assert over_http["result"]["content"][0]["text"] == "ok"


def test_websocket_rejects_a_bad_id_as_http_does(client: TestClient) -> None:
    body = {"jsonrpc": "2.0", "id": True, "method": "tools/list", "params": {"_meta": {PV: MODERN, CAPS: {}}}}
    r = client.post("/mcp", content=orjson.dumps(body), headers={"accept": ACCEPT})
    assert r.status_code == 400 and r.json()["error"]["code"] == -32600
    assert _over_ws(client, body) == r.json()


@pytest.mark.parametrize("tool", ["t_down", "t_no_worker"])
def test_a_503_carries_the_configured_retry_after(client: TestClient, tool: str) -> None:
    status, body = _over_http(client, _call(tool, {PV: MODERN, CAPS: {}}))
    assert status == 503 and body["error"]["code"] == SERVICE_UNAVAILABLE
    assert body["error"]["data"] == {"retryAfterS": RETRY_AFTER_S}
    r = client.post("/mcp", content=orjson.dumps(_call(tool, {PV: MODERN, CAPS: {}})),
                    headers={"accept": ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": "tools/call",
                             "mcp-name": tool})
    assert r.headers["retry-after"] == str(RETRY_AFTER_S)


def test_generate_output_is_checked_against_its_output_schema(client: TestClient, monkeypatch) -> None:
    """``generate`` returns its structured output and the dispatcher checks it like every
    other tool's: it reaches the client when it conforms, and becomes INTERNAL_ERROR when it
    does not (here: under a stricter schema than the worker's reply meets)."""
    async def reply(header: dict, frames: list, **kw: Any) -> dict:
        return {"text": "hi", "version": 3, "tokens": 1, "finish_reason": "length", "worker": "w0"}

    monkeypatch.setattr(client.app.state.gateway.workers, "request", reply)  # type: ignore[attr-defined]
    body = {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
            "params": {"name": "generate", "arguments": {"prompt": "x"}, "_meta": {PV: MODERN, CAPS: {}}}}
    status, answer = _over_http(client, body)
    out = answer["result"]["structuredContent"]
    assert status == 200 and (out["text"], out["model_version"], out["worker"]) == ("hi", 3, "w0")
    assert orjson.loads(answer["result"]["content"][0]["text"]) == out
    tools = client.app.registry.tools  # type: ignore[attr-defined]
    strict = {**GENERATE_OUTPUT, "properties": {**GENERATE_OUTPUT["properties"],
                                                "model_version": {"type": "integer", "minimum": 4}}}
    monkeypatch.setitem(tools, "generate", dataclasses.replace(tools["generate"], output_schema=strict))
    status, answer = _over_http(client, body)
    assert answer["error"]["code"] == INTERNAL_ERROR, (status, answer)
    assert answer["error"]["message"] == "Tool output did not match its output schema"


# ---------------------------------------------------------------------- the map on its own
def test_the_map(redis_url: str) -> None:
    cfg = _config(redis_url)
    missing = ContextNotFound.from_script("context c1")
    tool = wire_error(missing, cfg)
    assert (tool.code, tool.data) == (INVALID_PARAMS, {"kind": "context_not_found", "context_id": "c1"})
    old = wire_error(VersionUnavailable.from_script("context c1 version 3 is not retained"), cfg)
    assert old.data == {"kind": "version_unavailable", "context_id": "c1", "version": 3}
    read = wire_error(missing, cfg, method="resources/read", params={"uri": "context://c1/text"})
    assert (read.code, read.data) == (RESOURCE_NOT_FOUND, {"uri": "context://c1/text"})
    read = wire_error(missing, cfg, method="resources/read", params={"uri": "context://c1/text"}, modern=True)
    assert (read.code, read.data, read.http_status) == (INVALID_PARAMS, {"uri": "context://c1/text"}, 400)
    assert wire_error(ContextError("bad id"), cfg).http_status == 400
    assert wire_error(WorkerRequestError("bad_input", "image"), cfg).code == INVALID_PARAMS
    for down in (RedisConnectionError(), SessionLimit("alice"), NoWorker("none"), WorkerTimeout("slow")):
        wire = wire_error(down, cfg)
        assert (wire.code, wire.http_status, wire.retry_after_s) == (SERVICE_UNAVAILABLE, 503, RETRY_AFTER_S), down
    assert wire_error(NoWorker("draining", retry_after_s=30), cfg).retry_after_s == 30
    full = wire_error(MaxConnectionsError("Too many connections"), cfg)  # this replica's pool, not an outage
    assert (full.code, full.http_status, full.retry_after_s) == (SERVICE_UNAVAILABLE, 503, RETRY_AFTER_S)
    assert "redis.max_connections" in full.message and "unreachable" not in full.message, full.message
    gone = wire_error(SessionNotFound("sid"), cfg)
    assert (gone.code, gone.http_status) == (-32600, 404)
    crash = wire_error(RuntimeError("secret"), cfg, crashed_status=500)
    assert (crash.code, crash.message, crash.http_status) == (INTERNAL_ERROR, "Internal error", 500)
    assert tool_error_text(ToolError("no")) == "no"
    assert tool_error_text(WorkerRequestError("internal", "oom")) == "inference failed: oom"
    assert tool_error_text(WorkerRequestError("bad_input", "x")) is None


def test_the_map_for_rest_routes(redis_url: str) -> None:
    cfg = _config(redis_url)
    assert http_error(ContextNotFound("context c1"), cfg).status_code == 404
    assert http_error(ContextError("bad id"), cfg).status_code == 400
    down = http_error(RedisConnectionError(), cfg)
    assert down.status_code == 503 and down.headers == {"Retry-After": str(RETRY_AFTER_S)}
