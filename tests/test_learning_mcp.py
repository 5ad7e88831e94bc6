"""`learn` through the real gateway (MCP, 2026-07-28) and the admin sample routes."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from shared import keys
from shared.config import Config, load_config
from shared.redis_client import close_sync, for_each_primary_sync
from shared.samples import learned_token, partition_of, sample_partitions
from tests.conftest import free_port
from tests.trainer_support import sync_redis, sync_redis_open

MODERN = "2026-07-28"
KEY = "alice-key-123456"
OPERATOR = "operator-key-123456"
VIEWER = "viewer-key-1234567"
ADMIN = "admin-key-12345678"


@pytest.fixture
def redis_url(redis_target) -> str:
    """Every test here runs on a single server and on a cluster (tests/conftest.py)."""
    return redis_target.url


def _part(redis_url: str, principal: str = "alice") -> int:
    """The sample-log partition of ``principal`` (the default count: 1 on a server, 8 on a cluster)."""
    return partition_of(principal, sample_partitions(load_config(env={}, overrides={"redis": {"url": redis_url}})))


@pytest.fixture
def client(redis_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(_config(redis_url, learn_wait_s=1.0)), base_url="http://127.0.0.1:8000") as c:
        yield c


def _config(redis_url: str, learn_wait_s: float) -> Config:
    """A gateway without workers or trainer; a token nothing trained waits ``learn_wait_s``."""
    return load_config(env={}, overrides={
        "redis": {"url": redis_url},
        "gateway": {"api_keys": {"alice": KEY}, "request_state_keys": ["00" * 32],
                    "admin_keys": {"ops": {"key": OPERATOR, "role": "operator"},
                                   "root": {"key": ADMIN, "role": "admin"},
                                   "watch": {"key": VIEWER, "role": "viewer"}}},
        "worker": {"endpoints": []},
        "learning": {"teachers": ["alice", "bob"]},
        "consistency": {"learn_wait_s": learn_wait_s},
        "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}", "max_sample_bytes": 1024}})


def learn(c: TestClient, args: dict) -> dict:
    params = {"name": "learn", "arguments": args,
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    h = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
         "mcp-method": "tools/call", "mcp-name": "learn", "authorization": f"Bearer {KEY}"}
    r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}, headers=h)
    text = r.text.strip()
    if text.startswith("{"):
        return orjson.loads(text)
    msgs = [orjson.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
    return [m for m in msgs if "id" in m][-1]


def _log_len(redis_url: str) -> int:
    """Samples in the log (entries hold whole batches)."""
    r = sync_redis(redis_url)
    try:
        return sum(int(f[b"n"]) for _, f in r.xrange(keys.sample_log(_part(redis_url))))
    finally:
        close_sync(r)


def test_learn_acknowledges_ids_after_the_write(client, redis_url):
    out = learn(client, {"samples": [{"input": "q1", "target": "a1"}, {"input": "q2", "target": "a2"}]})
    result = out["result"]["structuredContent"]
    assert len(result["ids"]) == 2 and result["seqs"] == [1, 2]
    assert _log_len(redis_url) == 2
    out = learn(client, {"input": "q3", "target": "a3"})
    assert out["result"]["structuredContent"]["seqs"] == [3]


@pytest.mark.parametrize("shape", ["one", "batch"])
def test_a_learn_sent_again_with_its_request_id_is_logged_once(client, redis_url, shape):
    """A client that lost learn's answer sends the call again with the same request_id: the
    samples are in the log once, and the answer (ids, seqs, learned token) is the first's."""
    one = {"input": "The capital of Zorbland is", "target": " Quixville."}
    args = {**one, "request_id": "learn-1"} if shape == "one" else {"samples": [one, one], "request_id": "learn-1"}
    n = 1 if shape == "one" else 2
    first = learn(client, args)["result"]["structuredContent"]
    assert "repeated" not in first and first["seqs"] == list(range(1, n + 1))
    other = learn(client, {**one, "request_id": "learn-2"})["result"]["structuredContent"]
    plain = learn(client, one)["result"]["structuredContent"]
    again = learn(client, args)["result"]["structuredContent"]
    assert again == {**first, "queued": False, "repeated": True}
    assert _log_len(redis_url) == n + 2
    assert other["seqs"] == [n + 1] and plain["seqs"] == [n + 2]
    # the same id with other samples: refused, nothing logged
    changed = {"samples": [one, one, one], "request_id": "learn-1"}
    out = learn(client, changed)
    assert out["error"]["code"] == -32602 and out["error"]["data"] == {"request_id": "learn-1"}, out
    assert "a retry sends the same samples" in out["error"]["message"]
    assert learn(client, {**one, "request_id": "not one"})["error"]["code"] == -32602
    assert _log_len(redis_url) == n + 2
    # kept under the principal's own key, newest first, expiring a day after its last learn with one
    with sync_redis_open(redis_url) as r:
        held = r.lrange(keys.sample_requests(_part(redis_url), "alice"), 0, -1)
        assert [h.split(b"|")[0] for h in held] == [b"learn-2", b"learn-1"]
        assert 0 < r.ttl(keys.sample_requests(_part(redis_url), "alice")) <= 86_400


@pytest.mark.parametrize("args", [{"input": "q", "target": ""}, {"input": "q", "target": "x" * 2000},
                                  {"samples": [{"input": "q", "target": "a"}, {"input": 5, "target": "a"}]},
                                  {"input": "q", "target": "a", "context_id": "nope", "version": 3}])
def test_learn_refuses_bad_samples_with_invalid_params_and_writes_nothing(client, redis_url, args):
    out = learn(client, args)
    assert out["error"]["code"] == -32602, out
    assert _log_len(redis_url) == 0


def test_a_batch_naming_a_context_version_it_cannot_have_names_the_sample(client, redis_url):
    """Which sample of a batch named an unknown context, or a version not retained, is in the
    error's data (``index``, as for any one sample's error); a lone sample's error names no place."""
    assert "result" in call_tool(client, "context_append", {"context_id": "conv", "modality": "text", "text": "hi"})
    ok = {"input": "q", "target": "a", "context_id": "conv", "version": 1}
    for bad, data in (({"input": "q", "target": "a", "context_id": "conv", "version": 2},
                       {"kind": "version_unavailable", "context_id": "conv", "version": 2}),
                      ({"input": "q", "target": "a", "context_id": "nope", "version": 1},
                       {"kind": "context_not_found", "context_id": "nope", "version": 1})):
        out = learn(client, {"samples": [ok, ok, bad, bad]})
        assert out["error"]["code"] == -32602 and out["error"]["data"] == {**data, "index": 2}, out
        assert out["error"]["message"].startswith("sample 2: "), out
        out = learn(client, bad)
        assert out["error"]["code"] == -32602 and out["error"]["data"] == data, out
    assert _log_len(redis_url) == 0


def test_admin_bulk_import_needs_operator_and_stats_show_the_lag(client, redis_url):
    body = {"principal": "bob", "samples": [{"input": f"q{i}", "target": "a"} for i in range(50)]}
    assert client.post("/admin/samples", json=body).status_code == 401
    assert client.post("/admin/samples", json=body, headers={"authorization": f"Bearer {VIEWER}"}).status_code == 403
    r = client.post("/admin/samples", json=body, headers={"authorization": f"Bearer {OPERATOR}"})
    assert r.status_code == 200 and len(r.json()["ids"]) == 50
    bad = {"principal": "bob", "samples": [{"input": "q", "target": ""}]}
    r = client.post("/admin/samples", json=bad, headers={"authorization": f"Bearer {OPERATOR}"})
    assert r.status_code == 400 and "target" in r.text
    # no principal could be named so (a line break forges log lines; admin: is the admin keys' audit name)
    for principal in ("ali\nce", "admin:root", "a{b}", "", 7):
        r = client.post("/admin/samples", json={"principal": principal, "samples": body["samples"][:1]},
                        headers={"authorization": f"Bearer {OPERATOR}"})
        assert r.status_code == 400 and "principal" in r.text, principal
    stats = client.get("/admin/samples/stats", headers={"authorization": f"Bearer {VIEWER}"}).json()
    assert stats["log_entries"] == 1 and stats["last_seq"] == 50 and stats["lag"] == 50


def test_an_admin_import_sent_again_with_its_request_id_is_logged_once(client, redis_url):
    """An operator's import whose answer was lost (a timeout, a 503 the replica did not
    confirm) is sent again with its request id: the samples are logged once, and the retry is
    answered as the first call was, in the principal's name."""
    op = {"authorization": f"Bearer {OPERATOR}"}
    body = {"principal": "alice", "request_id": "import-7f3a", "samples": [{"input": f"q{i}", "target": "a"} for i in range(3)]}
    first = client.post("/admin/samples", json=body, headers=op)
    assert first.status_code == 200 and "repeated" not in first.json(), first.text
    again = client.post("/admin/samples", json=body, headers=op)
    assert again.status_code == 200, again.text
    assert again.json()["repeated"] is True and again.json()["queued"] is False
    assert {k: again.json()[k] for k in ("ids", "seqs", "learned")} == {k: first.json()[k] for k in ("ids", "seqs", "learned")}
    # the same id with other samples is refused and logs nothing; a bad id is refused up front
    other = client.post("/admin/samples", json={**body, "samples": body["samples"][:1]}, headers=op)
    assert other.status_code == 400 and "request_id" in other.text, other.text
    for bad in ("", "a b", "x" * 65, 7):
        r = client.post("/admin/samples", json={**body, "request_id": bad}, headers=op)
        assert r.status_code == 400 and "request_id" in r.text, (bad, r.text)
    # the ids are the principal's own: its learn naming that id is answered by the import
    out = learn(client, {"samples": body["samples"], "request_id": "import-7f3a"})["result"]["structuredContent"]
    assert out["repeated"] is True and out["ids"] == first.json()["ids"], out
    stats = client.get("/admin/samples/stats", headers={"authorization": f"Bearer {VIEWER}"}).json()
    assert stats["log_entries"] == 1 and stats["last_seq"] == 3, stats


def call_tool(c: TestClient, name: str, args: dict) -> dict:
    params = {"name": name, "arguments": args,
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    h = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
         "mcp-method": "tools/call", "mcp-name": name, "authorization": f"Bearer {KEY}"}
    r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}, headers=h)
    return orjson.loads(r.text.strip())


def test_learn_answers_a_token_that_generate_and_score_wait_on(client, redis_url):
    out = learn(client, {"samples": [{"input": "q1", "target": "a1"}, {"input": "q2", "target": "a2"}]})
    token = out["result"]["structuredContent"]["learned"]
    r = sync_redis(redis_url)
    part = _part(redis_url)
    try:
        log_id = r.get(keys.sample_log_id(part)).decode()
        assert token == learned_token(log_id, 2, part), "the token names this log partition and the call's last seq"
        # not a token: refused before any wait or worker (-32602, nothing else touched)
        # ('٣' and '²' pass str.isdigit; a partition this mesh does not have was never answered)
        for bad in ("2", "abc", f"{log_id}.x", "../etc.1", f"{log_id}.٣", f"{log_id}.²", f"{log_id}.1.999",
                    f"{log_id}.1.", f"{log_id}.1.2.3"):
            err = call_tool(client, "score", {"prompt": "q", "target": "a", "after_learn": bad})
            assert err["error"]["code"] == -32602 and "'learned' token" in err["error"]["message"], (bad, err)
        # the right log, but a seq no learn call was answered with: refused at once, not after
        # consistency.learn_wait_s (a typo or a token made up by hand would hold the call that long)
        err = call_tool(client, "score", {"prompt": "q", "target": "a", "after_learn": learned_token(log_id, 3, part)})
        assert err["error"]["code"] == -32602 and "does not hold" in err["error"]["message"], err
        # a token of a log that was recreated since (a Redis that lost its data)
        r.set(keys.sample_log_id(part), "0123456789abcdef")
        err = call_tool(client, "generate", {"prompt": "q", "after_learn": token})
        assert err["error"]["code"] == -32602 and "no longer exists" in err["error"]["message"]
        # the right log, and a version that holds the samples: the wait ends at once and the
        # request goes on to the worker pool (none here: -32050, retry later)
        r.set(keys.sample_log_id(part), log_id)
        r.zadd(keys.model_version_seq(part, "0123456789abcdef"), {"7": 2})  # another log's: not this token's
        err = call_tool(client, "score", {"prompt": "q", "target": "a", "after_learn": token})
        assert err["error"]["code"] == -32050 and "not trained yet" in err["error"]["message"], err
        r.zadd(keys.model_version_seq(part, log_id), {"7": 2})
        err = call_tool(client, "score", {"prompt": "q", "target": "a", "after_learn": token})
        assert err["error"]["code"] == -32050 and "trained" not in err["error"]["message"], err
    finally:
        close_sync(r)


def test_an_after_learn_wait_ends_with_a_retry_when_the_replica_stops(redis_url):
    """The server's drain begins (``GatewayApp.stopping``, what SIGTERM calls): a call waiting for
    its samples to be trained is answered -32050 (503, retry elsewhere) at once, instead of
    holding the drain until it is cancelled (a plain 500) or ``learn_wait_s`` runs out."""
    with TestClient(create_app(_config(redis_url, learn_wait_s=60)), base_url="http://127.0.0.1:8000") as c:
        token = learn(c, {"input": "q", "target": "a"})["result"]["structuredContent"]["learned"]
        c.portal.call(c.app.stopping)
        err = call_tool(c, "score", {"prompt": "q", "target": "a", "after_learn": token})
    assert err["error"]["code"] == -32050 and "stopping" in err["error"]["message"], err


def test_consistency_changed_at_runtime_is_what_the_gateway_waits(client, redis_url):
    """``PATCH /admin/config {"consistency": ...}`` is the gateway's too, not only the trainer's:
    the after_learn wait follows it, and ``DELETE /admin/config/runtime`` goes back to the file."""
    token = learn(client, {"input": "q", "target": "a"})["result"]["structuredContent"]["learned"]
    admin = {"authorization": f"Bearer {ADMIN}"}

    def waited() -> str:
        err = call_tool(client, "score", {"prompt": "q", "target": "a", "after_learn": token})
        assert err["error"]["code"] == -32050, err
        return err["error"]["message"]

    try:
        r = client.patch("/admin/config", json={"consistency": {"learn_wait_s": 0.25}}, headers=admin)
        assert r.status_code == 200 and r.json()["config"]["consistency"]["learn_wait_s"] == 0.25
        assert "waited 0.25s" in waited()
        r = client.delete("/admin/config/runtime", headers=admin)
        assert r.status_code == 200 and r.json()["config"]["consistency"]["learn_wait_s"] == 1.0
        assert "waited 1s" in waited()
    finally:
        client.delete("/admin/config/runtime", headers=admin)


def _version_lookups(redis_url: str) -> int:
    """ZRANGEBYSCORE calls Redis has served (what an after_learn wait polls with), on every master."""
    with sync_redis_open(redis_url) as r:
        stats = for_each_primary_sync(r, lambda node: node.info("commandstats").get("cmdstat_zrangebyscore", {}))
    return sum(int(s.get("calls", 0)) for s in stats)


def test_an_after_learn_wait_polls_redis_less_often_as_it_goes_on(redis_url):
    """A call waits up to consistency.learn_wait_s for its samples: polling every few milliseconds
    all that time would make each waiting call thousands of Redis round trips (and a burst of
    such calls from one client a load on Redis nothing else bounds). After its first fraction of
    a second it polls at most four times a second."""
    wait_s = 3.0
    with TestClient(create_app(_config(redis_url, learn_wait_s=wait_s)), base_url="http://127.0.0.1:8000") as c:
        token = learn(c, {"input": "q", "target": "a"})["result"]["structuredContent"]["learned"]
        before = _version_lookups(redis_url)
        err = call_tool(c, "score", {"prompt": "q", "target": "a", "after_learn": token})
        polls = _version_lookups(redis_url) - before
    assert err["error"]["code"] == -32050 and "not trained yet" in err["error"]["message"], err
    assert 2 <= polls <= 8 + wait_s * 4, polls
