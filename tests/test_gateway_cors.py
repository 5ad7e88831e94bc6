"""CORS on a live gateway (gateway/transports/cors.py): a browser app on an origin listed in
``gateway.allowed_origins`` (or a loopback one) gets its preflights answered and may read the
answers and the headers an MCP client needs; any other origin gets no CORS header at all and
its requests stay 403. Real HTTP requests, as a browser sends them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop
from tests.test_gateway_http import ACCEPT, modern, rpc

KEY = "cors-test-key-0123456789"
APP = "https://app.example"
FOREIGN = "https://attacker.example"
INITIALIZE = rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                "clientInfo": {"name": "browser", "version": "1"}})


@pytest.fixture(scope="module")
def base(redis_server: str) -> Iterator[str]:
    port = free_port()
    proc = start_gateway(port, redis_server, api_keys=f"alice:{KEY}",
                         overrides={"gateway": {"allowed_origins": [APP]}})
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def preflight(base: str, origin: str, path: str = "/mcp", method: str = "POST",
              headers: str = "authorization, content-type, mcp-protocol-version, mcp-method") -> httpx.Response:
    return httpx.options(base + path, headers={"origin": origin, "access-control-request-method": method,
                                               "access-control-request-headers": headers})


def listed(value: str) -> set[str]:
    return {part.strip().lower() for part in value.split(",")}


@pytest.mark.parametrize("origin", [APP, "http://localhost:6274"])
def test_preflight_from_an_allowed_origin_is_answered(base: str, origin: str) -> None:
    r = preflight(base, origin, headers="authorization, content-type, mcp-session-id, mcp-param-region")
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == origin
    assert "origin" in listed(r.headers["vary"])
    assert listed(r.headers["access-control-allow-methods"]) == {"get", "post", "delete"}
    assert {"authorization", "content-type", "mcp-session-id", "mcp-protocol-version", "last-event-id",
            "mcp-method", "mcp-name", "mcp-param-region"} <= listed(r.headers["access-control-allow-headers"])
    assert int(r.headers["access-control-max-age"]) > 0
    assert "access-control-allow-credentials" not in r.headers  # credentials are headers, never cookies


def test_preflight_from_another_origin_gets_no_cors(base: str) -> None:
    r = preflight(base, FOREIGN)
    assert r.status_code == 403
    assert not any(name.startswith("access-control-") for name in r.headers)


def test_answers_name_the_allowed_origin_and_expose_what_a_client_reads(base: str) -> None:
    opened = httpx.post(base + "/mcp", json=INITIALIZE,
                        headers={"origin": APP, "accept": ACCEPT, "authorization": f"Bearer {KEY}"})
    assert opened.status_code == 200, opened.text
    assert opened.headers["access-control-allow-origin"] == APP
    assert {"mcp-session-id", "www-authenticate", "retry-after"} <= listed(
        opened.headers["access-control-expose-headers"])
    assert "origin" in listed(opened.headers["vary"]) and opened.headers["mcp-session-id"]
    # a refusal too: an OAuth client reads WWW-Authenticate off the 401
    body, headers = modern("tools/list")
    refused = httpx.post(base + "/mcp", json=body, headers={**headers, "origin": APP, "authorization": "Bearer no"})
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert refused.headers["access-control-allow-origin"] == APP


def test_another_origin_is_refused_without_cors(base: str) -> None:
    body, headers = modern("tools/list")
    r = httpx.post(base + "/mcp", json=body, headers={**headers, "origin": FOREIGN, "authorization": f"Bearer {KEY}"})
    assert r.status_code == 403 and "origin not allowed" in r.text
    assert not any(name.startswith("access-control-") for name in r.headers)


def test_requests_without_origin_are_untouched(base: str) -> None:
    body, headers = modern("tools/list")
    r = httpx.post(base + "/mcp", json=body, headers={**headers, "authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert not any(name.startswith("access-control-") for name in r.headers)


def test_ticket_route_and_resource_metadata_allow_the_origin(base: str) -> None:
    """A browser client that cannot set WebSocket headers fetches a ticket first."""
    assert listed(preflight(base, APP, "/mcp/ws-ticket").headers["access-control-allow-methods"]) == {"post"}
    ticket = httpx.post(base + "/mcp/ws-ticket", headers={"origin": APP, "authorization": f"Bearer {KEY}"})
    assert ticket.status_code == 200 and ticket.headers["access-control-allow-origin"] == APP
    r = preflight(base, APP, "/.well-known/oauth-protected-resource", "GET", "mcp-protocol-version")
    assert r.status_code == 204 and listed(r.headers["access-control-allow-methods"]) == {"get"}


def test_other_routes_get_no_cors(base: str) -> None:
    r = preflight(base, APP, "/admin/summary", "GET", "authorization")
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in httpx.get(base + "/healthz", headers={"origin": APP}).headers
