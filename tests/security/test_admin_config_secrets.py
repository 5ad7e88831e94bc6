"""What ``GET /admin/config`` shows a viewer key, on a live gateway reaching a Redis that demands
a password: the configuration with every secret it may hold taken out, wherever it was written."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis_servers import SecuredRedis, start_password

from tests.admin_support import VIEWER_KEY, bearer, live_gateway

UPSTREAM_QUERY_TOKEN = "query-token-5f2c"
UPSTREAM_ARG_TOKEN = "argv-token-9d41"
UPSTREAM_TOKEN_VAR = "LM_TEST_UPSTREAM_TOKEN_VAR"
UPSTREAM_QUERY_VAR = "LM_TEST_UPSTREAM_QUERY_VAR"


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[SecuredRedis]:
    server = start_password(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


def test_the_config_view_shows_no_password_token_or_credential_source(secured: SecuredRedis,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py reads a password from the URL's query as from its user info; an upstream's query
    parameters and a stdio server's arguments may carry tokens; the upstream routes never name where a
    credential comes from, and neither does the configuration."""
    monkeypatch.setenv(UPSTREAM_TOKEN_VAR, "Bearer upstream-secret")
    monkeypatch.setenv(UPSTREAM_QUERY_VAR, UPSTREAM_QUERY_TOKEN)
    url = f"{secured.url}?password={secured.secret}"
    upstreams = [{"name": "search", "url": "http://127.0.0.1:1/mcp", "query_from_env": {"api_key": UPSTREAM_QUERY_VAR},
                  "headers_from_env": {"Authorization": UPSTREAM_TOKEN_VAR}},
                 {"name": "tool", "command": [sys.executable, "-c", "pass", "--token", UPSTREAM_ARG_TOKEN]}]
    with live_gateway(url, proxy={"upstreams": upstreams}) as srv:
        resp = httpx.get(f"{srv.url}/admin/config", headers=bearer(VIEWER_KEY), timeout=10)
    assert resp.status_code == 200, resp.text
    for secret in (secured.secret, UPSTREAM_QUERY_TOKEN, UPSTREAM_ARG_TOKEN, UPSTREAM_TOKEN_VAR, UPSTREAM_QUERY_VAR):
        assert secret not in resp.text
    config = resp.json()["config"]
    assert config["redis"]["url"] == f"{secured.url}?password=***"
    search, tool = config["proxy"]["upstreams"]
    assert search["url"] == "http://127.0.0.1:1/mcp"
    assert search["query_from_env"] == {"api_key": "***"}  # the parameter's name stays, its source goes
    assert search["headers_from_env"] == {"Authorization": "***"}
    assert tool["command"] == [sys.executable, "***", "***", "***", "***"]
