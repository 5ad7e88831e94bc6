"""Helpers for the proxy tests (their fixtures: tests/proxy_front_fixtures.py): a real upstream (a second learnmesh gateway process, which
serves both revisions) and a front gateway (in a thread, so ``caplog`` sees its log lines)
whose ``proxy`` section points at it, plus small MCP clients for both revisions."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from gateway.app import create_app
from shared import keys
from shared.config import RedisConfig
from shared.redis_client import SyncRedis, close_sync, sync_client
from tests.admin_support import ADMIN_KEY, MCP_KEY, LiveServer, admin_config
from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import start_gateway, stop

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
ACCEPT = "application/json, text/event-stream"
UPSTREAM_SECRET = "upstream-secret-token-5f1c2a"
TOKEN_ENV = "LM_TEST_UPSTREAM_TOKEN"
BOB_KEY = "mcp-bob-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


_UPSTREAM_REDIS: dict[str, str] = {}


def upstream_db(upstream_url: str) -> str:
    """The URL of the upstream gateway's own Redis."""
    return _UPSTREAM_REDIS[upstream_url]


@contextmanager
def front_store(target: RedisTarget, **options: Any) -> Iterator[SyncRedis]:
    """A client of the front gateways' Redis (single server or cluster)."""
    client = target.sync_client(**options)
    try:
        yield client
    finally:
        close_sync(client)


@contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of its own: an upstream sharing the front's server would share its pub/sub
    control channel too, and reach the front's clients around the proxy."""
    import redis as redis_sync

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="lm-upstream-redis-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis_sync.Redis.from_url(url) as client:
            wait_for_sync(lambda: _answers(client), timeout_s=10, what="the upstream's redis-server")
        yield url
    finally:
        stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _answers(client: Any) -> bool:
    import redis as redis_sync

    try:
        return bool(client.ping())
    except redis_sync.ConnectionError:
        return False


@contextmanager
def upstream_gateway(fixtures: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A learnmesh gateway as the upstream, on its own Redis; its one principal ``proxy`` holds
    UPSTREAM_SECRET. ``fixtures="conformance"`` adds the conformance suite's fixtures."""
    with private_redis() as db:
        port = free_port()
        overrides = {"gateway": {"fixtures": fixtures}} if fixtures else None
        proc = start_gateway(port, db, api_keys=f"proxy:{UPSTREAM_SECRET}", overrides=overrides)
        url = f"http://127.0.0.1:{port}/mcp"
        _UPSTREAM_REDIS[url] = db
        try:
            yield url, proc
        finally:
            stop(proc)
            _UPSTREAM_REDIS.pop(url, None)


def upstream_entry(url: str, **fields: Any) -> dict[str, Any]:
    return {"name": "up", "url": url, "headers_from_env": {"Authorization": TOKEN_ENV}, "timeout_s": 10.0, **fields}


@contextmanager
def front_gateway(redis_url: str, proxy: dict[str, Any], api_keys: dict[str, str] | None = None,
                  **sections: Any) -> Iterator[str]:
    """A gateway whose ``proxy`` section is ``proxy``; principals alice (MCP_KEY) and bob (BOB_KEY),
    or ``api_keys`` ({}: an open loopback gateway, every caller ``local``)."""
    keys = {"alice": MCP_KEY, "bob": BOB_KEY} if api_keys is None else api_keys
    gateway = {"api_keys": keys, **sections.pop("gateway", {})}
    cfg = admin_config(redis_url, gateway=gateway, proxy=proxy, **sections)
    with LiveServer(create_app(cfg)) as server:
        yield server.url


class Client:
    """A minimal MCP client of one revision over Streamable HTTP (JSON or SSE answers)."""

    def __init__(self, base: str, key: str, revision: str) -> None:
        self.url = base + "/mcp"
        self.auth = {"authorization": f"Bearer {key}", "accept": ACCEPT}
        self.revision = revision
        self.sid: str | None = None
        self.ids = iter(range(1, 1_000_000))

    def open(self) -> Client:
        if self.revision == LEGACY:
            r = httpx.post(self.url, headers=self.auth, json={
                "jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": LEGACY, "capabilities": {"sampling": {}},
                           "clientInfo": {"name": "t", "version": "1"}}})
            assert r.status_code == 200, r.text
            self.sid = r.headers["mcp-session-id"]
        return self

    def notify(self, method: str, params: dict[str, Any]) -> httpx.Response:
        """A notification on the legacy session."""
        headers = {**self.auth, "mcp-session-id": self.sid or "", "mcp-protocol-version": LEGACY}
        return httpx.post(self.url, headers=headers, json={"jsonrpc": "2.0", "method": method, "params": params})

    def post(self, method: str, params: dict[str, Any] | None = None, caps: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        """``headers``: more request headers (SEP-2243 ``Mcp-Param-*``)."""
        p = dict(params or {})
        headers = {**self.auth, **(headers or {})}
        if self.revision == MODERN:
            p["_meta"] = {**p.get("_meta", {}), "io.modelcontextprotocol/protocolVersion": MODERN,
                          "io.modelcontextprotocol/clientCapabilities": caps or {}}
            headers.update({"mcp-protocol-version": MODERN, "mcp-method": method})
            name = p.get("uri") if method == "resources/read" else p.get("name")
            if method in ("tools/call", "prompts/get", "resources/read"):
                headers["mcp-name"] = name
            elif method.startswith("tasks/"):
                headers["mcp-name"] = p.get("taskId")
        else:
            headers.update({"mcp-session-id": self.sid or "", "mcp-protocol-version": LEGACY})
        return httpx.post(self.url, headers=headers, timeout=30,
                          json={"jsonrpc": "2.0", "id": next(self.ids), "method": method, "params": p})

    def messages(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> list[dict[str, Any]]:
        r = self.post(method, params, **kw)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            return [orjson.loads(line[5:]) for line in r.text.splitlines()
                    if line.startswith("data:") and line[5:].strip()]
        return [r.json()]

    def call(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        """The final answer (result or error object as a dict with ``result`` or ``error``)."""
        return self.messages(method, params, **kw)[-1]

    def result(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        answer = self.call(method, params, **kw)
        assert "result" in answer, answer
        return answer["result"]

    def names(self, kind: str = "tools") -> list[str]:
        method = {"tools": "tools/list", "prompts": "prompts/list"}[kind]
        return [t["name"] for t in self.result(method)[kind]]


def read_stream(method: str, url: str, headers: dict[str, str], body: Any, seen: list[dict[str, Any]],
                until: str) -> None:
    """Collect the JSON-RPC messages of an SSE response into ``seen`` until one has method
    ``until`` (run in a thread; a stream cut by the gateway stopping just ends the reading)."""
    try:
        with httpx.stream(method, url, json=body, headers=headers, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:") and line[5:].strip():
                    seen.append(orjson.loads(line[5:]))
                    if seen[-1].get("method") == until:
                        return
    except httpx.HTTPError:
        return


@dataclass
class Stream:
    """An SSE stream read in a thread: ``opened`` once the gateway answered with its headers."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    opened: threading.Event = field(default_factory=threading.Event)

    def methods(self) -> list[str]:
        return [m.get("method", "") for m in list(self.seen)]

    def read(self, method: str, url: str, headers: dict[str, str], body: Any) -> None:
        try:
            with httpx.stream(method, url, json=body, headers=headers, timeout=60) as resp:
                self.opened.set()
                for line in resp.iter_lines():
                    if line.startswith("data:") and line[5:].strip():
                        self.seen.append(orjson.loads(line[5:]))
        except httpx.HTTPError:
            return


def open_stream(stream: Stream, method: str, url: str, headers: dict[str, str], body: Any = None) -> Stream:
    threading.Thread(target=stream.read, args=(method, url, headers, body), daemon=True).start()
    wait_for_sync(stream.opened.is_set, timeout_s=10, what="the stream to open")
    return stream


def get_stream(client: Client, last_event_id: str | None = None) -> Stream:
    """The legacy session's GET stream (resuming after ``last_event_id``)."""
    headers = {**client.auth, "mcp-session-id": client.sid or "", "mcp-protocol-version": LEGACY}
    if last_event_id is not None:
        headers["last-event-id"] = last_event_id
    return open_stream(Stream(), "GET", client.url, headers)


def listen_stream(client: Client, notifications: dict[str, Any], request_id: int = 9) -> Stream:
    """A 2026-07-28 ``subscriptions/listen`` stream asking for ``notifications``, once acknowledged."""
    body = {"jsonrpc": "2.0", "id": request_id, "method": "subscriptions/listen",
            "params": {"notifications": notifications,
                       "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}
    headers = {**client.auth, "mcp-protocol-version": MODERN, "mcp-method": "subscriptions/listen"}
    stream = open_stream(Stream(), "POST", client.url, headers, body)
    wait_for_sync(lambda: stream.seen, timeout_s=10, what="the listen stream's acknowledgement")
    return stream


def publish_control(redis_url: str, message: dict[str, Any]) -> None:
    """A control message as another replica publishes it (single server or cluster)."""
    client = sync_client(RedisConfig(url=redis_url))
    try:
        client.publish(keys.GATEWAY_CONTROL_CHANNEL, orjson.dumps(message))
    finally:
        close_sync(client)
