"""What MCP clients (the TypeScript SDK first) notice beyond the conformance suite, on a real
gateway: a cancelled request gets no response, ``completion/complete`` fills the context
template from the caller's own contexts, not-found errors say so, and output schemas give
every property one type."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from conformance.fixtures import PNG_1PX
from tests.conftest import RedisTarget, free_port
from tests.gateway_support import start_gateway, stop

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
ACCEPT = "application/json, text/event-stream"
LEGACY, MODERN = "2025-11-25", "2026-07-28"
TEMPLATE = "context://{context_id}/{modality}"
WAIT_S = 15


@pytest.fixture(scope="module")
def mcp(redis_target_module: RedisTarget) -> Iterator[str]:
    """One gateway per Redis kind (single server, cluster)."""
    port = free_port()
    proc = start_gateway(port, redis_target_module.url, api_keys=f"alice:{ALICE},bob:{BOB}")
    yield f"http://127.0.0.1:{port}/mcp"
    stop(proc)


@pytest.fixture
def redis_url(redis_target_module: RedisTarget) -> str:
    """The gateway's Redis, emptied for each test."""
    redis_target_module.flush()
    return redis_target_module.url


def ask_http(mcp: str, key: str, method: str, params: dict[str, Any], name: str | None = None) -> httpx.Response:
    """One 2026-07-28 request."""
    params = {**params, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                  "io.modelcontextprotocol/clientCapabilities": {}}}
    headers = {"accept": ACCEPT, "authorization": f"Bearer {key}", "mcp-protocol-version": MODERN,
               "mcp-method": method}
    if name is not None:
        headers["mcp-name"] = name
    return httpx.post(mcp, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params})


def ask(mcp: str, key: str, method: str, params: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """One 2026-07-28 request; its JSON-RPC answer."""
    return orjson.loads(ask_http(mcp, key, method, params, name).content)


def legacy_session(mcp: str, key: str) -> dict[str, str]:
    """The headers of a new 2025-11-25 session of ``key``'s principal."""
    headers = {"accept": ACCEPT, "authorization": f"Bearer {key}"}
    init = httpx.post(mcp, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {"sampling": {}}, "clientInfo": {"name": "t", "version": "1"}}})
    return headers | {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": LEGACY}


def append(mcp: str, key: str, context_id: str, modality: str) -> None:
    args = {"context_id": context_id, "modality": modality}
    args.update({"text": "hi"} if modality == "text" else {"data": PNG_1PX})
    assert "result" in ask(mcp, key, "tools/call", {"name": "context_append", "arguments": args}, "context_append")


def complete(mcp: str, key: str, argument: str, value: str, resolved: dict[str, str] | None = None,
             uri: str = TEMPLATE) -> dict[str, Any]:
    params: dict[str, Any] = {"ref": {"type": "ref/resource", "uri": uri},
                              "argument": {"name": argument, "value": value}}
    if resolved is not None:
        params["context"] = {"arguments": resolved}
    return ask(mcp, key, "completion/complete", params)


def test_cancelled_request_gets_no_response(mcp: str) -> None:
    headers = legacy_session(mcp, ALICE)
    events: list[dict[str, Any]] = []
    asked = threading.Event()

    def call() -> None:  # t_ask waits for the client's sampling answer, which never comes
        with httpx.stream("POST", mcp, headers=headers, timeout=WAIT_S, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "t_ask", "arguments": {}}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip():
                    events.append(orjson.loads(line[5:]))
                    asked.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert asked.wait(WAIT_S), "the tool did not ask the client"
    cancelled = httpx.post(mcp, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/cancelled",
                                                       "params": {"requestId": 2, "reason": "user"}})
    assert cancelled.status_code == 202
    caller.join(WAIT_S)
    assert not caller.is_alive(), "the cancelled request's stream did not end"
    assert [e.get("method") for e in events] == ["sampling/createMessage"], events


def test_context_template_completes_the_callers_own_ids(mcp: str, redis_url: str) -> None:
    for cid, modality in (("alpha", "text"), ("alpha", "image"), ("alpine", "text"), ("beta", "text")):
        append(mcp, ALICE, cid, modality)
    append(mcp, BOB, "alps", "text")
    got = complete(mcp, ALICE, "context_id", "al")["result"]["completion"]
    assert sorted(got["values"]) == ["alpha", "alpine"] and got["total"] == 2 and got["hasMore"] is False
    assert sorted(complete(mcp, ALICE, "context_id", "")["result"]["completion"]["values"]) == [
        "alpha", "alpine", "beta"]
    assert complete(mcp, BOB, "context_id", "al")["result"]["completion"]["values"] == ["alps"]
    for odd in (5, None, ["al"], {"v": "al"}):  # not a prefix at all: refused, not read as "" (every id)
        got = complete(mcp, ALICE, "context_id", odd)  # type: ignore[arg-type]
        assert got["error"]["code"] == -32602 and "argument.value" in got["error"]["message"], got


def test_context_template_completes_the_modalities_of_the_chosen_context(mcp: str, redis_url: str) -> None:
    append(mcp, ALICE, "alpha", "text")
    append(mcp, ALICE, "alpha", "image")
    append(mcp, ALICE, "alpine", "text")

    def values(typed: str, resolved: dict[str, str] | None) -> list[str]:
        return complete(mcp, ALICE, "modality", typed, resolved)["result"]["completion"]["values"]

    assert values("", {"context_id": "alpha"}) == ["text", "image"]
    assert values("i", {"context_id": "alpha"}) == ["image"]
    assert values("", {"context_id": "alpine"}) == ["text"]
    assert values("", {"context_id": "nope"}) == []
    assert values("", None) == ["text", "image", "audio"]  # no context chosen yet: every configured modality
    assert complete(mcp, BOB, "modality", "", {"context_id": "alpha"})["result"]["completion"]["values"] == []


def test_not_found_errors_say_not_found(mcp: str, redis_url: str) -> None:
    errors = [
        ask(mcp, ALICE, "tools/call", {"name": "no_such_tool", "arguments": {}}, "no_such_tool"),
        ask(mcp, ALICE, "prompts/get", {"name": "no_such_prompt"}, "no_such_prompt"),
        ask(mcp, ALICE, "tools/call", {"name": "context_get", "arguments": {"context_id": "nope"}}, "context_get"),
        ask(mcp, ALICE, "resources/read", {"uri": "context://nope/text"}, "context://nope/text"),
        complete(mcp, ALICE, "x", "", uri="nothing://{here}"),
    ]
    for reply in errors:
        assert "not found" in reply["error"]["message"], reply


# What matches no resource: a context that is not the caller's or does not exist, a modality that is
# not configured (names are case-sensitive), anything after the modality, a URI nothing serves.
UNKNOWN_RESOURCES = ("context://zz/text", "context://c1/Text", "context://c1/text?x=1", "context://c1/text/x",
                     "context://c1/video", "test://nope")


def test_an_unknown_resource_is_invalid_params_on_2026_and_resource_not_found_on_2025(mcp: str,
                                                                                        redis_url: str) -> None:
    append(mcp, ALICE, "c1", "text")
    assert ask(mcp, ALICE, "resources/read", {"uri": "context://c1/text"}, "context://c1/text")["result"]
    for key, uris in ((ALICE, UNKNOWN_RESOURCES), (BOB, ("context://c1/text",))):
        for uri in uris:
            r = ask_http(mcp, key, "resources/read", {"uri": uri}, uri)  # SEP-2164
            assert r.status_code == 400, (uri, r.text)
            assert r.json()["error"] == {"code": -32602, "message": f"Resource not found: {uri}",
                                         "data": {"uri": uri}}, uri
    for key, uris in ((ALICE, UNKNOWN_RESOURCES), (BOB, ("context://c1/text",))):
        headers = legacy_session(mcp, key)
        for uri in uris:
            r = httpx.post(mcp, headers=headers, json={"jsonrpc": "2.0", "id": 2, "method": "resources/read",
                                                       "params": {"uri": uri}})
            assert r.status_code == 200, (uri, r.text)
            assert r.json()["error"] == {"code": -32002, "message": f"Resource not found: {uri}",
                                         "data": {"uri": uri}}, uri


LISTS = {"tools/list": "tools", "resources/list": "resources", "resources/templates/list": "resourceTemplates",
         "prompts/list": "prompts"}
# Cursors no list of this gateway issued: without upstreams every list is one page, so none is.
FOREIGN_CURSORS = ("garbage", 5, "", {"offset": 3}, base64.urlsafe_b64encode(b"tools:3").decode())


def test_a_cursor_the_gateway_did_not_issue_is_invalid_params(mcp: str, redis_url: str) -> None:
    append(mcp, ALICE, "c1", "text")  # resources/list holds the caller's contexts too
    headers = legacy_session(mcp, ALICE)
    for method, key in LISTS.items():
        first = ask_http(mcp, ALICE, method, {})
        assert first.status_code == 200 and key in first.json()["result"], first.text
        assert "nextCursor" not in first.json()["result"]
        assert ask_http(mcp, ALICE, method, {"cursor": None}).json()["result"] == first.json()["result"]
        for cursor in FOREIGN_CURSORS:
            r = ask_http(mcp, ALICE, method, {"cursor": cursor})
            assert r.status_code == 400 and r.json()["error"]["code"] == -32602, (method, cursor, r.text)
            assert "cursor" in r.json()["error"]["message"]
            r = httpx.post(mcp, headers=headers, json={"jsonrpc": "2.0", "id": 2, "method": method,
                                                       "params": {"cursor": cursor}})
            assert r.status_code == 200 and r.json()["error"]["code"] == -32602, (method, cursor, r.text)


def _types(schema: Any) -> Iterator[Any]:
    if isinstance(schema, dict):
        if "type" in schema:
            yield schema["type"]
        for value in schema.values():
            yield from _types(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _types(value)


def test_output_schemas_give_every_property_one_type(mcp: str) -> None:
    tools = ask(mcp, ALICE, "tools/list", {})["result"]["tools"]
    schemas = [t["outputSchema"] for t in tools if "outputSchema" in t]
    assert any(t["name"] == "generate" for t in tools) and schemas
    for schema in schemas:
        assert all(isinstance(t, str) for t in _types(schema)), schema
