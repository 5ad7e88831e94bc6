"""Crafted session and task ids: a client-chosen id becomes part of a Redis key, so one shaped
like ``<real id>:events`` named another key (WRONGTYPE, answered as a store outage). Ids are
checked for form first: a malformed one is simply not found, and Redis (every master of a
cluster) never sees it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis as redis_sync

from gateway.mcp.sessions import is_session_id, new_session_id
from shared import keys
from shared.redis_client import SyncRedis, close_sync, for_each_primary_sync
from tests.conftest import RedisTarget, free_port
from tests.gateway_support import start_gateway, stop

ACCEPT = "application/json, text/event-stream"
LEGACY = "2025-11-25"
MODERN = "2026-07-28"
MARKER = "crafted-id-marker"
TASKS = {"extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.fixture(scope="module")
def mcp(redis_target_module: RedisTarget) -> Iterator[str]:
    port = free_port()
    proc = start_gateway(port, redis_target_module.url)
    yield f"http://127.0.0.1:{port}/mcp"
    stop(proc)


@dataclass
class Recorded:
    """Redis with every command recorded on every master (SLOWLOG keeps each command's
    arguments); ``client`` routes commands as the gateway's does."""

    client: SyncRedis
    masters: list[redis_sync.Redis]


@pytest.fixture
def commands(redis_target_module: RedisTarget) -> Iterator[Recorded]:
    redis_target_module.flush()
    client = redis_target_module.sync_client()
    masters = for_each_primary_sync(client, lambda node: node)
    before = [node.config_get("slowlog-*") for node in masters]
    for node in masters:
        node.config_set("slowlog-log-slower-than", 0)
        node.config_set("slowlog-max-len", 100_000)
        node.slowlog_reset()
    yield Recorded(client, masters)
    for node, settings in zip(masters, before, strict=True):
        for name, value in settings.items():
            node.config_set(name, value)
    close_sync(client)


def mentions(recorded: Recorded, text: str) -> list[list[bytes]]:
    return [entry["command"] for node in recorded.masters for entry in node.slowlog_get(100_000)
            if text.encode() in entry["command"]]


def legacy(url: str, sid: str, method: str, params: dict | None = None) -> httpx.Response:
    return httpx.post(url, json={"jsonrpc": "2.0", "id": 2, "method": method, "params": params or {}},
                      headers={"accept": ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": LEGACY})


def test_session_id_naming_another_key_is_not_found(mcp: str, commands: Recorded) -> None:
    init = httpx.post(mcp, headers={"accept": ACCEPT}, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    sid = init.headers["mcp-session-id"]
    commands.client.xadd(keys.session_events("local", sid), {"d": b"{}"})  # the session's event stream exists
    r = legacy(mcp, sid + ":events", "ping")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Session not found", r.text
    assert legacy(mcp, sid, "ping").status_code == 200  # the real session is untouched


@pytest.mark.parametrize("crafted", [MARKER, f"{MARKER}:events", "{other}" + MARKER, MARKER * 100])
def test_malformed_session_id_never_reaches_redis(mcp: str, commands: Recorded, crafted: str) -> None:
    assert legacy(mcp, crafted, "ping").status_code == 404
    assert httpx.get(mcp, headers={"accept": "text/event-stream", "mcp-session-id": crafted}).status_code == 404
    assert httpx.delete(mcp, headers={"mcp-session-id": crafted}).status_code == 404
    assert mentions(commands, MARKER) == []


@pytest.mark.parametrize("method", ["tasks/get", "tasks/cancel", "tasks/update"])
@pytest.mark.parametrize("crafted", [MARKER, f"{MARKER}:pending", "A" * 21 + ":"])
def test_malformed_task_id_is_not_found_without_redis(mcp: str, commands: Recorded, method: str,
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
