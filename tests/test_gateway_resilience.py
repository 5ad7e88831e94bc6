"""Auth, principal isolation, the per-principal session cap, Redis outage and recovery,
and the WebSocket transport — each against a real gateway process and real Redis."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import logged_gateway, start_gateway, stop
from tests.test_gateway_http import ACCEPT, init, legacy, modern, rpc

KEYS = "alice:alice-key-123,bob:bob-key-4567"


def test_api_keys_and_principal_isolation(redis_target: RedisTarget) -> None:
    port = free_port()
    proc = start_gateway(port, redis_target.url, api_keys=KEYS, cap=2)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        body, h = modern("tools/list")
        assert httpx.post(url, json=body, headers=h).status_code == 401
        r = httpx.post(url, json=body, headers={**h, "authorization": "Bearer wrong-key-000"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        alice = {"authorization": "Bearer alice-key-123"}
        bob = {"authorization": "Bearer bob-key-4567"}
        body, h = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}})
        assert httpx.post(url, json=body, headers={**h, **alice}).json()["result"]["content"][0]["text"] == "alice:x"
        sid = init(url, alice)
        assert legacy(url, sid, rpc("ping"), **alice).status_code == 200
        assert legacy(url, sid, rpc("ping"), **bob).status_code == 404  # bound to alice
        assert httpx.delete(url, headers={"mcp-session-id": sid, **bob}).status_code == 404
        assert legacy(url, sid, rpc("ping"), **alice).status_code == 200
        init(url, alice)
        r = httpx.post(url, json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}}),
                       headers={"accept": ACCEPT, **alice})
        assert r.status_code == 503 and "retry-after" in r.headers  # cap of 2 sessions per principal
        init(url, bob)  # bob has his own budget
    finally:
        stop(proc)


def _redis(port: int, workdir: str) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    def up() -> bool:
        try:
            return bool(redis.Redis(port=port, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    wait_for_sync(up, timeout_s=10, what="private redis-server")
    return proc


def _session_unless_unavailable(url: str) -> str | None:
    r = httpx.post(url, json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                                "clientInfo": {"name": "t", "version": "1"}}),
                   headers={"accept": ACCEPT}, timeout=15)
    if r.status_code == 503:
        assert r.headers["retry-after"] == "2" and r.json()["error"]["code"] == -32050
        return None
    assert r.status_code == 200, r.text
    return r.headers["mcp-session-id"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary to stop/start")
def test_redis_down_503_then_recovers() -> None:
    rport, port = free_port(), free_port()
    workdir = tempfile.mkdtemp(prefix="lm-gw-redis-")
    rproc = _redis(rport, workdir)
    gw = start_gateway(port, f"redis://127.0.0.1:{rport}/0")
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        init(url)
        rproc.terminate()
        rproc.wait(10)
        r = httpx.post(url, json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}}),
                       headers={"accept": ACCEPT}, timeout=15)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == -32050
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=15).status_code == 503
        body, h = modern("tools/call", {"name": "t_echo", "arguments": {"text": "s"}})
        assert httpx.post(url, json=body, headers=h).status_code == 200  # stateless path needs no Redis
        rproc = _redis(rport, workdir)
        wait_for_sync(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200, timeout_s=15,
                      what="readyz to recover")
        # A connection pooled before the restart may still answer its first use with 503 +
        # Retry-After (it is dropped then); a client that retries gets its session.
        sid = wait_for_sync(lambda: _session_unless_unavailable(url), timeout_s=15, what="a session after recovery")
        assert legacy(url, sid, rpc("ping")).status_code == 200
    finally:
        stop(gw)
        rproc.terminate()
        rproc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_websocket_transport(redis_target: RedisTarget) -> None:
    port = free_port()
    proc = start_gateway(port, redis_target.url)
    uri = f"ws://127.0.0.1:{port}/mcp/ws"

    async def scenario() -> None:
        with pytest.raises(InvalidStatus):
            async with ws_connect(uri):
                pass  # no "mcp" subprotocol -> refused
        async with ws_connect(uri, subprotocols=["mcp"]) as ws:
            assert ws.subprotocol == "mcp"

            async def ask(msg: dict) -> dict:
                await ws.send(orjson.dumps(msg).decode())
                return orjson.loads(await asyncio.wait_for(ws.recv(), 10))

            await ws.send("{oops")
            assert orjson.loads(await ws.recv())["error"]["code"] == -32700
            assert (await ask(rpc("tools/list")))["error"]["code"] == -32600  # no initialize yet
            init_res = await ask(rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}}))
            assert init_res["result"]["protocolVersion"] == "2025-11-25"
            out = await ask(rpc("tools/call", {"name": "t_echo", "arguments": {"text": "ws"}}, rid=2))
            assert out["result"]["content"][0]["text"] == "local:ws"
            body, _ = modern("tools/list", rid=3)
            assert (await ask(body))["result"]["resultType"] == "complete"
            # a server->client request travels as a frame; the answer frame completes the tool
            await ws.send(orjson.dumps(rpc("tools/call", {"name": "t_ask", "arguments": {}}, rid=4)).decode())
            req = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
            assert req["method"] == "sampling/createMessage"
            done = await ask({"jsonrpc": "2.0", "id": req["id"], "result": {
                "role": "assistant", "content": {"type": "text", "text": "W"}, "model": "m"}})
            assert done["id"] == 4 and done["result"]["content"][0]["text"] == "got W"

    try:
        asyncio.run(scenario())
    finally:
        stop(proc)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary to stop/start")
def test_authentication_while_redis_is_down(tmp_path: Path) -> None:
    """Runtime admin keys and failed-attempt counts live in Redis: with Redis away an admin key
    the config does not hold is 503 + Retry-After (it may be a runtime key), and failed attempts
    are counted by the replica itself: guessing is refused (429) past the count as with Redis,
    only for the guesser's address, and nothing is a crash."""
    admin_key, workdir = "root-admin-key-0123456789", tempfile.mkdtemp(prefix="lm-gw-redis-")
    rport = free_port()
    rproc = _redis(rport, workdir)
    try:
        with logged_gateway(f"redis://127.0.0.1:{rport}/0", tmp_path / "gateway.log", api_keys="alice:alice-key-123",
                            overrides={"gateway": {"admin_keys": {"root": {"key": admin_key, "role": "admin"}},
                                                   "auth_throttle": {"failures_per_source": 3}}}) as gw:
            rproc.terminate()
            rproc.wait(10)
            unknown = httpx.get(gw.base + "/admin/config", headers={"authorization": "Bearer lmadm_not-a-key"},
                                timeout=15)
            assert unknown.status_code == 503 and unknown.headers["retry-after"] == "2", unknown.text
            assert "Traceback" not in unknown.text and unknown.json()["detail"]
            body, h = modern("tools/list")

            def mcp(source: str, key: str) -> httpx.Response:
                with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=15) as http:
                    return http.post(gw.base + "/mcp", json=body, headers={**h, "authorization": f"Bearer {key}"})

            codes = [mcp("127.0.0.2", f"wrong-key-00{i}").status_code for i in range(5)]
            assert codes == [401, 401, 429, 429, 429], codes
            assert mcp("127.0.0.2", "alice-key-123").status_code == 429  # a right guess does not show
            assert mcp("127.0.0.3", "alice-key-123").status_code == 200  # other addresses are served
            assert mcp("127.0.0.3", "wrong-key-009").status_code == 401
            text = gw.log.read_text(errors="replace")
            assert "Traceback" not in text
            assert sum("counted by this replica alone" in row for row in text.splitlines()) == 1, text
    finally:
        rproc.terminate()
        rproc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
