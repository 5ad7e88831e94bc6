"""OAuth resource-server mode on real gateway processes against a real Redis: the RFC 9728
document, HS256 JWTs minted here with PyJWT accepted on both MCP revisions (principal = the
configured claim), every kind of bad token refused with 401 + ``WWW-Authenticate`` and no
state written, isolation between two ``sub`` values, and no secret in the replica's logs. The
WebSocket transport (``/mcp/ws``) is held to the same rules, its handshake refused with the
same 401 + challenge."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
import orjson
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from shared.redis_client import close_sync, for_each_primary_sync
from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import start_gateway, stop
from tests.test_gateway_http import ACCEPT, modern, rpc

LEGACY = "2025-11-25"
ISSUER = "https://auth.example.test"
AUDIENCE = "learnmesh-test-audience"
SECRET = "hs256-secret-of-the-test-authorization-server-0123456789abcdefgh"  # 64 bytes: HS512 too
OTHER_SECRET = "another-authorization-servers-secret-0123456789abcdefghijklmnopq"
API_KEY = "ops-api-key-12345678"
WELL_KNOWN = "/.well-known/oauth-protected-resource"


@dataclass
class Gateway:
    base: str
    log: Path | None = None

    @property
    def mcp(self) -> str:
        return self.base + "/mcp"

    @property
    def ws(self) -> str:
        return self.base.replace("http://", "ws://", 1) + "/mcp/ws"

    @property
    def challenge(self) -> str:
        return f'Bearer resource_metadata="{self.base}{WELL_KNOWN}"'


def _oauth(port: int, **extra: Any) -> dict[str, dict[str, Any]]:
    return {"gateway": {"oauth": {"enabled": True, "resource": f"http://127.0.0.1:{port}/mcp",
                                  "authorization_servers": [ISSUER], "issuer": ISSUER, "audience": AUDIENCE,
                                  "hs256_secret": SECRET, **extra}}}


@pytest.fixture(scope="module")
def oauth_gw(redis_target_module: RedisTarget, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """OAuth on (principal = ``sub``) with an API key alongside; output captured at DEBUG."""
    port = free_port()
    log = tmp_path_factory.mktemp(f"oauth-gw-{redis_target_module.kind}") / "gateway.log"
    with log.open("wb") as out:
        proc = start_gateway(port, redis_target_module.url, api_keys=f"ops:{API_KEY}", overrides=_oauth(port),
                             output=out, log_level="debug")
    yield Gateway(f"http://127.0.0.1:{port}", log)
    stop(proc)


@pytest.fixture(scope="module")
def email_gw(redis_target_module: RedisTarget) -> Iterator[Gateway]:
    """OAuth on with ``principal_claim: email`` and no API keys."""
    port = free_port()
    proc = start_gateway(port, redis_target_module.url, overrides=_oauth(port, principal_claim="email"))
    yield Gateway(f"http://127.0.0.1:{port}")
    stop(proc)


def mint(secret: str | None = SECRET, algorithm: str = "HS256", drop: tuple[str, ...] = (), **claims: Any) -> str:
    now = int(time.time())
    payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 300, **claims}
    for name in drop:
        del payload[name]
    return jwt.encode(payload, secret, algorithm=algorithm)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def body(r: httpx.Response) -> dict:
    """The JSON-RPC response of a POST answered as JSON or as an SSE stream."""
    text = r.text.strip()
    if text.startswith("{"):
        return orjson.loads(text)
    msgs = [orjson.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
    return [m for m in msgs if "id" in m][-1]


def call_modern(gw: Gateway, auth: dict[str, str], method: str, params: dict | None = None) -> httpx.Response:
    msg, h = modern(method, params)
    return httpx.post(gw.mcp, json=msg, headers={**h, **auth})


def tool(gw: Gateway, auth: dict[str, str], name: str, **args: Any) -> dict:
    return body(call_modern(gw, auth, "tools/call", {"name": name, "arguments": args}))


def initialize(gw: Gateway, auth: dict[str, str]) -> httpx.Response:
    return httpx.post(gw.mcp, json=rpc("initialize", {"protocolVersion": LEGACY, "capabilities": {},
                                                      "clientInfo": {"name": "t", "version": "1"}}),
                      headers={"accept": ACCEPT, **auth})


class Legacy:
    """A 2025-11-25 session opened with one set of credentials."""

    def __init__(self, gw: Gateway, auth: dict[str, str]) -> None:
        r = initialize(gw, auth)
        assert r.status_code == 200, r.text
        self.gw, self.auth, self.sid = gw, auth, r.headers["mcp-session-id"]

    def post(self, method: str, params: dict | None = None, auth: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(self.gw.mcp, json=rpc(method, params, rid=2),
                          headers={"accept": ACCEPT, "mcp-session-id": self.sid, "mcp-protocol-version": LEGACY,
                                   **(self.auth if auth is None else auth)})

    def tool(self, name: str, **args: Any) -> dict:
        return body(self.post("tools/call", {"name": name, "arguments": args}))


def echo_text(reply: dict) -> str:
    assert "result" in reply, reply
    return reply["result"]["content"][0]["text"]


def assert_refused(r: httpx.Response, challenge: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == challenge
    assert r.headers["content-type"].startswith("application/json")
    assert set(r.json()) == {"error", "error_description"} and r.json()["error"] == "unauthorized"
    assert "Traceback" not in r.text and "mcp-session-id" not in r.headers


def ws_open(gw: Gateway, auth: dict[str, str]) -> ClientConnection:
    """A WebSocket on ``/mcp/ws`` (subprotocol ``mcp``) opened with these credentials."""
    return ws_connect(gw.ws, subprotocols=["mcp"], additional_headers=auth, open_timeout=10)


def ws_ask(ws: ClientConnection, msg: dict) -> dict:
    """Send one JSON-RPC request as a text frame; return the frame answering its id."""
    ws.send(orjson.dumps(msg).decode())
    while True:
        got = orjson.loads(ws.recv(timeout=10))
        if got.get("id") == msg["id"] and "method" not in got:
            return got


def ws_initialize(ws: ClientConnection) -> dict:
    init = ws_ask(ws, rpc("initialize", {"protocolVersion": LEGACY, "capabilities": {},
                                         "clientInfo": {"name": "t", "version": "1"}}, rid="init"))
    assert init["result"]["protocolVersion"] == LEGACY, init
    ws.send(orjson.dumps(rpc("notifications/initialized", rid=None)).decode())
    return init


def ws_refused(gw: Gateway, auth: dict[str, str]) -> Any:
    """The HTTP response that refused the WebSocket handshake."""
    with pytest.raises(InvalidStatus) as refused, ws_open(gw, auth):
        pass
    return refused.value.response


def assert_ws_refused(gw: Gateway, auth: dict[str, str], challenge: str) -> None:
    response = ws_refused(gw, auth)
    assert response.status_code == 401, (response.status_code, response.body)
    assert response.headers.get("www-authenticate") == challenge
    assert orjson.loads(response.body)["error"] == "unauthorized"
    assert b"Traceback" not in response.body


@pytest.fixture
def store(redis_target_module: RedisTarget) -> RedisTarget:
    """The module's Redis, flushed for this test."""
    redis_target_module.flush()
    return redis_target_module


def principal_keys(store: RedisTarget) -> list[bytes]:
    """Every key that belongs to some principal (sessions, contexts, tasks carry ``{principal}``),
    on every master."""
    client = store.sync_client()
    try:
        return [k for keys in for_each_primary_sync(client, lambda node: list(node.scan_iter(count=1000)))
                for k in keys if b"{" in k]
    finally:
        close_sync(client)


# ------------------------------------------------------------------ RFC 9728 document
def test_protected_resource_metadata(oauth_gw: Gateway, redis_target_module: RedisTarget) -> None:
    for path in (WELL_KNOWN, WELL_KNOWN + "/mcp"):
        r = httpx.get(oauth_gw.base + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        assert r.json() == {"resource": oauth_gw.mcp, "authorization_servers": [ISSUER],
                            "bearer_methods_supported": ["header"]}
        assert SECRET not in r.text
    port = free_port()
    proc = start_gateway(port, redis_target_module.url, api_keys=f"ops:{API_KEY}")
    try:
        plain = Gateway(f"http://127.0.0.1:{port}")
        for path in (WELL_KNOWN, WELL_KNOWN + "/mcp"):
            r = httpx.get(plain.base + path)
            assert r.status_code == 404 and "error" in r.json()
        # OAuth off: no resource_metadata in the challenge, and a well-signed JWT is no credential
        assert_refused(call_modern(plain, {}, "tools/list"), "Bearer")
        assert_refused(call_modern(plain, bearer(mint()), "tools/list"), 'Bearer, error="invalid_token"')
        assert echo_text(tool(plain, bearer(API_KEY), "t_echo", text="k")) == "ops:k"
    finally:
        stop(proc)


# ------------------------------------------------------------------ accepted tokens
def test_valid_jwt_is_the_sub_principal_on_both_revisions(oauth_gw: Gateway, store: RedisTarget) -> None:
    token = bearer(mint(sub="alice"))
    assert echo_text(tool(oauth_gw, token, "t_echo", text="hi")) == "alice:hi"
    session = Legacy(oauth_gw, token)
    assert echo_text(session.tool("t_echo", text="old")) == "alice:old"
    assert any(k.startswith(b"lm:{alice}:sess:") for k in principal_keys(store))
    # an API key works alongside OAuth, as its own principal
    assert echo_text(tool(oauth_gw, bearer(API_KEY), "t_echo", text="k")) == "ops:k"
    assert echo_text(Legacy(oauth_gw, bearer(API_KEY)).tool("t_echo", text="k")) == "ops:k"
    # an audience given as a list containing ours is accepted too
    listed = bearer(mint(sub="dave", aud=["someone-else", AUDIENCE]))
    assert echo_text(tool(oauth_gw, listed, "t_echo", text="l")) == "dave:l"


def test_issuer_clock_ahead_or_behind_within_leeway_is_accepted(oauth_gw: Gateway, store: RedisTarget) -> None:
    """The issuer's clock runs a few seconds off ours: its fresh token says it was issued (and is
    valid from) a moment in our future, or expired a moment ago; within ``oauth.leeway_s`` (30)."""
    ahead = int(time.time()) + 10
    token = bearer(mint(sub="alice", iat=ahead, nbf=ahead, exp=ahead + 300))
    assert echo_text(tool(oauth_gw, token, "t_echo", text="skew")) == "alice:skew"
    assert echo_text(Legacy(oauth_gw, token).tool("t_echo", text="old")) == "alice:old"
    with ws_open(oauth_gw, token) as ws:
        ws_initialize(ws)
    just_expired = bearer(mint(sub="alice", exp=int(time.time()) - 5))
    assert echo_text(tool(oauth_gw, just_expired, "t_echo", text="late")) == "alice:late"
    invalid = oauth_gw.challenge + ', error="invalid_token"'
    beyond = int(time.time()) + 120  # further off than the leeway
    assert_refused(call_modern(oauth_gw, bearer(mint(sub="alice", iat=beyond, nbf=beyond)), "tools/list"), invalid)
    assert_refused(call_modern(oauth_gw, bearer(mint(sub="alice", iat=beyond)), "tools/list"), invalid)


def test_principal_claim_is_configurable(email_gw: Gateway, store: RedisTarget) -> None:
    token = bearer(mint(sub="mallory", email="carol@example.com"))
    assert echo_text(tool(email_gw, token, "t_echo", text="hi")) == "carol@example.com:hi"
    assert echo_text(Legacy(email_gw, token).tool("t_echo", text="x")) == "carol@example.com:x"
    invalid = email_gw.challenge + ', error="invalid_token"'
    assert_refused(call_modern(email_gw, bearer(mint(sub="carol")), "tools/list"), invalid)  # no email claim
    assert_refused(initialize(email_gw, bearer(mint(sub="carol"))), invalid)
    assert_refused(call_modern(email_gw, bearer(API_KEY), "tools/list"), invalid)  # no API keys here


# ------------------------------------------------------------------ refused tokens
def _tampered() -> str:
    head, _, sig = mint(sub="alice").split(".")
    _, payload, _ = mint(sub="bob").split(".")
    return f"{head}.{payload}.{sig}"


REFUSED: dict[str, Any] = {
    "expired": lambda: mint(exp=int(time.time()) - 120),
    "wrong-audience": lambda: mint(aud="some-other-resource"),
    "missing-audience": lambda: mint(drop=("aud",)),
    "wrong-issuer": lambda: mint(iss="https://evil.example.test"),
    "missing-issuer": lambda: mint(drop=("iss",)),
    "not-yet-valid": lambda: mint(nbf=int(time.time()) + 600),
    "other-secret": lambda: mint(secret=OTHER_SECRET),
    "tampered-payload": _tampered,
    "alg-none": lambda: mint(secret=None, algorithm="none"),
    "alg-hs512": lambda: mint(algorithm="HS512"),
    "no-exp": lambda: mint(drop=("exp",)),
    "no-sub": lambda: mint(drop=("sub",)),
    "sub-with-brace": lambda: mint(sub="ali{ce}"),
    "sub-with-space": lambda: mint(sub="ali ce"),
    "sub-with-newline": lambda: mint(sub="alice\n"),
    "sub-empty": lambda: mint(sub=""),
    "sub-too-long": lambda: mint(sub="a" * 129),
    "sub-in-the-admin-keys-audit-namespace": lambda: mint(sub="admin:root"),
    "sub-of-the-open-gateway": lambda: mint(sub="local"),
    "sub-of-an-api-key": lambda: mint(sub="ops"),
    "sub-naming-the-global-context-accounting": lambda: mint(sub="ctxglobal-3"),
    "sub-not-a-string": lambda: mint(sub=12345),
    "not-a-jwt": lambda: "not.a.jwt",
    "api-key-lookalike": lambda: API_KEY + "x",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_token_refused_without_state(oauth_gw: Gateway, store: RedisTarget, case: str) -> None:
    token = REFUSED[case]()
    auth = bearer(token)
    challenge = oauth_gw.challenge + ', error="invalid_token"'
    assert_refused(initialize(oauth_gw, auth), challenge)
    assert_refused(call_modern(oauth_gw, auth, "tools/call", {"name": "context_append", "arguments": {
        "context_id": "c", "modality": "text", "text": "must not land"}}), challenge)
    assert_refused(httpx.get(oauth_gw.mcp, headers={"accept": "text/event-stream", "mcp-session-id": "x", **auth}),
                   challenge)
    assert principal_keys(store) == []


@pytest.mark.parametrize("authorization", [None, "Bearer", "Basic b3BzOnNlY3JldA==", f"Token {API_KEY}"])
def test_missing_bearer_token_refused(oauth_gw: Gateway, store: RedisTarget, authorization: str | None) -> None:
    auth = {} if authorization is None else {"authorization": authorization}
    assert_refused(initialize(oauth_gw, auth), oauth_gw.challenge)
    assert_refused(call_modern(oauth_gw, auth, "tools/list"), oauth_gw.challenge)
    assert principal_keys(store) == []


TWO_CREDENTIALS = {"error": "invalid_request", "error_description": "more than one Authorization header"}


@pytest.mark.parametrize("second", ["garbage", "other-sub", "same"])
def test_two_authorization_headers_are_refused(oauth_gw: Gateway, store: RedisTarget, second: str) -> None:
    """The field is a singleton: which copy a proxy in front reads and which the gateway reads
    must not decide who calls, on any route or transport, whichever copy comes first."""
    alice = "Bearer " + mint(sub="alice")
    other = {"garbage": "Bearer not-a-token", "other-sub": "Bearer " + mint(sub="bob"), "same": alice}[second]
    for pair in ([("authorization", alice), ("authorization", other)],
                 [("authorization", other), ("authorization", alice)]):
        msg, h = modern("tools/call", {"name": "context_append", "arguments": {
            "context_id": "c", "modality": "text", "text": "must not land"}})
        for r in (httpx.post(oauth_gw.mcp, json=msg, headers=[*h.items(), *pair]),
                  httpx.post(oauth_gw.base + "/mcp/ws-ticket", headers=pair)):
            assert (r.status_code, r.json()) == (400, TWO_CREDENTIALS), r.text
            assert r.headers["www-authenticate"] == 'Bearer error="invalid_request"'
        admin = httpx.get(oauth_gw.base + "/admin/config", headers=pair)
        assert admin.status_code == 400 and admin.json() == {"detail": TWO_CREDENTIALS["error_description"]}
        with pytest.raises(InvalidStatus) as refused, \
                ws_connect(oauth_gw.ws, subprotocols=["mcp"], additional_headers=pair, open_timeout=10):
            pass
        response = refused.value.response
        assert response.status_code == 400 and orjson.loads(response.body) == TWO_CREDENTIALS
    assert principal_keys(store) == []


def test_session_needs_a_valid_token_on_every_request(oauth_gw: Gateway, store: RedisTarget) -> None:
    session = Legacy(oauth_gw, bearer(mint(sub="alice")))
    invalid = oauth_gw.challenge + ', error="invalid_token"'
    assert_refused(session.post("ping", auth={}), oauth_gw.challenge)
    assert_refused(session.post("ping", auth=bearer(mint(sub="alice", exp=int(time.time()) - 60))), invalid)
    assert session.post("ping", auth=bearer(mint(sub="alice"))).json()["result"] == {}  # a fresh token goes on


# ------------------------------------------------------------------ isolation by sub
def test_two_subs_are_isolated(oauth_gw: Gateway, store: RedisTarget) -> None:
    alice, bob = bearer(mint(sub="alice")), bearer(mint(sub="bob"))
    appended = tool(oauth_gw, alice, "context_append", context_id="diary", modality="text", text="alice only")
    assert appended["result"]["structuredContent"]["version"] == 1, appended
    bob_session = Legacy(oauth_gw, bob)

    def bob_modern(method: str, params: dict) -> dict:
        return body(call_modern(oauth_gw, bob, method, params))

    for ask, not_found in ((lambda m, p: body(bob_session.post(m, p)), -32002), (bob_modern, -32602)):
        assert ask("tools/call", {"name": "context_get", "arguments": {"context_id": "diary"}})["error"]["code"] == -32602
        assert ask("tools/call", {"name": "context_fork", "arguments": {
            "context_id": "diary", "new_context_id": "stolen"}})["error"]["code"] == -32602
        assert ask("resources/read", {"uri": "context://diary/text"})["error"]["code"] == not_found
        assert not any("diary" in x["uri"] for x in ask("resources/list", {})["result"]["resources"])
    # the same id under bob is bob's own context; alice's is untouched
    assert bob_session.tool("context_append", context_id="diary", modality="text",
                            text="bob")["result"]["structuredContent"]["version"] == 1
    got = tool(oauth_gw, alice, "context_get", context_id="diary")["result"]["structuredContent"]
    assert [e["text"] for e in got["entries"]] == ["alice only"] and got["version"] == 1
    uris = [x["uri"] for x in body(call_modern(oauth_gw, alice, "resources/list"))["result"]["resources"]]
    assert "context://diary/text" in uris
    # a legacy session is bound to the principal that opened it
    alice_session = Legacy(oauth_gw, alice)
    stolen = alice_session.post("ping", auth=bob)
    assert stolen.status_code == 404 and "Traceback" not in stolen.text
    assert alice_session.post("ping").json()["result"] == {}


def test_a_token_cannot_be_an_api_keys_principal(oauth_gw: Gateway, store: RedisTarget) -> None:
    """Contexts, sessions and tasks are scoped by principal name: a token whose claim names the
    principal of an API key (``ops``) would be that key's holder. It is refused, whoever issued it."""
    ops = bearer(API_KEY)
    appended = tool(oauth_gw, ops, "context_append", context_id="runbook", modality="text", text="ops only")
    assert appended["result"]["structuredContent"]["version"] == 1, appended
    challenge = oauth_gw.challenge + ', error="invalid_token"'
    for token in (mint(sub="ops"), mint(sub="ops", aud=[AUDIENCE, "x"])):
        r = call_modern(oauth_gw, bearer(token), "tools/call", {"name": "context_get",
                                                                 "arguments": {"context_id": "runbook"}})
        assert_refused(r, challenge)
        assert "ops only" not in r.text
        assert_refused(initialize(oauth_gw, bearer(token)), challenge)
        assert_refused(httpx.post(oauth_gw.base + "/mcp/ws-ticket", headers=bearer(token)), challenge)
        assert_ws_refused(oauth_gw, bearer(token), challenge)
    # the key's own holder still reads it, and a token of another name is its own principal
    got = tool(oauth_gw, ops, "context_get", context_id="runbook")["result"]["structuredContent"]
    assert [e["text"] for e in got["entries"]] == ["ops only"]
    assert echo_text(tool(oauth_gw, bearer(mint(sub="ops2")), "t_echo", text="x")) == "ops2:x"


# ------------------------------------------------------------------ WebSocket transport (/mcp/ws)
def test_websocket_valid_jwt_is_the_sub_principal(oauth_gw: Gateway, store: RedisTarget) -> None:
    with ws_open(oauth_gw, bearer(mint(sub="alice"))) as ws:
        assert ws.subprotocol == "mcp"
        ws_initialize(ws)
        assert any(k.startswith(b"lm:{alice}:sess:") for k in principal_keys(store))
        assert echo_text(ws_ask(ws, rpc("tools/call", {"name": "t_echo", "arguments": {"text": "ws"}},
                                        rid=2))) == "alice:ws"
        stateless, _ = modern("tools/call", {"name": "t_echo", "arguments": {"text": "new"}}, rid=3)
        assert echo_text(ws_ask(ws, stateless)) == "alice:new"
    # the connection's session goes with it
    wait_for_sync(lambda: not any(k.startswith(b"lm:{alice}:sess:") for k in principal_keys(store)),
                  timeout_s=10, what="alice's WebSocket session to be deleted on close")
    # an API key works alongside OAuth on this transport too, as its own principal
    with ws_open(oauth_gw, bearer(API_KEY)) as ws:
        ws_initialize(ws)
        assert echo_text(ws_ask(ws, rpc("tools/call", {"name": "t_echo", "arguments": {"text": "k"}},
                                        rid=2))) == "ops:k"


def test_websocket_principal_claim_is_configurable(email_gw: Gateway, store: RedisTarget) -> None:
    with ws_open(email_gw, bearer(mint(sub="mallory", email="carol@example.com"))) as ws:
        ws_initialize(ws)
        assert echo_text(ws_ask(ws, rpc("tools/call", {"name": "t_echo", "arguments": {"text": "e"}},
                                        rid=2))) == "carol@example.com:e"
    assert_ws_refused(email_gw, bearer(mint(sub="carol")), email_gw.challenge + ', error="invalid_token"')


WS_REFUSED = ("expired", "wrong-audience", "other-secret", "tampered-payload", "alg-none", "sub-with-brace",
              "sub-of-the-open-gateway", "sub-of-an-api-key", "sub-naming-the-global-context-accounting")


@pytest.mark.parametrize("case", WS_REFUSED)
def test_websocket_bad_token_refused_at_handshake(oauth_gw: Gateway, store: RedisTarget, case: str) -> None:
    assert_ws_refused(oauth_gw, bearer(REFUSED[case]()), oauth_gw.challenge + ', error="invalid_token"')
    assert principal_keys(store) == []


@pytest.mark.parametrize("authorization", [None, "Bearer", f"Token {API_KEY}"])
def test_websocket_missing_bearer_token_refused_at_handshake(oauth_gw: Gateway, store: RedisTarget,
                                                             authorization: str | None) -> None:
    auth = {} if authorization is None else {"authorization": authorization}
    assert_ws_refused(oauth_gw, auth, oauth_gw.challenge)
    assert principal_keys(store) == []


def test_websocket_two_subs_are_isolated(oauth_gw: Gateway, store: RedisTarget) -> None:
    with ws_open(oauth_gw, bearer(mint(sub="alice"))) as alice, ws_open(oauth_gw, bearer(mint(sub="bob"))) as bob:
        ws_initialize(alice)
        ws_initialize(bob)
        appended = ws_ask(alice, rpc("tools/call", {"name": "context_append", "arguments": {
            "context_id": "diary", "modality": "text", "text": "alice only"}}, rid=2))
        assert appended["result"]["structuredContent"]["version"] == 1, appended
        rid = iter(range(10, 100))

        def bob_session(method: str, params: dict) -> dict:
            return ws_ask(bob, rpc(method, params, rid=next(rid)))

        def bob_stateless(method: str, params: dict) -> dict:
            return ws_ask(bob, modern(method, params, rid=next(rid))[0])

        for ask, not_found in ((bob_session, -32002), (bob_stateless, -32602)):
            assert ask("tools/call", {"name": "context_get", "arguments": {"context_id": "diary"}})["error"]["code"] == -32602
            assert ask("tools/call", {"name": "context_fork", "arguments": {
                "context_id": "diary", "new_context_id": "stolen"}})["error"]["code"] == -32602
            assert ask("resources/read", {"uri": "context://diary/text"})["error"]["code"] == not_found
            assert not any("diary" in x["uri"] for x in ask("resources/list", {})["result"]["resources"])
        # the same id under bob is bob's own context; alice's is untouched
        assert bob_session("tools/call", {"name": "context_append", "arguments": {
            "context_id": "diary", "modality": "text", "text": "bob"}})["result"]["structuredContent"]["version"] == 1
        got = ws_ask(alice, rpc("tools/call", {"name": "context_get", "arguments": {"context_id": "diary"}},
                                rid=3))["result"]["structuredContent"]
        assert [e["text"] for e in got["entries"]] == ["alice only"] and got["version"] == 1
        uris = [x["uri"] for x in ws_ask(alice, rpc("resources/list", {}, rid=4))["result"]["resources"]]
        assert "context://diary/text" in uris
    # and over HTTP, bob still sees nothing of alice's
    assert tool(oauth_gw, bearer(mint(sub="bob")), "context_get", context_id="diary")["result"][
        "structuredContent"]["entries"][0]["text"] == "bob"


def test_websocket_closes_when_its_token_expires(redis_target_module: RedisTarget) -> None:
    """HTTP checks the token on every request; a WebSocket or an event stream once, when it opens,
    so it ends when the token it was opened with expires (``leeway_s`` 0 here): a WebSocket with
    1008, whether the token came as a header or through a ticket; a GET /mcp stream by ending (the
    client reconnects with Last-Event-ID). A connection opened with an API key stays."""
    port = free_port()
    proc = start_gateway(port, redis_target_module.url, api_keys=f"ops:{API_KEY}",
                         overrides=_oauth(port, leeway_s=0))
    gw = Gateway(f"http://127.0.0.1:{port}")
    try:
        soon = bearer(mint(sub="alice", exp=int(time.time()) + 3))
        issued = httpx.post(gw.base + "/mcp/ws-ticket", headers=soon)
        assert issued.status_code == 200, issued.text
        with ws_open(gw, soon) as by_header, \
                ws_connect(gw.ws + "?ticket=" + issued.json()["ticket"], subprotocols=["mcp"], open_timeout=10) \
                as by_ticket, ws_open(gw, bearer(API_KEY)) as by_key:
            for ws in (by_header, by_ticket, by_key):
                ws_initialize(ws)
            for ws in (by_header, by_ticket):
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        ws.recv(timeout=20)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
            assert ws_ask(by_key, rpc("ping", rid=9))["result"] == {}
        # a legacy session's GET stream likewise ends when the token it was opened with expires
        session = Legacy(gw, bearer(mint(sub="alice")))
        soon = bearer(mint(sub="alice", exp=int(time.time()) + 3))
        with httpx.stream("GET", gw.mcp, headers={"accept": "text/event-stream", "mcp-session-id": session.sid,
                                                  "mcp-protocol-version": LEGACY, **soon},
                          timeout=httpx.Timeout(10, read=20)) as stream:
            assert stream.status_code == 200
            deadline = time.monotonic() + 20
            for _ in stream.iter_bytes():  # until the server ends the stream
                assert time.monotonic() < deadline, "the stream outlived its token"
    finally:
        stop(proc)


def _sse_messages(stream: httpx.Response) -> Iterator[dict]:
    """The JSON-RPC messages of an SSE response, as they arrive."""
    for line in stream.iter_lines():
        if line.startswith("data:") and line[5:].strip():
            yield orjson.loads(line[5:])


def test_listen_stream_ends_when_its_token_expires(redis_target_module: RedisTarget) -> None:
    """A 2026-07-28 ``subscriptions/listen`` stream checks its token once, like a WebSocket, so it
    delivers until that token expires (``leeway_s`` 0 here) and then ends the way a listen ends
    on shutdown: the request's result, carrying the subscription id. The client listens again with
    a fresh token. One opened with an API key stays."""
    port = free_port()
    proc = start_gateway(port, redis_target_module.url, api_keys=f"ops:{API_KEY}",
                         overrides=_oauth(port, leeway_s=0))
    gw = Gateway(f"http://127.0.0.1:{port}")
    uri = "context://listened/text"
    listen, headers = modern("subscriptions/listen", {"notifications": {"resourceSubscriptions": [uri]}}, rid=7)
    lasting = bearer(mint(sub="alice"))
    try:
        soon = bearer(mint(sub="alice", exp=int(time.time()) + 3))
        with httpx.stream("POST", gw.mcp, json=listen, headers={**headers, **bearer(API_KEY)},
                          timeout=httpx.Timeout(10, read=20)) as by_key:
            kept = _sse_messages(by_key)
            assert next(kept)["method"] == "notifications/subscriptions/acknowledged"
            with httpx.stream("POST", gw.mcp, json=listen, headers={**headers, **soon},
                              timeout=httpx.Timeout(10, read=20)) as stream:
                assert stream.status_code == 200
                messages = _sse_messages(stream)
                assert next(messages)["method"] == "notifications/subscriptions/acknowledged"
                appended = tool(gw, lasting, "context_append", context_id="listened", modality="text", text="x")
                assert "result" in appended, appended
                updated = next(messages)  # delivered while the token is valid
                assert updated["method"] == "notifications/resources/updated" and updated["params"]["uri"] == uri
                deadline = time.monotonic() + 20
                rest = []
                for msg in messages:  # until the server ends the stream
                    rest.append(msg)
                    assert time.monotonic() < deadline, "the stream outlived its token"
            sub_meta = {"io.modelcontextprotocol/subscriptionId": 7}
            assert rest == [{"jsonrpc": "2.0", "id": 7, "result": {"_meta": sub_meta, "resultType": "complete"}}]
            appended = tool(gw, bearer(API_KEY), "context_append", context_id="listened", modality="text", text="y")
            assert "result" in appended, appended
            assert next(kept)["params"]["uri"] == uri  # the API key's stream lives on
        # listening again with a fresh token works (the ended stream gave back its listen_streams slot)
        with httpx.stream("POST", gw.mcp, json=listen, headers={**headers, **lasting},
                          timeout=httpx.Timeout(10, read=20)) as again:
            assert next(_sse_messages(again))["method"] == "notifications/subscriptions/acknowledged"
    finally:
        stop(proc)


# ------------------------------------------------------------------ logs
def test_secret_and_tokens_never_logged(oauth_gw: Gateway, store: RedisTarget) -> None:
    assert oauth_gw.log is not None
    good = mint(sub="alice")
    refused = [mint(exp=int(time.time()) - 120), mint(secret=OTHER_SECRET), mint(secret=None, algorithm="none"),
               mint(sub="ali{ce}")]
    assert echo_text(tool(oauth_gw, bearer(good), "t_echo", text="x")) == "alice:x"
    Legacy(oauth_gw, bearer(good)).tool("t_echo", text="y")
    for token in refused:
        assert initialize(oauth_gw, bearer(token)).status_code == 401
        assert call_modern(oauth_gw, bearer(token), "tools/list").status_code == 401
    # the WebSocket handshake carries the same credentials (logged header by header at DEBUG)
    for auth in (bearer(good), bearer(API_KEY)):
        with ws_open(oauth_gw, auth) as ws:
            ws_initialize(ws)
    for token in refused:
        assert ws_refused(oauth_gw, bearer(token)).status_code == 401
    crash = tool(oauth_gw, bearer(good), "t_crash")
    assert crash["error"]["code"] == -32603
    # the crash is logged: proof that the captured output is the replica's log
    wait_for_sync(lambda: "secret internal detail" in oauth_gw.log.read_text(errors="replace"), timeout_s=10,
                  what="the tool crash to reach the gateway's log")
    text = oauth_gw.log.read_text(errors="replace")
    assert "< authorization: [redacted]" in text  # proof that the handshake headers were logged
    assert SECRET not in text
    assert API_KEY not in text
    for token in [good, *refused]:
        head, payload, sig = token.split(".")
        assert token not in text and payload not in text
        assert not sig or sig not in text
