"""Guessing credentials is throttled (gateway/auth_throttle.py), tested on a real gateway process
against a real Redis (single server and cluster): failed attempts from one client address are
counted over ``/mcp``, the WebSocket ticket route and handshake and the admin API together, and
once they reach ``failures_per_source`` the address gets 429 + Retry-After for every request,
a valid key that could be guessed included (but not a random API or admin key, a ticket or a
signed token), while
other addresses go on as before; one credential failing from many
addresses is refused likewise; ``X-Forwarded-For`` is believed from trusted proxies only; the
counts live in Redis keys with a TTL that never hold a credential."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from shared.redis_client import close_sync, for_each_primary_sync
from tests.conftest import RedisTarget
from tests.gateway_support import LoggedGateway, logged_gateway
from tests.test_gateway_http import modern

KEY = "alice-key-0123456789"  # short enough to be guessed: refused with the address
RANDOM_KEY = "bQ7x-Zk2_Lr9VtWm4NcYs1HdPf0GjEa8uXoTiRnB3Ke"  # secrets.token_urlsafe(32)
SECRET = "hs256-secret-of-the-test-authorization-server-0123456789abcdefgh"
ISSUER, AUDIENCE = "https://as.example", "https://gateway.example/mcp"
ADMIN_KEY = "root-admin-key-0123456789"
RANDOM_ADMIN_KEY = "Hw3_Tq9ZcVb-Lm0Xe7RkYs2JnGa5PdUf8BiOt4Ql6Cx"  # secrets.token_urlsafe(32)
WINDOW_S = 60
TOOLS_LIST, MCP_HEADERS = modern("tools/list")


def gateway(target: RedisTarget, tmp: pytest.TempPathFactory, **throttle: Any) -> Any:
    oauth = {"enabled": True, "resource": AUDIENCE, "authorization_servers": [ISSUER], "issuer": ISSUER,
             "hs256_secret": SECRET}
    return logged_gateway(target.url, tmp.mktemp("auththrottle") / "gateway.log",
                          api_keys=f"alice:{KEY},bob:{RANDOM_KEY}",
                          overrides={"gateway": {"admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"},
                                                                "ops": {"key": RANDOM_ADMIN_KEY, "role": "admin"}},
                                                 "oauth": oauth, "auth_throttle": {"window_s": WINDOW_S, **throttle}}})


def token(secret: str = SECRET) -> str:
    now = int(time.time())
    return jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "carol", "iat": now, "exp": now + 300}, secret,
                      algorithm="HS256")


@pytest.fixture(scope="module")
def per_source(redis_target_module: RedisTarget, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedGateway]:
    with gateway(redis_target_module, tmp_path_factory, failures_per_source=5, failures_per_credential=0,
                 trusted_proxies=["127.0.0.9"]) as gw:
        yield gw


@pytest.fixture(scope="module")
def per_credential(redis_target_module: RedisTarget,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedGateway]:
    with gateway(redis_target_module, tmp_path_factory, failures_per_source=0, failures_per_credential=3) as gw:
        yield gw


def client(source: str) -> httpx.Client:
    """An HTTP client whose connections come from ``source`` (an address of 127.0.0.0/8)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10)


def mcp(http: httpx.Client, gw: LoggedGateway, key: str, **headers: str) -> httpx.Response:
    return http.post(gw.base + "/mcp", json=TOOLS_LIST, headers={**MCP_HEADERS, "authorization": f"Bearer {key}",
                                                                 **headers})


def assert_too_many(r: httpx.Response, detail: str = "error_description") -> None:
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S
    assert "too many failed authentication attempts" in r.json()[detail] and "Traceback" not in r.text


def failure_keys(target: RedisTarget) -> dict[bytes, int]:
    """Every failure count in Redis, with its TTL (s)."""
    redis = target.sync_client()
    try:
        found = for_each_primary_sync(redis, lambda node: [(k, node.ttl(k)) for k in node.scan_iter(match="lm:authfail:*")])
        return dict(pair for node in found for pair in node)
    finally:
        close_sync(redis)


def failures_of(target: RedisTarget, source: str) -> int:
    """The failures counted for one client address."""
    [key] = [k for k in failure_keys(target) if source.encode() in k]
    redis = target.sync_client()
    try:
        return int(redis.get(key))
    finally:
        close_sync(redis)


def test_failures_from_one_address_refuse_it_and_only_it(per_source: LoggedGateway,
                                                         redis_target_module: RedisTarget) -> None:
    redis_target_module.flush()
    with client("127.0.0.2") as attacker, client("127.0.0.3") as other:
        assert mcp(attacker, per_source, KEY).status_code == 200  # a success counts for nothing
        guesses = [mcp(attacker, per_source, f"guess-{i}-0123456789") for i in range(2)]
        guesses.append(attacker.post(per_source.base + "/mcp/ws-ticket", headers={"authorization": "Bearer guess-2"}))
        guesses.append(attacker.get(per_source.base + "/admin/config", headers={"authorization": "Bearer guess-3"}))
        assert [r.status_code for r in guesses] == [401] * 4, [r.text for r in guesses]
        assert mcp(attacker, per_source, "no-credential-counts", authorization="Basic eDp5").status_code == 401
        assert_too_many(mcp(attacker, per_source, "guess-4-0123456789"))  # the fifth failure
        # from now on nothing from that address is checked: a right guess would not show
        assert_too_many(mcp(attacker, per_source, KEY))
        assert_too_many(mcp(attacker, per_source, KEY, **{"x-forwarded-for": "10.1.2.3"}))  # not a trusted proxy
        assert_too_many(attacker.get(per_source.base + "/admin/config",
                                     headers={"authorization": f"Bearer {ADMIN_KEY}"}), detail="detail")
        # another address is served as before, and its own failures are 401
        assert mcp(other, per_source, KEY).status_code == 200
        assert mcp(other, per_source, "guess-from-elsewhere").status_code == 401
        assert other.get(per_source.base + "/admin/config",
                         headers={"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
    # the WebSocket handshake from the refused address is refused too
    with pytest.raises(InvalidStatus) as refused, ws_connect(
            per_source.ws, subprotocols=["mcp"], additional_headers={"authorization": f"Bearer {KEY}"},
            open_timeout=10, source_address=("127.0.0.2", 0)):
        pass
    assert refused.value.response.status_code == 429
    stored = failure_keys(redis_target_module)
    assert stored and all(0 < ttl <= WINDOW_S for ttl in stored.values()), stored
    assert not any(b"guess" in k or KEY.encode() in k for k in stored)
    assert b"127.0.0.2" in b"".join(stored) and b"127.0.0.3" in b"".join(stored)


def test_forwarded_for_is_believed_from_trusted_proxies_only(per_source: LoggedGateway,
                                                             redis_target_module: RedisTarget) -> None:
    redis_target_module.flush()
    with client("127.0.0.9") as proxy:
        def via(forwarded_for: str, key: str) -> httpx.Response:
            return mcp(proxy, per_source, key, **{"x-forwarded-for": forwarded_for})

        # what the client wrote left of the address the proxy appended is not believed
        codes = [via(f"203.0.113.{i}, 198.51.100.7", f"guess-{i}").status_code for i in range(5)]
        assert codes == [401] * 4 + [429]
        assert_too_many(via("198.51.100.7", KEY))
        assert via("198.51.100.8", KEY).status_code == 200  # the proxy's other clients
        assert via("2001:db8:1:2::1", "guess-v6").status_code == 401
        for i in range(4):  # an IPv6 client counts as its /64
            via(f"2001:db8:1:2::{i + 2}", f"guess-v6-{i}")
        assert_too_many(via("2001:db8:1:2:ffff::9", KEY))
        assert via("2001:db8:1:3::1", KEY).status_code == 200


def test_one_credential_failing_everywhere_is_refused(per_credential: LoggedGateway,
                                                      redis_target_module: RedisTarget) -> None:
    redis_target_module.flush()
    stale = "revoked-key-0123456789"
    codes = []
    for source in ("127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7"):
        with client(source) as http:
            codes.append(mcp(http, per_credential, stale).status_code)
    assert codes == [401, 401, 429, 429]
    with client("127.0.0.7") as http:
        assert mcp(http, per_credential, "another-wrong-key").status_code == 401  # the address is not refused
        assert mcp(http, per_credential, KEY).status_code == 200  # nor is a valid key


def test_a_failing_ticket_counts_as_a_credential(per_credential: LoggedGateway,
                                                 redis_target_module: RedisTarget) -> None:
    """A WebSocket ticket is a credential too: one that keeps failing (used, expired, made up) is
    refused with 429 from every address once it reached its count."""
    redis_target_module.flush()
    made_up = "?ticket=YWxpY2U." + "A" * 43
    codes = []
    for source in ("127.0.0.4", "127.0.0.5", "127.0.0.6"):
        with pytest.raises(InvalidStatus) as refused, ws_connect(per_credential.ws + made_up, subprotocols=["mcp"],
                                                                 open_timeout=10, source_address=(source, 0)):
            pass
        codes.append(refused.value.response.status_code)
    assert codes == [401, 401, 429]
    with client("127.0.0.6") as http:  # the address itself is not refused
        issued = http.post(per_credential.base + "/mcp/ws-ticket", headers={"authorization": f"Bearer {KEY}"})
        assert issued.status_code == 200


def test_a_refused_address_still_serves_credentials_no_one_can_guess(per_source: LoggedGateway,
                                                                     redis_target_module: RedisTarget) -> None:
    """Clients behind one NAT share an address: one guesser there must not lock the others out.
    A random API key (32 characters or more) or a token signed by the authorization server cannot
    be guessed, so seeing it pass tells a guesser nothing it could use; anything that could be
    guessed (a short key, a wrong key, a forged token) is 429 as before, unchecked and uncounted."""
    redis_target_module.flush()
    with client("127.0.0.12") as nat:
        codes = [mcp(nat, per_source, f"guess-{i}-0123456789").status_code for i in range(5)]
        assert codes == [401] * 4 + [429]
        assert mcp(nat, per_source, RANDOM_KEY).json()["result"]["tools"] is not None
        assert mcp(nat, per_source, token()).status_code == 200
        assert_too_many(mcp(nat, per_source, KEY))  # a key that could be guessed: a hit must not show
        assert_too_many(mcp(nat, per_source, RANDOM_KEY[:-1] + "x"))
        assert_too_many(mcp(nat, per_source, token(secret="a-forger-who-guesses-the-secret-0123456789")))
        assert_too_many(mcp(nat, per_source, token()[:-2] + "xx"))
    with ws_connect(per_source.ws, subprotocols=["mcp"], additional_headers={"authorization": f"Bearer {RANDOM_KEY}"},
                    open_timeout=10, source_address=("127.0.0.12", 0)) as ws:
        assert ws.subprotocol == "mcp"
    assert failures_of(redis_target_module, "127.0.0.12") == 5  # what came while refused was not counted


def test_a_refused_address_still_serves_admin_keys_and_tickets_no_one_can_guess(per_source: LoggedGateway,
                                                                               redis_target_module: RedisTarget) -> None:
    """The rule of ``/mcp`` holds for admin keys and WebSocket tickets: a random configured admin
    key, a key ``POST /admin/keys`` made (256 random bits) and a single-use ticket pass from a
    refused address; a guessable admin key, a wrong random-looking one and a made-up or used
    ticket are 429 there, uncounted."""
    redis_target_module.flush()
    with client("127.0.0.3") as elsewhere:
        made = elsewhere.post(per_source.base + "/admin/keys", json={"name": "nat-viewer", "role": "viewer"},
                              headers={"authorization": f"Bearer {RANDOM_ADMIN_KEY}"})
        assert made.status_code in (200, 201), made.text
        runtime_key = made.json()["key"]
    with client("127.0.0.13") as nat:
        codes = [mcp(nat, per_source, f"guess-{i}-0123456789").status_code for i in range(5)]
        assert codes == [401] * 4 + [429]

        def admin(key: str) -> httpx.Response:
            return nat.get(per_source.base + "/admin/config", headers={"authorization": f"Bearer {key}"})

        assert admin(RANDOM_ADMIN_KEY).status_code == 200
        assert nat.get(per_source.base + "/admin/summary",
                       headers={"authorization": f"Bearer {runtime_key}"}).status_code == 200
        assert_too_many(admin(ADMIN_KEY), detail="detail")  # could be guessed: a hit must not show
        for key in (RANDOM_ADMIN_KEY, runtime_key):  # one character off
            assert_too_many(admin(key[:-1] + ("x" if key[-1] != "x" else "y")), detail="detail")
        ticket = nat.post(per_source.base + "/mcp/ws-ticket", headers={"authorization": f"Bearer {RANDOM_KEY}"})
        assert ticket.status_code == 200, ticket.text
    url = per_source.ws + "?ticket=" + ticket.json()["ticket"]
    with ws_connect(url, subprotocols=["mcp"], open_timeout=10, source_address=("127.0.0.13", 0)) as ws:
        assert ws.subprotocol == "mcp"
    for refused_ticket in (url, per_source.ws + "?ticket=YWxpY2U." + "A" * 43):  # used, made up
        with pytest.raises(InvalidStatus) as refused, ws_connect(refused_ticket, subprotocols=["mcp"], open_timeout=10,
                                                                 source_address=("127.0.0.13", 0)):
            pass
        assert refused.value.response.status_code == 429
    assert failures_of(redis_target_module, "127.0.0.13") == 5  # what came while refused was not counted
