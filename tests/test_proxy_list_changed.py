"""An upstream's ``list_changed`` across the proxy: it reaches every client that may see the
upstream — a 2025-11-25 session on its GET stream, a 2026-07-28 ``subscriptions/listen``
stream — and no principal the allow-list keeps from the upstream; every replica drops its copy
of the upstream's lists, so the next ``tools/list`` shows the change."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from tests.admin_support import MCP_KEY
from tests.conftest import wait_for_sync
from tests.proxy.harness import Upstream, sdk_client
from tests.proxy_front import (
    BOB_KEY,
    LEGACY,
    MODERN,
    Client,
    Stream,
    front_gateway,
    get_stream,
    publish_control,
)
from tests.proxy_front import listen_stream as listen_stream_for

pytest_plugins = ("tests.proxy_support",)  # its fixtures: the SDK upstream processes

TOKEN_ENV = "LM_TEST_LIST_CHANGED_TOKEN"
TOOLS_CHANGED = "notifications/tools/list_changed"
PROMPTS_CHANGED = "notifications/prompts/list_changed"
SENTINEL = {"t": "lc", "p": "bob", "k": "prompts", "o": "another-replica"}  # the gateway's own change, for bob


def listen_stream(client: Client) -> Stream:
    """A 2026-07-28 listen stream asking for tool and prompt list changes."""
    return listen_stream_for(client, {"toolsListChanged": True, "promptsListChanged": True})


@pytest.fixture(params=[LEGACY, MODERN])
def sdk_upstream(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Upstream:
    """An SDK upstream of either revision whose credential the front reads from ``TOKEN_ENV``."""
    up: Upstream = request.getfixturevalue("legacy_upstream" if request.param == LEGACY else "modern_upstream")
    monkeypatch.setenv(TOKEN_ENV, f"Bearer {up.token}")
    return up


def _front(redis_url: str, up: Upstream, list_ttl_s: float = 3600.0) -> Any:
    """A front gateway on ``up`` that only alice may use; its lists are kept long enough that only
    a change announced can make it fetch them again within a test."""
    entry = {"name": "up", "url": up.url, "headers_from_env": {"Authorization": TOKEN_ENV}, "timeout_s": 10.0,
             "revision": up.revision}
    return front_gateway(redis_url, {"upstreams": [entry], "allow": {"principals": {"alice": ["up"]}},
                                     "list_ttl_s": list_ttl_s})


def test_the_first_list_is_fetched_on_a_clock_younger_than_the_list_ttl(redis_url: str, sdk_upstream: Upstream) -> None:
    """The monotonic clock counts from boot: a list TTL longer than the host's uptime must not make
    the never-fetched lists look fresh (and empty)."""
    with _front(redis_url, sdk_upstream, list_ttl_s=2 * time.monotonic() + 3600) as base:
        assert "up.echo" in Client(base, MCP_KEY, MODERN).names()


def _assert_bob_told_nothing(redis_url: str, streams: list[Stream]) -> None:
    """The gateway's own change for bob comes after the upstream's: once each of bob's streams
    has it, the upstream's would have come before it."""
    publish_control(redis_url, SENTINEL)
    for stream in streams:
        wait_for_sync(lambda s=stream: PROMPTS_CHANGED in s.methods(), timeout_s=10,
                      what="the gateway's own prompts/list_changed on bob's stream")
        assert TOOLS_CHANGED not in stream.methods()


def test_upstream_change_reaches_both_revisions_and_only_the_allowed(redis_url: str, sdk_upstream: Upstream) -> None:
    with _front(redis_url, sdk_upstream) as base:
        alice, alice_modern = Client(base, MCP_KEY, LEGACY).open(), Client(base, MCP_KEY, MODERN)
        bob, bob_modern = Client(base, BOB_KEY, LEGACY).open(), Client(base, BOB_KEY, MODERN)
        assert "up.echo" in alice.names() and "up.echo" in alice_modern.names()  # the lists are now kept
        assert not [n for n in bob.names() if n.startswith("up.")]
        alice_streams = [get_stream(alice), listen_stream(alice_modern)]
        bob_streams = [get_stream(bob), listen_stream(bob_modern)]
        names = (f"added_{i}" for i in itertools.count())
        added: list[str] = []

        def told() -> bool:  # the proxy may still be opening its own stream on the upstream
            added.append(next(names))
            assert alice.result("tools/call", {"name": "up.grow", "arguments": {"name": added[-1]}})
            return all(TOOLS_CHANGED in s.methods() for s in alice_streams)

        wait_for_sync(told, timeout_s=30, interval_s=0.3, what="the upstream's tools/list_changed at alice's streams")
        assert f"up.{added[-1]}" in alice.names()
        assert f"up.{added[-1]}" in alice_modern.names()
        listen_note = next(m for m in alice_streams[1].seen if m.get("method") == TOOLS_CHANGED)
        assert listen_note["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 9
        _assert_bob_told_nothing(redis_url, bob_streams)


def test_change_learned_by_another_replica_reaches_this_replicas_sessions(redis_url: str,
                                                                          legacy_upstream: Upstream,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, f"Bearer {legacy_upstream.token}")
    with _front(redis_url, legacy_upstream) as base:
        alice, bob = Client(base, MCP_KEY, LEGACY).open(), Client(base, BOB_KEY, LEGACY).open()
        assert "up.elsewhere" not in alice.names()
        alice_stream, bob_stream = get_stream(alice), get_stream(bob)

        async def grow_directly() -> None:  # the front does not see this call, nor its notification
            async with sdk_client(legacy_upstream, "legacy") as direct:
                await direct.call_tool("grow", {"name": "elsewhere"})

        asyncio.run(grow_directly())
        assert "up.elsewhere" not in alice.names()  # the front still has the lists it fetched
        publish_control(redis_url, {"t": "lc", "p": None, "k": "tools", "u": "up", "o": "another-replica"})
        wait_for_sync(lambda: TOOLS_CHANGED in alice_stream.methods(), timeout_s=10,
                      what="tools/list_changed from another replica on alice's GET stream")
        assert "up.elsewhere" in alice.names()
        _assert_bob_told_nothing(redis_url, [bob_stream])
