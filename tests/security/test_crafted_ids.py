"""Crafted session and task ids: a client-chosen id becomes part of a Redis key, so one shaped
like ``<real id>:events`` named another key (WRONGTYPE, answered as a store outage). Ids are
checked for form first: a malformed one is simply not found, and Redis never sees it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis as redis_sync

from gateway.mcp.sessions import is_session_id, new_session_id
from shared import keys
from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

ACCEPT = "application/json, text/event-stream"
LEGACY = "2025-11-25"
MODERN = "2026-07-28"
MARKER = "crafted-id-marker"
TASKS = {"extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.fixture(scope="module")
def mcp(redis_server: str) -> Iterator[str]:
    port = free_port()
    proc = start_gateway(port, redis_server)
    yield f"http://127.0.0.1:{port}/mcp"
    stop(proc)


@pytest.fixture
def commands(redis_url: str) -> Iterator[redis_sync.Redis]:
    """Redis with every command recorded (SLOWLOG keeps each command's arguments)."""
    client = redis_sync.Redis.from_url(redis_url)
    before = client.config_get("slowlog-*")
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 100_000)
    client.slowlog_reset()
    yield client
    for name, value in before.items():
        client.config_set(name, value)
    client.close()


def mentions(client: redis_sync.Redis, text: str) -> list[list[bytes]]:
    return [entry["command"] for entry in client.slowlog_get(100_000) if text.encode() in entry["command"]]


def legacy(url: str, sid: str, method: str, params: dict | None = None) -> httpx.Response:
    return httpx.post(url, json={"jsonrpc": "2.0", "id": 2, "method": method, "params": params or {}},
                      headers={"accept": ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": LEGACY})


def test_session_id_naming_another_key_is_not_found(mcp: str, commands: redis_sync.Redis) -> None:
    init = httpx.post(mcp, headers={"accept": ACCEPT}, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    sid = init.headers["mcp-session-id"]
    commands.xadd(keys.session_events("local", sid), {"d": b"{}"})  # the session's event stream exists
    r = legacy(mcp, sid + ":events", "ping")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Session not found", r.text
    assert legacy(mcp, sid, "ping").status_code == 200  # the real session is untouched


@pytest.mark.parametrize("crafted", [MARKER, f"{MARKER}:events", "{other}" + MARKER, MARKER * 100])
def test_malformed_session_id_never_reaches_redis(mcp: str, commands: redis_sync.Redis, crafted: str) -> None:
    assert legacy(mcp, crafted, "ping").status_code == 404
    assert httpx.get(mcp, headers={"accept": "text/event-stream", "mcp-session-id": crafted}).status_code == 404
    assert httpx.delete(mcp, headers={"mcp-session-id": crafted}).status_code == 404
    assert mentions(commands, MARKER) == []


@pytest.mark.parametrize("method", ["tasks/get", "tasks/cancel", "tasks/update"])
@pytest.mark.parametrize("crafted", [MARKER, f"{MARKER}:pending", "A" * 21 + ":"])
def test_malformed_task_id_is_not_found_without_redis(mcp: str, commands: redis_sync.Redis, method: str,
                                                      crafted: str) -> None:
    params = {"taskId": crafted, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                            "io.modelcontextprotocol/clientCapabilities": TASKS}}
    if method == "tasks/update":
        params["inputResponses"] = {}
    r = httpx.post(mcp, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                   headers={"accept": ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": method,
                            "mcp-name": crafted})
    error = r.json()["error"]
    assert error["code"] == -32602 and "not found" in error["message"], r.text
    assert mentions(commands, crafted[:12]) == []


def test_session_id_form() -> None:
    assert all(is_session_id(new_session_id()) for _ in range(100))
    for bad in ("", "a" * 42, "a" * 44, "a" * 42 + ":", "a" * 42 + "=", "a" * 42 + "{", "a" * 42 + "\n"):
        assert not is_session_id(bad)
