"""What a browser or a cache in front may do with admin answers: keep none of them (a new key's
plaintext, contexts' contents, the audit log are for the key's holder, now), read none of
them as another type than declared, and show the dashboard in no other site's frame."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.admin_support import ADMIN_KEY, MCP_KEY, VIEWER_KEY, bearer, live_gateway
from tests.security.raw_http import connection, read_response


@pytest.fixture(scope="module")
def gw(redis_server: str) -> Iterator[httpx.Client]:
    with live_gateway(redis_server) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        yield client


def _never_stored(resp: httpx.Response) -> None:
    assert resp.headers.get("cache-control") == "no-store", (resp.request.url, resp.status_code, resp.headers)
    assert resp.headers.get("x-content-type-options") == "nosniff", (resp.request.url, resp.headers)


def test_admin_answers_are_never_stored(gw: httpx.Client) -> None:
    created = gw.post("/admin/keys", headers=bearer(ADMIN_KEY), json={"name": "cache-probe", "role": "viewer"})
    assert created.status_code == 201 and created.json()["key"], created.text
    _never_stored(created)  # the key's plaintext, shown once
    for path in ("/admin/summary", "/admin/config", "/admin/keys", "/admin/audit", "/admin/contexts",
                 "/admin/sessions", "/admin/whoami"):
        resp = gw.get(path, headers=bearer(ADMIN_KEY))
        assert resp.status_code == 200, (path, resp.text)
        _never_stored(resp)
    assert gw.delete("/admin/keys/cache-probe", headers=bearer(ADMIN_KEY)).status_code == 200


@pytest.mark.parametrize("method,path,headers,status", [
    ("GET", "/admin/summary", {}, 401),  # refused by the edge, before routing
    ("GET", "/admin/summary", bearer(MCP_KEY), 401),
    ("POST", "/admin/keys", bearer(VIEWER_KEY), 403),
    ("GET", "/admin/contexts/alice/%3Cb%3Ex", bearer(VIEWER_KEY), 400),  # the id is echoed
    ("GET", "/admin/sessions/nope", bearer(VIEWER_KEY), 404),
    ("GET", "/admin/contexts?limit=-1", bearer(VIEWER_KEY), 422),
    ("GET", "/admin/nothing-here", bearer(VIEWER_KEY), 404),
])
def test_admin_refusals_are_never_stored(gw: httpx.Client, method: str, path: str, headers: dict[str, str],
                                         status: int) -> None:
    resp = gw.request(method, path, headers=headers, json={} if method == "POST" else None)
    assert resp.status_code == status, (path, resp.status_code, resp.text)
    _never_stored(resp)


def test_a_body_refused_for_its_size_is_never_stored(gw: httpx.Client) -> None:
    port = gw.base_url.port
    assert port is not None
    with connection(port) as sock:
        sock.sendall(f"POST /admin/keys HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN_KEY}\r\n"
                     f"Content-Length: {10**9}\r\n\r\n".encode())
        status, headers, _ = read_response(sock)
    assert status == 413
    assert headers.get("cache-control") == "no-store" and headers.get("x-content-type-options") == "nosniff"


@pytest.mark.parametrize("path", ["/admin/ui", "/admin/ui/", "/admin/ui/index.html", "/admin/ui/app.js",
                                  "/admin/ui/style.css"])
def test_the_dashboard_runs_its_own_files_only_and_is_never_framed(gw: httpx.Client, path: str) -> None:
    resp = gw.get(path)
    assert resp.status_code == 200
    _never_stored(resp)
    policy = {d.strip().split(" ", 1)[0]: d.strip() for d in resp.headers["content-security-policy"].split(";")}
    assert policy["default-src"] == "default-src 'self'" and policy["frame-ancestors"] == "frame-ancestors 'none'"
    assert policy["object-src"] == "object-src 'none'" and policy["base-uri"] == "base-uri 'none'"
    assert resp.headers["x-frame-options"] == "DENY"
    assert resp.headers.get_list("cache-control") == ["no-store"]  # the route's own, not repeated by the edge


def test_mcp_answers_carry_no_admin_headers(gw: httpx.Client) -> None:
    """The hot path is left as it is: the headers are the admin routes' alone."""
    resp = gw.post("/mcp", headers={**bearer(MCP_KEY), "accept": "application/json"},
                   json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert resp.status_code == 400 and "x-content-type-options" not in resp.headers
