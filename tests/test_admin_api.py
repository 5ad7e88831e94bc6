"""Admin REST API against a live gateway and real Redis: roles, keys, audit, control plane."""

from __future__ import annotations

import httpx
import pytest

from shared import control, keys
from shared.config import CompressionConfig
from shared.redis_client import close_sync
from tests.admin_support import ADMIN_KEY, MCP_KEY, OPERATOR_KEY, VIEWER_KEY, bearer, live_gateway


@pytest.fixture
def redis_url(redis_target):
    """Every test here runs on a single server and on a cluster (tests/conftest.py)."""
    return redis_target.url


@pytest.fixture
def gw(redis_url):
    with live_gateway(redis_url) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        yield client


@pytest.fixture
def r(redis_target):
    client = redis_target.sync_client(decode_responses=True)
    yield client
    close_sync(client)


def test_no_key_wrong_key_and_mcp_key_get_401(gw):
    assert gw.get("/admin/whoami").status_code == 401
    assert gw.get("/admin/whoami", headers=bearer("not-a-key-at-all")).status_code == 401
    resp = gw.get("/admin/whoami", headers=bearer(MCP_KEY))
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert gw.get("/admin/whoami", headers={"Authorization": f"Basic {ADMIN_KEY}"}).status_code == 401


def test_roles_are_ordered(gw):
    assert gw.get("/admin/whoami", headers=bearer(VIEWER_KEY)).json() == {
        "name": "watch", "role": "viewer", "source": "config"}
    # viewer reads, may not act
    assert gw.get("/admin/trainer", headers=bearer(VIEWER_KEY)).status_code == 200
    assert gw.post("/admin/trainer/pause", headers=bearer(VIEWER_KEY)).status_code == 403
    # operator acts, may not change configuration or keys
    assert gw.post("/admin/trainer/pause", headers=bearer(OPERATOR_KEY)).status_code == 200
    assert gw.patch("/admin/config", json={"compression": {"density": 0.5}},
                    headers=bearer(OPERATOR_KEY)).status_code == 403
    assert gw.get("/admin/keys", headers=bearer(OPERATOR_KEY)).status_code == 403
    assert gw.get("/admin/keys", headers=bearer(ADMIN_KEY)).status_code == 200


def test_runtime_keys_hashed_created_used_revoked(gw, r):
    resp = gw.post("/admin/keys", json={"name": "carol", "role": "operator"}, headers=bearer(ADMIN_KEY))
    assert resp.status_code == 201, resp.text
    new_key = resp.json()["key"]
    stored = r.hgetall(keys.ADMIN_KEYS)
    assert stored and all(new_key not in k and new_key not in v for k, v in stored.items())
    assert gw.get("/admin/whoami", headers=bearer(new_key)).json()["role"] == "operator"
    assert gw.post("/admin/keys", json={"name": "carol", "role": "viewer"},
                   headers=bearer(ADMIN_KEY)).status_code == 409
    assert gw.post("/admin/keys", json={"name": "root", "role": "viewer"},
                   headers=bearer(ADMIN_KEY)).status_code == 409
    assert gw.post("/admin/keys", json={"name": "bad name!", "role": "viewer"},
                   headers=bearer(ADMIN_KEY)).status_code == 422
    assert gw.post("/admin/keys", json={"name": "x", "role": "god"}, headers=bearer(ADMIN_KEY)).status_code == 422
    listed = gw.get("/admin/keys", headers=bearer(ADMIN_KEY)).json()["keys"]
    assert {k["name"] for k in listed} == {"root", "ops", "watch", "carol"}
    assert all("key" not in k or k["key"] == "***" for k in listed)
    assert gw.delete("/admin/keys/root", headers=bearer(ADMIN_KEY)).status_code == 409
    assert gw.delete("/admin/keys/carol", headers=bearer(ADMIN_KEY)).status_code == 200
    assert gw.get("/admin/whoami", headers=bearer(new_key)).status_code == 401
    assert gw.delete("/admin/keys/carol", headers=bearer(ADMIN_KEY)).status_code == 404


def test_a_body_that_is_not_json_is_400_on_every_admin_route(gw):
    """Malformed input is 400 on every admin route that takes a body (docs/operations.md), however
    its body is declared; JSON the route's model refuses stays 422."""
    doc = gw.get("/admin/openapi.json").json()
    with_body = [(method.upper(), path.replace("{", "").replace("}", ""))
                 for path, ops in doc["paths"].items() for method, op in ops.items() if "requestBody" in op]
    assert ("POST", "/admin/keys") in with_body and ("POST", "/admin/samples") in with_body
    json_type = {**bearer(ADMIN_KEY), "content-type": "application/json"}
    for method, path in with_body:
        resp = gw.request(method, path, content=b'{"name": "carol",', headers=json_type)
        assert resp.status_code == 400, (method, path, resp.text)
        assert resp.json()["detail"].startswith("the body is not valid JSON: "), (method, path, resp.text)
        resp = gw.request(method, path, content=b'{"name": "carol"}', headers={**bearer(ADMIN_KEY),
                                                                             "content-type": "text/plain"})
        assert resp.status_code == 400, (method, path, resp.text)
    resp = gw.post("/admin/keys", json={"name": "carol", "role": "god"}, headers=bearer(ADMIN_KEY))
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "role"]
    assert gw.post("/admin/keys", content=b'{"name": "carol",', headers=json_type).json() == {
        "detail": "the body is not valid JSON: Expecting property name enclosed in double quotes (char 17)"}


def test_every_action_is_audited_and_queryable(gw):
    gw.post("/admin/trainer/pause", headers=bearer(OPERATOR_KEY))
    gw.post("/admin/trainer/resume", headers=bearer(OPERATOR_KEY))
    gw.post("/admin/delta-key/rotate", headers=bearer(ADMIN_KEY))
    q = gw.get("/admin/audit", params={"principal": "admin:ops"}, headers=bearer(VIEWER_KEY)).json()
    assert [e["action"] for e in q["entries"]] == ["trainer.resume", "trainer.pause"]
    q = gw.get("/admin/audit", params={"action": "delta_key.*"}, headers=bearer(VIEWER_KEY)).json()
    assert [e["principal"] for e in q["entries"]] == ["admin:root"]
    first_ms = q["entries"][0]["ts_ms"]
    q = gw.get("/admin/audit", params={"since_ms": first_ms + 60_000}, headers=bearer(VIEWER_KEY)).json()
    assert q["entries"] == []
    q = gw.get("/admin/audit", params={"until_ms": first_ms, "limit": 1}, headers=bearer(VIEWER_KEY)).json()
    assert q["count"] == 1


def test_trainer_control_channel_round_trip(gw, r):
    ctl = control.TrainerControl(r)
    assert not ctl.paused()
    gw.post("/admin/trainer/pause", headers=bearer(OPERATOR_KEY))
    assert ctl.paused()
    assert gw.get("/admin/trainer", headers=bearer(VIEWER_KEY)).json()["paused"] is True
    gw.post("/admin/trainer/resume", headers=bearer(OPERATOR_KEY))
    assert not ctl.paused()
    cid = gw.post("/admin/trainer/checkpoint", headers=bearer(OPERATOR_KEY)).json()["command_id"]
    assert gw.get(f"/admin/trainer/commands/{cid}", headers=bearer(VIEWER_KEY)).json()["state"] == "pending"
    [cmd] = ctl.commands()
    assert (cmd.id, cmd.cmd, cmd.by) == (cid, "checkpoint", "admin:ops")
    ctl.ack(cmd, ok=True, path="var/checkpoints/step-7.pt")
    done = gw.get(f"/admin/trainer/commands/{cid}", headers=bearer(VIEWER_KEY)).json()
    assert done["state"] == "done" and done["result"]["path"] == "var/checkpoints/step-7.pt"
    # a restarted trainer neither repeats nor misses commands
    assert control.TrainerControl(r).commands() == []
    assert gw.get("/admin/trainer/commands/" + "0" * 32, headers=bearer(VIEWER_KEY)).status_code == 404


def test_model_versions_and_rollback(gw, r):
    assert gw.post("/admin/models/rollback", json={"version": 1}, headers=bearer(ADMIN_KEY)).status_code == 404
    for v in (1, 2, 3):
        control.record_version(r, v, step=v * 10, loss=3.0 / v, anchor=(v == 2))
    r.set(keys.MODEL_VERSION, 3)
    listed = gw.get("/admin/models", headers=bearer(VIEWER_KEY)).json()
    assert listed["current"] == 3 and [v["version"] for v in listed["versions"]] == [3, 2, 1]
    assert gw.post("/admin/models/rollback", json={"version": 1}, headers=bearer(OPERATOR_KEY)).status_code == 403
    assert gw.post("/admin/models/rollback", json={}, headers=bearer(ADMIN_KEY)).status_code == 422
    for not_an_int in (True, False, 1.0, "1", None):  # never read as version 1 (or 0)
        resp = gw.post("/admin/models/rollback", json={"version": not_an_int, "anchor": False},
                       headers=bearer(ADMIN_KEY))
        assert resp.status_code == 422, (not_an_int, resp.text)
    for not_a_bool in (1, "true"):
        resp = gw.post("/admin/models/rollback", json={"anchor": not_a_bool}, headers=bearer(ADMIN_KEY))
        assert resp.status_code == 422, (not_a_bool, resp.text)
    assert gw.post("/admin/models/rollback", json={"version": 9}, headers=bearer(ADMIN_KEY)).status_code == 404
    resp = gw.post("/admin/models/rollback", json={"anchor": True}, headers=bearer(ADMIN_KEY))
    assert resp.status_code == 202 and resp.json()["to_version"] == 2
    [cmd] = control.TrainerControl(r).commands()
    assert cmd.cmd == "rollback" and cmd.args == {"to_version": "2", "anchor": "1", "ts_ms": cmd.args["ts_ms"]}


def test_runtime_config_validated_redacted_and_picked_up(gw, r, redis_url):
    view = gw.get("/admin/config", headers=bearer(VIEWER_KEY)).json()
    assert view["config"]["gateway"]["admin_keys"]["root"] == {"role": "admin", "key": "***"}
    assert view["config"]["gateway"]["api_keys"]["alice"] == "***"
    assert ADMIN_KEY not in str(view) and MCP_KEY not in str(view)
    from admin_support import admin_config
    watcher = control.RuntimeConfigWatcher(r, admin_config(redis_url))
    assert watcher.poll() is None or watcher.current.compression.density == CompressionConfig().density
    for bad in ({"compression": {"density": 2}}, {"compression": {"nope": 1}}, {"gateway": {"port": 1}},
                {"compression": {"algorithm": "magic"}}, {}, {"consistency": {}}):
        resp = gw.patch("/admin/config", json=bad, headers=bearer(ADMIN_KEY))
        assert resp.status_code == 422, (bad, resp.text)
    assert r.hgetall(keys.RUNTIME_CONFIG) == {}
    resp = gw.patch("/admin/config", json={"compression": {"density": 0.05}, "consistency": {"sync_interval": 3}},
                    headers=bearer(ADMIN_KEY))
    assert resp.status_code == 200, resp.text
    assert resp.json()["config"]["compression"]["density"] == 0.05
    new = watcher.poll()
    assert new is not None and new.compression.density == 0.05 and new.consistency.sync_interval == 3
    assert watcher.poll() is None
    gw.patch("/admin/config", json={"compression": {"zstd_level": 3}}, headers=bearer(ADMIN_KEY))
    new = watcher.poll()
    assert new.compression.zstd_level == 3 and new.compression.density == 0.05
    gw.delete("/admin/config/runtime", headers=bearer(ADMIN_KEY))
    assert watcher.poll().compression.density == CompressionConfig().density


def test_delta_key_rotation_signal(gw, r):
    watcher = control.KeyRotationWatcher(r)
    assert watcher.pending() == []
    # before any rotation: the keys the trainer's last publish used
    control.report_status(r, "delta", version=3, key_id="k1", signing_key_id="s1")
    status = gw.get("/admin/delta-key", headers=bearer(VIEWER_KEY)).json()
    assert status["key_ring"] == {"key_id": "k1", "signing_key_id": "s1"}
    rid = gw.post("/admin/delta-key/rotate", headers=bearer(ADMIN_KEY)).json()["request_id"]
    signing = gw.post("/admin/delta-key/rotate", params={"kind": "signing"}, headers=bearer(ADMIN_KEY))
    assert signing.status_code == 202
    assert watcher.pending() == [(rid, "encryption"), (signing.json()["request_id"], "signing")]
    bad = gw.post("/admin/delta-key/rotate", params={"kind": "everything"}, headers=bearer(ADMIN_KEY))
    assert bad.status_code == 422
    watcher.done(rid, key_id="k2", epoch=2)
    assert [kind for _, kind in control.KeyRotationWatcher(r).pending()] == ["signing"]
    status = gw.get("/admin/delta-key", headers=bearer(VIEWER_KEY)).json()
    assert status["key_ring"]["key_id"] == "k2" and status["key_ring"]["last_request"] == rid
    assert status["key_ring"]["signing_key_id"] == "s1", "not rotated yet: the one in use"


def test_workers_list_and_drain(gw, r):
    r.set(keys.MODEL_VERSION, 7)
    control.report_status(r, "worker:w1", version=5, load=2)
    control.report_status(r, "worker:w2", version=7, load=0)
    # w3 opens no delta (a key ring of before a rotation): it sees no newer version, so reports no lag
    control.report_status(r, "worker:w3", version=1, load=0, lag=0)
    workers = gw.get("/admin/workers", headers=bearer(VIEWER_KEY)).json()["workers"]
    by_id = {w["id"]: w for w in workers}
    assert by_id["w1"]["lag"] == 2 and by_id["w2"]["lag"] == 0 and by_id["w1"]["load"] == 2
    assert by_id["w3"]["lag"] == 6, "the trainer's latest version tells how far a worker is behind"
    # reported in Redis but not in this replica's pool (gone, or its report not yet expired): not serving
    assert by_id["w1"]["alive"] is False and by_id["w2"]["alive"] is False
    assert gw.post("/admin/workers/w1/drain", headers=bearer(VIEWER_KEY)).status_code == 403
    assert gw.post("/admin/workers/nope/drain", headers=bearer(OPERATOR_KEY)).status_code == 404
    assert gw.post("/admin/workers/w1/drain", headers=bearer(OPERATOR_KEY)).json()["drained"] is True
    assert control.drained_workers(r) == {"w1"}
    assert {w["id"]: w["drained"] for w in gw.get("/admin/workers", headers=bearer(VIEWER_KEY)).json()["workers"]} \
        == {"w1": True, "w2": False, "w3": False}
    gw.delete("/admin/workers/w1/drain", headers=bearer(OPERATOR_KEY))
    assert control.drained_workers(r) == set()


async def _make_session(redis_url, principal):
    from gateway.mcp.sessions import SessionRegistry
    from shared.config import GatewayConfig, RedisConfig
    from shared.redis_client import async_client
    ra = async_client(RedisConfig(url=redis_url))
    try:
        reg = SessionRegistry(ra, ra, GatewayConfig())
        return (await reg.create(principal, "2025-11-25", {"roots": {}})).id
    finally:
        await ra.aclose()


async def test_sessions_list_inspect_terminate(redis_url):
    sid_a = await _make_session(redis_url, "alice")
    sid_b = await _make_session(redis_url, "bob")
    import asyncio
    await asyncio.to_thread(_sessions_checks, redis_url, sid_a, sid_b)


def _sessions_checks(redis_url, sid_a, sid_b):
    with live_gateway(redis_url) as srv, httpx.Client(base_url=srv.url, timeout=10) as gw:
        listed = gw.get("/admin/sessions", headers=bearer(VIEWER_KEY)).json()["sessions"]
        assert {(s["principal"], s["id"]) for s in listed} == {("alice", sid_a), ("bob", sid_b)}
        only = gw.get("/admin/sessions", params={"principal": "bob"}, headers=bearer(VIEWER_KEY)).json()
        assert [s["id"] for s in only["sessions"]] == [sid_b]
        info = gw.get(f"/admin/sessions/{sid_a}", headers=bearer(VIEWER_KEY)).json()
        assert info["protocol_version"] == "2025-11-25" and info["principal"] == "alice"
        assert gw.delete(f"/admin/sessions/{sid_a}", headers=bearer(VIEWER_KEY)).status_code == 403
        assert gw.delete(f"/admin/sessions/{sid_a}", headers=bearer(OPERATOR_KEY)).status_code == 200
        assert gw.get(f"/admin/sessions/{sid_a}", headers=bearer(VIEWER_KEY)).status_code == 404
        assert gw.delete(f"/admin/sessions/{sid_a}", headers=bearer(OPERATOR_KEY)).status_code == 404
        assert gw.get("/admin/sessions/*", headers=bearer(VIEWER_KEY)).status_code == 404
        audit = gw.get("/admin/audit", params={"action": "session.terminate"}, headers=bearer(VIEWER_KEY)).json()
        assert audit["entries"][0]["session"] == sid_a and audit["entries"][0]["client"] == "alice"


def test_openapi_published_with_security(gw):
    doc = gw.get("/admin/openapi.json").json()
    paths = doc["paths"]
    assert "/admin/sessions/{session_id}" in paths and "/admin/config" in paths
    assert all(p.startswith("/admin") for p in paths)
    assert "/admin/ui" not in paths and "/admin/openapi.json" not in paths
    assert doc["components"]["securitySchemes"]["adminKey"]["scheme"] == "bearer"
    assert "401" in paths["/admin/trainer/pause"]["post"]["responses"]


def test_admin_itself_leads_to_the_dashboard(gw):
    for path in ("/admin", "/admin/"):
        r = gw.get(path, follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/admin/ui", (path, r.status_code)
    assert gw.get("/admin", follow_redirects=True).text.startswith("<!")
    assert gw.post("/admin", json={}).status_code == 401  # only reading it is public


def test_redaction_covers_every_secret():
    from gateway.admin.config import redact
    from shared.config import load_config
    cfg = load_config(None, env={}, overrides={
        "redis": {"url": "redis://user:s3cret-pass@redis:6379/0"},
        "gateway": {"request_state_keys": ["aa" * 32], "oauth": {"hs256_secret": "jwt-secret-123"},
                    "api_keys": {"alice": MCP_KEY}, "admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"}}}})
    out = redact(cfg.to_dict())
    flat = str(out)
    for secret in ("s3cret-pass", "aa" * 32, "jwt-secret-123", MCP_KEY, ADMIN_KEY):
        assert secret not in flat
    assert out["redis"]["url"] == "redis://user:***@redis:6379/0"
    assert out["security"]["delta_key_file"] == cfg.security.delta_key_file  # a path, not a secret
    assert out["compression"] == cfg.to_dict()["compression"]


def _operations(gw):
    doc = gw.get("/admin/openapi.json").json()
    for path, ops in doc["paths"].items():
        concrete = path.replace("{", "").replace("}", "")  # /admin/sessions/session_id ...
        for method in ops:
            yield method.upper(), concrete


def test_every_admin_operation_refuses_mcp_keys_and_lets_viewers_only_read(gw):
    ops = list(_operations(gw))
    assert len(ops) >= 25
    for method, path in ops:
        for headers in ({}, bearer(MCP_KEY)):
            resp = gw.request(method, path, headers=headers, json={} if method in ("POST", "PATCH") else None)
            assert resp.status_code == 401, (method, path, headers, resp.status_code)
        if method != "GET":
            resp = gw.request(method, path, headers=bearer(VIEWER_KEY), json={} if method != "DELETE" else None)
            assert resp.status_code == 403, (method, path, resp.status_code)


def test_context_listings_are_bounded_by_limit(redis_url):
    from tests.test_gateway_http import modern

    principals = {f"p{i:03d}": f"key-of-p{i:03d}-0123456789" for i in range(101)}
    with live_gateway(redis_url, gateway={"api_keys": principals}) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as c:
        for name, key in principals.items():
            for context_id in (("a", "b", "c") if name == "p000" else ("a",)):
                body, h = modern("tools/call", {"name": "context_append", "arguments": {
                    "context_id": context_id, "modality": "text", "text": "x" * 10}})
                assert c.post("/mcp", json=body, headers={**h, **bearer(key)}).status_code == 200
        everyone = c.get("/admin/contexts", headers=bearer(VIEWER_KEY)).json()
        assert len(everyone["principals"]) == everyone["count"] == 100 and everyone["total"] == 101
        assert len(c.get("/admin/contexts?limit=1000", headers=bearer(VIEWER_KEY)).json()["principals"]) == 101
        newest = c.get("/admin/contexts?limit=1", headers=bearer(VIEWER_KEY)).json()
        assert [p["principal"] for p in newest["principals"]] == ["p100"]  # most recently used first
        own = c.get("/admin/contexts?principal=p000&limit=2", headers=bearer(VIEWER_KEY)).json()
        assert [x["id"] for x in own["contexts"]] == ["c", "b"] and own["count"] == 2 and own["total"] == 3
        assert own["bytes"] == sum(x["bytes"] for x in c.get("/admin/contexts?principal=p000", headers=bearer(
            VIEWER_KEY)).json()["contexts"])  # all of the principal's contexts, not the ones shown
        for bad in ("0", "1001", "-1", "x"):
            assert c.get(f"/admin/contexts?limit={bad}", headers=bearer(VIEWER_KEY)).status_code == 422, bad
