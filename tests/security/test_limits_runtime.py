"""A principal's limits change at runtime: an operator lowers an abusive principal's limits, or
raises a customer's, through the admin API, and every gateway replica enforces the change
without a restart; ``DELETE`` goes back to the config's. Two real gateway processes, one real
Redis (a server or a cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from websockets.asyncio.client import connect as ws_connect

from gateway.errors import LimitExceeded
from gateway.limits import Limits, set_override
from shared import keys
from shared.config import load_config
from shared.redis_client import async_client
from tests.conftest import RedisTarget, private_redis, wait_for_sync
from tests.gateway_support import two_gateways
from tests.security.test_limits import _refused_handshake
from tests.test_gateway_http import modern

KEYS = {p: f"key-{p}-0123456789" for p in ("abuser", "calm", "streamer", "tenant")}
ADMIN = "root-admin-key-0123456789"
OPERATOR = "ops-operator-key-0123456789"
VIEWER = "watch-viewer-key-0123456789"
SLOW = 0.001  # tokens per second: none come back while a test runs
WAIT_S = 30  # for a change to reach a replica (at once through the control channel; a bound, not a target)


@pytest.fixture(scope="module")
def replicas(redis_target_module: RedisTarget) -> Iterator[tuple[str, str]]:
    overrides = {"limits": {"roles": {"gold": {"listen_streams": 5, "requests_burst": 500}},
                            "principal_roles": {"tenant": "gold"},
                            "principals": {"tenant": {"requests_burst": 100}}},
                 "gateway": {"admin_keys": {"root": {"key": ADMIN, "role": "admin"},
                                            "ops": {"key": OPERATOR, "role": "operator"},
                                            "watch": {"key": VIEWER, "role": "viewer"}}}}
    with two_gateways(redis_target_module.url, KEYS, overrides) as urls:
        yield urls


def admin(method: str, url: str, key: str = OPERATOR, json_body: bool = False, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **({"content-type": "application/json"} if json_body else {})}
    return httpx.request(method, url, headers=headers, timeout=10, **kw)


def tools_list(base: str, principal: str) -> httpx.Response:
    body, headers = modern("tools/list")
    return httpx.post(base + "/mcp", json=body, headers={**headers, "authorization": f"Bearer {KEYS[principal]}"},
                      timeout=10)


def limited(r: httpx.Response, limit: str) -> bool:
    if r.status_code == 200:
        return False
    assert r.status_code == 429 and r.json()["error"]["data"]["limit"] == limit, r.text
    return True


def test_an_operator_lowers_a_request_rate_on_every_replica_and_restores_it(replicas: tuple[str, str],
                                                                            store: Any) -> None:
    a, b = replicas
    for _ in range(5):
        assert tools_list(b, "abuser").status_code == 200
    put = admin("PUT", a + "/admin/limits/abuser", json={"requests_per_s": SLOW, "requests_burst": 3})
    assert put.status_code == 200, put.text
    view = put.json()
    assert view["limits"]["requests_per_s"] == SLOW and view["limits"]["requests_burst"] == 3
    assert view["source"]["requests_per_s"] == "runtime" and view["source"]["listen_streams"] == "default"
    assert view["runtime"]["limits"] == {"requests_per_s": SLOW, "requests_burst": 3}
    assert view["runtime"]["by"] == "admin:ops"
    # the replica that did not serve the change enforces it, with no restart
    wait_for_sync(lambda: limited(tools_list(b, "abuser"), "requests"), timeout_s=WAIT_S,
                  what="replica B to refuse the abuser")
    assert limited(tools_list(a, "abuser"), "requests")
    # another principal is not slowed down
    for i in range(10):
        assert tools_list(a if i % 2 else b, "calm").status_code == 200
    # both replicas and the listing say the same
    assert admin("GET", b + "/admin/limits/abuser", VIEWER).json() == {**view, "runtime": view["runtime"]}
    assert set(admin("GET", b + "/admin/limits", VIEWER).json()["runtime"]) == {"abuser"}
    # back to the config: the abuser is served again on both replicas
    reset = admin("DELETE", b + "/admin/limits/abuser")
    assert reset.status_code == 200 and reset.json()["runtime"] is None
    assert reset.json()["limits"]["requests_per_s"] == 1000 and set(reset.json()["source"].values()) == {"default"}
    wait_for_sync(lambda: tools_list(a, "abuser").status_code == 200, timeout_s=WAIT_S,
                  what="replica A to serve the abuser again")
    wait_for_sync(lambda: tools_list(b, "abuser").status_code == 200, timeout_s=WAIT_S,
                  what="replica B to serve the abuser again")
    assert not store.exists(keys.limit_override("abuser")) and not store.hlen(keys.LIMIT_OVERRIDES)
    changes = admin("GET", a + "/admin/audit", VIEWER, params={"action": "limit.*"}).json()["entries"]
    assert [(e["action"], e["client"], e["principal"]) for e in changes] == [
        ("limit.reset", "abuser", "admin:ops"), ("limit.set", "abuser", "admin:ops")]


def test_a_lowered_cap_holds_on_every_replica(replicas: tuple[str, str], store: Any) -> None:
    a, b = replicas
    ws_a, ws_b = (base.replace("http://", "ws://") + "/mcp/ws" for base in replicas)

    async def scenario() -> None:
        async with ws_connect(ws_a, subprotocols=["mcp"], open_timeout=10,
                              additional_headers={"authorization": f"Bearer {KEYS['streamer']}"}):
            # a second stream is fine by the config (64)
            async with ws_connect(ws_b, subprotocols=["mcp"], open_timeout=10,
                                  additional_headers={"authorization": f"Bearer {KEYS['streamer']}"}):
                pass
            assert admin("PUT", a + "/admin/limits/streamer", json={"event_streams": 1}).status_code == 200

            async def refused_on_b() -> bool:
                try:
                    async with ws_connect(ws_b, subprotocols=["mcp"], open_timeout=10,
                                          additional_headers={"authorization": f"Bearer {KEYS['streamer']}"}):
                        return False
                except Exception:  # noqa: BLE001 - the status is checked below
                    return True

            deadline = asyncio.get_running_loop().time() + WAIT_S
            while not await refused_on_b():
                assert asyncio.get_running_loop().time() < deadline, "replica B never applied the cap"
            status, headers, body = await _refused_handshake(ws_b, "streamer")
            assert status == 429 and body["error"] == "limit_exceeded" and "event streams" in body["error_description"]
            # another principal's streams are not capped
            async with ws_connect(ws_b, subprotocols=["mcp"], open_timeout=10,
                                  additional_headers={"authorization": f"Bearer {KEYS['calm']}"}):
                async with ws_connect(ws_a, subprotocols=["mcp"], open_timeout=10,
                                      additional_headers={"authorization": f"Bearer {KEYS['calm']}"}):
                    pass
            assert admin("DELETE", b + "/admin/limits/streamer").status_code == 200

            async def opens_on_a() -> bool:
                try:
                    async with ws_connect(ws_a, subprotocols=["mcp"], open_timeout=10,
                                          additional_headers={"authorization": f"Bearer {KEYS['streamer']}"}):
                        return True
                except Exception:  # noqa: BLE001
                    return False

            deadline = asyncio.get_running_loop().time() + WAIT_S
            while not await opens_on_a():
                assert asyncio.get_running_loop().time() < deadline, "replica A never dropped the cap"

    asyncio.run(scenario())


def test_the_view_names_where_each_limit_comes_from(replicas: tuple[str, str], store: Any) -> None:
    a, _ = replicas
    view = admin("GET", a + "/admin/limits/tenant", VIEWER).json()
    assert view["role"] == "gold" and view["runtime"] is None
    assert view["limits"]["listen_streams"] == 5 and view["limits"]["requests_burst"] == 100
    assert (view["source"]["listen_streams"], view["source"]["requests_burst"],
            view["source"]["event_streams"]) == ("role", "principal", "default")
    raised = admin("PUT", a + "/admin/limits/tenant", ADMIN, json={"requests_burst": 5000}).json()
    assert raised["limits"]["requests_burst"] == 5000 and raised["source"]["requests_burst"] == "runtime"
    assert raised["limits"]["listen_streams"] == 5 and raised["source"]["listen_streams"] == "role"
    # a PUT replaces what was set before
    again = admin("PUT", a + "/admin/limits/tenant", json={"inference_in_flight": 2}).json()
    assert again["runtime"]["limits"] == {"inference_in_flight": 2} and again["limits"]["requests_burst"] == 100


@pytest.mark.parametrize(("body", "named"), [
    (b'{"bogus": 1}', "bogus"),
    (b'{"requests_per_s": 5.0, "requests_burst": 0}', "requests_burst"),
    (b'{"requests_burst": "many"}', "requests_burst"),
    (b'{"requests_burst": true}', "requests_burst"),
    (b'{"listen_streams": -1}', "listen_streams"),
    (b'{"requests_per_s": 1.5, "running_tasks": 2.5}', "running_tasks"),
    (b'{"requests_per_s": Infinity}', "requests_per_s"),
    (b'{"requests_per_s": NaN}', "requests_per_s"),
    (b'{"requests_burst": 1180591620717411303424}', "requests_burst"),
    # a bucket that would take longer than 1e12 s to fill: its wait overflows what Redis can expire
    (b'{"requests_per_s": 1e-300}', "requests_per_s"),
    (b'{"requests_per_s": 5e-324, "requests_burst": 1}', "requests_per_s"),
    (b'{"learn_bytes_per_s": 1e-6}', "learn_bytes_per_s"),
    (b'{"requests_per_s": null}', "requests_per_s"),
    (b'{}', "at least one"),
    (b'[{"requests_per_s": 1}]', ""),
    (b'"requests_per_s"', ""),
])
def test_bad_bodies_are_refused_and_store_nothing(replicas: tuple[str, str], store: Any, body: bytes,
                                                  named: str) -> None:
    a, _ = replicas
    r = admin("PUT", a + "/admin/limits/abuser", content=body, json_body=True)
    assert r.status_code == 422, r.text
    assert named in str(r.json()["detail"])
    assert not store.exists(keys.limit_override("abuser")) and not store.hlen(keys.LIMIT_OVERRIDES)
    assert admin("GET", a + "/admin/limits/abuser", VIEWER).json()["runtime"] is None
    r = admin("PUT", a + "/admin/limits/abuser", content=b"{not json", json_body=True)
    assert r.status_code == 400 and not store.exists(keys.limit_override("abuser"))


def test_a_viewer_may_read_limits_but_not_change_them(replicas: tuple[str, str], store: Any) -> None:
    a, _ = replicas
    assert admin("GET", a + "/admin/limits/abuser", VIEWER).status_code == 200
    assert admin("PUT", a + "/admin/limits/abuser", VIEWER, json={"requests_per_s": SLOW}).status_code == 403
    assert admin("DELETE", a + "/admin/limits/abuser", VIEWER).status_code == 403
    assert not store.exists(keys.limit_override("abuser"))
    assert admin("PUT", a + "/admin/limits/bad%7Bname%7D", json={"requests_per_s": SLOW}).status_code == 422
    assert admin("GET", a + "/admin/limits/abuser", "no-such-key").status_code == 401


def test_with_redis_gone_the_last_limits_read_stay_in_force() -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server to stop")
    with private_redis(binary) as url:
        cfg = load_config(None, env={}, overrides={"redis": {"url": url},
                                                   "limits": {"principals": {"capped": {"inference_in_flight": 4}}}})

        async def scenario() -> None:
            redis = async_client(cfg.redis)
            limits = Limits(redis, cfg)
            await set_override(redis, "abuser", {"inference_in_flight": 1}, "admin:ops")
            assert (await limits.current("abuser")).inference_in_flight == 1
            with contextlib.suppress(RedisConnectionError):  # the server closes the connection as it goes
                await redis.execute_command("SHUTDOWN", "NOSAVE")
            # Redis is gone: reading again keeps what was read last, and never fails the caller
            assert (await limits.refresh("abuser")).inference_in_flight == 1
            with limits.inference_slot("abuser"), pytest.raises(LimitExceeded):
                with limits.inference_slot("abuser"):
                    pass
            # a principal not read yet has the config's limits, not none
            assert (await limits.current("capped")).inference_in_flight == 4
            assert (await limits.refresh("newcomer")).inference_in_flight == cfg.limits.default.inference_in_flight
            await limits.admit_request("abuser")  # within its rate: this replica's own bucket lets it pass
            await redis.aclose()

        asyncio.run(scenario())
