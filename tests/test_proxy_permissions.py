"""Who may use what through the proxy, what the audit stream records (refusals included), and that an upstream's
credential appears in no response, log line, admin read, metric, audit record or Redis value."""

from __future__ import annotations

import logging

import httpx
import pytest

from shared import keys
from tests.admin_support import MCP_KEY
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import (
    ADMIN,
    BOB_KEY,
    LEGACY,
    MODERN,
    TOKEN_ENV,
    UPSTREAM_SECRET,
    Client,
    front_gateway,
    front_store,
    upstream_entry,
)

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url

FORBIDDEN = -32003


def test_allow_lists_by_principal_and_role(redis_url: str, upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream)],
             "allow": {"principals": {"alice": ["*"]}, "roles": {"analyst": ["up.t_echo"]}}}
    limits = {"roles": {"analyst": {}}, "principal_roles": {"bob": "analyst"}}
    with front_gateway(redis_url, proxy, limits=limits) as base:
        alice = Client(base, MCP_KEY, LEGACY).open()
        assert {"up.t_echo", "up.t_fail"} <= set(alice.names())
        for revision in (LEGACY, MODERN):
            bob = Client(base, BOB_KEY, revision).open()
            assert [n for n in bob.names() if n.startswith("up.")] == ["up.t_echo"]
            assert bob.result("tools/call", {"name": "up.t_echo", "arguments": {"text": "ok"}})["content"]
            denied = bob.post("tools/call", {"name": "up.t_fail", "arguments": {}})
            error = denied.json()["error"]
            assert error["code"] == FORBIDDEN and "up.t_fail" in error["message"] and "'up'" in error["message"]
            assert denied.status_code == (403 if revision == MODERN else 200)
            read = bob.call("resources/read", {"uri": "upstream://up/test%3A%2F%2Fr"})
            assert read["error"]["code"] == FORBIDDEN  # a tool grant is not the whole upstream
            assert not [r for r in bob.result("resources/list")["resources"] if r["uri"].startswith("upstream://")]


def test_unlisted_principal_sees_no_upstream(redis_url: str, upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream)], "allow": {"principals": {"alice": ["up"]}}}
    with front_gateway(redis_url, proxy) as base:
        bob = Client(base, BOB_KEY, LEGACY).open()
        assert not [n for n in bob.names() if n.startswith("up.")]
        assert bob.call("tools/call", {"name": "up.t_echo", "arguments": {"text": "x"}})["error"]["code"] == FORBIDDEN
        alice = Client(base, MCP_KEY, LEGACY).open()
        assert "up.t_echo" in alice.names()


def test_every_proxied_call_is_audited(redis_url: str, redis_target: RedisTarget, upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        client.result("tools/call", {"name": "up.t_echo", "arguments": {"text": "audited"}})
        client.result("tools/call", {"name": "up.t_fail", "arguments": {}})
        with front_store(redis_target, decode_responses=True) as r:
            def records() -> list[dict[str, str]]:
                return [f for stream in keys.audit_streams() for _, f in r.xrange(stream)
                        if f.get("action") == "proxy.call"]
            wait_for_sync(lambda: len(records()) >= 2, timeout_s=10, what="two audit records")
            calls = {rec["item"]: rec for rec in records() if rec["method"] == "tools/call"}
        assert calls["t_echo"]["principal"] == "alice" and calls["t_echo"]["upstream"] == "up"
        assert calls["t_echo"]["outcome"] == "ok" and float(calls["t_echo"]["latency_ms"]) > 0
        assert calls["t_fail"]["outcome"] == "tool_error"
        assert not any("audited" in v for rec in calls.values() for v in rec.values())  # no arguments


def test_a_refused_proxied_call_is_audited_without_its_arguments(redis_url: str, redis_target: RedisTarget,
                                                                  upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream)], "allow": {"roles": {"analyst": ["up.t_echo"]}}}
    limits = {"roles": {"analyst": {}}, "principal_roles": {"bob": "analyst"}}
    with front_gateway(redis_url, proxy, limits=limits) as base:
        bob = Client(base, BOB_KEY, LEGACY).open()
        refused = bob.call("tools/call", {"name": "up.t_fail", "arguments": {"token": "arg-secret-8e1d"}})
        assert refused["error"]["code"] == FORBIDDEN
        assert bob.call("resources/read", {"uri": "upstream://up/test%3A%2F%2Fr"})["error"]["code"] == FORBIDDEN
        assert bob.call("resources/subscribe", {"uri": "upstream://up/test%3A%2F%2Fr"})["error"]["code"] == FORBIDDEN
        with front_store(redis_target, decode_responses=True) as r:
            def records() -> list[dict[str, str]]:
                return [f for stream in keys.audit_streams() for _, f in r.xrange(stream)
                        if f.get("action") == "proxy.call" and f.get("principal") == "bob"]
            wait_for_sync(lambda: len(records()) >= 3, timeout_s=10, what="three audit records")
            found = records()
    assert {(rec["method"], rec["item"], rec["outcome"], rec["upstream"]) for rec in found} == {
        ("tools/call", "t_fail", "forbidden", "up"), ("resources/read", "test://r", "forbidden", "up"),
        ("resources/subscribe", "test://r", "forbidden", "up")}
    assert not any("arg-secret-8e1d" in v or UPSTREAM_SECRET in v for rec in found for v in rec.values())


def test_credentials_appear_nowhere(redis_url: str, redis_target: RedisTarget, upstream: str,
                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream)]}) as base:
        seen: list[str] = []
        for revision in (LEGACY, MODERN):
            client = Client(base, MCP_KEY, revision).open()
            for method, params in (("tools/list", {}), ("resources/list", {}),
                                   ("tools/call", {"name": "up.t_echo", "arguments": {"text": "a"}}),
                                   ("tools/call", {"name": "up.t_crash", "arguments": {}}),
                                   ("tools/call", {"name": "up.t_echo", "arguments": {"text": 1}}),
                                   ("resources/read", {"uri": "upstream://up/test%3A%2F%2Fr"})):
                seen.append(client.post(method, params).text)
        for path in ("/admin/upstreams", "/admin/upstreams/up", "/admin/upstreams/up/health", "/admin/audit",
                     "/admin/config"):
            r = httpx.get(base + path, headers=ADMIN)
            seen.append(r.text)
        admin_read = httpx.get(base + "/admin/upstreams/up", headers=ADMIN).json()
        assert admin_read["credentials"] == {"Authorization": "env"} and TOKEN_ENV not in str(admin_read)
        seen.append(httpx.get(base + "/metrics").text)
        with front_store(redis_target) as r:
            seen.extend(str(r.dump(k)) for k in r.scan_iter("*"))
    assert any("proxy:a" in s for s in seen)  # the calls did reach the upstream
    for text in [*seen, caplog.text]:
        assert UPSTREAM_SECRET not in text


def test_quotas_apply_to_proxied_calls(redis_url: str, upstream: str) -> None:
    limits = {"principals": {"alice": {"requests_per_s": 0.01, "requests_burst": 2}}}
    with front_gateway(redis_url, {"upstreams": [upstream_entry(upstream)]}, limits=limits) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        answers = [client.post("tools/call", {"name": "up.t_echo", "arguments": {"text": "q"}}) for _ in range(3)]
        assert [a.status_code for a in answers[:2]] == [200, 200]
        assert answers[2].status_code == 429 and answers[2].json()["error"]["code"] == -32029
        assert "retry-after" in answers[2].headers
