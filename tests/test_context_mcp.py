"""The context store through the gateway: tools, resources, admin REST, and isolation of two
API keys through both MCP revisions and the WebSocket transport (one in-process gateway
built with create_app), on a single Redis server and on a Redis Cluster."""

from __future__ import annotations

import base64
import io
import re
import struct
import wave
import zlib
from collections.abc import Iterator

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from conformance.fixtures import PNG_1PX, WAV_MINIMAL
from gateway.app import create_app
from shared.config import load_config
from tests.admin_support import ADMIN_KEY, MCP_KEY, LiveServer, admin_config, bearer
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import Client, get_stream, publish_control

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
ACCEPT = "application/json, text/event-stream"
KEYS = {"alice": "alice-key-123456", "bob": "bob-key-1234567"}
ADMIN = "admin-key-123456"


@pytest.fixture
def client(redis_target: RedisTarget) -> Iterator[TestClient]:
    cfg = load_config(env={}, overrides={
        "redis": {"url": redis_target.url},
        "gateway": {"api_keys": KEYS, "admin_keys": {"root": {"key": ADMIN, "role": "admin"}},
                    "request_state_keys": ["00" * 32]},
        "context": {"max_entry_bytes": 4096, "channel_max_bytes": 65536},
        "learning": {"teachers": list(KEYS)}})
    with TestClient(create_app(cfg), base_url="http://127.0.0.1:8000") as c:
        yield c


def modern(c: TestClient, who: str, method: str, params: dict) -> dict:
    p = {**params, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                             "io.modelcontextprotocol/clientCapabilities": {}}}
    h = {"accept": ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": method,
         "authorization": f"Bearer {KEYS[who]}"}
    if method == "tools/call":
        h["mcp-name"] = params["name"]
    if method == "resources/read":
        h["mcp-name"] = params["uri"]
    r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": p}, headers=h)
    return _body(r.text)


def _body(text: str) -> dict:
    text = text.strip()
    if text.startswith("{"):
        return orjson.loads(text)
    msgs = [orjson.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
    return [m for m in msgs if "id" in m][-1]


class Legacy:
    def __init__(self, c: TestClient, who: str) -> None:
        self.c, self.auth = c, f"Bearer {KEYS[who]}"
        r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
            headers={"accept": ACCEPT, "authorization": self.auth})
        assert r.status_code == 200, r.text
        self.sid = r.headers["mcp-session-id"]

    def __call__(self, method: str, params: dict) -> dict:
        r = self.c.post("/mcp", json={"jsonrpc": "2.0", "id": 2, "method": method, "params": params},
                        headers={"accept": ACCEPT, "mcp-session-id": self.sid, "authorization": self.auth,
                                 "mcp-protocol-version": "2025-11-25"})
        return _body(r.text)


def call(rpc, name: str, **args) -> dict:
    if isinstance(rpc, Legacy):
        return rpc("tools/call", {"name": name, "arguments": args})
    return rpc("tools/call", {"name": name, "arguments": args})


def test_tools_roundtrip_and_bad_input(client: TestClient) -> None:
    def a(name, **args):
        return modern(client, "alice", "tools/call", {"name": name, "arguments": args})

    img = PNG_1PX
    r = a("context_append", context_id="conv", modality="image", data=img, mime_type="image/png")
    assert "result" in r, r
    assert r["result"]["structuredContent"]["entry_id"] == "image:1"
    r = a("context_append", context_id="conv", modality="text", text="look", links=["image:1"])
    assert r["result"]["structuredContent"]["version"] == 2
    got = a("context_get", context_id="conv", modalities=["text", "image"])["result"]["structuredContent"]
    assert [e["id"] for e in got["entries"]] == ["image:1", "text:1"]
    assert got["entries"][0]["data"] == img and got["entries"][1]["text"] == "look"
    assert a("context_get", context_id="conv", version=1)["result"]["structuredContent"]["version"] == 1
    fork = a("context_fork", context_id="conv", new_context_id="conv2")["result"]["structuredContent"]
    assert fork == {"context_id": "conv2", "source": "conv", "version": 1}
    assert a("context_clear", context_id="conv2")["result"]["structuredContent"]["version"] == 2
    read = modern(client, "alice", "resources/read", {"uri": "context://conv/image"})["result"]
    assert read["contents"][0]["blob"] == img and read["contents"][0]["mimeType"] == "image/png"
    read = modern(client, "alice", "resources/read", {"uri": "context://conv/text"})["result"]
    assert read["contents"][0]["text"] == "look"
    for bad in ({"context_id": "conv", "modality": "image", "data": "not base64!"},
                {"context_id": "conv", "modality": "video", "text": "x"},
                {"context_id": "conv", "modality": "text", "text": "x" * 5000},
                {"context_id": "conv", "modality": "text"},
                {"context_id": "bad id", "modality": "text", "text": "x"},
                {"context_id": "conv", "modality": "text", "text": "x", "mime_type": "text/plain\r\nX-Injected: 1"}):
        err = a("context_append", **bad)
        assert err["error"]["code"] == -32602, (bad, err)
    assert a("context_get", context_id="conv", last_n=0)["error"]["code"] == -32602
    assert a("context_get", context_id="missing")["error"]["code"] == -32602
    assert modern(client, "alice", "resources/read", {"uri": "context://missing/text"})["error"]["code"] == -32602
    assert a("context_get", context_id="conv")["result"]["structuredContent"]["version"] == 2  # nothing written


def test_an_append_sent_again_with_its_request_id_is_answered_without_a_second_entry(client: TestClient) -> None:
    """A client that lost an answer sends the call again: through either revision, with the
    same request_id, the context still holds the entry once and the answer is the first's."""
    legacy = Legacy(client, "alice")
    for rpc, cid in ((lambda m, p: modern(client, "alice", m, p), "modern"), (legacy, "legacy")):
        first = call(rpc, "context_append", context_id=cid, modality="text", text="hi", request_id="7f1c-01")
        first = first["result"]["structuredContent"]
        assert first == {"context_id": cid, "entry_id": "text:1", "version": 1, "evicted": []}
        again = call(rpc, "context_append", context_id=cid, modality="text", text="hi", request_id="7f1c-01")
        assert again["result"]["structuredContent"] == {**first, "repeated": True}
        got = call(rpc, "context_get", context_id=cid)["result"]["structuredContent"]
        assert got["version"] == 1 and [e["text"] for e in got["entries"]] == ["hi"]
        bad = call(rpc, "context_append", context_id=cid, modality="text", text="hi", request_id="no spaces")
        assert bad["error"]["code"] == -32602, bad
    # the id is the principal's own: bob's call with it appends to bob's context
    bobs = modern(client, "bob", "tools/call", {"name": "context_append", "arguments": {
        "context_id": "modern", "modality": "text", "text": "hi", "request_id": "7f1c-01"}})
    assert "repeated" not in bobs["result"]["structuredContent"]


def test_two_keys_are_isolated_modern_and_legacy(client: TestClient) -> None:
    def a(name, **args):
        return modern(client, "alice", "tools/call", {"name": name, "arguments": args})

    a("context_append", context_id="secret", modality="text", text="alice only")
    bob = Legacy(client, "bob")
    for rpc, not_found in ((bob, -32002), (lambda m, p: modern(client, "bob", m, p), -32602)):
        assert call(rpc, "context_get", context_id="secret")["error"]["code"] == -32602
        assert call(rpc, "context_clear", context_id="secret")["error"]["code"] == -32602
        assert call(rpc, "context_fork", context_id="secret", new_context_id="stolen")["error"]["code"] == -32602
        assert rpc("resources/read", {"uri": "context://secret/text"})["error"]["code"] == not_found
        listed = rpc("resources/list", {})["result"]["resources"]
        assert not any("secret" in x["uri"] for x in listed)
    # bob writing the same id creates bob's own context; alice's is untouched
    assert call(bob, "context_append", context_id="secret", modality="text", text="bob")["result"][
        "structuredContent"]["version"] == 1
    call(bob, "context_clear", context_id="secret")
    got = a("context_get", context_id="secret")["result"]["structuredContent"]
    assert [e["text"] for e in got["entries"]] == ["alice only"] and got["version"] == 1


def test_resources_list_shows_own_contexts(client: TestClient) -> None:
    modern(client, "alice", "tools/call", {"name": "context_append", "arguments": {
        "context_id": "mine", "modality": "text", "text": "x"}})
    uris = [x["uri"] for x in modern(client, "alice", "resources/list", {})["result"]["resources"]]
    assert "context://mine/text" in uris
    uris = [x["uri"] for x in modern(client, "bob", "resources/list", {})["result"]["resources"]]
    assert "context://mine/text" not in uris


def test_websocket_isolation_and_updates(client: TestClient) -> None:
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}

    def frame(rid, method, params):
        return orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                             "params": {**params, "_meta": meta}}).decode()

    modern(client, "alice", "tools/call", {"name": "context_append", "arguments": {
        "context_id": "ws-secret", "modality": "text", "text": "alice"}})
    with client.websocket_connect("/mcp/ws", subprotocols=["mcp"],
                                  headers={"authorization": f"Bearer {KEYS['bob']}", "host": "127.0.0.1:8000",
                                           "origin": "http://127.0.0.1:8000"}) as ws:
        ws.send_text(frame(1, "tools/call", {"name": "context_get", "arguments": {"context_id": "ws-secret"}}))
        assert orjson.loads(ws.receive_text())["error"]["code"] == -32602
        ws.send_text(frame(2, "resources/read", {"uri": "context://ws-secret/text"}))
        assert orjson.loads(ws.receive_text())["error"]["code"] == -32602
        # bob listens to alice's context name and to his own; only his own change may arrive
        ws.send_text(frame(3, "subscriptions/listen", {"notifications": {
            "resourceSubscriptions": ["context://ws-secret/text", "context://ws-mine/text"]}}))
        assert orjson.loads(ws.receive_text())["method"] == "notifications/subscriptions/acknowledged"
        modern(client, "alice", "tools/call", {"name": "context_append", "arguments": {
            "context_id": "ws-secret", "modality": "text", "text": "more"}})
        ws.send_text(frame(4, "tools/call", {"name": "context_append", "arguments": {
            "context_id": "ws-mine", "modality": "text", "text": "bob"}}))
        seen = []
        while True:
            msg = orjson.loads(ws.receive_text())
            seen.append(msg)
            if msg.get("method") == "notifications/resources/updated":
                break
        assert seen[-1]["params"]["uri"] == "context://ws-mine/text"
        assert not any("ws-secret" in orjson.dumps(m).decode() for m in seen)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` and whose pixel data is broken."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", b"broken") + chunk(b"IEND", b""))


def _wav(sample_width: int, frames: bytes) -> bytes:
    with io.BytesIO() as out:
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(sample_width)
            w.setframerate(8000)
            w.writeframes(frames)
        return out.getvalue()


def test_context_append_refuses_media_no_worker_could_read(client: TestClient) -> None:
    """An image or audio entry a worker could never decode would fail every later generate and
    score on its context: append refuses it with -32602 saying what is wrong, from its header
    alone, and stores nothing. What a worker reads is taken."""
    def append(modality: str, content: bytes) -> dict:
        return modern(client, "alice", "tools/call", {"name": "context_append", "arguments": {
            "context_id": "media", "modality": modality, "data": base64.b64encode(content).decode()}})

    b64 = base64.b64encode
    refused = [("image", b"\x89PNG\x00\x01", "image format not recognised"),
               ("image", b"GIF89a", "image format not recognised"),
               ("image", _png_header(7000, 7000), "image is 7000x7000 pixels; at most 40000000"),
               ("image", _png_header(20000, 20000), "image is larger than 40000000 pixels"),
               ("audio", b"RIFF\x00\x00\x00\x00WAVEjunk", "not a valid WAV file"),
               ("audio", _wav(2, b"")[:30], "not a valid WAV file (its header is cut short)"),
               ("audio", _wav(3, b"\x00" * 30), "sample width 3 bytes is not supported"),
               ("audio", _wav(2, b""), "audio has no samples"),
               ("audio", b"\x01", "16-bit little-endian PCM")]
    for modality, content, reason in refused:
        err = append(modality, content)
        assert err.get("error", {}).get("code") == -32602, (reason, err)
        message = err["error"]["message"]
        assert message.startswith(f"{modality} entry refused: ") and reason in message, (reason, err)
    err = modern(client, "alice", "tools/call", {"name": "context_append", "arguments": {
        "context_id": "media", "modality": "image", "text": "a picture of a cat"}})
    assert err.get("error", {}).get("code") == -32602 and "image format not recognised" in err["error"]["message"]
    missing = modern(client, "alice", "tools/call", {"name": "context_get", "arguments": {"context_id": "media"}})
    assert missing["error"]["code"] == -32602, missing  # nothing was stored
    for modality, content in (("image", base64.b64decode(PNG_1PX)), ("image", _png_header(8, 8)),
                              ("audio", base64.b64decode(WAV_MINIMAL)), ("audio", _wav(1, b"\x80" * 16)),
                              ("audio", b"\x00\x01\x02\x03")):
        ok = append(modality, content)
        assert "result" in ok and not ok["result"].get("isError"), (modality, ok)
    got = modern(client, "alice", "tools/call", {"name": "context_get", "arguments": {"context_id": "media"}})
    assert [e["id"] for e in got["result"]["structuredContent"]["entries"]][-1] == "audio:3"
    assert b64(_png_header(8, 8)).decode() in [e.get("data") for e in got["result"]["structuredContent"]["entries"]]


def test_admin_routes(client: TestClient) -> None:
    modern(client, "alice", "tools/call", {"name": "context_append", "arguments": {
        "context_id": "adm", "modality": "image", "data": PNG_1PX}})
    h = {"authorization": f"Bearer {ADMIN}"}
    assert client.get("/admin/contexts").status_code == 401
    assert client.get("/admin/contexts", headers={"authorization": f"Bearer {KEYS['alice']}"}).status_code == 401
    listing = client.get("/admin/contexts", params={"principal": "alice"}, headers=h).json()
    assert [c["id"] for c in listing["contexts"]] == ["adm"] and listing["contexts"][0]["entries"] == {"image": 1}
    assert "alice" in [p["principal"] for p in client.get("/admin/contexts", headers=h).json()["principals"]]
    inspect_ = client.get("/admin/contexts/alice/adm", headers=h).json()
    assert inspect_["entries"][0]["id"] == "image:1" and "data" not in inspect_["entries"][0]
    export = client.get("/admin/contexts/alice/adm/export", headers=h).json()
    assert export["entries"][0]["data"] == PNG_1PX
    assert client.get("/admin/contexts/alice/nope", headers=h).status_code == 404
    assert client.get("/admin/contexts/alice/bad%20id", headers=h).status_code == 400
    assert client.delete("/admin/contexts/alice/adm", headers=h).json()["evicted"] is True
    assert client.delete("/admin/contexts/alice/adm", headers=h).status_code == 404


def test_a_malformed_id_in_a_resource_uri_is_a_resource_not_found(client: TestClient) -> None:
    """Whatever a crafted URI names — an id the store never accepts, percent-encoded dots,
    braces — it is answered like any unknown resource of the caller's, naming the URI."""
    legacy = Legacy(client, "alice")
    for uri in ("context://{bob}c/text", "context://%2e%2e/text", "context://" + "a" * 200 + "/text"):
        r = client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "resources/read", "params": {
            "uri": uri, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                  "io.modelcontextprotocol/clientCapabilities": {}}}},
            headers={"accept": ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": "resources/read",
                     "mcp-name": uri, "authorization": f"Bearer {KEYS['alice']}"})
        assert r.status_code == 400, (uri, r.text)
        assert _body(r.text)["error"] == {"code": -32602, "message": f"Resource not found: {uri}",
                                          "data": {"uri": uri}}, uri
        old = legacy("resources/read", {"uri": uri})
        assert old["error"] == {"code": -32002, "message": f"Resource not found: {uri}", "data": {"uri": uri}}, uri


RESOURCES_CHANGED = "notifications/resources/list_changed"


def test_resources_list_changes_are_announced(redis_target: RedisTarget) -> None:
    """resources/list shows each channel that holds entries: an append that opens a channel, a
    clear and a fork change it and send resources/list_changed; an append to a channel that
    already holds entries does not."""
    with LiveServer(create_app(admin_config(redis_target.url))) as server:
        alice = Client(server.url, MCP_KEY, LEGACY).open()
        stream = get_stream(alice)

        def announced(n: int) -> None:
            wait_for_sync(lambda: stream.methods().count(RESOURCES_CHANGED) >= n, timeout_s=10,
                          what=f"resources/list_changed #{n}")

        def tool(name: str, **args: object) -> None:
            alice.result("tools/call", {"name": name, "arguments": args})

        tool("context_append", context_id="conv", modality="text", text="hello")  # a new context
        announced(1)
        tool("context_append", context_id="conv", modality="text", text="again")  # the list is as it was
        tool("context_clear", context_id="conv")  # its text channel leaves the list
        announced(2)
        tool("context_append", context_id="conv", modality="text", text="back")  # and comes back
        announced(3)
        tool("context_fork", context_id="conv", new_context_id="conv2")
        announced(4)
        # a marker after them all: what the gateway announced before it is on the stream by then
        publish_control(redis_target.url, {"t": "lc", "p": "alice", "k": "prompts", "o": "another-replica"})
        wait_for_sync(lambda: "notifications/prompts/list_changed" in stream.methods(), timeout_s=10,
                      what="the marker")
        assert stream.methods().count(RESOURCES_CHANGED) == 4
        # an operator's eviction takes the context's channels off the list too
        gone = httpx.delete(f"{server.url}/admin/contexts/alice/conv2", headers=bearer(ADMIN_KEY), timeout=10)
        assert gone.status_code == 200, gone.text
        announced(5)


def test_a_global_budget_eviction_is_announced_to_the_evicted_principal(redis_target: RedisTarget) -> None:
    """The global budget's evictor takes the least recently used principal's contexts: that
    principal's clients get resources/list_changed, as for any other change of the list."""
    from tests.proxy_front import BOB_KEY

    cfg = admin_config(redis_target.url, gateway={"api_keys": {"alice": MCP_KEY, "bob": BOB_KEY}},
                       context={"global_budget_bytes": 64 * 1024, "principal_budget_bytes": 64 * 1024, "max_entry_bytes": 16384,
                                "global_evict_interval_s": 0.2})
    with LiveServer(create_app(cfg)) as server:
        alice, bob = Client(server.url, MCP_KEY, LEGACY).open(), Client(server.url, BOB_KEY, LEGACY).open()
        alice.result("tools/call", {"name": "context_append", "arguments": {
            "context_id": "old", "modality": "text", "text": "a" * 8192}})
        stream = get_stream(alice)
        wait_for_sync(lambda: RESOURCES_CHANGED in stream.methods(), timeout_s=10, what="the append's announcement")
        before = stream.methods().count(RESOURCES_CHANGED)
        for i in range(8):  # bob, used later, pushes the mesh over its budget
            bob.result("tools/call", {"name": "context_append", "arguments": {
                "context_id": f"new{i}", "modality": "text", "text": "b" * 8192}})
        wait_for_sync(lambda: stream.methods().count(RESOURCES_CHANGED) > before, timeout_s=20,
                      what="alice to hear that her context was evicted")
        listed = alice.result("resources/list")["resources"]
        assert not [r for r in listed if r["uri"].startswith("context://old/")], listed


def test_an_unknown_context_is_named_in_the_error_data_by_every_tool(client: TestClient) -> None:
    """Whichever tool names a context the caller does not hold (unknown, or another principal's),
    on either revision, the -32602 error's data says so in one shape a program can act on."""
    def a(name, **args):
        return modern(client, "alice", "tools/call", {"name": name, "arguments": args})

    a("context_append", context_id="mine", modality="text", text="alice only")
    legacy = Legacy(client, "bob")
    calls = [("context_get", {"context_id": "mine"}), ("context_clear", {"context_id": "mine"}),
             ("context_fork", {"context_id": "mine"}), ("generate", {"prompt": "hi", "context_id": "mine"}),
             ("score", {"prompt": "hi", "target": "x", "context_id": "mine"}),
             ("learn", {"input": "hi", "target": "x", "context_id": "mine", "version": 1}),
             # a read at a version is one script call, which cannot tell the context from its version
             ("context_get", {"context_id": "mine", "version": 1})]
    for rpc in (legacy, lambda m, p: modern(client, "bob", m, p)):
        for name, args in calls:
            err = call(rpc, name, **args)["error"]
            assert err["code"] == -32602, (name, err)
            kind = "version_unavailable" if name == "context_get" and "version" in args else "context_not_found"
            assert {k: err["data"][k] for k in ("kind", "context_id")} == {"kind": kind, "context_id": "mine"}, (
                name, err)
        err = call(rpc, "learn", samples=[{"input": "a", "target": "b"},
                                          {"input": "hi", "target": "x", "context_id": "mine", "version": 1}])["error"]
        assert err["data"] == {"kind": "context_not_found", "context_id": "mine", "version": 1, "index": 1}
    for args in ({"context_id": "mine", "version": 7},
                 {"samples": [{"input": "hi", "target": "x", "context_id": "mine", "version": 7}]}):
        name = "learn" if "samples" in args else "context_get"
        err = a(name, **args)["error"]
        assert err["code"] == -32602
        assert {k: err["data"][k] for k in ("kind", "context_id", "version")} == {
            "kind": "version_unavailable", "context_id": "mine", "version": 7}, (name, err)


def test_a_learn_sample_naming_a_modality_twice_is_refused_by_its_index(client: TestClient) -> None:
    a = lambda m, p: modern(client, "alice", m, p)  # noqa: E731
    call(a, "context_append", context_id="conv", modality="text", text="hi")
    twice = {"input": "q", "target": "a", "context_id": "conv", "version": 1, "modalities": ["text", "text"]}
    ok = {"input": "q", "target": "a"}
    for rpc in (Legacy(client, "bob"), a):
        err = call(rpc, "learn", samples=[ok, twice])["error"]
        assert (err["code"], err["data"]) == (-32602, {"index": 1}), err
        assert err["message"] == "sample 1: duplicate modality in 'modalities': text", err
        err = call(rpc, "learn", **twice)["error"]
        assert err["code"] == -32602 and "duplicate modality" in err["message"] and "data" not in err, err
    assert call(a, "learn", **ok)["result"]["structuredContent"]["seqs"] == [1]  # nothing was written before


def test_integers_sent_as_floats_are_taken_as_the_schema_promises(client: TestClient) -> None:
    """JSON Schema's integer includes 2.0: a client whose numbers are floats is served, on both
    revisions, wherever a tool's inputSchema says integer."""
    a = lambda m, p: modern(client, "alice", m, p)  # noqa: E731
    for rpc, cid in ((a, "floats"), (Legacy(client, "alice"), "floats2")):
        appended = call(rpc, "context_append", context_id=cid, modality="text", text="one", tokens=3.0)
        assert appended["result"]["structuredContent"]["version"] == 1, appended
        call(rpc, "context_append", context_id=cid, modality="text", text="two")
        for args, texts in (({"last_n": 1.0}, ["two"]), ({"max_tokens": 1.0}, ["two"]),
                            ({"version": 1.0}, ["one"])):
            got = call(rpc, "context_get", context_id=cid, **args)
            assert [e["text"] for e in got["result"]["structuredContent"]["entries"]] == texts, (args, got)
        learned = call(rpc, "learn", input="q", target="a", context_id=cid, version=1.0)
        assert "result" in learned, learned
        assert "error" in call(rpc, "context_get", context_id=cid, last_n=1.5)
        # beyond 2**53 a float is no exact integer: refused, never echoed back as a 300-digit one
        for name, args in (("learn", {"input": "q", "target": "a", "context_id": cid, "version": 1e300}),
                           ("generate", {"prompt": "hi", "seed": 1e300}),
                           ("generate", {"prompt": "hi", "min_model_version": 1e300})):
            err = call(rpc, name, **args)["error"]
            assert err["code"] == -32602 and not re.search(r"\d{25}", orjson.dumps(err).decode()), (name, err)


def test_modalities_to_read_are_named_once(client: TestClient) -> None:
    a = lambda m, p: modern(client, "alice", m, p)  # noqa: E731
    call(a, "context_append", context_id="conv", modality="text", text="hi")
    for args in ({"modalities": ["text", "text"]}, {"modalities": ["text"] * 10_000}):
        for name, extra in (("context_get", {}), ("generate", {"prompt": "hi"}),
                            ("score", {"prompt": "hi", "target": "x"})):
            err = call(a, name, context_id="conv", **extra, **args)["error"]
            assert err["code"] == -32602 and "(at modalities)" in err["message"], (name, err)


def test_a_huge_name_is_refused_without_being_echoed_back(client: TestClient) -> None:
    a = lambda m, p: modern(client, "alice", m, p)  # noqa: E731
    huge = "x" * 200_000
    call(a, "context_append", context_id="conv", modality="text", text="hi")
    for name, args in (("context_append", {"context_id": "conv", "modality": huge, "text": "x"}),
                       ("context_append", {"context_id": "conv", "modality": "text", "text": "x",
                                           "links": [f"image:{'1' * 200_000}"]}),
                       ("context_append", {"context_id": "conv", "modality": "text", "text": "x",
                                           "links": [f"{huge}:1"]}),
                       ("context_get", {"context_id": "conv", "modalities": [huge]}),
                       ("learn", {"input": "q", "target": "a", "context_id": "conv", "version": 1,
                                  "modalities": [huge]})):
        err = call(a, name, **args)["error"]
        assert err["code"] == -32602 and len(orjson.dumps(err)) < 1000, (name, orjson.dumps(err)[:300])
