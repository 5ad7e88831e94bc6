"""DNS rebinding: with no keys on a loopback bind the gateway is open to this machine, so a web
page must not reach it through a name the attacker controls. Loopback is decided by parsing
the address (gateway/auth.py), for ``Origin`` and ``Host`` alike; here through a live gateway."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from gateway.auth import is_loopback
from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

REBIND = "127.0.0.1.rebind.attacker.example"
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}
HEADERS = {"accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
           "mcp-method": "server/discover"}


@pytest.fixture(scope="module")
def port(redis_server: str) -> Iterator[int]:
    p = free_port()
    proc = start_gateway(p, redis_server)  # no API keys, bound to 127.0.0.1: open
    yield p
    stop(proc)


def discover(port: int, **headers: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/mcp", headers={**HEADERS, **headers},
                      json={"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": META}})


@pytest.mark.parametrize("host", [REBIND, "127.attacker.example", "localhost.attacker.example", "0.0.0.0",
                                  "10.0.0.1", "[::2]"])
def test_foreign_host_is_refused(port: int, host: str) -> None:
    r = discover(port, host=f"{host}:{port}")
    assert r.status_code == 403 and r.json()["error_description"] == "host not allowed", r.text


@pytest.mark.parametrize("origin", [f"http://{REBIND}", f"http://{REBIND}:80", "http://127.0.0.1.nip.io",
                                    "http://attacker.example"])
def test_foreign_origin_is_refused(port: int, origin: str) -> None:
    r = discover(port, origin=origin)
    assert r.status_code == 403 and r.json()["error_description"] == "origin not allowed", r.text


@pytest.mark.parametrize("name", ["127.0.0.1", "127.0.0.2", "localhost", "[::1]"])
def test_loopback_names_are_served(port: int, name: str) -> None:
    r = discover(port, host=f"{name}:{port}", origin=f"http://{name}:{port}")
    assert r.status_code == 200 and r.json()["result"]["serverInfo"]["name"] == "learnmesh", r.text


@pytest.mark.parametrize("method,path", [("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/readyz"),
                                         ("HEAD", "/healthz"), ("GET", "/admin/ui"), ("GET", "/admin/ui/app.js"),
                                         ("GET", "/admin/openapi.json"), ("GET", "/admin/summary"),
                                         ("POST", "/mcp/ws-ticket"), ("GET", "/nowhere")])
def test_every_route_answers_loopback_names_only(port: int, method: str, path: str) -> None:
    """A page on a rebound name reads nothing of the gateway: not its metrics, its health, its
    dashboard's files nor the shape of its routes."""
    url = f"http://127.0.0.1:{port}{path}"
    refused = httpx.request(method, url, headers={"host": f"{REBIND}:{port}"})
    assert refused.status_code == 403, (path, refused.status_code, refused.text)
    if method != "HEAD":
        assert "host not allowed" in refused.text and "learnmesh" not in refused.text
    assert refused.headers["connection"] == "close"
    served = httpx.request(method, url, headers={"host": f"localhost:{port}"})
    assert served.status_code != 403, (path, served.status_code, served.text)


def test_websocket_handshake_is_guarded_alike(port: int) -> None:
    # the browser's view: the URL names the attacker's host, which resolves to 127.0.0.1
    for url, headers in ((f"ws://{REBIND}:{port}/mcp/ws", {}),
                         (f"ws://127.0.0.1:{port}/mcp/ws", {"Origin": f"http://{REBIND}"})):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        with pytest.raises(InvalidStatus) as refused, ws_connect(url, sock=sock, subprotocols=["mcp"],
                                                                 additional_headers=headers, open_timeout=10):
            pass
        sock.close()
        assert refused.value.response.status_code == 403
    with ws_connect(f"ws://127.0.0.1:{port}/mcp/ws", subprotocols=["mcp"],
                    additional_headers={"Origin": f"http://127.0.0.2:{port}"}, open_timeout=10) as ws:
        assert ws.subprotocol == "mcp"


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("127.255.255.254", True), ("localhost", True), ("LocalHost", True),
    ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    (REBIND, False), ("127.evil", False), ("127.0.0.1:80", False), ("0.0.0.0", False), ("::", False),
    ("[::1", False), ("", False), ("localhost.", False), ("169.254.0.1", False)])
def test_is_loopback_parses_the_address(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
