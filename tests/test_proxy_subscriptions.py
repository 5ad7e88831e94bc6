"""Resource subscriptions across the proxy: a client of either revision subscribed to an
upstream's resource gets the upstream's ``notifications/resources/updated`` for it, with the
URI in the client's form, whatever revision the upstream speaks."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis as redis_sync

from tests.admin_support import MCP_KEY
from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import start_gateway, stop
from tests.proxy_front import (
    LEGACY,
    MODERN,
    UPSTREAM_SECRET,
    Client,
    front_gateway,
    private_redis,
    read_stream,
    upstream_entry,
)

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


@dataclass
class Restartable:
    """A learnmesh upstream whose process can be restarted on its port, forgetting its sessions."""

    url: str
    port: int
    db: str
    proc: subprocess.Popen

    def restart(self) -> None:
        """A restart that loses the upstream's state (its sessions and their subscriptions)."""
        self.proc.kill()
        self.proc.wait(10)
        with redis_sync.Redis.from_url(self.db) as r:
            r.flushall()
        self.proc = start_gateway(self.port, self.db, api_keys=f"proxy:{UPSTREAM_SECRET}")


@contextmanager
def restartable_upstream() -> Iterator[Restartable]:
    with private_redis() as db:
        port = free_port()
        up = Restartable(f"http://127.0.0.1:{port}/mcp", port, db,
                         start_gateway(port, db, api_keys=f"proxy:{UPSTREAM_SECRET}"))
        try:
            yield up
        finally:
            stop(up.proc)


def test_subscriptions_are_renewed_on_a_legacy_upstreams_new_session(redis_url: str) -> None:
    """A 2025-11-25 upstream keeps subscriptions per session: one that restarts and forgets its
    sessions is subscribed again on the new session, and updates keep coming."""
    with restartable_upstream() as upstream, \
            front_gateway(redis_url, {"upstreams": [upstream_entry(upstream.url, revision=LEGACY)]}) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        assert client.result("resources/subscribe", {"uri": URI}) == {}
        seen: list[dict[str, Any]] = []
        headers = {**client.auth, "mcp-session-id": client.sid or "", "mcp-protocol-version": LEGACY}
        threading.Thread(target=read_stream, args=("GET", client.url, headers, None, seen, "none"),
                         daemon=True).start()
        _until_updated(client, seen)
        upstream.restart()
        seen.clear()
        assert _until_updated(client, seen)["params"]["uri"] == URI
