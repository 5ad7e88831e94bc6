"""``revision: auto`` against an upstream that speaks only 2025-11-25: the gateway's
``server/discover`` is refused, it falls back to sessions, and clients of both revisions are
served. The upstream is a learnmesh gateway behind a guard that refuses every 2026-07-28 request,
as a server of that older revision would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from shared.config import load_config
from tests.admin_support import MCP_KEY, LiveServer
from tests.conftest import RedisTarget
from tests.gateway_support import register_test_tools
from tests.proxy_front import (
    ADMIN,
    LEGACY,
    MODERN,
    UPSTREAM_SECRET,
    Client,
    front_gateway,
    private_redis,
    upstream_entry,
)

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url


def legacy_only(app: Any) -> Any:
    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"mcp-protocol-version") == MODERN.encode():
            body = orjson.dumps({"jsonrpc": "2.0", "id": None,
                                 "error": {"code": -32600, "message": "Unsupported protocol version"}})
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)
    return guarded


@pytest.fixture
def old_upstream() -> Iterator[str]:
    with private_redis() as db:
        cfg = load_config(None, env={}, overrides={"redis": {"url": db},
                                                   "gateway": {"api_keys": {"proxy": UPSTREAM_SECRET}}})
        app = create_app(cfg)
        register_test_tools(app.registry)
        with LiveServer(legacy_only(app)) as server:
            yield server.url + "/mcp"


def test_auto_falls_back_to_sessions(redis_url: str, old_upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(old_upstream, revision="auto")]}) as base:
        for revision in (LEGACY, MODERN):
            client = Client(base, MCP_KEY, revision).open()
            out = client.result("tools/call", {"name": "up.t_echo", "arguments": {"text": revision}})
            assert out["content"][0]["text"] == f"proxy:{revision}"
        health = httpx.get(base + "/admin/upstreams/up/health", headers=ADMIN).json()
        assert health["revision"] == LEGACY and health["breaker"] == "closed"
