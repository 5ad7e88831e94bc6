"""The upstream set at runtime: the admin API (add, read, change, disable, remove, health),
kept in Redis so every replica serves the same set, and upstream sessions held per principal
in Redis so any replica continues them (and renews one the upstream forgot)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync

from gateway.app import create_app
from shared import keys
from tests.admin_support import MCP_KEY, VIEWER_KEY, LiveServer, admin_config
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import (
    ADMIN,
    LEGACY,
    MODERN,
    UPSTREAM_SECRET,
    Client,
    front_gateway,
    front_store,
    upstream_db,
    upstream_entry,
)

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url


def _tools(base: str) -> set[str]:
    return set(Client(base, MCP_KEY, LEGACY).open().names())


def test_admin_api_manages_upstreams(redis_url: str, upstream: str) -> None:
    with front_gateway(redis_url, {}) as base:
        admin_url = base + "/admin/upstreams"
        entry: dict[str, Any] = upstream_entry(upstream, name="up2", namespace="u2")
        assert httpx.post(admin_url, json=entry, headers={"authorization": f"Bearer {VIEWER_KEY}"}).status_code == 403
        created = httpx.post(admin_url, json=entry, headers=ADMIN)
        assert created.status_code == 201, created.text
        assert created.json()["namespace"] == "u2" and created.json()["credentials"] == {"Authorization": "env"}
        assert httpx.post(admin_url, json=entry, headers=ADMIN).status_code == 409
        assert [u["name"] for u in httpx.get(admin_url, headers=ADMIN).json()["upstreams"]] == ["up2"]
        assert "u2.t_echo" in _tools(base)
        Client(base, MCP_KEY, LEGACY).open().result("tools/call", {"name": "u2.t_echo", "arguments": {"text": "d"}})
        [panel] = httpx.get(base + "/admin/summary", headers=ADMIN).json()["upstreams"]  # the dashboard's panel
        assert panel["name"] == "up2" and panel["calls"] == 1 and panel["errors"] == 0 and panel["breaker"] == "closed"
        off = httpx.patch(admin_url + "/up2", json={"enabled": False}, headers=ADMIN)
        assert off.status_code == 200 and off.json()["enabled"] is False
        assert "u2.t_echo" not in _tools(base)
        call = Client(base, MCP_KEY, LEGACY).open().call("tools/call", {"name": "u2.t_echo", "arguments": {"text": "x"}})
        assert call["error"]["code"] == -32602 and "Tool not found" in call["error"]["message"]
        assert httpx.patch(admin_url + "/up2", json={"enabled": True}, headers=ADMIN).status_code == 200
        health = httpx.get(admin_url + "/up2/health", headers=ADMIN).json()
        assert health["breaker"] == "closed" and health["enabled"] is True
        assert httpx.patch(admin_url + "/up2", json={"url": "http://elsewhere/mcp"}, headers=ADMIN).status_code == 422
        assert httpx.delete(admin_url + "/up2", headers=ADMIN).json() == {"removed": "up2"}
        assert httpx.get(admin_url + "/up2", headers=ADMIN).status_code == 404
        assert "u2.t_echo" not in _tools(base)


@pytest.mark.parametrize(("body", "needle"), [
    ({"name": "x", "url": "http://a/mcp", "command": ["srv"]}, "exactly one of url or command"),
    ({"name": "x", "url": "http://a/mcp", "headers_from_env": {"Authorization": "LM_TEST_UNSET_VAR"}},
     "LM_TEST_UNSET_VAR"),
    ({"name": "Bad Name", "url": "http://a/mcp"}, "name"),
    ({"name": "x", "url": "ftp://a/mcp"}, "http"),
    ({"name": "x", "url": "http://proxy:pw-in-url-5d2e@a/mcp"}, "must not carry credentials"),
    ({"name": "x", "url": "http://a/mcp?api_key=pw-in-url-5d2e"}, "query_from_env or query_from_file"),
    ({"name": "x", "url": "http://a/mcp?"}, "must not carry a query"),
    ({"name": "x", "url": "http://a/mcp#pw-in-url-5d2e"}, "fragment"),
    ({"name": "x", "url": "http://a/mcp", "query_from_env": {"api_key": "LM_TEST_UNSET_VAR"}}, "LM_TEST_UNSET_VAR"),
    ({"name": "x", "url": "http://a/mcp", "query_from_env": {"k": "A"}, "query_from_file": {"k": "/f"}}, "not both"),
    ({"name": "x", "url": "http://a/mcp", "query_from_env": {"a&b": "A"}}, "query parameter names"),
    ({"name": "x", "command": ["srv"], "query_from_env": {"k": "A"}}, "belong to an upstream with a url"),
    ({"name": "x", "url": "http://127.0.0.1:99999/mcp"}, "port"),
    ({"name": "x", "url": "http://127.0.0.1:0/mcp"}, "port"),
    ({"name": "x", "url": "http://127.0.0.1:http/mcp"}, "port"),
    ({"name": "x", "url": "http:///mcp"}, "host"),
    ({"name": "x", "url": "https://:8080/mcp"}, "host"),
    ({"name": "x", "url": "http://[::1/mcp"}, "url"),
    ({"name": "x", "url": "127.0.0.1:9000/mcp"}, "http"),
    ({"name": "x", "url": "http://a/mcp", "stdio_idle_s": 5.0}, "stdio_idle_s apply to stdio upstreams only"),
])
def test_admin_api_refuses_bad_upstreams(redis_url: str, body: dict[str, Any], needle: str) -> None:
    with front_gateway(redis_url, {}) as base:
        r = httpx.post(base + "/admin/upstreams", json=body, headers=ADMIN)
        assert r.status_code == 422 and needle in r.text and "pw-in-url-5d2e" not in r.text
        listed = httpx.get(base + "/admin/upstreams", headers=ADMIN)
        assert listed.status_code == 200 and listed.json() == {"upstreams": []}


def test_replicas_follow_the_set_in_redis(redis_url: str, upstream: str) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(front_gateway(redis_url, {}))
        b = stack.enter_context(front_gateway(redis_url, {}))
        assert httpx.post(a + "/admin/upstreams", json=upstream_entry(upstream), headers=ADMIN).status_code == 201
        wait_for_sync(lambda: "up.t_echo" in _tools(b), timeout_s=10, what="replica b to mount the new upstream")
        assert httpx.patch(b + "/admin/upstreams/up", json={"enabled": False}, headers=ADMIN).status_code == 200
        wait_for_sync(lambda: "up.t_echo" not in _tools(a), timeout_s=10, what="replica a to drop it")


def test_config_upstream_removed_at_runtime_stays_removed(redis_url: str, upstream: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    proxy = {"upstreams": [upstream_entry(upstream)]}
    with front_gateway(redis_url, proxy) as base:
        assert "up.t_echo" in _tools(base)
        assert httpx.delete(base + "/admin/upstreams/up", headers=ADMIN).status_code == 200
    with front_gateway(redis_url, proxy) as base:
        assert "up.t_echo" not in _tools(base)
        assert httpx.get(base + "/admin/upstreams", headers=ADMIN).json() == {"upstreams": []}
    assert "proxy upstream up: the configuration file differs from the set in Redis (removed at runtime)" \
        in caplog.text


def test_upstream_session_is_shared_by_replicas_and_renewed(redis_url: str, redis_target: RedisTarget,
                                                            upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream, revision="2025-11-25")]}
    echo = {"name": "up.t_echo", "arguments": {"text": "s"}}
    with ExitStack() as stack, front_store(redis_target, decode_responses=True) as r, \
            redis_sync.Redis.from_url(upstream_db(upstream)) as up_redis:
        a = stack.enter_context(front_gateway(redis_url, proxy))
        b = stack.enter_context(front_gateway(redis_url, proxy))
        assert Client(a, MCP_KEY, LEGACY).open().result("tools/call", echo)["content"][0]["text"] == "proxy:s"
        sid = r.get(keys.proxy_session("alice", "up/sampling"))
        assert sid
        assert Client(b, MCP_KEY, LEGACY).open().result("tools/call", echo)["content"][0]["text"] == "proxy:s"
        # b continued a's upstream session: opening its own would have replaced the id in Redis
        assert r.get(keys.proxy_session("alice", "up/sampling")) == sid
        assert up_redis.exists(f"lm:{{proxy}}:sess:{sid}")  # the upstream's own record of that session
        gone = httpx.delete(upstream, headers={"authorization": f"Bearer {UPSTREAM_SECRET}", "mcp-session-id": sid})
        assert gone.status_code in (200, 204)
        assert Client(a, MCP_KEY, LEGACY).open().result("tools/call", echo)["content"][0]["text"] == "proxy:s"
        renewed = r.get(keys.proxy_session("alice", "up/sampling"))
        assert renewed and renewed != sid


def test_upstream_session_in_redis_is_renewed_while_in_use(redis_url: str, redis_target: RedisTarget,
                                                          upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream, revision="2025-11-25")]}
    echo = {"name": "up.t_echo", "arguments": {"text": "r"}}
    with front_gateway(redis_url, proxy, gateway={"session_idle_ttl_s": 6}) as base, \
            front_store(redis_target) as r:
        client = Client(base, MCP_KEY, LEGACY).open()
        client.result("tools/call", echo)
        key = keys.proxy_session("alice", "up/sampling")
        seen = [r.pttl(key)]

        def renewed() -> bool:  # without renewal the TTL only falls (and the key is gone after 6 s)
            client.result("tools/call", echo)
            seen.append(r.pttl(key))
            return seen[-1] > seen[-2]

        wait_for_sync(renewed, timeout_s=10, interval_s=0.2, what="the upstream session's TTL to be renewed")


def test_idle_principals_sessions_are_forgotten_by_the_replica(redis_url: str, upstream: str) -> None:
    """Every principal's upstream session is held in the replica's memory; principals come and go
    (OAuth), so one unused for the session TTL is dropped there (Redis still holds it)."""
    keys_ = {f"p{i}": f"principal-key-{i}-0123456789" for i in range(6)} | {"late": "principal-key-late-0123456"}
    cfg = admin_config(redis_url, gateway={"api_keys": keys_, "session_idle_ttl_s": 1},
                       proxy={"upstreams": [upstream_entry(upstream, revision="2025-11-25")]})
    app = create_app(cfg)
    echo = {"name": "up.t_echo", "arguments": {"text": "i"}}
    with LiveServer(app) as server:
        for principal in sorted(keys_):
            Client(server.url, keys_[principal], MODERN).result("tools/call", echo)
        client = app.state.gateway.proxy.upstreams["up"].client
        held: set[str] = set()

        def only_late() -> bool:
            Client(server.url, keys_["late"], MODERN).result("tools/call", echo)
            try:  # the maps belong to the gateway's loop, in another thread: a read may meet a change
                held.clear()
                held.update(seat.principal for seat in [*client._sessions, *client._renewed] if seat.principal)
            except RuntimeError:
                return False
            return held == {"late"}

        wait_for_sync(only_late, timeout_s=20, interval_s=0.2, what=lambda: f"idle sessions forgotten, held {held}")


def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[int]:
    """``bodies`` POSTed to ``url`` at once (one thread each, released together)."""
    gate = threading.Barrier(len(bodies))

    def post(body: dict[str, Any]) -> int:
        gate.wait()
        return httpx.post(url, json=body, headers=ADMIN, timeout=30).status_code

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


@pytest.mark.parametrize("clash", ["namespace", "name"])
def test_concurrent_adds_under_one_namespace_or_name_let_exactly_one_in(redis_url: str, upstream: str,
                                                                        clash: str) -> None:
    bodies = [upstream_entry(upstream, name=f"up{n}" if clash == "namespace" else "up", namespace="shared")
              for n in range(20)]
    with front_gateway(redis_url, {}) as base:
        codes = _post_all(base + "/admin/upstreams", bodies)
        assert sorted(codes) == [201] + [409] * 19
        listed = httpx.get(base + "/admin/upstreams", headers=ADMIN).json()["upstreams"]
        assert [u["namespace"] for u in listed] == ["shared"]


@pytest.mark.parametrize("number", ["1e309", "-1e309", "1e12", "100000000000000000000000000"])
def test_an_endless_or_absurd_number_is_refused_and_the_upstream_kept(redis_url: str, upstream: str,
                                                                      number: str) -> None:
    admin_url_json = {**ADMIN, "content-type": "application/json"}
    with front_gateway(redis_url, {}) as base:
        admin_url = base + "/admin/upstreams"
        for field in ("timeout_s", "concurrency"):
            body = f'{{"name": "x", "url": "http://127.0.0.1:9/mcp", "{field}": {number}}}'
            assert httpx.post(admin_url, content=body, headers=admin_url_json).status_code == 422
            assert httpx.get(admin_url + "/x", headers=ADMIN).status_code == 404
        assert httpx.post(admin_url, json=upstream_entry(upstream), headers=ADMIN).status_code == 201
        for field in ("timeout_s", "concurrency"):
            r = httpx.patch(admin_url + "/up", content=f'{{"{field}": {number}}}', headers=admin_url_json)
            assert r.status_code == 422, r.text
        kept = httpx.get(admin_url + "/up", headers=ADMIN)
        assert kept.status_code == 200 and kept.json()["timeout_s"] == 10.0 and kept.json()["concurrency"] == 16
        Client(base, MCP_KEY, LEGACY).open().result("tools/call", {"name": "up.t_echo", "arguments": {"text": "k"}})


@pytest.mark.parametrize("body", [{"stdio_max_processes": 4}, {"stdio_idle_s": 5.0, "timeout_s": 3.0}])
def test_a_stdio_setting_is_refused_for_an_http_upstream_and_nothing_changes(redis_url: str, redis_target: RedisTarget,
                                                                           upstream: str, body: dict[str, Any]) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream)]}) as base:
        admin_url = base + "/admin/upstreams/up"
        with front_store(redis_target) as r:
            stored = r.hget(keys.PROXY_UPSTREAMS, "up")
            refused = httpx.patch(admin_url, json=body, headers=ADMIN)
            assert refused.status_code == 422
            assert refused.json()["detail"].startswith(", ".join(sorted(k for k in body if k.startswith("stdio_"))))
            assert "apply to stdio upstreams only; this one speaks HTTP" in refused.json()["detail"]
            assert r.hget(keys.PROXY_UPSTREAMS, "up") == stored
        kept = httpx.get(admin_url, headers=ADMIN).json()
        assert kept["timeout_s"] == 10.0 and "stdio_max_processes" not in kept and "stdio_idle_s" not in kept


def test_a_stored_upstream_that_cannot_be_read_is_shown_as_such_and_can_be_removed(
        redis_url: str, redis_target: RedisTarget, upstream: str) -> None:
    nulled = {**upstream_entry(upstream, name="nulled"), "timeout_s": None}
    no_port = upstream_entry("http://127.0.0.1:99999/mcp", name="no_port")
    with front_gateway(redis_url, {}) as base, front_store(redis_target) as r:
        admin_url = base + "/admin/upstreams"
        assert httpx.post(admin_url, json=upstream_entry(upstream), headers=ADMIN).status_code == 201
        r.hset(keys.PROXY_UPSTREAMS, mapping={"nulled": orjson.dumps(nulled), "garbled": b"{not json",
                                              "no_port": orjson.dumps(no_port)})
        listed = httpx.get(admin_url, headers=ADMIN)
        assert listed.status_code == 200, listed.text
        by_name = {u["name"]: u for u in listed.json()["upstreams"]}
        assert sorted(by_name) == ["garbled", "no_port", "nulled", "up"] and "unreadable" not in by_name["up"]
        assert "timeout_s" in by_name["nulled"]["unreadable"] and "JSON" in by_name["garbled"]["unreadable"]
        assert "port" in by_name["no_port"]["unreadable"]
        one = httpx.get(admin_url + "/nulled", headers=ADMIN)
        assert one.status_code == 200 and one.json() == by_name["nulled"]
        assert httpx.get(admin_url + "/nulled/health", headers=ADMIN).status_code == 404
        changed = httpx.patch(admin_url + "/nulled", json={"timeout_s": 5.0}, headers=ADMIN)
        assert changed.status_code == 409 and "cannot be read" in changed.text
        for name in ("nulled", "garbled", "no_port"):
            assert httpx.delete(admin_url + f"/{name}", headers=ADMIN).json() == {"removed": name}
            assert httpx.get(admin_url + f"/{name}", headers=ADMIN).status_code == 404
        assert [u["name"] for u in httpx.get(admin_url, headers=ADMIN).json()["upstreams"]] == ["up"]
        Client(base, MCP_KEY, LEGACY).open().result("tools/call", {"name": "up.t_echo", "arguments": {"text": "k"}})
