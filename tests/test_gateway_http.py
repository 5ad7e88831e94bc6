"""Streamable HTTP /mcp on real gateway processes sharing one real Redis: both revisions'
happy paths, every bad-input case, and the cross-replica behaviour of legacy sessions."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import start_gateway, stop

MODERN = "2026-07-28"
ACCEPT = "application/json, text/event-stream"


@pytest.fixture(scope="module")
def replicas(redis_target_module: RedisTarget) -> Iterator[tuple[str, str]]:
    """Two replicas per Redis kind (single server, cluster)."""
    pa, pb = free_port(), free_port()
    a = start_gateway(pa, redis_target_module.url)
    b = start_gateway(pb, redis_target_module.url)
    yield f"http://127.0.0.1:{pa}/mcp", f"http://127.0.0.1:{pb}/mcp"
    stop(a)
    stop(b)


@pytest.fixture
def redis_url(redis_target_module: RedisTarget) -> str:
    """The replicas' Redis, emptied for each test."""
    redis_target_module.flush()
    return redis_target_module.url


def rpc(method: str, params: dict | None = None, rid: int | str | None = 1) -> dict:
    msg: dict = {"jsonrpc": "2.0", "method": method}
    if rid is not None:
        msg["id"] = rid
    if params is not None:
        msg["params"] = params
    return msg


def modern(method: str, params: dict | None = None, rid: int = 1, caps: dict | None = None) -> tuple[dict, dict]:
    p = dict(params or {})
    p["_meta"] = {**p.get("_meta", {}), "io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": caps or {}}
    headers = {"accept": ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": method}
    if method in ("tools/call", "prompts/get"):
        headers["mcp-name"] = p["name"]
    if method == "resources/read":
        headers["mcp-name"] = p["uri"]
    return rpc(method, p, rid), headers


def init(url: str, headers: dict | None = None) -> str:
    r = httpx.post(url, json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {"sampling": {}},
                                                 "clientInfo": {"name": "t", "version": "1"}}),
                   headers={"accept": ACCEPT, **(headers or {})})
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    assert len(sid) >= 40 and all(0x21 <= ord(c) <= 0x7E for c in sid)
    return sid


def legacy(url: str, sid: str, msg: dict, **headers: str) -> httpx.Response:
    return httpx.post(url, json=msg, headers={"accept": ACCEPT, "mcp-session-id": sid,
                                              "mcp-protocol-version": "2025-11-25", **headers})


def sse_messages(text: str) -> list[dict]:
    return [orjson.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]


# ------------------------------------------------------------------ 2025-11-25 happy path
def test_legacy_session_lifecycle(replicas: tuple[str, str], redis_url: str) -> None:
    url = replicas[0]
    sid = init(url)
    assert legacy(url, sid, rpc("notifications/initialized", rid=None)).status_code == 202
    tools = legacy(url, sid, rpc("tools/list")).json()["result"]["tools"]
    assert {"t_echo", "t_chatty"} <= {t["name"] for t in tools}
    r = legacy(url, sid, rpc("tools/call", {"name": "t_echo", "arguments": {"text": "hi"}}, rid="a"))
    assert r.json() == {"jsonrpc": "2.0", "id": "a", "result": {"content": [{"type": "text", "text": "local:hi"}]}}
    assert legacy(url, sid, rpc("ping")).json()["result"] == {}
    assert legacy(url, sid, rpc("logging/setLevel", {"level": "info"})).json()["result"] == {}
    read = legacy(url, sid, rpc("resources/read", {"uri": "test://r"})).json()["result"]
    assert read["contents"][0]["text"] == "resource text" and "ttlMs" not in read
    assert httpx.delete(url, headers={"mcp-session-id": sid}).status_code == 200
    after = legacy(url, sid, rpc("ping"))
    assert after.status_code == 404 and after.json()["error"]["code"] == -32600


def test_legacy_sse_notifications_precede_result(replicas: tuple[str, str], redis_url: str) -> None:
    url = replicas[0]
    sid = init(url)
    legacy(url, sid, rpc("logging/setLevel", {"level": "debug"}))
    r = legacy(url, sid, rpc("tools/call", {"name": "t_chatty", "arguments": {}, "_meta": {"progressToken": "p1"}}))
    assert r.headers["content-type"].startswith("text/event-stream")
    msgs = sse_messages(r.text)
    assert [m.get("method") for m in msgs] == ["notifications/message", "notifications/progress",
                                               "notifications/progress", None]
    assert msgs[1]["params"] == {"progressToken": "p1", "progress": 1, "total": 2}
    assert msgs[-1]["result"]["content"][0]["text"] == "done"


def test_tool_results_and_errors(replicas: tuple[str, str], redis_url: str) -> None:
    url = replicas[0]
    sid = init(url)
    s = legacy(url, sid, rpc("tools/call", {"name": "t_struct", "arguments": {}})).json()["result"]
    assert s["structuredContent"] == {"n": 7} and orjson.loads(s["content"][0]["text"]) == {"n": 7}
    f = legacy(url, sid, rpc("tools/call", {"name": "t_fail", "arguments": {}})).json()["result"]
    assert f == {"content": [{"type": "text", "text": "tool said no"}], "isError": True}
    c = legacy(url, sid, rpc("tools/call", {"name": "t_crash", "arguments": {}}))
    assert c.json()["error"] == {"code": -32603, "message": "Internal error"} and "secret" not in c.text
    bad = legacy(url, sid, rpc("tools/call", {"name": "t_echo", "arguments": {"text": 5}})).json()
    assert bad["error"]["code"] == -32602
    unknown = legacy(url, sid, rpc("tools/call", {"name": "nope", "arguments": {}})).json()
    assert unknown["error"]["code"] == -32602
    assert legacy(url, sid, rpc("no/such")).json()["error"]["code"] == -32601


# ------------------------------------------------------------------ 2026-07-28
def test_modern_happy_path(replicas: tuple[str, str], redis_url: str) -> None:
    url = replicas[1]
    body, h = modern("server/discover")
    d = httpx.post(url, json=body, headers=h)
    assert d.status_code == 200 and "mcp-session-id" not in d.headers
    res = d.json()["result"]
    assert res["resultType"] == "complete" and MODERN in res["supportedVersions"]
    assert res["ttlMs"] >= 0 and res["cacheScope"] in ("public", "private") and "tools" in res["capabilities"]
    body, h = modern("tools/list")
    lst = httpx.post(url, json=body, headers=h).json()["result"]
    assert lst["resultType"] == "complete" and "ttlMs" in lst and "cacheScope" in lst
    body, h = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}}, rid=9)
    call = httpx.post(url, json=body, headers=h).json()
    assert call["id"] == 9 and call["result"]["content"][0]["text"] == "local:x"
    assert call["result"]["resultType"] == "complete"
    body, h = modern("resources/read", {"uri": "test://r"})
    read = httpx.post(url, json=body, headers=h).json()["result"]
    assert read["cacheScope"] == "private" and read["contents"][0]["text"] == "resource text"
    assert httpx.get(url, headers={"mcp-protocol-version": MODERN}).status_code == 405
    assert httpx.delete(url, headers={"mcp-protocol-version": MODERN}).status_code == 405


@pytest.mark.parametrize("case,status,code", [
    ("unknown-method", 404, -32601), ("ping-removed", 404, -32601), ("method-mismatch", 400, -32020),
    ("name-mismatch", 400, -32020), ("version-header-mismatch", 400, -32020), ("unsupported", 400, -32022),
    ("missing-meta", 400, -32602), ("missing-caps", 400, -32602), ("bad-args", 400, -32602),
])
def test_modern_rejections(replicas: tuple[str, str], redis_url: str, case: str, status: int, code: int) -> None:
    url = replicas[0]
    if case in ("unknown-method", "ping-removed"):
        body, h = modern("unknown/method" if case == "unknown-method" else "ping", rid=7)
    else:
        body, h = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}}, rid=7)
    if case == "method-mismatch":
        h["mcp-method"] = "tools/list"
    elif case == "name-mismatch":
        h["mcp-name"] = "other"
    elif case == "version-header-mismatch":
        body["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] = "v999.0.0"
    elif case == "unsupported":
        body["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] = "v999.0.0"
        h["mcp-protocol-version"] = "v999.0.0"
    elif case == "missing-meta":
        del body["params"]["_meta"]
    elif case == "missing-caps":
        del body["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"]
    elif case == "bad-args":
        body["params"]["arguments"] = {"text": 1}
    r = httpx.post(url, json=body, headers=h)
    assert r.status_code == status, r.text
    assert r.json()["id"] == 7 and r.json()["error"]["code"] == code
    if case == "unsupported":
        assert r.json()["error"]["data"] == {"supported": [MODERN], "requested": "v999.0.0"}


def test_input_required_round_trip_across_replicas(replicas: tuple[str, str], redis_url: str) -> None:
    a, b = replicas
    body, h = modern("tools/call", {"name": "t_ask", "arguments": {}}, caps={"sampling": {}})
    first = httpx.post(a, json=body, headers=h).json()["result"]
    assert first["resultType"] == "input_required"
    assert first["inputRequests"]["q"]["method"] == "sampling/createMessage"
    state = first["requestState"]
    answer = {"role": "assistant", "content": {"type": "text", "text": "42"}, "model": "m"}
    body["params"].update(requestState=state, inputResponses={"q": answer})
    done = httpx.post(b, json=body, headers=h).json()["result"]  # the other replica opens the state
    assert done["resultType"] == "complete" and done["content"][0]["text"] == "got 42"
    tampered = state[:-4] + ("AAAA" if state[-4:] != "AAAA" else "BBBB")
    body["params"].update(requestState=tampered)
    bad = httpx.post(b, json=body, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == -32602


# ------------------------------------------------------------------ bad input (both revisions)
def test_transport_bad_input(replicas: tuple[str, str], redis_url: str) -> None:
    url = replicas[0]
    h = {"accept": ACCEPT, "content-type": "application/json"}
    r = httpx.post(url, content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json() == {"jsonrpc": "2.0", "id": None,
                                                 "error": {"code": -32700, "message": "Parse error"}}
    r = httpx.post(url, content=b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == -32600
    r = httpx.post(url, json={"id": 1, "method": "ping"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == -32600
    r = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": 5}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == -32600
    big = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"' + b"a" * (4 * 1024 * 1024) + b'"}}'
    r = httpx.post(url, content=big, headers=h)
    assert r.status_code == 413
    r = httpx.post(url, json=rpc("tools/list"), headers={**h, "mcp-protocol-version": "2025-11-25"})
    assert r.status_code == 400 and "Mcp-Session-Id" in r.json()["error"]["message"]
    r = legacy(url, "no-such-session", rpc("tools/list"))
    assert r.status_code == 404
    sid = init(url)
    r = legacy(url, sid, rpc("tools/list"), origin="http://evil.example.com")
    assert r.status_code == 403
    r = httpx.post(url, json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}}),
                   headers={**h, "host": "evil.example.com", "origin": "http://evil.example.com"})
    assert r.status_code == 403
    r = legacy(url, sid, rpc("tools/list"), **{"mcp-protocol-version": "1999-01-01"})
    assert r.status_code == 400
    assert httpx.get(url, headers={"accept": "text/event-stream", "mcp-session-id": "nope"}).status_code == 404
    assert httpx.delete(url, headers={"mcp-session-id": "nope"}).status_code == 404


# ------------------------------------------------------------------ replicas
def test_session_continues_on_other_replica_and_delete_reaches_it(replicas: tuple[str, str], redis_url: str) -> None:
    a, b = replicas
    sid = init(a)
    r = legacy(b, sid, rpc("tools/call", {"name": "t_echo", "arguments": {"text": "b"}}))
    assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == "local:b"
    assert legacy(b, sid, rpc("ping")).status_code == 200  # now cached on b
    assert httpx.delete(a, headers={"mcp-session-id": sid}).status_code == 200
    wait_for_sync(lambda: legacy(b, sid, rpc("ping")).status_code == 404, timeout_s=10,
                  what="delete on replica a to reach replica b")


def _read_stream(resp: httpx.Response, want: int, out: list[dict], ids: list[str]) -> None:
    event_id = None
    for line in resp.iter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:") and line[5:].strip():
            out.append(orjson.loads(line[5:]))
            ids.append(event_id or "")
            if len(out) >= want:
                return


def test_last_event_id_replay_on_other_replica(replicas: tuple[str, str], redis_url: str) -> None:
    a, b = replicas
    sid = init(a)
    assert legacy(a, sid, rpc("resources/subscribe", {"uri": "test://r"})).json()["result"] == {}
    legacy(a, sid, rpc("tools/call", {"name": "t_touch", "arguments": {}}))
    legacy(a, sid, rpc("tools/call", {"name": "t_touch", "arguments": {}}))
    got: list[dict] = []
    ids: list[str] = []
    with httpx.stream("GET", b, headers={"accept": "text/event-stream", "mcp-session-id": sid,
                                         "last-event-id": "0-0"}, timeout=10) as resp:
        assert resp.status_code == 200
        _read_stream(resp, 2, got, ids)
    assert [m["method"] for m in got] == ["notifications/resources/updated"] * 2
    assert got[0]["params"] == {"uri": "test://r"}
    replay: list[dict] = []
    with httpx.stream("GET", a, headers={"accept": "text/event-stream", "mcp-session-id": sid,
                                         "last-event-id": ids[0]}, timeout=10) as resp:
        _read_stream(resp, 1, replay, [])
    assert replay == got[1:]
    # an id that no stream entry can have (past 64 bits) is ignored as if absent: the stream stays
    # open and carries what comes next
    later: list[dict] = []
    with httpx.stream("GET", b, headers={"accept": "text/event-stream", "mcp-session-id": sid,
                                         "last-event-id": "99999999999999999999-0"}, timeout=10) as resp:
        assert resp.status_code == 200
        legacy(a, sid, rpc("tools/call", {"name": "t_touch", "arguments": {}}))
        _read_stream(resp, 1, later, [])
    assert later == got[:1]


def test_server_request_answered_via_other_replica(replicas: tuple[str, str], redis_url: str) -> None:
    a, b = replicas
    sid = init(a)
    msgs: list[dict] = []

    def run() -> None:
        with httpx.stream("POST", a, json=rpc("tools/call", {"name": "t_ask", "arguments": {}}, rid=5),
                          headers={"accept": ACCEPT, "mcp-session-id": sid}, timeout=20) as resp:
            _read_stream(resp, 2, msgs, [])

    t = threading.Thread(target=run)
    t.start()
    wait_for_sync(lambda: msgs, timeout_s=10, what="sampling request on the POST stream")
    req = msgs[0]
    assert req["method"] == "sampling/createMessage" and "id" in req
    answer = {"jsonrpc": "2.0", "id": req["id"],
              "result": {"role": "assistant", "content": {"type": "text", "text": "B"}, "model": "m"}}
    assert legacy(b, sid, answer).status_code == 202
    t.join(15)
    assert msgs[1]["id"] == 5 and msgs[1]["result"]["content"][0]["text"] == "got B"


def test_health_and_metrics(replicas: tuple[str, str], redis_url: str) -> None:
    base = replicas[0][: -len("/mcp")]
    assert legacy(replicas[0], init(replicas[0]), rpc("tools/call", {"name": "t_struct", "arguments": {}})).is_success
    assert httpx.get(base + "/healthz").json() == {"status": "ok"}
    assert httpx.get(base + "/readyz").status_code == 200
    text = httpx.get(base + "/metrics").text
    assert 'learnmesh_mcp_requests_total{method="tools/call",revision="2025-11-25",transport="http"}' in text
    assert "learnmesh_mcp_errors_total" in text and "learnmesh_mcp_sessions_open" in text
    # the trainer's exporters count its metrics; here they would read 0, as if nothing were trained
    assert "learnmesh_trainer_" not in text and "learnmesh_samples_accepted_total" in text
