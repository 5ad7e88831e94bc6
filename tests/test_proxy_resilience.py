"""A dead, slow or crashing upstream gives a clear error naming it, opens its breaker, and
never takes the gateway's own tools or another upstream down with it; a stdio upstream
(official SDK server) is restarted on the next call after it dies."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync

from tests.admin_support import MCP_KEY
from tests.conftest import wait_for_sync
from tests.proxy.harness import start_http_upstream, stop_upstream
from tests.proxy_front import (
    ADMIN,
    LEGACY,
    MODERN,
    TOKEN_ENV,
    UPSTREAM_SECRET,
    Client,
    front_gateway,
    upstream_db,
    upstream_entry,
    upstream_gateway,
)

pytest_plugins = ("tests.proxy_front_fixtures",)

STDIO_SERVER = str(Path(__file__).resolve().parent / "proxy_stdio_server.py")
UPSTREAM_FAILED = -32052


@pytest.fixture
def killable() -> Iterator[tuple[str, Any]]:
    with upstream_gateway() as (url, proc):
        yield url, proc


def _in_background(client: Client, params: dict[str, Any]) -> tuple[threading.Thread, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: out.append(client.call("tools/call", params)))
    thread.start()
    return thread, out


def _started(upstream: str) -> int:
    with redis_sync.Redis.from_url(upstream_db(upstream)) as r:
        return int(r.llen("test:t_sleep:started"))


@pytest.mark.parametrize("revision", [LEGACY, MODERN])
def test_upstream_killed_mid_call_fails_clearly_and_opens_the_breaker(redis_url: str, killable: tuple[str, Any],
                                                                      revision: str) -> None:
    url, proc = killable
    proxy = {"upstreams": [upstream_entry(url, revision=revision)], "breaker": {"failures": 2, "reset_s": 300.0}}
    with front_gateway(redis_url, proxy) as base:
        client = Client(base, MCP_KEY, revision).open()
        thread, out = _in_background(client, {"name": "up.t_sleep", "arguments": {"seconds": 30}})
        wait_for_sync(lambda: _started(url) == 1, timeout_s=15, what="the call in flight on the upstream")
        proc.kill()
        thread.join(20)
        assert not thread.is_alive(), "a call to a killed upstream must end"
        error = out[0]["error"]
        assert error["code"] == UPSTREAM_FAILED and "'up'" in error["message"]
        assert error["data"] == {"upstream": "up", "reason": "unreachable"}
        second = client.call("tools/call", {"name": "up.t_echo", "arguments": {"text": "x"}})["error"]
        assert second["data"]["reason"] == "unreachable"
        third = client.call("tools/call", {"name": "up.t_echo", "arguments": {"text": "x"}})["error"]
        assert third["data"]["reason"] == "breaker_open" and "circuit breaker open" in third["message"]
        own = client.result("tools/call", {"name": "context_append", "arguments": {
            "context_id": "c1", "modality": "text", "text": "still here"}})
        assert own["structuredContent"]["version"] >= 1
        assert "context_append" in client.names()
        metrics = client_get(base + "/metrics")
        assert 'learnmesh_proxy_breaker_state{upstream="up"} 2.0' in metrics
        assert 'learnmesh_proxy_calls_total{method="tools/call",outcome="unreachable",upstream="up"}' in metrics


def client_get(url: str) -> str:
    return httpx.get(url, timeout=10).text


def test_slow_upstream_times_out_and_blocks_nothing_else(redis_url: str, killable: tuple[str, Any]) -> None:
    url, _ = killable
    proxy = {"upstreams": [upstream_entry(url, timeout_s=2.0),
                           upstream_entry(url, name="other", namespace="other")]}
    with front_gateway(redis_url, proxy) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        assert "other.t_echo" in client.names()
        thread, out = _in_background(client, {"name": "up.t_sleep", "arguments": {"seconds": 20}})
        wait_for_sync(lambda: _started(url) == 1, timeout_s=15, what="the slow call in flight")
        other = client.result("tools/call", {"name": "other.t_echo", "arguments": {"text": "fast"}})
        own = client.result("tools/call", {"name": "context_append", "arguments": {
            "context_id": "c1", "modality": "text", "text": "x"}})
        assert thread.is_alive(), "the other upstream and the gateway's own tool answered while the slow call waited"
        assert other["content"][0]["text"] == "proxy:fast" and not own.get("isError")
        thread.join(20)
        error = out[0]["error"]
        assert error["code"] == UPSTREAM_FAILED and error["data"] == {"upstream": "up", "reason": "timeout"}
        assert "did not answer tools/call within 2 s" in error["message"]


def test_stdio_upstream_serves_dies_and_comes_back(redis_url: str) -> None:
    proxy = {"upstreams": [{"name": "local", "command": [sys.executable, STDIO_SERVER], "timeout_s": 20.0,
                            "capture": {"tools": ["image"]}}]}
    with front_gateway(redis_url, proxy) as base:
        for revision in (LEGACY, MODERN):
            client = Client(base, MCP_KEY, revision).open()
            assert {"local.echo", "local.image", "context_append"} <= set(client.names())
            out = client.result("tools/call", {"name": "local.echo", "arguments": {"text": revision}})
            assert out["content"][0]["text"] == f"stdio:{revision}"
        died = client.call("tools/call", {"name": "local.exit_now", "arguments": {}})["error"]
        assert died["code"] == UPSTREAM_FAILED and died["data"] == {"upstream": "local", "reason": "unreachable"}
        back = client.result("tools/call", {"name": "local.echo", "arguments": {"text": "again"}})
        assert back["content"][0]["text"] == "stdio:again"
        image = client.result("tools/call", {"name": "local.image", "arguments": {},
                                             "_meta": {"io.learnmesh/context": "shots"}})
        assert image["content"][0]["type"] == "image"
        window = client.result("tools/call", {"name": "context_get", "arguments": {"context_id": "shots"}})
        entries = window["structuredContent"]["entries"]
        assert [e["modality"] for e in entries] == ["text", "image"]
        assert entries[1]["mimeType"] == "image/png" and entries[1]["role"] == "assistant"


def test_client_cancellation_reaches_the_upstream(redis_url: str, killable: tuple[str, Any]) -> None:
    url, _ = killable
    with front_gateway(redis_url, {"upstreams": [upstream_entry(url, revision=LEGACY)]}) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        statuses: list[int] = []
        params = {"name": "up.t_sleep", "arguments": {"seconds": 60}}
        thread = threading.Thread(target=lambda: statuses.append(client.post("tools/call", params).status_code))
        thread.start()
        wait_for_sync(lambda: _started(url) == 1, timeout_s=15, what="the call in flight on the upstream")
        cancelled = client.notify("notifications/cancelled", {"requestId": 1, "reason": "changed my mind"})
        assert cancelled.status_code == 202
        with redis_sync.Redis.from_url(upstream_db(url)) as r:
            wait_for_sync(lambda: r.llen("test:t_sleep:ended") == 1, timeout_s=20,
                          what="the upstream to stop the cancelled call")
        thread.join(20)
        assert statuses == [202]  # a cancelled request gets no answer


@pytest.mark.parametrize(("upstream_revision", "cancel_on"), [(LEGACY, "same"), (MODERN, "other")])
def test_a_modern_clients_cancellation_reaches_the_upstream(redis_url: str, killable: tuple[str, Any],
                                                            upstream_revision: str, cancel_on: str) -> None:
    """A 2026-07-28 client has no session: its notifications/cancelled names the request's id, and
    may reach any replica (a load balancer's choice)."""
    url, _ = killable
    proxy = {"upstreams": [upstream_entry(url, revision=upstream_revision, timeout_s=120.0)]}
    with front_gateway(redis_url, proxy) as base, front_gateway(redis_url, proxy) as other:
        client = Client(base, MCP_KEY, MODERN)
        statuses: list[int] = []
        params = {"name": "up.t_sleep", "arguments": {"seconds": 60}}
        thread = threading.Thread(target=lambda: statuses.append(client.post("tools/call", params).status_code))
        thread.start()
        wait_for_sync(lambda: _started(url) == 1, timeout_s=15, what="the call in flight on the upstream")
        target = base if cancel_on == "same" else other
        cancelled = httpx.post(target + "/mcp", headers={**client.auth, "mcp-protocol-version": MODERN,
                                                         "mcp-method": "notifications/cancelled"},
                               json={"jsonrpc": "2.0", "method": "notifications/cancelled",
                                     "params": {"requestId": 1, "_meta": {
                                         "io.modelcontextprotocol/protocolVersion": MODERN}}})
        assert cancelled.status_code == 202
        with redis_sync.Redis.from_url(upstream_db(url)) as r:
            wait_for_sync(lambda: r.llen("test:t_sleep:ended") == 1, timeout_s=20,
                          what="the upstream to stop the cancelled call")
        thread.join(20)
        assert statuses == [202]  # a cancelled request gets no answer


def test_stdio_upstream_gets_only_the_environment_it_is_given(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_TEST_STDIO_TOKEN", "stdio-token")
    monkeypatch.setenv("LM_TEST_GATEWAY_ONLY_SECRET", "not-for-upstreams")
    proxy = {"upstreams": [{"name": "local", "command": [sys.executable, STDIO_SERVER],
                            "headers_from_env": {"Authorization": "LM_TEST_STDIO_TOKEN"}}]}
    with front_gateway(redis_url, proxy) as base:
        client = Client(base, MCP_KEY, LEGACY).open()

        def has(name: str) -> str:
            return client.result("tools/call", {"name": "local.has_env", "arguments": {"name": name}})["content"][0]["text"]

        assert has("LM_TEST_STDIO_TOKEN") == "yes" and has("PATH") == "yes"
        assert has("LM_TEST_GATEWAY_ONLY_SECRET") == "no"


def test_a_stdio_upstream_showing_its_credential_does_not_pass_it_on(redis_url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_TEST_STDIO_TOKEN", "stdio-token-7e6d5c4b")
    proxy = {"upstreams": [{"name": "local", "command": [sys.executable, STDIO_SERVER],
                            "headers_from_env": {"Authorization": "LM_TEST_STDIO_TOKEN"}}]}
    with front_gateway(redis_url, proxy) as base:
        for revision in (LEGACY, MODERN):
            shown = Client(base, MCP_KEY, revision).open().result(
                "tools/call", {"name": "local.show_env", "arguments": {"name": "LM_TEST_STDIO_TOKEN"}})
            assert shown["content"][0]["text"] == "LM_TEST_STDIO_TOKEN=[redacted]"
            assert "stdio-token-7e6d5c4b" not in orjson.dumps(shown).decode()



@pytest.fixture(params=["learnmesh", "sdk"])
def guarded_upstream(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An upstream that demands a bearer token: a learnmesh gateway (its 401 carries an OAuth
    error body) or an official-SDK server (its 401 carries a JSON-RPC error)."""
    if request.param == "learnmesh":
        yield request.getfixturevalue("upstream")
        return
    up = start_http_upstream("sdk", "both", tmp_path, token=UPSTREAM_SECRET)
    try:
        assert up.url is not None
        yield up.url
    finally:
        stop_upstream(up)


@pytest.mark.parametrize("revision", [LEGACY, MODERN, "auto"])
def test_upstream_refusing_the_gateways_credential_is_an_upstream_failure(
        redis_url: str, guarded_upstream: str, revision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream that answers 401 refuses the gateway's own credential, not the client's: the
    client must not take the upstream's "bad token" for a verdict on its key, and the gateway must
    not settle on a revision from an answer that refused it."""
    monkeypatch.setenv(TOKEN_ENV, "Bearer not-the-upstream-secret")
    with front_gateway(redis_url, {"upstreams": [upstream_entry(guarded_upstream, revision=revision)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        error = client.call("tools/call", {"name": "up.t_echo", "arguments": {"text": "x"}})["error"]
        assert error["code"] == UPSTREAM_FAILED and error["data"] == {"upstream": "up", "reason": "unreachable"}
        assert "upstream 'up' refused the gateway's credential" in error["message"]
        assert "HTTP 401" in error["message"] and "headers_from_env" in error["message"]
        health = httpx.get(base + "/admin/upstreams/up/health", headers=ADMIN, timeout=10).json()
        assert health["revision"] == ("unknown" if revision == "auto" else revision)


def test_a_stdio_upstream_that_cannot_start_is_named_in_the_log_not_to_the_client(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The operator reads which command failed and why; the client learns only that the
    upstream is unreachable (a command line may carry what clients must not see)."""
    missing = "/nonexistent/mcp-server"
    proxy = {"upstreams": [{"name": "gone", "command": [missing, "--token", "s3cret"], "timeout_s": 5.0}]}
    with caplog.at_level(logging.WARNING, logger="gateway.proxy"), front_gateway(redis_url, proxy) as base:
        client = Client(base, MCP_KEY, LEGACY).open()
        assert "context_append" in client.names()
        error = client.call("tools/call", {"name": "gone.echo", "arguments": {}})["error"]
    assert error == {"code": UPSTREAM_FAILED, "data": {"upstream": "gone", "reason": "unreachable"},
                     "message": "upstream 'gone' is unreachable (its process could not be started)"}
    assert f"stdio upstream {missing} cannot be started: No such file or directory" in caplog.text
    assert "s3cret" not in caplog.text


@pytest.mark.parametrize("upstream_revision", [LEGACY, MODERN])
def test_a_modern_client_closing_its_call_cancels_it_at_the_upstream(redis_url: str, killable: tuple[str, Any],
                                                                     upstream_revision: str) -> None:
    """On 2026-07-28 a client cancels by closing the connection of its POST: a proxied call is then
    cancelled at the upstream too, as the gateway's own tools are stopped."""
    url, _ = killable
    proxy = {"upstreams": [upstream_entry(url, revision=upstream_revision, timeout_s=120.0)]}
    with front_gateway(redis_url, proxy) as base:
        body = orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
            "name": "up.t_sleep", "arguments": {"seconds": 60},
            "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                      "io.modelcontextprotocol/clientCapabilities": {}}}})
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /mcp HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer %s\r\n"
                         b"accept: application/json, text/event-stream\r\ncontent-type: application/json\r\n"
                         b"mcp-protocol-version: %s\r\nmcp-method: tools/call\r\nmcp-name: up.t_sleep\r\n"
                         b"content-length: %d\r\n\r\n%s" % (host.encode(), MCP_KEY.encode(), MODERN.encode(),
                                                            len(body), body))
            wait_for_sync(lambda: _started(url) == 1, timeout_s=15, what="the call in flight on the upstream")
        with redis_sync.Redis.from_url(upstream_db(url)) as r:
            wait_for_sync(lambda: r.llen("test:t_sleep:ended") == 1, timeout_s=20,
                          what="the upstream to stop the call its client closed")
