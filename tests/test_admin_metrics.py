"""Metrics and the dashboard feed: windowed quantiles, replicas aggregated through Redis,
mesh-wide gauges on /metrics, static UI files, 405/404 for what no admin route serves."""

from __future__ import annotations

import math
import re

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.admin.stats import quantile
from shared import control, keys
from shared.metrics import HotCounter, HotHistogram
from shared.redis_client import close_sync
from tests.admin_support import ADMIN_KEY, MCP_KEY, VIEWER_KEY, bearer, live_gateway
from tests.conftest import wait_for_sync


def test_histogram_quantile_interpolates_like_promql():
    buckets = [(0.001, 0.0), (0.01, 50.0), (0.1, 100.0), (math.inf, 100.0)]
    assert math.isclose(quantile(buckets, 0.5), 0.01)
    assert math.isclose(quantile(buckets, 0.99), 0.01 + 0.09 * 49 / 50)
    assert quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5) is None
    assert quantile([(0.1, 0.0), (math.inf, 4.0)], 0.5) == 0.1  # beyond the last finite bucket


def _samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for fam in registry.collect() for s in fam.samples
            if not s.name.endswith("_created")}


def test_hot_collectors_expose_what_prometheus_client_does():
    """The lock-free histogram and counter of the context store's hot path give the same
    samples (buckets on the edges, +Inf, sum, count; counter totals) as prometheus_client's."""
    hot_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.1)
    hot = HotHistogram("lat_seconds", "latency", ["op"], buckets=buckets, registry=hot_reg)
    ref = Histogram("lat_seconds", "latency", ["op"], buckets=buckets, registry=ref_reg)
    for op, v in (("a", 0.0005), ("a", 0.001), ("a", 0.0011), ("a", 0.1), ("a", 7.0), ("b", 0.05)):
        hot.labels(op).observe(v)
        ref.labels(op).observe(v)
    got, want = _samples(hot_reg), _samples(ref_reg)
    assert got == want
    assert got[("lat_seconds_bucket", frozenset({("op", "a"), ("le", "0.001")}))] == 2  # le is inclusive
    assert b'lat_seconds_bucket{le="+Inf",op="a"} 5.0' in generate_latest(hot_reg)
    counter = HotCounter("bytes_total", "bytes", ["mod"], registry=hot_reg)
    counter.labels("text").inc(3)
    counter.labels("text").inc(4)
    assert _samples(hot_reg)[("bytes_total", frozenset({("mod", "text")}))] == 7
    with pytest.raises(ValueError):
        hot.labels("a", "b")


def _mcp(client: httpx.Client) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}}}
    return client.post("/mcp", json=body, headers={**bearer(MCP_KEY), "Mcp-Method": "tools/list",
                                                    "MCP-Protocol-Version": "2026-07-28",
                                                    "Accept": "application/json, text/event-stream"})


def test_summary_aggregates_replicas_and_metrics_serve_mesh_gauges(redis_target):
    redis_url = redis_target.url
    r = redis_target.sync_client()
    with live_gateway(redis_url) as a, live_gateway(redis_url) as b, \
            httpx.Client(base_url=a.url, timeout=10) as ca, httpx.Client(base_url=b.url, timeout=10) as cb:
        for _ in range(20):
            assert _mcp(ca).status_code == 200
        r.set(keys.MODEL_VERSION, 9)
        control.report_status(r, "worker:w7", version=6, load=1)

        def summary_ok():
            s = cb.get("/admin/summary", headers=bearer(VIEWER_KEY)).json()
            return s if s["gateway"]["replicas"] == 2 and s["gateway"]["rps"] > 0 else None
        s = wait_for_sync(summary_ok, timeout_s=15, what="both replicas in the summary")
        assert s["gateway"]["requests_total"] >= 20 and s["gateway"]["p99_ms"] is not None
        assert [w["id"] for w in s["workers"]] == ["w7"] and s["workers"][0]["lag"] == 3
        assert s["model_version"] == 9 and s["who"] == {"name": "watch", "role": "viewer"}

        assert cb.get("/admin/summary", headers=bearer(MCP_KEY)).status_code == 401
        text = wait_for_sync(lambda: (t := ca.get("/metrics").text) and 'learnmesh_worker_version_lag{worker="w7"} 3.0'
                             in t and t, what="worker lag gauge")
        assert 'learnmesh_admin_denied_total{status="401"}' in text
        assert "learnmesh_context_stored_bytes" in text
        assert "learnmesh_mcp_requests_total" in text
    close_sync(r)


def test_ui_files_and_unmatched_methods(redis_url):
    with live_gateway(redis_url) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        page = c.get("/admin/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/admin/ui/app.js" in page.text and "https://" not in page.text  # no CDN
        assert c.get("/admin/ui/").text == page.text
        assert c.get("/admin/ui/app.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/admin/ui/style.css").status_code == 200
        assert c.get("/admin/ui/__init__.py").status_code == 404
        assert c.get("/admin/ui/..%2Fauth.py").status_code == 401  # not a dashboard file: a key first
        assert c.get("/admin/ui/..%2Fauth.py", headers=bearer(ADMIN_KEY)).status_code == 404
        resp = c.options("/admin/config", headers=bearer(ADMIN_KEY))
        assert resp.status_code == 405 and resp.headers["allow"] == "GET, HEAD, PATCH"
        resp = c.put("/admin/sessions/abc", headers=bearer(ADMIN_KEY))
        assert resp.status_code == 405 and resp.headers["allow"] == "DELETE, GET, HEAD"
        assert c.get("/admin/no-such-thing", headers=bearer(ADMIN_KEY)).status_code == 404


def test_head_is_every_get_route_without_its_body_and_with_its_auth(redis_url):
    with live_gateway(redis_url) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        doc = c.get("/admin/openapi.json").json()
        paths = [re.sub(r"\{[^}]+\}", "x", p) for p, ops in doc["paths"].items() if "get" in ops]
        assert len(paths) >= 15
        for path in paths:
            get, head = c.get(path, headers=bearer(VIEWER_KEY)), c.head(path, headers=bearer(VIEWER_KEY))
            assert (head.status_code, head.content) == (get.status_code, b""), path
            assert head.headers["content-type"] == get.headers["content-type"], path
            for anonymous in (c.head(path), c.head(path, headers=bearer(MCP_KEY))):
                assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer", path
        whoami = c.get("/admin/whoami", headers=bearer(VIEWER_KEY))
        assert c.head("/admin/whoami", headers=bearer(VIEWER_KEY)).headers["content-length"] == str(len(whoami.content))
        for public in ("/admin/ui", "/admin/ui/app.js", "/admin/openapi.json", "/healthz", "/readyz", "/metrics"):
            head = c.head(public)
            assert head.status_code == 200 and head.content == b"", public
        assert c.head("/admin", follow_redirects=False).status_code == 307
        assert c.head("/admin/ui/__init__.py").status_code == 404
        mcp = c.head("/mcp", headers=bearer(MCP_KEY))  # its GET opens an event stream: not served as one
        assert mcp.status_code == 405 and "HEAD" not in mcp.headers["allow"]
        post_only = c.head("/admin/models/rollback", headers=bearer(ADMIN_KEY))
        assert post_only.status_code == 405 and "HEAD" not in post_only.headers["allow"]
