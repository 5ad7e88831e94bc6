"""Helpers for the proxy tests (their fixtures: tests/proxy_front_fixtures.py): a real upstream (a second learnmesh gateway process, which
serves both revisions) and a front gateway (in a thread, so ``caplog`` sees its log lines)
whose ``proxy`` section points at it, plus small MCP clients for both revisions."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson

from gateway.app import create_app
from tests.admin_support import ADMIN_KEY, MCP_KEY, LiveServer, admin_config
from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
ACCEPT = "application/json, text/event-stream"
UPSTREAM_SECRET = "upstream-secret-token-5f1c2a"
TOKEN_ENV = "LM_TEST_UPSTREAM_TOKEN"
BOB_KEY = "mcp-bob-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def upstream_db(redis_url: str) -> str:
    """The upstream gateway's own database on the test Redis (its keys stay apart from the front's)."""
    return redis_url.rsplit("/", 1)[0] + "/1"


@contextmanager
def upstream_gateway(redis_url: str, fixtures: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A learnmesh gateway as the upstream; its one principal ``proxy`` holds UPSTREAM_SECRET.
    ``fixtures="conformance"`` adds the conformance suite's fixture tools, resources and prompts."""
    import redis as redis_sync

    db = upstream_db(redis_url)
    with redis_sync.Redis.from_url(db) as client:
        client.flushdb()
    port = free_port()
    overrides = {"gateway": {"fixtures": fixtures}} if fixtures else None
    proc = start_gateway(port, db, api_keys=f"proxy:{UPSTREAM_SECRET}", overrides=overrides)
    try:
        yield f"http://127.0.0.1:{port}/mcp", proc
    finally:
        stop(proc)


def upstream_entry(url: str, **fields: Any) -> dict[str, Any]:
    return {"name": "up", "url": url, "headers_from_env": {"Authorization": TOKEN_ENV}, "timeout_s": 10.0, **fields}


@contextmanager
def front_gateway(redis_url: str, proxy: dict[str, Any], **sections: Any) -> Iterator[str]:
    """A gateway whose ``proxy`` section is ``proxy``; principals alice (MCP_KEY) and bob (BOB_KEY)."""
    cfg = admin_config(redis_url, gateway={"api_keys": {"alice": MCP_KEY, "bob": BOB_KEY}}, proxy=proxy,
                       **sections)
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
             ) -> httpx.Response:
        p = dict(params or {})
        headers = dict(self.auth)
        if self.revision == MODERN:
            p["_meta"] = {**p.get("_meta", {}), "io.modelcontextprotocol/protocolVersion": MODERN,
                          "io.modelcontextprotocol/clientCapabilities": caps or {}}
            headers.update({"mcp-protocol-version": MODERN, "mcp-method": method})
            name = p.get("uri") if method == "resources/read" else p.get("name")
            if method in ("tools/call", "prompts/get", "resources/read"):
                headers["mcp-name"] = name
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
