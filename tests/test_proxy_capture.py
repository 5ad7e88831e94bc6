"""Opt-in capture: a proxied call's arguments and results become entries of the caller's
context, readable back (context_get) and teachable (a learn sample naming that context's
version); calls of tools not opted in leave no entry. Plus the proxy's /metrics families."""

from __future__ import annotations

import base64

import httpx
import orjson
import pytest

from tests.admin_support import MCP_KEY
from tests.conftest import RedisTarget
from tests.proxy_front import (
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


def test_captured_calls_become_context_entries_and_samples(redis_url: str, upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream, capture={"tools": ["t_echo"]})]}
    with front_gateway(redis_url, proxy, learning={"teachers": ["alice"]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        meta = {"io.learnmesh/context": "weather-chat"}
        client.result("tools/call", {"name": "up.t_echo", "arguments": {"text": "rain?"}, "_meta": meta})
        client.result("tools/call", {"name": "up.t_struct", "arguments": {}, "_meta": meta})  # not captured
        window = client.result("tools/call", {"name": "context_get", "arguments": {"context_id": "weather-chat"}})
        entries = window["structuredContent"]["entries"]
        assert [(e["modality"], e["role"]) for e in entries] == [("text", "user"), ("text", "assistant")]
        assert orjson.loads(entries[0]["text"]) == {"tool": "up.t_echo", "arguments": {"text": "rain?"}}
        assert entries[1]["text"] == "proxy:rain?"
        version = window["structuredContent"]["version"]
        taught = client.result("tools/call", {"name": "learn", "arguments": {
            "input": "rain?", "target": "bring an umbrella", "context_id": "weather-chat", "version": version}})
        assert not taught.get("isError") and len(taught["structuredContent"]["ids"]) == 1


def test_capture_defaults_to_a_context_per_upstream(redis_url: str, upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream, capture=True)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        client.result("tools/call", {"name": "up.t_echo", "arguments": {"text": "one"}})
        window = client.result("tools/call", {"name": "context_get", "arguments": {"context_id": "proxy.up"}})
        assert [e.get("text") for e in window["structuredContent"]["entries"]][-1] == "proxy:one"


def test_metrics_count_calls_latency_and_breaker(redis_url: str, upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        client.result("tools/call", {"name": "up.t_echo", "arguments": {"text": "m"}})
        client.result("tools/call", {"name": "up.t_fail", "arguments": {}})
        text = httpx.get(base + "/metrics").text
        assert 'learnmesh_proxy_calls_total{method="tools/call",outcome="ok",upstream="up"}' in text
        assert 'learnmesh_proxy_calls_total{method="tools/call",outcome="tool_error",upstream="up"}' in text
        assert 'learnmesh_proxy_call_seconds_count{upstream="up"}' in text
        assert 'learnmesh_proxy_breaker_state{upstream="up"} 0.0' in text


async def test_capture_leaves_out_media_no_worker_could_read(redis_target: RedisTarget,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """An upstream's image that is no image would fail every later generate on the context."""
    from conformance.fixtures import PNG_1PX
    from gateway.mcp.dispatcher import Call
    from gateway.proxy.capture import capture
    from shared.config import ContextConfig
    from shared.context import ContextStore

    client = redis_target.async_client()
    try:
        store = ContextStore(client, ContextConfig())
        call = Call(principal="alice", request_id=1, protocol_version="2026-07-28", state=None,  # type: ignore[arg-type]
                    meta={"io.learnmesh/context": "shots"})
        result = {"content": [
            {"type": "image", "data": PNG_1PX, "mimeType": "image/png"},
            {"type": "image", "data": base64.b64encode(b"\x89PNG broken").decode(), "mimeType": "image/png"},
            {"type": "audio", "data": base64.b64encode(b"RIFF\x00\x00\x00\x00WAVEjunk").decode()},
            {"type": "text", "text": "two pictures"}]}
        await capture(store, call, "up", "up.shoot", {}, result, max_image_pixels=4096)
        window = await store.get_window("alice", "shots")
        kept = [(e.modality, e.role) for e in window.entries()]
        assert sorted(kept) == [("image", "assistant"), ("text", "assistant"), ("text", "user")]
        assert [bytes(e.content) for e in window.channels["image"]] == [base64.b64decode(PNG_1PX)]
        assert "left out an image item" in caplog.text and "left out an audio item" in caplog.text
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await client.aclose()
