"""The proxy between revisions, through the real path: a client of either revision, the front
gateway, and a real upstream (a second learnmesh gateway process) pinned to either revision:
merged and namespaced lists, routed calls, resources mapped back, progress and logging
carried across, and server->client requests reaching the client the way its revision expects."""

from __future__ import annotations

import base64
import threading
from typing import Any

import httpx
import orjson
import pytest

from tests.admin_support import MCP_KEY
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import (
    ACCEPT,
    LEGACY,
    MODERN,
    Client,
    front_gateway,
    upstream_entry,
)

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url

PAIRS = [(LEGACY, LEGACY), (LEGACY, MODERN), (MODERN, LEGACY), (MODERN, MODERN)]  # (client, upstream)
SAMPLED = {"role": "assistant", "content": {"type": "text", "text": "42"}, "model": "m"}


def front(redis_url: str, upstream: str, revision: str, **fields: Any) -> Any:
    return front_gateway(redis_url, {"upstreams": [upstream_entry(upstream, revision=revision, **fields)]})


@pytest.mark.parametrize(("client_rev", "upstream_rev"), PAIRS)
def test_lists_merge_and_calls_route_across_revisions(redis_url: str, upstream: str, client_rev: str,
                                                      upstream_rev: str) -> None:
    with front(redis_url, upstream, upstream_rev) as base:
        client = Client(base, MCP_KEY, client_rev).open()
        tools = client.names()
        assert "context_append" in tools and "up.t_echo" in tools and "t_echo" not in tools
        out = client.result("tools/call", {"name": "up.t_echo", "arguments": {"text": "hi"}})
        assert out["content"] == [{"type": "text", "text": "proxy:hi"}]  # the upstream saw its own principal
        assert ("resultType" in out) == (client_rev == MODERN)
        failed = client.result("tools/call", {"name": "up.t_fail", "arguments": {}})
        assert failed["isError"] is True and failed["content"][0]["text"] == "tool said no"
        uris = [r["uri"] for r in client.result("resources/list")["resources"]]
        assert "upstream://up/test%3A%2F%2Fr" in uris
        read = client.result("resources/read", {"uri": "upstream://up/test%3A%2F%2Fr"})
        assert read["contents"] == [{"uri": "upstream://up/test%3A%2F%2Fr", "mimeType": "text/plain",
                                     "text": "resource text"}] or read["contents"][0]["text"] == "resource text"
        assert read["contents"][0]["uri"] == "upstream://up/test%3A%2F%2Fr"


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_upstream_errors_keep_their_code(redis_url: str, upstream: str, upstream_rev: str) -> None:
    with front(redis_url, upstream, upstream_rev) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        bad = client.call("tools/call", {"name": "up.t_echo", "arguments": {"text": 5}})
        assert bad["error"]["code"] == -32602 and "t_echo" in bad["error"]["message"]
        missing = client.call("tools/call", {"name": "nothere.tool", "arguments": {}})
        assert missing["error"]["code"] == -32602 and "Tool not found" in missing["error"]["message"]


@pytest.mark.parametrize(("client_rev", "upstream_rev"), PAIRS)
def test_an_unknown_upstream_resource_is_not_found_in_the_clients_revision(redis_url: str, upstream: str,
                                                                          client_rev: str, upstream_rev: str) -> None:
    """-32002 on 2025-11-25, -32602 on 2026-07-28 (SEP-2164), whichever the upstream speaks; the
    URI named is the one the client asked for."""
    uri = "upstream://up/test%3A%2F%2Fnothere"
    with front(redis_url, upstream, upstream_rev) as base:
        error = Client(base, MCP_KEY, client_rev).open().call("resources/read", {"uri": uri})["error"]
    assert error["code"] == (-32602 if client_rev == MODERN else -32002)
    assert error["data"] == {"uri": uri} and error["message"] == f"Resource not found: {uri}"


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_progress_and_log_messages_reach_the_client(redis_url: str, upstream: str, upstream_rev: str) -> None:
    with front(redis_url, upstream, upstream_rev) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        msgs = client.messages("tools/call", {"name": "up.t_chatty", "arguments": {}, "_meta": {"progressToken": "p1"}})
        methods = [m.get("method") for m in msgs[:-1]]
        progress = [m["params"] for m in msgs if m.get("method") == "notifications/progress"]
        assert [p["progress"] for p in progress] == [1, 2] and all(p["progressToken"] == "p1" for p in progress)
        assert "notifications/message" in methods  # a 2026-07-28 upstream gets the legacy session's level
        assert msgs[-1]["result"]["content"][0]["text"] == "done"


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_modern_client_answers_upstream_sampling_through_input_required(redis_url: str, upstream: str,
                                                                       upstream_rev: str) -> None:
    with front(redis_url, upstream, upstream_rev) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        call = {"name": "up.t_ask", "arguments": {}}
        first = client.result("tools/call", call, caps={"sampling": {}})
        assert first["resultType"] == "input_required"
        [(key, request)] = first["inputRequests"].items()
        assert request["method"] == "sampling/createMessage"
        assert key == "q" if upstream_rev == MODERN else key.startswith("up:")  # a 2026-07-28 upstream's key passes
        done = client.result("tools/call", {**call, "requestState": first["requestState"],
                                            "inputResponses": {key: SAMPLED}}, caps={"sampling": {}})
        assert done["resultType"] == "complete" and done["content"][0]["text"] == "got 42"


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_legacy_client_answers_upstream_sampling_on_its_stream(redis_url: str, upstream: str,
                                                               upstream_rev: str) -> None:
    with front(redis_url, upstream, upstream_rev) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        msgs: list[dict[str, Any]] = []
        headers = {**client.auth, "mcp-session-id": client.sid or "", "mcp-protocol-version": LEGACY}

        def run() -> None:
            body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "up.t_ask", "arguments": {}}}
            with httpx.stream("POST", client.url, json=body, headers=headers, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:") and line[5:].strip():
                        msgs.append(orjson.loads(line[5:]))

        reader = threading.Thread(target=run)
        reader.start()
        wait_for_sync(lambda: msgs, timeout_s=15, what="the sampling request on the client's stream")
        ask = msgs[0]
        assert ask["method"] == "sampling/createMessage"
        answer = {"jsonrpc": "2.0", "id": ask["id"], "result": {**SAMPLED, "content": {"type": "text", "text": "B"}}}
        assert httpx.post(client.url, json=answer, headers={**headers, "accept": ACCEPT}).status_code == 202
        reader.join(20)
        assert msgs[-1]["id"] == 9 and msgs[-1]["result"]["content"][0]["text"] == "got B"


def test_unprefixed_namespace_and_pagination(redis_url: str, upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream, namespace="")], "page_size": 3}
    with front_gateway(redis_url, proxy) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        names: list[str] = []
        cursor = None
        for _ in range(50):
            page = client.result("tools/list", {"cursor": cursor} if cursor else {})
            assert len(page["tools"]) <= 3
            names.extend(t["name"] for t in page["tools"])
            cursor = page.get("nextCursor")
            if cursor is None:
                break
        assert "t_echo" in names and "context_append" in names and len(names) == len(set(names))
        assert names.index("t_echo") < names.index("context_append")  # an unprefixed upstream's entries first
        out = client.result("tools/call", {"name": "t_echo", "arguments": {"text": "bare"}})
        assert out["content"][0]["text"] == "proxy:bare"
        assert "test://r" in [r["uri"] for r in client.result("resources/list")["resources"]]
        read = client.result("resources/read", {"uri": "test://r"})
        assert read["contents"][0]["uri"] == "test://r" and read["contents"][0]["text"] == "resource text"
        bad = client.call("tools/list", {"cursor": "bm90LWEtY3Vyc29y"})
        assert bad["error"]["code"] == -32602


@pytest.mark.parametrize("client_rev", [LEGACY, MODERN])
def test_a_cursor_the_proxy_did_not_issue_is_invalid_params(redis_url: str, upstream: str, client_rev: str) -> None:
    """The merged lists issue a cursor at each page boundary of their own list; anything else,
    including another list's cursor or an issued one spelt differently, is -32602."""
    proxy = {"upstreams": [upstream_entry(upstream)], "page_size": 3}
    with front_gateway(redis_url, proxy) as base:
        client = Client(base, MCP_KEY, client_rev).open()
        issued = client.result("tools/list")["nextCursor"]
        assert client.result("tools/list", {"cursor": issued})["tools"]
        offset = int(base64.urlsafe_b64decode(issued).decode().partition(":")[2])
        forged = [base64.urlsafe_b64encode(f"tools:{n}".encode()).decode() for n in (0, offset - 1, offset + 1)]
        respelt = [issued.rstrip("="), issued + "!", base64.urlsafe_b64encode(f"tools:0{offset}".encode()).decode()]
        for method, cursor in [("tools/list", c) for c in (*forged, *respelt, "garbage", "", 5, [issued])] + \
                              [(m, issued) for m in ("prompts/list", "resources/list", "resources/templates/list")]:
            r = client.post(method, {"cursor": cursor})
            error = r.json().get("error", {})
            assert error.get("code") == -32602 and "cursor" in error["message"], (method, cursor, r.text)
            assert r.status_code == (400 if client_rev == MODERN else 200)
