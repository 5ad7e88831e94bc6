"""The official SDK client (``mcp`` 2.3.0) through the proxy, in both of its modes, against an
upstream pinned to either revision: lists, calls, resources, prompts, and the SDK's own
input_required loop answered across the revision boundary."""

from __future__ import annotations

from typing import Any

import pytest
from mcp import Client

from tests.conftest import RedisTarget
from tests.proxy_front import LEGACY, MODERN, front_gateway, upstream_entry

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url

PAIRS = [("legacy", LEGACY), ("legacy", MODERN), (MODERN, LEGACY), (MODERN, MODERN)]  # (SDK mode, upstream)


@pytest.mark.parametrize(("mode", "upstream_rev"), PAIRS)
async def test_sdk_client_through_the_proxy(redis_url: str, fixtures_upstream: str, mode: str,
                                            upstream_rev: str) -> None:
    proxy = {"upstreams": [upstream_entry(fixtures_upstream, revision=upstream_rev)]}
    with front_gateway(redis_url, proxy, api_keys={}) as base:
        async with Client(base + "/mcp", mode=mode, cache=None) as client:
            names = {t.name for t in (await client.list_tools()).tools}
            assert {"up.test_simple_text", "context_append"} <= names
            called = await client.call_tool("up.test_simple_text", {})
            assert called.content[0].text == "This is a simple text response for testing."
            failed = await client.call_tool("up.test_error_handling", {})
            assert failed.is_error
            read = await client.read_resource("upstream://up/test%3A%2F%2Fstatic-text")
            assert read.contents[0].text == "This is the content of the static text resource."
            prompt = await client.get_prompt("up.test_prompt_with_arguments", {"arg1": "a", "arg2": "b"})
            assert prompt.messages[0].content.text == "Prompt with arguments: arg1='a', arg2='b'"


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
async def test_sdk_input_required_loop_through_the_proxy(redis_url: str, fixtures_upstream: str,
                                                         upstream_rev: str) -> None:
    async def elicit(context: Any, params: Any) -> Any:
        from mcp.types import ElicitResult
        field = next(iter(params.requested_schema["properties"]))
        return ElicitResult(action="accept", content={field: "Ada" if field == "name" else "green"})

    proxy = {"upstreams": [upstream_entry(fixtures_upstream, revision=upstream_rev)]}
    with front_gateway(redis_url, proxy, api_keys={}) as base:
        async with Client(base + "/mcp", mode=MODERN, cache=None, elicitation_callback=elicit) as client:
            out = await client.call_tool("up.test_input_required_result_multi_round", {})
            assert out.content[0].text == "Multi-round complete for Ada who likes green"
