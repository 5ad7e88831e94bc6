"""Resource subscriptions across the proxy: a client of either revision subscribed to an
upstream's resource gets the upstream's ``notifications/resources/updated`` for it, with the
URI in the client's form, whatever revision the upstream speaks."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.admin_support import MCP_KEY
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import LEGACY, MODERN, Client, front_gateway, read_stream, upstream_entry

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url

URI = "upstream://up/test%3A%2F%2Fr"
UPDATED = "notifications/resources/updated"


def _until_updated(client: Client, seen: list[dict[str, Any]]) -> dict[str, Any]:
    def updated() -> bool:  # the upstream's resource changes until the update has come through
        client.result("tools/call", {"name": "up.t_touch", "arguments": {}})
        return any(m.get("method") == "notifications/resources/updated" for m in seen)

    wait_for_sync(updated, timeout_s=20, interval_s=0.3, what="the upstream's resource update at the client")
    return next(m for m in seen if m.get("method") == "notifications/resources/updated")


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_legacy_client_subscription_gets_upstream_updates(redis_url: str, upstream: str, upstream_rev: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream, revision=upstream_rev)]}) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        assert client.result("resources/subscribe", {"uri": URI}) == {}
        seen: list[dict[str, Any]] = []
        headers = {**client.auth, "mcp-session-id": client.sid or "", "mcp-protocol-version": LEGACY}
        reader = threading.Thread(target=read_stream,
                                  args=("GET", client.url, headers, None, seen, UPDATED), daemon=True)
        reader.start()
        note = _until_updated(client, seen)
        assert note["params"]["uri"] == URI


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_listen_stream_gets_upstream_updates(redis_url: str, upstream: str, upstream_rev: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream, revision=upstream_rev)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        seen: list[dict[str, Any]] = []
        body = {"jsonrpc": "2.0", "id": 3, "method": "subscriptions/listen",
                "params": {"notifications": {"resourceSubscriptions": [URI]},
                           "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                     "io.modelcontextprotocol/clientCapabilities": {}}}}
        headers = {**client.auth, "mcp-protocol-version": MODERN, "mcp-method": "subscriptions/listen"}
        reader = threading.Thread(target=read_stream,
                                  args=("POST", client.url, headers, body, seen, UPDATED), daemon=True)
        reader.start()
        wait_for_sync(lambda: seen, timeout_s=10, what="the listen stream's acknowledgement")
        note = _until_updated(client, seen)
        assert note["params"]["uri"] == URI
