"""WebSocket clients that cannot set headers (browsers, the TypeScript SDK's
``WebSocketClientTransport``) authenticate with a ``bearer.<token>`` subprotocol or a
single-use ticket (gateway/transports/websocket.py, gateway/auth.py), tested here with the
``websockets`` client sending no ``Authorization`` header; a refused handshake is a clean
401 with nothing logged as an error, and no credential reaches the log even at DEBUG."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from shared.redis_client import close_sync, for_each_primary_sync
from tests.conftest import RedisTarget, wait_for_sync
from tests.gateway_support import LoggedGateway as Gateway
from tests.gateway_support import logged_gateway

KEY = "alice-key-0123456789"
TICKET_TTL_S = 45
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


@pytest.fixture(scope="module")
def gw(redis_target_module: RedisTarget, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway per Redis kind (single server, cluster)."""
    with logged_gateway(redis_target_module.url, tmp_path_factory.mktemp("wsauth") / "gateway.log",
                        api_keys=f"alice:{KEY}", log_level="debug",
                        overrides={"gateway": {"ws_ticket_ttl_s": TICKET_TTL_S}}) as gateway:
        yield gateway


def open_ws(gw: Gateway, subprotocols: list[str], query: str = "") -> ClientConnection:
    return ws_connect(gw.ws + query, subprotocols=subprotocols, open_timeout=10)  # type: ignore[arg-type]


def whoami(ws: ClientConnection) -> str:
    """The principal the server sees, through the t_echo test tool."""
    ws.send(orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                          "params": {"name": "t_echo", "arguments": {"text": "x"}, "_meta": META}}).decode())
    reply = orjson.loads(ws.recv(timeout=10))
    return reply["result"]["content"][0]["text"].removesuffix(":x")


def refused(gw: Gateway, subprotocols: list[str], query: str = "") -> Any:
    with pytest.raises(InvalidStatus) as failure, open_ws(gw, subprotocols, query):
        pass
    return failure.value.response


def ticket(gw: Gateway, key: str = KEY) -> httpx.Response:
    return httpx.post(gw.base + "/mcp/ws-ticket", headers={"authorization": f"Bearer {key}"})


def test_bearer_subprotocol_authenticates_and_is_not_echoed(gw: Gateway) -> None:
    with open_ws(gw, ["mcp", f"bearer.{KEY}"]) as ws:
        assert ws.request is not None and "Authorization" not in ws.request.headers
        assert ws.response is not None and ws.response.headers["Sec-WebSocket-Protocol"] == "mcp"
        assert whoami(ws) == "alice"


def test_ticket_authenticates_once(gw: Gateway, redis_target_module: RedisTarget) -> None:
    redis_target_module.flush()
    issued = ticket(gw)
    assert issued.status_code == 200 and issued.json()["expires_in_s"] == TICKET_TTL_S
    assert issued.headers["cache-control"] == "no-store"
    value = issued.json()["ticket"]
    client = redis_target_module.sync_client()
    try:  # Redis holds the ticket under alice's hash tag, with its TTL, and never the ticket itself
        stored = [k for node in for_each_primary_sync(client, lambda n: list(n.scan_iter(match="*wsticket*")))
                  for k in node]
        assert len(stored) == 1 and b"{alice}" in stored[0] and value.split(".")[1].encode() not in stored[0]
        assert 0 < client.ttl(stored[0]) <= TICKET_TTL_S
    finally:
        close_sync(client)
    with open_ws(gw, ["mcp"], f"?ticket={value}") as ws:
        assert whoami(ws) == "alice"
    assert refused(gw, ["mcp"], f"?ticket={value}").status_code == 401  # single use


@pytest.mark.parametrize("subprotocols,query", [
    (["mcp"], ""), (["mcp", "bearer.wrong-key-0123456789"], ""), (["mcp"], "?ticket=garbage"),
    (["mcp"], "?ticket=YWxpY2U." + "A" * 43), (["mcp"], "?ticket=e30." + "A" * 43)])
def test_bad_credentials_are_a_clean_401(gw: Gateway, subprotocols: list[str], query: str) -> None:
    response = refused(gw, subprotocols, query)
    assert response.status_code == 401 and response.headers["www-authenticate"].startswith("Bearer")
    assert orjson.loads(response.body)["error"] == "unauthorized"


def test_a_ticket_needs_credentials(gw: Gateway) -> None:
    assert ticket(gw, "wrong-key-0123456789").status_code == 401
    assert httpx.post(gw.base + "/mcp/ws-ticket").status_code == 401


def test_refusals_log_no_error_and_no_credential(gw: Gateway) -> None:
    issued = ticket(gw).json()["ticket"]
    with open_ws(gw, ["mcp", f"bearer.{KEY}"]) as ws:
        whoami(ws)
    with open_ws(gw, ["mcp"], f"?ticket={issued}") as ws:
        whoami(ws)
    for _ in range(3):
        refused(gw, ["mcp"])
        refused(gw, ["mcp", "bearer.wrong-key-0123456789"])
    # a crash logged after the refusals: proof that the captured output is the replica's log
    httpx.post(gw.base + "/mcp", headers={"authorization": f"Bearer {KEY}", "accept": "application/json",
                                          "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
                                          "mcp-name": "t_crash"},
               json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                     "params": {"name": "t_crash", "arguments": {}, "_meta": META}})
    wait_for_sync(lambda: "secret internal detail" in gw.log.read_text(errors="replace"), timeout_s=10,
                  what="the crash to reach the gateway's log")
    text = gw.log.read_text(errors="replace")
    assert "< sec-websocket-protocol: [redacted]" in text  # proof that the handshakes were logged at DEBUG
    assert "< GET /mcp/ws?[redacted] HTTP/1.1" in text
    before_crash = text.split("internal error while serving")[0].rsplit("\n", 1)[0]
    assert "ASGI" not in before_crash and "ERROR" not in before_crash, before_crash[-3000:]
    assert KEY not in text and issued not in text and issued.split(".")[1] not in text
