"""Hostile input to the admin API on a live gateway and real Redis: what it cannot accept is a
clear 4xx in JSON, never a 500, and never stored where the mesh would read it back wrong."""

from __future__ import annotations

import httpx
import pytest
import redis as redis_sync

from shared import keys
from tests.admin_support import ADMIN_KEY, bearer, live_gateway

JSON_ADMIN = {**bearer(ADMIN_KEY), "content-type": "application/json"}


@pytest.fixture
def gw(redis_url):
    with live_gateway(redis_url) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        yield client


@pytest.fixture
def r(redis_url):
    with redis_sync.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("POST", "/admin/models/rollback", b'{"version": NaN}', ["body", "version"]),
    ("POST", "/admin/models/rollback", b'{"anchor": Infinity}', ["body", "anchor"]),
    ("POST", "/admin/keys", b'{"name": -Infinity}', ["body", "name"]),
    ("PATCH", "/admin/config", b'{"compression": {"density": NaN}}', ["body", "compression", "density"]),
    ("PATCH", "/admin/config", b'{"compression": {"density": 1e400}}', ["body", "compression", "density"]),
])
def test_a_refused_non_finite_number_is_422_naming_the_field(gw, method, path, body, field):
    """Python's JSON reader takes NaN, Infinity and 1e400 (an infinity); the route's model refuses
    them, and the answer that echoes the value back is JSON all the same."""
    resp = gw.request(method, path, content=body, headers=JSON_ADMIN)
    assert resp.status_code == 422, resp.text
    assert resp.headers["content-type"] == "application/json"
    (error,) = resp.json()["detail"]
    assert error["loc"] == field
    assert error["input"] in ("nan", "inf", "-inf")
    assert gw.get("/admin/whoami", headers=bearer(ADMIN_KEY)).status_code == 200


@pytest.mark.parametrize(("body", "problem"), [
    # refused by the route's model, as every configured float must be finite: named by its place
    (b'{"compression": {"threshold": Infinity}}', ["body", "compression", "threshold"]),
    (b'{"consistency": {"timeout_s": 1e400}}', ["body", "consistency", "timeout_s"]),
    (b'{"consistency": {"learn_wait_s": Infinity}}', ["body", "consistency", "learn_wait_s"]),
    (b'{"consistency": {"sync_interval": 1180591620717411303424}}',
     "consistency.sync_interval: must fit in a signed 64-bit integer"),
])
def test_runtime_config_refuses_a_value_the_mesh_could_not_read_back(gw, r, body, problem):
    """Stored, an infinity (which JSON cannot carry) or an integer past 64 bits would make every
    gateway replica ignore all runtime overrides, the ones already in force among them."""
    assert gw.patch("/admin/config", json={"compression": {"density": 0.5}},
                    headers=bearer(ADMIN_KEY)).status_code == 200
    before = r.hgetall(keys.RUNTIME_CONFIG)
    resp = gw.patch("/admin/config", content=body, headers=JSON_ADMIN)
    assert resp.status_code == 422, resp.text
    if isinstance(problem, str):
        assert resp.json() == {"detail": problem}
    else:
        (error,) = resp.json()["detail"]
        assert (error["loc"], error["type"]) == (problem, "finite_number"), error
    assert r.hgetall(keys.RUNTIME_CONFIG) == before
    shown = gw.get("/admin/config", headers=bearer(ADMIN_KEY)).json()
    assert shown["runtime_overrides"] == {"compression": {"density": 0.5}}
    assert shown["config"]["compression"]["density"] == 0.5


@pytest.mark.parametrize(("method", "path"), [
    ("DELETE", "/admin/contexts/admin:root/notes"),
    ("GET", "/admin/contexts/admin:root/notes/export"),
    ("GET", "/admin/contexts/admin:root/notes"),
    ("GET", "/admin/contexts?principal=admin:root"),
    ("PUT", "/admin/teachers/admin:root"),
    ("DELETE", "/admin/limits/admin:root"),
    ("GET", "/admin/contexts/*/notes"),
    ("GET", "/admin/contexts?principal=../../etc"),
])
def test_a_name_no_principal_can_have_is_422_and_leaves_no_audit_record(gw, method, path):
    """``admin:<key name>`` is how the audit names admin keys: an operator's key evicting a
    "context" of ``admin:root`` would put a record in the admin root's trail."""
    resp = gw.request(method, path, headers=bearer(ADMIN_KEY))
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"][-1] == "principal"
    trail = gw.get("/admin/audit", params={"principal": "admin:root"}, headers=bearer(ADMIN_KEY)).json()
    assert trail["entries"] == []
