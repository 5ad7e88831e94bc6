"""The dashboard in a real headless Chromium (Debian's ``chromium``), driven over the
DevTools protocol: the page asks for a key, loads with an admin key, and its numbers
move while MCP load and trainer reports run, on a single Redis and on a Redis Cluster. A
screenshot is written to bench/out/."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from shared import control, keys
from shared.net import free_port
from shared.redis_client import close_sync
from tests.admin_support import ADMIN_KEY, MCP_KEY, bearer, live_gateway
from tests.conftest import RedisTarget, wait_for_sync

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("LEARNMESH_REQUIRE_BROWSER"),
                                reason="Debian chromium not installed (apt-get install -y chromium)")
SHOT_DIR = Path(__file__).resolve().parent.parent / "bench" / "out"


class Browser:
    """Just enough of the DevTools protocol: evaluate JavaScript, navigate, screenshot."""

    def __init__(self) -> None:
        assert CHROMIUM, "Debian chromium is required: apt-get install -y chromium"
        self.profile = tempfile.mkdtemp(prefix="lm-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        wait_for_sync(lambda: port_file.exists() and port_file.read_text().strip() or self.proc.poll() is not None,
                      timeout_s=30, what="chromium to start")
        assert self.proc.poll() is None, "chromium exited at start"
        port = int(port_file.read_text().split()[0])
        pages = wait_for_sync(lambda: [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json()
                                       if t["type"] == "page"], what="a page target")
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self.ids = itertools.count(1)

    def call(self, method: str, **params):
        mid = next(self.ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        deadline = time.monotonic() + 30
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"page error: {res['exceptionDetails']}")
        return res["result"].get("value")

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            shutil.rmtree(self.profile, ignore_errors=True)


def _mcp_load(url: str, stop: threading.Event) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}}}
    headers = {**bearer(MCP_KEY), "Mcp-Method": "tools/list", "MCP-Protocol-Version": "2026-07-28",
               "Accept": "application/json, text/event-stream"}
    append = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "context_append", "arguments": {"context_id": "chat-1", "modality": "text", "text": "hello"},
        "_meta": body["params"]["_meta"]}}
    with httpx.Client(base_url=url, timeout=10) as client:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 10 == 1:
                client.post("/mcp", json=append, headers={**headers, "Mcp-Method": "tools/call",
                                                          "Mcp-Name": "context_append"})
            else:
                client.post("/mcp", json=body, headers=headers)
            stop.wait(0.01)


async def _legacy_session(target: RedisTarget, principal: str) -> None:
    from gateway.mcp.sessions import SessionRegistry
    from shared.config import GatewayConfig
    r = target.async_client()
    try:
        await SessionRegistry(r, r, GatewayConfig()).create(principal, "2025-11-25", {})
    finally:
        await r.aclose()


def _trainer_reports(target: RedisTarget, stop: threading.Event) -> None:
    r = target.sync_client()
    step = 0
    try:
        while not stop.is_set():
            step += 1
            r.hset(keys.TRAINER_STATUS, mapping={"step": step, "loss": 3.0 / (1 + 0.1 * step),
                                                 "samples_per_s": 40 + step % 7, "updated_ms": control.now_ms()})
            control.report_status(r, "delta", compression_ratio=100 + step % 30, sync_latency_ms=20 + step % 9)
            control.report_status(r, "worker:w1", version=step, load=step % 3)
            r.set(keys.MODEL_VERSION, step + 1)
            stop.wait(0.2)
    finally:
        close_sync(r)


def _polls(b: Browser) -> int:
    try:  # the page may be between documents while reloading
        return int(b.js("Number(document.body?.dataset.polls || 0)") or 0)
    except AssertionError:
        return 0


def _text(b: Browser, element_id: str) -> str:
    return b.js(f"document.getElementById({element_id!r}).textContent")


def test_dashboard_live_in_headless_chromium(redis_target: RedisTarget) -> None:
    stop = threading.Event()
    with live_gateway(redis_target.url) as srv:
        browser = Browser()
        threads = [threading.Thread(target=_mcp_load, args=(srv.url, stop), daemon=True),
                   threading.Thread(target=_trainer_reports, args=(redis_target, stop), daemon=True)]
        try:
            browser.call("Page.enable")
            browser.call("Page.navigate", url=f"{srv.url}/admin/ui?poll=250")
            # without a key the page asks for one and shows no data
            wait_for_sync(lambda: browser.js("!!document.getElementById('login')?.open"), what="the key dialog")
            assert _text(browser, "rps") == "–"
            # a wrong key is refused
            browser.js("document.getElementById('key').value = 'wrong-key-123456';"
                       "document.getElementById('login-form').requestSubmit()")
            wait_for_sync(lambda: "not accepted" in _text(browser, "login-error"), what="the refusal")
            browser.js(f"document.getElementById('key').value = {ADMIN_KEY!r};"
                       "document.getElementById('login-form').requestSubmit()")
            wait_for_sync(lambda: int(browser.js("document.body.dataset.polls")) >= 1, what="a first poll")
            assert _text(browser, "who") == "root (admin)"
            assert _text(browser, "conn") == "live"

            for t in threads:
                t.start()
            asyncio.run(_legacy_session(redis_target, "alice"))
            first = {k: _text(browser, k) for k in ("requests-total", "loss", "step", "version")}
            wait_for_sync(lambda: all(_text(browser, k) != v for k, v in first.items()), timeout_s=30,
                          what="live numbers to change under load")
            wait_for_sync(lambda: _text(browser, "rps") not in ("–", "0"), timeout_s=30, what="a throughput figure")
            wait_for_sync(lambda: _text(browser, "ratio") != "–" and _text(browser, "sync") != "–",
                          what="delta figures")
            rows = browser.js("[...document.querySelectorAll('#workers tbody tr')].map(r => r.cells[0].textContent)")
            assert rows == ["w1"]
            # a report from a worker this replica does not reach: not serving here
            assert browser.js("document.querySelector('#workers tbody tr').cells[4].textContent") == "down"
            ctx_row = "[...document.querySelectorAll('#contexts tbody tr')].map(r => r.cells[1].textContent)"
            wait_for_sync(lambda: browser.js(ctx_row) == ["chat-1"], what="the context table")
            wait_for_sync(lambda: browser.js("document.querySelector('#sessions tbody tr').cells[1].textContent")
                          == "alice", what="the session table")
            # the charts drew something: non-background pixels in the throughput canvas
            painted = browser.js("""(() => { const c = document.getElementById('chart-rps');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] + d[i+1] + d[i+2] > 200) n++;
                return n; })()""")
            assert painted > 50
            wait_for_sync(lambda: _polls(browser) >= 12, what="some chart history")
            shot = browser.call("Page.captureScreenshot", format="png")["data"]
            png = base64.b64decode(shot)
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
            SHOT_DIR.mkdir(parents=True, exist_ok=True)
            (SHOT_DIR / "dashboard.png").write_bytes(png)
            # the key survives a reload (local storage)
            browser.call("Page.reload")
            wait_for_sync(lambda: _polls(browser) >= 2, what="polling after reload")
            assert not browser.js("document.getElementById('login').open")
        finally:
            stop.set()
            for t in threads:
                if t.is_alive() or t.ident is not None:
                    t.join(10)
            browser.close()


def test_dashboard_shows_each_upstreams_breakers_over_the_replicas(redis_target: RedisTarget) -> None:
    proxy = {"upstreams": [{"name": "weather", "url": f"http://127.0.0.1:{free_port()}/mcp"}]}
    cell = "document.querySelector('#upstreams tbody tr')?.cells[2]?.textContent"
    with live_gateway(redis_target.url, proxy=proxy) as srv:
        browser, r = Browser(), redis_target.sync_client()
        try:
            browser.call("Page.enable")
            browser.call("Page.navigate", url=f"{srv.url}/admin/ui?poll=250")
            wait_for_sync(lambda: browser.js("!!document.getElementById('login')?.open"), what="the key dialog")
            browser.js(f"document.getElementById('key').value = {ADMIN_KEY!r};"
                       "document.getElementById('login-form').requestSubmit()")
            wait_for_sync(lambda: browser.js(cell) == "closed on 1 replica", what="this replica's closed breaker")

            def another_replica_reports_it_open() -> bool:  # as a replica that could not reach it publishes
                now = control.now_ms()
                r.hset(keys.PROXY_BREAKERS, "replica-b", json.dumps({"ts_ms": now, "upstreams": {"weather": {
                    "state": "open", "consecutive_failures": 5, "opened_ms": now, "retry_at_ms": now + 30_000,
                    "calls": 7, "errors": 5}}}))
                return browser.js(cell) == "open on 1 of 2 replicas"

            wait_for_sync(another_replica_reports_it_open, interval_s=0.2, what="the mesh-wide breaker on the page")
            row = browser.js("[...document.querySelector('#upstreams tbody tr').cells].map(c => c.textContent)")
            assert row == ["weather", "unknown", "open on 1 of 2 replicas", "7", "5"]
        finally:
            close_sync(r)
            browser.close()
