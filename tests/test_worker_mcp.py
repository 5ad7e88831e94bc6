"""`generate` and `score` over MCP: a real gateway process, a real worker process, real Redis
(a single server, then a cluster)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import struct
import subprocess
import sys
import zlib
from typing import Any

import httpx
import jsonschema
import orjson
import PIL.Image
import pytest
import zmq.asyncio

from gateway.tools.inference import GENERATE_OUTPUT
from shared.model import build_model
from tests.conftest import RedisTarget, free_port, wait_for, wait_for_sync
from tests.worker_support import ROOT, FakeWorker, spawn_worker, stop, write_config

MODERN = "2026-07-28"


def call(url: str, name: str, arguments: dict, progress: str | None = None,
         key: str | None = None) -> tuple[list[dict], dict]:
    r = post_call(url, name, arguments, progress, key)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        msgs = [orjson.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:") and line[5:].strip()]
    else:
        msgs = [r.json()]
    return msgs[:-1], msgs[-1]


def post_call(url: str, name: str, arguments: dict, progress: str | None = None,
              key: str | None = None) -> httpx.Response:
    """A 2026-07-28 ``tools/call`` (as ``key``'s principal, if given)."""
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}
    if progress:
        meta["progressToken"] = progress
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": name, "arguments": arguments, "_meta": meta}}
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, timeout=60, headers={
        "accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
        "mcp-method": "tools/call", "mcp-name": name, **auth})


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, redis_target_module: RedisTarget):
    port = free_port()
    tmp_path = tmp_path_factory.mktemp("mesh")
    path, cfg = write_config(tmp_path, 1, redis_url=redis_target_module.url, extra={"gateway": {"port": port}})
    build_model(cfg.model)
    worker = spawn_worker(path, 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    gw = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "gateway"], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        assert gw.poll() is None, "gateway exited"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for_sync(up, timeout_s=60, interval_s=0.1, what="gateway /healthz")
    url = f"http://127.0.0.1:{port}/mcp"
    wait_for_sync(lambda: "result" in call(url, "generate", {"prompt": "hi", "max_tokens": 1})[1], timeout_s=90,
                  interval_s=0.2, what="the worker to answer through the gateway")
    yield f"http://127.0.0.1:{port}/mcp", cfg
    stop(gw)
    stop(worker)


def test_generate_and_score_over_mcp(mesh):
    url, cfg = mesh
    _, res = call(url, "context_append", {"context_id": "chat1", "modality": "text", "text": "My name is Ada."})
    assert "error" not in res and not res["result"].get("isError"), res

    notes, res = call(url, "generate", {"prompt": "What is my name?", "context_id": "chat1", "max_tokens": 24,
                                        "temperature": 0.0}, progress="g1")
    out = res["result"]["structuredContent"]
    assert out["model_version"] == 0 and len(out["generation_id"]) == 32 and out["tokens"] >= 1
    progress = [n["params"] for n in notes if n.get("method") == "notifications/progress"]
    assert progress and all(out["text"].startswith(p["message"]) for p in progress)
    assert progress[0]["progressToken"] == "g1"

    _, got = call(url, "context_get", {"context_id": "chat1"})
    entries = got["result"]["structuredContent"]["entries"]
    assert [(e["role"], e["text"]) for e in entries][-2:] == [("user", "What is my name?"), ("assistant", out["text"])]
    assert out["context_version"] == got["result"]["structuredContent"]["version"]
    # the dispatcher checks generate's output against its schema; the client sees it conform too
    jsonschema.validate(out, GENERATE_OUTPUT)
    assert orjson.loads(res["result"]["content"][0]["text"]) == out and "isError" not in res["result"]

    _, sc = call(url, "score", {"prompt": "What is my name?", "target": "Ada", "context_id": "chat1"})
    s = sc["result"]["structuredContent"]
    assert s["nll"] > 0 and s["tokens"] == 4 and s["log_likelihood"] == pytest.approx(-s["nll"] * 4)


def test_generate_bad_input_is_a_clear_error(mesh):
    url, cfg = mesh
    limit = cfg.worker.max_tokens_limit
    cases = [({"prompt": ""}, "prompt"), ({"prompt": "hi", "max_tokens": limit + 1}, "max_tokens"),
             ({"prompt": "hi", "context_id": "nope"}, "context nope not found"),
             ({"prompt": "x" * (cfg.worker.max_prompt_bytes + 1)}, "bytes"),
             ({"prompt": "hi", "modalities": ["image"]}, "give context_id")]
    for args, match in cases:
        _, res = call(url, "generate", args)
        assert res.get("error", {}).get("code") == -32602, (args, res)
        assert match in res["error"]["message"].lower() or match in orjson.dumps(res["error"]).decode().lower()
    _, res = call(url, "context_append", {"context_id": "img", "modality": "image",
                                          "data": base64.b64encode(b"\x89PNG\r\n\x1a\nnot an image").decode()})
    assert res.get("error", {}).get("code") == -32602 and "image format not recognised" in res["error"]["message"]
    # a sound header over broken pixel data passes append (a header read) and fails where it is decoded:
    # the error names the entry, so the caller knows what to leave out (modalities) or clear
    _, app = call(url, "context_append", {"context_id": "img", "modality": "text", "text": "look"})
    assert "result" in app, app
    _, app = call(url, "context_append", {"context_id": "img", "modality": "image",
                                          "data": base64.b64encode(_broken_png(8, 8)).decode()})
    assert app["result"]["structuredContent"]["entry_id"] == "image:1", app
    for name, args in (("generate", {}), ("score", {"target": "a cat"})):
        _, res = call(url, name, {"prompt": "what is this?", "context_id": "img", **args})
        assert res.get("error", {}).get("code") == -32602, res
        assert res["error"]["message"].startswith("context entry image:1: image could not be decoded"), res
    # leaving the image out, the generation over the text entry completes
    _, res = call(url, "generate", {"prompt": "what is this?", "context_id": "img", "modalities": ["text"],
                                    "max_tokens": 2, "append": False})
    assert_completed(res, max_tokens=2)


def assert_completed(res: dict, max_tokens: int) -> None:
    """``res`` is a generation that completed: sampled, it may end at once on the end-of-text
    token, so what is checked is how it ended and its bound, not its length."""
    out = res.get("result", {}).get("structuredContent", {})
    jsonschema.validate(out, GENERATE_OUTPUT)
    assert out["finish_reason"] in {"stop", "length"} and 0 <= out["tokens"] <= max_tokens, res


def _broken_png(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` and whose pixel data is broken."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", b"broken") + chunk(b"IEND", b""))


def test_integers_written_as_floats_are_integers(mesh):
    """The inputSchema says integer, and JSON Schema's integer includes 2.0 (what a client whose
    numbers are all floats sends): such a max_tokens and seed are taken as the integers they are."""
    url, _ = mesh
    _, res = call(url, "generate", {"prompt": "hi", "max_tokens": 2.0, "seed": 7.0, "temperature": 1.0})
    assert 1 <= res.get("result", {}).get("structuredContent", {}).get("tokens", 0) <= 2, res
    _, again = call(url, "generate", {"prompt": "hi", "max_tokens": 2, "seed": 7, "temperature": 1.0})
    assert again["result"]["structuredContent"]["text"] == res["result"]["structuredContent"]["text"]
    _, res = call(url, "generate", {"prompt": "hi", "max_tokens": 2.5})
    assert res.get("error", {}).get("code") == -32602, res


def test_score_refuses_a_target_longer_than_the_model_scores(mesh):
    """A target cut to fit the sequence would be scored as another continuation than the one
    asked about: -32602 naming the limit; the longest that fits is scored whole, its end included."""
    url, cfg = mesh
    limit = build_model(cfg.model).max_target_tokens
    _, res = call(url, "score", {"prompt": "Tell me", "target": "x" * limit})
    assert res.get("error", {}).get("code") == -32602, res
    assert f"target is {limit + 1} tokens" in res["error"]["message"] and str(limit) in res["error"]["message"]
    _, res = call(url, "score", {"prompt": "Tell me", "target": "x" * (limit - 1)})
    assert res["result"]["structuredContent"]["tokens"] == limit


def test_a_context_of_large_images_does_not_silence_the_worker(mesh):
    """Decoding a large image takes about a second; a context may hold many. The worker goes on
    answering heartbeats meanwhile, so the gateway does not take it for dead (and send the
    request to the next worker, which one caller could silence in turn): the request is answered."""
    url, cfg = mesh
    side = int((cfg.model.max_image_pixels * 0.99) ** 0.5)
    with io.BytesIO() as out:
        PIL.Image.new("RGB", (side, side), (10, 20, 30)).save(out, "PNG")
        png = base64.b64encode(out.getvalue()).decode()
    for _ in range(4):
        _, app = call(url, "context_append", {"context_id": "big-images", "modality": "image", "data": png})
        assert "result" in app, app
    _, res = call(url, "generate", {"prompt": "what are these?", "context_id": "big-images", "max_tokens": 2,
                                    "append": False})
    assert_completed(res, max_tokens=2)


@contextlib.asynccontextmanager
async def gateway_process(config_path, port: int, log_path, key: str | None = None):
    """A gateway process (its output in ``log_path``), once it answers a generation whose prompt
    is "warm" (a worker must answer those; asked as ``key``'s principal, if given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    with log_path.open("wb") as log_file:
        gw = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(config_path), "gateway"],
                              cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/mcp"

        async def warm() -> bool:
            assert gw.poll() is None, "gateway exited"
            try:
                _, res = await asyncio.to_thread(call, url, "generate", {"prompt": "warm", "max_tokens": 1}, key=key)
            except httpx.HTTPError:
                return False
            return "result" in res

        try:
            await wait_for(warm, timeout_s=60, interval_s=0.2, what="the gateway to reach the worker")
            yield url
        finally:
            stop(gw)


def _warm_only(header: dict) -> bool:
    return header.get("prompt") == "warm"


@pytest.fixture
async def held_worker(tmp_path, redis_target: RedisTarget):
    """A gateway process in front of a worker (a real ZeroMQ ROUTER with the workers' keys) that
    answers requests whose prompt is "warm" and holds every other one, noting what is cancelled;
    the gateway's output goes to gateway.log. Yields the gateway's port, the worker, the log's
    path and the configuration."""
    port = free_port()
    path, cfg = write_config(tmp_path, 1, redis_url=redis_target.url, extra={"gateway": {"port": port}},
                             worker={"request_timeout_s": 300.0})
    ctx = zmq.asyncio.Context()
    worker = FakeWorker(ctx, cfg, cfg.worker.endpoints[0], "held")
    worker.answers = _warm_only
    try:
        async with gateway_process(path, port, tmp_path / "gateway.log"):
            yield port, worker, tmp_path / "gateway.log", cfg
    finally:
        await worker.close()
        ctx.term()


async def test_a_2026_generate_whose_client_disconnects_stops_on_its_worker(held_worker):
    """On 2026-07-28 closing the connection is how a client cancels a request: the gateway tells
    the worker to drop the generation at once (not when worker.request_timeout_s runs out), and
    logs no error for it."""
    port, worker, log_path, _ = held_worker
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {},
            "progressToken": "p"}
    body = orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "generate", "arguments": {"prompt": "a long story", "max_tokens": 500}, "_meta": meta}})
    head = (f"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"accept: application/json, text/event-stream\r\nmcp-protocol-version: {MODERN}\r\n"
            f"mcp-method: tools/call\r\nmcp-name: generate\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    await wait_for(lambda: any(not rid.startswith("probe") for rid in worker.unanswered),
                   what="the generation to reach the worker")
    held = [rid for rid in worker.unanswered if not rid.startswith("probe")]
    assert worker.cancelled == []
    writer.close()
    await writer.wait_closed()
    await wait_for(lambda: worker.cancelled == held, timeout_s=20, what="the worker to be told to stop")
    assert "Traceback" not in log_path.read_text(errors="replace")


ALICE, BOB = "alice-inference-key", "bob-inference-key"
LEGACY = "2025-11-25"
_ACCEPT = "application/json, text/event-stream"


@pytest.fixture
async def capped_worker(tmp_path, redis_target: RedisTarget):
    """``held_worker`` with API keys for alice and bob, each of whom may have two generate/score
    calls in flight. Yields the gateway's port, the worker and the gateway's log."""
    port = free_port()
    path, cfg = write_config(tmp_path, 1, redis_url=redis_target.url, worker={"request_timeout_s": 300.0}, extra={
        "gateway": {"port": port, "api_keys": {"alice": ALICE, "bob": BOB}},
        "limits": {"default": {"inference_in_flight": 2}}})
    ctx = zmq.asyncio.Context()
    worker = FakeWorker(ctx, cfg, cfg.worker.endpoints[0], "held")
    worker.answers = _warm_only
    try:
        async with gateway_process(path, port, tmp_path / "gateway.log", key=BOB):
            yield port, worker, tmp_path / "gateway.log"
    finally:
        await worker.close()
        ctx.term()


async def _open_post(port: int, body: dict, headers: dict[str, str],
                     connections: list[asyncio.StreamWriter]) -> asyncio.StreamWriter:
    """A POST /mcp on a connection of its own (added to ``connections``) whose answer nobody
    reads; closing the connection is how its client goes away."""
    data = orjson.dumps(body)
    fields = {"host": f"127.0.0.1:{port}", "content-type": "application/json", "accept": _ACCEPT, **headers,
              "content-length": str(len(data))}
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    connections.append(writer)
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    writer.write(f"POST /mcp HTTP/1.1\r\n{head}\r\n".encode() + data)
    await writer.drain()
    return writer


def _legacy_session(url: str, key: str) -> dict[str, str]:
    """The headers of a new 2025-11-25 session of ``key``'s principal."""
    headers = {"accept": _ACCEPT, "authorization": f"Bearer {key}"}
    init = httpx.post(url, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    return headers | {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": LEGACY}


def _generations(worker: FakeWorker) -> list[str]:
    return [rid for rid in worker.unanswered if not rid.startswith("probe")]


async def test_a_principal_has_at_most_its_cap_of_inference_calls_in_flight(capped_worker):
    """A principal has at most limits.<…>.inference_in_flight generate/score calls in flight (two
    here): one more, of either tool in either revision, is refused at once with 429 and -32029
    while another principal is served; a call gives its place back however it ends: its client
    disconnects, a 2025-11-25 client cancels it, the worker answers, the worker fails."""
    port, worker, log_path = capped_worker
    url = f"http://127.0.0.1:{port}/mcp"
    legacy = await asyncio.to_thread(_legacy_session, url, ALICE)
    connections: list[asyncio.StreamWriter] = []
    try:
        await _cap_of_inference_calls(port, worker, legacy, connections)
    finally:
        for writer in connections:
            writer.close()
            await writer.wait_closed()
    assert "Traceback" not in log_path.read_text(errors="replace")


async def _cap_of_inference_calls(port: int, worker: FakeWorker, legacy: dict[str, str],
                                  connections: list[asyncio.StreamWriter]) -> None:
    url = f"http://127.0.0.1:{port}/mcp"
    story = {"prompt": "a long story", "max_tokens": 500}  # held by the worker until told otherwise
    warm = {"prompt": "warm", "max_tokens": 1}
    modern_meta = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}
    modern_headers = {"authorization": f"Bearer {ALICE}", "mcp-protocol-version": MODERN,
                      "mcp-method": "tools/call", "mcp-name": "generate"}

    async def held(opened: Any) -> Any:
        """``opened`` awaited, once the generation it starts waits at the worker."""
        count = len(_generations(worker))
        call_ = await opened
        await wait_for(lambda: len(_generations(worker)) == count + 1, what="the generation to reach the worker")
        return call_

    async def served() -> bool:
        _, res = await asyncio.to_thread(call, url, "generate", warm, key=ALICE)
        return "result" in res

    async def refused() -> None:
        r = await asyncio.to_thread(post_call, url, "generate", warm, key=ALICE)
        assert r.status_code == 429 and r.headers.get("retry-after") == "1", r.text
        assert orjson.loads(r.content)["error"]["data"] == {"limit": "inference_in_flight", "retryAfterS": 1}

    start = len(_generations(worker))
    disconnecting = await held(_open_post(port, {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "generate", "arguments": story, "_meta": modern_meta}}, modern_headers, connections))
    await held(_open_post(port, {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {
        "name": "generate", "arguments": story}}, legacy, connections))
    await refused()
    r = await asyncio.to_thread(post_call, url, "score", {"prompt": "warm", "target": "x"}, key=ALICE)
    assert r.status_code == 429 and orjson.loads(r.content)["error"]["code"] == -32029, r.text
    r = await asyncio.to_thread(httpx.post, url, headers=legacy, json={
        "jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "generate", "arguments": warm}})
    assert r.status_code == 429 and r.headers.get("retry-after") == "1", r.text
    assert orjson.loads(r.content)["error"]["data"]["limit"] == "inference_in_flight"
    _, res = await asyncio.to_thread(call, url, "generate", warm, key=BOB)
    assert "structuredContent" in res.get("result", {}), res  # another principal's calls are served

    disconnecting.close()
    await disconnecting.wait_closed()
    await wait_for(served, timeout_s=20, what="the disconnected call's place to come back")
    answered = await held(_started(asyncio.to_thread(call, url, "generate", story, key=ALICE)))
    await refused()  # the disconnected call's place came back once, not twice

    await asyncio.to_thread(httpx.post, url, headers=legacy, json={
        "jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 8, "reason": "user"}})
    await wait_for(served, timeout_s=20, what="the cancelled call's place to come back")
    failed = await held(_started(asyncio.to_thread(call, url, "generate", story, key=ALICE)))
    await refused()

    await worker.answer(_generations(worker)[start + 2])
    _, res = await answered
    assert res["result"]["structuredContent"]["text"] == "ok", res
    await worker.fail(_generations(worker)[start + 3])
    _, res = await failed
    assert res["result"]["isError"] is True, res
    # nothing in flight now: two places, and no more
    for i in (10, 11):
        await held(_open_post(port, {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
            "name": "generate", "arguments": story, "_meta": modern_meta}}, modern_headers, connections))
    await refused()


async def _started(work: Any) -> asyncio.Task:
    """``work`` running on its own, as a task to await later."""
    return asyncio.ensure_future(work)


async def test_progress_keeps_increasing_when_a_generation_moves_to_another_worker(tmp_path, redis_target):
    """A worker that dies under a streamed generation: the request goes on on another worker,
    its text restarts, and its progress still increases with every notification (the MCP rule),
    never beyond its total."""
    port = free_port()
    path, cfg = write_config(tmp_path, 2, redis_url=redis_target.url, extra={"gateway": {"port": port}})
    ctx = zmq.asyncio.Context()
    first = FakeWorker(ctx, cfg, cfg.worker.endpoints[0], "first")
    first.answers, first.tokens = _warm_only, 5
    second = None
    try:
        async with gateway_process(path, port, tmp_path / "gateway.log") as url:
            streamed = asyncio.create_task(asyncio.to_thread(
                call, url, "generate", {"prompt": "a story", "max_tokens": 20}, progress="g"))
            await wait_for(lambda: first.unanswered, what="the generation to reach the first worker")
            second = FakeWorker(ctx, cfg, cfg.worker.endpoints[1], "second")
            second.tokens = 1
            first.silent = True  # dead: neither heartbeats nor answers
            notes, res = await asyncio.wait_for(streamed, 60)
        assert res["result"]["structuredContent"]["worker"] == "second"
        progress = [n["params"] for n in notes if n.get("method") == "notifications/progress"]
        values = [p["progress"] for p in progress]
        assert progress[0]["message"].startswith("t") and progress[-1]["message"] == "t", progress
        assert values == sorted(set(values)) and len(values) >= 2, progress
        assert all(p["progress"] <= p["total"] for p in progress), progress
    finally:
        await first.close()
        if second is not None:
            await second.close()
        ctx.term()


async def test_a_text_entry_reaches_the_worker_cut_to_what_the_model_reads(held_worker):
    """A context's text entry may hold megabytes, of which the model reads at most its last
    model.max_seq bytes: only those travel to the worker, not the whole entry with every request."""
    port, worker, _, cfg = held_worker
    url = f"http://127.0.0.1:{port}/mcp"
    text = "old words " * 100_000 + "the newest words"
    _, app = await asyncio.to_thread(call, url, "context_append", {"context_id": "long", "modality": "text",
                                                                   "text": text})
    assert "result" in app, app
    _, res = await asyncio.to_thread(call, url, "generate", {"prompt": "warm", "context_id": "long",
                                                             "max_tokens": 1, "append": False})
    assert "result" in res, res
    header, frames = worker.received[-1]
    assert [e["modality"] for e in header["entries"]] == ["text"]
    assert len(frames) == 1 and len(frames[0]) == cfg.model.max_seq and text.encode().endswith(frames[0])


async def test_every_inference_request_names_its_authenticated_principal(held_worker):
    """Workers share their batches out among principals by the name in each request's header: it is
    the principal the gateway authenticated (``local`` on an open gateway), never one the caller
    writes into its arguments."""
    port, worker, _, _ = held_worker
    url = f"http://127.0.0.1:{port}/mcp"
    for name, args in (("generate", {"prompt": "warm", "max_tokens": 1, "append": False}),
                       ("score", {"prompt": "warm", "target": "x"})):
        await asyncio.to_thread(call, url, name, args)  # the stand-in worker answers a generation's shape only
        assert worker.received[-1][0]["op"] == name and worker.received[-1][0]["principal"] == "local"
        _, res = await asyncio.to_thread(call, url, name, {**args, "principal": "bob"})
        assert res.get("error", {}).get("code") == -32602, res
    assert {h.get("principal") for h, _ in worker.received if h["prompt"] == "warm"} == {"local"}


async def test_a_generate_that_appends_its_exchange_is_announced_like_any_append(capped_worker):
    """generate with ``append`` writes the exchange to the context: its subscribers get
    notifications/resources/updated, and a channel it opens (a context of images gains text)
    changes resources/list, announced as a context_append's would be."""
    from conformance.fixtures import PNG_1PX
    from tests.proxy_front import Client, get_stream

    port, worker, log_path = capped_worker
    alice = await asyncio.to_thread(lambda: Client(f"http://127.0.0.1:{port}", ALICE, LEGACY).open())

    def tool(name: str, **args: Any) -> dict:
        return alice.result("tools/call", {"name": name, "arguments": args})

    await asyncio.to_thread(tool, "context_append", context_id="conv", modality="text", text="hello")
    await asyncio.to_thread(tool, "context_append", context_id="pic", modality="image",
                            data=PNG_1PX)
    await asyncio.to_thread(alice.result, "resources/subscribe", {"uri": "context://conv/text"})
    stream = await asyncio.to_thread(get_stream, alice)
    listed = "notifications/resources/list_changed"

    async def generate(context_id: str) -> None:
        known = set(_generations(worker))
        answered = asyncio.create_task(asyncio.to_thread(tool, "generate", prompt="tell me", context_id=context_id,
                                                         append=True))
        await wait_for(lambda: bool(set(_generations(worker)) - known), what="the generation to reach the worker")
        await worker.answer((set(_generations(worker)) - known).pop())
        assert (await answered)["structuredContent"]["context_version"] >= 2

    await generate("conv")  # a channel that holds entries: updated, the list as it was
    await wait_for(lambda: any(m.get("method") == "notifications/resources/updated"
                               and m["params"]["uri"] == "context://conv/text" for m in stream.seen),
                   timeout_s=10, what="the subscriber to hear of the exchange")
    # the session's notifications come in order: those of the appends above are in by now
    before = stream.methods().count(listed)
    await generate("pic")  # its first text entries: the list changed
    await wait_for(lambda: stream.methods().count(listed) == before + 1, timeout_s=10, what="resources/list_changed")
    assert "Traceback" not in log_path.read_text(errors="replace")
