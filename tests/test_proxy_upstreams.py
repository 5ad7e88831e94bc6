"""The proxy tests' upstream servers, checked directly with the official SDK client.

A proxy test that fails must point at the proxy, never at its upstream: these tests prove
each upstream (SDK ``mcp`` 2.3.0, a process on a free port or over stdio) serves every tool,
resource and prompt the proxy tests use, speaks only its pinned revision, and lets in only
the bearer token it was given.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import httpx2
import pytest
from mcp.shared.exceptions import MCPError

from conformance.http_guards import LEGACY, MODERN
from tests.proxy.harness import ELICITED_NAME, SAMPLED_TEXT, Upstream, leaf_errors, sdk_client
from tests.proxy.upstreams.server import FAIL_MESSAGE, PNG_1PX, STATIC_TEXT, STATIC_URI

pytest_plugins = ("tests.proxy_support",)  # its fixtures: the upstream processes

CLIENT_MODE = {LEGACY: "legacy", MODERN: MODERN}
TOOLS = {"echo", "add", "image", "slow", "fail", "progress", "revision", "greet_user", "ask_model"}


@pytest.fixture(params=[LEGACY, MODERN])
def pinned_upstream(request: pytest.FixtureRequest) -> Upstream:
    return request.getfixturevalue("legacy_upstream" if request.param == LEGACY else "modern_upstream")


async def exercise(client: Any, expect_revision: str) -> None:
    """Everything the proxy tests rely on, through one connected SDK client."""
    listed = await client.list_tools()
    assert {t.name for t in listed.tools} >= TOOLS

    assert (await client.call_tool("echo", {"text": "hi"})).content[0].text == "hi"
    added = await client.call_tool("add", {"a": 2, "b": 3})
    assert added.structured_content == {"total": 5, "operands": [2, 3]}
    image = (await client.call_tool("image", {})).content[0]
    assert image.mime_type == "image/png" and base64.b64decode(image.data) == PNG_1PX
    failed = await client.call_tool("fail", {})
    assert failed.is_error and FAIL_MESSAGE in failed.content[0].text
    assert (await client.call_tool("revision", {})).content[0].text == expect_revision

    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    done = await client.call_tool("progress", {"steps": 3}, progress_callback=on_progress)
    assert done.content[0].text == "3 steps done" and seen == [1, 2, 3]

    greeted = await client.call_tool("greet_user", {})
    assert greeted.content[0].text == f"Hello, {ELICITED_NAME}!"
    sampled = await client.call_tool("ask_model", {"prompt": "Capital of France?"})
    assert sampled.content[0].text == f"model said: {SAMPLED_TEXT}"

    assert (await client.read_resource(STATIC_URI)).contents[0].text == STATIC_TEXT
    templates = await client.list_resource_templates()
    assert [t.uri_template for t in templates.resource_templates] == ["upstream://items/{item_id}"]
    item = await client.read_resource("upstream://items/42")
    assert '"item": "42"' in item.contents[0].text
    prompt = await client.get_prompt("greeting", {"person": "Grace"})
    assert prompt.messages[0].content.text == "Please greet Grace warmly."


async def test_pinned_upstream_serves_its_revision(pinned_upstream: Upstream) -> None:
    async with sdk_client(pinned_upstream, CLIENT_MODE[pinned_upstream.revision]) as client:
        await exercise(client, pinned_upstream.revision)


async def test_auto_mode_lands_on_the_pinned_revision(pinned_upstream: Upstream) -> None:
    """The SDK's ``auto`` probe finds the one revision each upstream speaks."""
    async with sdk_client(pinned_upstream, "auto") as client:
        assert (await client.call_tool("revision", {})).content[0].text == pinned_upstream.revision


async def test_upstream_refuses_the_other_revision(pinned_upstream: Upstream) -> None:
    other = "legacy" if pinned_upstream.revision == MODERN else MODERN
    with pytest.raises(BaseException) as caught:
        async with sdk_client(pinned_upstream, other) as client:
            await client.list_tools()
    refusals = [e for e in leaf_errors(caught.value) if isinstance(e, MCPError)]
    assert refusals and "Unsupported protocol version" in str(refusals[0])


@pytest.mark.parametrize("mode", ["legacy", MODERN])
async def test_stdio_upstream_serves_both_revisions(stdio_upstream: Upstream, mode: str) -> None:
    async with sdk_client(stdio_upstream, mode) as client:
        await exercise(client, LEGACY if mode == "legacy" else MODERN)


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic x"])
async def test_upstream_demands_its_bearer_token(legacy_upstream: Upstream, authorization: str | None) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    async with httpx.AsyncClient(timeout=5) as http:
        refused = await http.post(legacy_upstream.url, json=body, headers=headers)
        assert refused.status_code == 401
        assert legacy_upstream.token not in refused.text
        admitted = await http.post(legacy_upstream.url, json=body, headers={**headers, **legacy_upstream.headers})
        assert admitted.status_code == 200


async def test_killed_upstream_fails_the_call_in_flight(modern_upstream: Upstream, kill_mid_call: Any) -> None:
    """The killer fixture works: the call reaches the upstream, the process dies under it and
    the SDK client reports the broken connection instead of waiting."""
    outcome: tuple[str, Any] | None = None
    with pytest.raises(BaseException) as caught:
        async with sdk_client(modern_upstream, MODERN) as client:
            outcome = await kill_mid_call(modern_upstream, lambda: client.call_tool("slow", {"seconds": 60}))
    # The SDK's 2026-07-28 transport fails its whole connection (cancelling the body) rather
    # than the one call; either way the call ended.
    assert outcome is None or outcome[0] in ("error", "cancelled"), outcome
    assert any(isinstance(e, httpx2.TransportError) for e in leaf_errors(caught.value)), caught.value
    assert modern_upstream.proc.poll() is not None
