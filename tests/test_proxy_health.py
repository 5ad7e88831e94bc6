"""Breakers stay per replica, their view is mesh-wide: a breaker that opens on one replica is seen
through another replica's health route, list route and dashboard feed while each replica's
/metrics keeps its own gauge; a replica that stops publishing drops out after
``proxy.health_ttl_s``, and one that stops cleanly withdraws its report at once. Real upstream,
two gateway replicas (one a process that is killed), a single Redis and a Redis Cluster."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shared import keys
from shared.net import free_port
from tests.admin_support import ADMIN_KEY, MCP_KEY
from tests.conftest import RedisTarget, wait_for_sync
from tests.gateway_support import start_gateway, stop
from tests.proxy_front import (
    ADMIN,
    LEGACY,
    Client,
    front_gateway,
    front_store,
    upstream_entry,
    upstream_gateway,
)

pytest_plugins = ("tests.proxy_front_fixtures",)

TTL_S = 2.0
FAST_ROUNDS = {"status_interval_s": 0.25}  # how often a replica republishes (and renews the TTL)
SLOW_ROUNDS = {"status_interval_s": 60.0}
ECHO = {"name": "up.t_echo", "arguments": {"text": "x"}}


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The replicas' Redis: a single server, then a cluster."""
    return redis_target.url


@pytest.fixture
def killable() -> Iterator[tuple[str, subprocess.Popen]]:
    with upstream_gateway() as (url, proc):
        yield url, proc


def _health(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/admin/upstreams/up/health", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _states(view: dict[str, Any]) -> dict[str, str]:
    return {r["replica"]: r["state"] for r in view["per_replica"]}


def _replica_process(redis_url: str, proxy: dict[str, Any], rounds: dict[str, float]) -> tuple[str, subprocess.Popen]:
    """A gateway replica in a process of its own: its /metrics are its own, and it can die
    without withdrawing anything."""
    port = free_port()
    overrides = {"proxy": proxy, "metrics": rounds,
                 "gateway": {"admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"}}}}
    return f"http://127.0.0.1:{port}", start_gateway(port, redis_url, api_keys=f"alice:{MCP_KEY}",
                                                       overrides=overrides)


def test_open_breaker_on_one_replica_is_seen_through_another(redis_url: str,
                                                            killable: tuple[str, subprocess.Popen]) -> None:
    url, upstream_proc = killable
    proxy = {"upstreams": [upstream_entry(url, revision=LEGACY)], "breaker": {"failures": 2, "reset_s": 300.0},
             "health_ttl_s": 120.0}
    # Rounds far apart: what b sees within the wait below was published when a's breaker moved.
    a, a_proc = _replica_process(redis_url, proxy, SLOW_ROUNDS)
    try:
        with front_gateway(redis_url, proxy, metrics=SLOW_ROUNDS) as b:
            a_id, b_id = _health(a)["replica"], _health(b)["replica"]
            wait_for_sync(lambda: _states(_health(b)) == {b_id: "closed", a_id: "closed"}, timeout_s=10,
                          what="both replicas' breakers in b's view")
            client = Client(a, MCP_KEY, LEGACY).open()
            assert client.result("tools/call", ECHO)["content"][0]["text"] == "proxy:x"
            upstream_proc.kill()
            upstream_proc.wait(10)
            reasons = [client.call("tools/call", ECHO)["error"]["data"]["reason"] for _ in range(3)]
            assert reasons == ["unreachable", "unreachable", "breaker_open"]

            wait_for_sync(lambda: _states(_health(b)).get(a_id) == "open", timeout_s=10,
                          what="a's open breaker in b's health view")
            view = _health(b)
            own, other = view["per_replica"]
            assert view["replica"] == b_id and view["breaker"] == "closed"
            assert (own["replica"], own["state"], own["age_s"], own["opened_ms"]) == (b_id, "closed", 0.0, None)
            assert other["replica"] == a_id and other["consecutive_failures"] == 2 and other["age_s"] >= 0
            assert other["retry_at_ms"] - other["opened_ms"] == 300_000
            assert {k: view["mesh"][k] for k in ("replicas", "closed", "half_open", "open")} == {
                "replicas": 2, "closed": 1, "half_open": 0, "open": 1}
            [listed] = httpx.get(b + "/admin/upstreams", headers=ADMIN, timeout=10).json()["upstreams"]
            assert listed["health"]["mesh"]["open"] == 1
            [panel] = httpx.get(b + "/admin/summary", headers=ADMIN, timeout=10).json()["upstreams"]
            assert panel["mesh"]["open"] == 1 and panel["mesh"]["replicas"] == 2
            seen_by_a = _health(a)  # a's own entry is read live, not from Redis
            assert seen_by_a["breaker"] == "open" and (seen_by_a["calls"], seen_by_a["errors"]) == (4, 3)
            assert seen_by_a["per_replica"][0]["replica"] == a_id
            # /metrics stays per replica: a's gauge shows its open breaker, b's its closed one
            assert 'learnmesh_proxy_breaker_state{upstream="up"} 2.0' in httpx.get(a + "/metrics", timeout=10).text
            assert 'learnmesh_proxy_breaker_state{upstream="up"} 0.0' in httpx.get(b + "/metrics", timeout=10).text
    finally:
        stop(a_proc)


def test_replica_that_stops_publishing_ages_out(redis_url: str, redis_target: RedisTarget, upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream)], "health_ttl_s": TTL_S}
    a, a_proc = _replica_process(redis_url, proxy, FAST_ROUNDS)
    try:
        with front_gateway(redis_url, proxy, metrics=FAST_ROUNDS) as b, front_store(redis_target) as r:
            a_id, b_id = _health(a)["replica"], _health(b)["replica"]
            wait_for_sync(lambda: set(_states(_health(b))) == {a_id, b_id}, timeout_s=15,
                          what="both replicas in b's view")
            first = json.loads(r.hget(keys.PROXY_BREAKERS, a_id))["ts_ms"]
            wait_for_sync(lambda: json.loads(r.hget(keys.PROXY_BREAKERS, a_id))["ts_ms"] > first, timeout_s=10,
                          what="a to refresh its report")
            a_proc.kill()  # no clean stop: its report stays in Redis until it is too old
            a_proc.wait(10)
            wait_for_sync(lambda: a_id not in _states(_health(b)), timeout_s=TTL_S + 15,
                          what="the killed replica's report to age out")
            assert _health(b)["mesh"]["replicas"] == 1
            assert not r.hexists(keys.PROXY_BREAKERS, a_id)  # the reader deleted it
            assert 0 < r.pttl(keys.PROXY_BREAKERS) <= TTL_S * 1000  # b keeps the key alive, for no longer
    finally:
        stop(a_proc)


def test_replica_stopping_cleanly_withdraws_its_report(redis_url: str, redis_target: RedisTarget,
                                                       upstream: str) -> None:
    proxy = {"upstreams": [upstream_entry(upstream)], "health_ttl_s": 60.0}
    with front_store(redis_target) as r:
        with front_gateway(redis_url, proxy, metrics=FAST_ROUNDS) as base:
            replica = _health(base)["replica"]
            wait_for_sync(lambda: r.hexists(keys.PROXY_BREAKERS, replica), timeout_s=10,
                          what="the replica's report in Redis")
            r.hset(keys.PROXY_BREAKERS, "not-a-replica", "{broken")
            assert [x["replica"] for x in _health(base)["per_replica"]] == [replica]
            assert not r.hexists(keys.PROXY_BREAKERS, "not-a-replica")  # what no replica wrote is dropped
            assert 0 < r.pttl(keys.PROXY_BREAKERS) <= 60_000
        assert not r.hexists(keys.PROXY_BREAKERS, replica)  # gone at once, not 60 s later
