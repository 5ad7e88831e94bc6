"""A stdio upstream (official SDK server, real subprocesses) runs one process per principal on a
replica: each principal's calls reach its own process and session, a resource update from one
principal's process reaches that principal only, at most ``stdio_max_processes`` run (the least
recently used idle one makes room; when all are busy the call is refused with 503 and
Retry-After), an idle process is stopped, and neither disabling the upstream nor stopping the
gateway leaves a process behind."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.proxy.names import wrap_uri
from tests.admin_support import MCP_KEY
from tests.conftest import wait_for_sync
from tests.proxy_front import ADMIN, BOB_KEY, LEGACY, MODERN, Client, front_gateway, read_stream

STDIO_SERVER = str(Path(__file__).resolve().parent / "proxy_stdio_server.py")
CAROL_KEY = "mcp-carol-key-0123456789"
KEYS = {"alice": MCP_KEY, "bob": BOB_KEY, "carol": CAROL_KEY}
SERVICE_UNAVAILABLE = -32050
UPDATED = "notifications/resources/updated"


def _local(**fields: Any) -> dict[str, Any]:
    return {"name": "local", "command": [sys.executable, STDIO_SERVER], "timeout_s": 20.0, **fields}


def _pid(client: Client) -> int:
    return int(client.result("tools/call", {"name": "local.pid", "arguments": {}})["content"][0]["text"])


def _exists(pid: int) -> bool:
    """Running, or exited and not reaped yet (a zombie is a process left behind too)."""
    return Path(f"/proc/{pid}").exists()


def _stdio_children() -> set[int]:
    """This test process's children running the stdio server (the gateway runs in a thread here)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and STDIO_SERVER.encode() in cmdline:
            found.add(int(proc.name))
    return found


def _health(base: str) -> dict[str, Any]:
    return httpx.get(base + "/admin/upstreams/local/health", headers=ADMIN, timeout=10).json()


@pytest.mark.parametrize("revision", [LEGACY, MODERN])
def test_each_principal_has_its_own_process_and_shutdown_stops_them_all(redis_url: str, revision: str) -> None:
    with front_gateway(redis_url, {"upstreams": [_local(revision=revision)]}, api_keys=KEYS) as base:
        alice, bob = Client(base, MCP_KEY, LEGACY).open(), Client(base, BOB_KEY, MODERN).open()
        assert {"local.pid", "local.echo"} <= set(alice.names())  # listed through the lists' own process
        a, b = _pid(alice), _pid(bob)
        assert a != b
        assert (_pid(alice), _pid(bob)) == (a, b)
        echo = alice.result("tools/call", {"name": "local.echo", "arguments": {"text": "hi"}})
        assert echo["content"][0]["text"] == "stdio:hi"
        started = _stdio_children()
        assert {a, b} < started and len(started) == 3, started
        assert _health(base)["processes"] == 3
    left = [pid for pid in started if _exists(pid)]
    assert not left, f"stdio processes left after the gateway stopped: {left}"


def _touch_until_seen(client: Client, uri: str, client_uri: str, seen: list[dict[str, Any]]) -> None:
    def updated() -> bool:  # touched again until the subscription is in place and the update came through
        client.result("tools/call", {"name": "local.touch", "arguments": {"uri": uri}})
        return any(m.get("method") == UPDATED and m["params"]["uri"] == client_uri for m in seen)

    wait_for_sync(updated, timeout_s=20, interval_s=0.3, what=f"the update of {uri} at the client")


@pytest.mark.parametrize("revision", [LEGACY, MODERN])
def test_a_resource_update_reaches_only_the_principal_whose_process_sent_it(redis_url: str, revision: str) -> None:
    shared, probe = wrap_uri("local", "note://shared"), wrap_uri("local", "note://probe")
    with front_gateway(redis_url, {"upstreams": [_local(revision=revision)]}, api_keys=KEYS) as base:
        seen: dict[str, list[dict[str, Any]]] = {}
        clients = {"alice": Client(base, MCP_KEY, LEGACY).open(), "bob": Client(base, BOB_KEY, LEGACY).open()}
        for name, client in clients.items():
            for uri in (shared, probe):  # both watch the same resource
                assert client.result("resources/subscribe", {"uri": uri}) == {}
            seen[name] = []
            headers = {**client.auth, "mcp-session-id": client.sid or "", "mcp-protocol-version": LEGACY}
            threading.Thread(target=read_stream, args=("GET", client.url, headers, None, seen[name], "none"),
                             daemon=True).start()
        _touch_until_seen(clients["alice"], "note://shared", shared, seen["alice"])
        # Bob's own process announces another resource: once that reached bob, an update of
        # alice's sent before it would have too, had it been routed to him.
        _touch_until_seen(clients["bob"], "note://probe", probe, seen["bob"])
        assert {m["params"]["uri"] for m in seen["bob"] if m.get("method") == UPDATED} == {probe}
        assert {m["params"]["uri"] for m in seen["alice"] if m.get("method") == UPDATED} == {shared}


def _hold(client: Client, mark: Path, release: Path) -> tuple[threading.Thread, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    params = {"name": "local.hold", "arguments": {"mark": str(mark), "release": str(release)}}
    thread = threading.Thread(target=lambda: out.append(client.call("tools/call", params)))
    thread.start()
    return thread, out


@pytest.mark.parametrize("revision", [LEGACY, MODERN])
def test_concurrent_calls_of_one_principal_each_get_their_own_progress(
        redis_url: str, tmp_path: Path, revision: str) -> None:
    """One principal, one process, two calls in flight: each call's progress comes back on its own
    answer, matched by the progress token it sent (not to whichever call is oldest)."""
    release = tmp_path / "release"
    with front_gateway(redis_url, {"upstreams": [_local(revision=revision)]}, api_keys=KEYS) as base:
        alice = Client(base, MCP_KEY, MODERN)
        answers: dict[str, list[dict[str, Any]]] = {}

        def call(label: str) -> None:
            params = {"name": "local.steps", "_meta": {"progressToken": f"token-{label}"},
                      "arguments": {"label": label, "mark": str(tmp_path / label), "release": str(release)}}
            answers[label] = alice.messages("tools/call", params)

        threads = [threading.Thread(target=call, args=(label,)) for label in ("first", "second")]
        threads[0].start()
        wait_for_sync((tmp_path / "first").exists, timeout_s=20, what="the first call in flight")
        threads[1].start()
        wait_for_sync((tmp_path / "second").exists, timeout_s=20, what="the second call in flight")
        release.touch()
        for thread in threads:
            thread.join(timeout=30)
        for label in ("first", "second"):
            progress = [m["params"] for m in answers[label] if m.get("method") == "notifications/progress"]
            assert [(p["progressToken"], p["progress"], p.get("message")) for p in progress] == \
                [(f"token-{label}", 1, label), (f"token-{label}", 2, label)], answers[label]
            assert answers[label][-1]["result"]["content"][0]["text"] == label


def test_the_cap_stops_the_least_recently_used_idle_process_and_refuses_when_all_are_busy(
        redis_url: str, tmp_path: Path) -> None:
    with front_gateway(redis_url, {"upstreams": [_local(stdio_max_processes=2)]}, api_keys=KEYS) as base:
        alice, bob = Client(base, MCP_KEY, LEGACY).open(), Client(base, BOB_KEY, LEGACY).open()
        carol = Client(base, CAROL_KEY, MODERN).open()
        assert "local.hold" in alice.names()  # the lists' process runs beside the cap
        a, b = _pid(alice), _pid(bob)
        c = _pid(carol)  # a third principal: alice's, the least recently used, makes room
        assert not _exists(a) and _exists(b) and _exists(c)
        release = tmp_path / "release"
        holds = [_hold(bob, tmp_path / "bob", release), _hold(carol, tmp_path / "carol", release)]
        try:
            wait_for_sync(lambda: (tmp_path / "bob").exists() and (tmp_path / "carol").exists(), timeout_s=20,
                          what="bob's and carol's calls in flight on their processes")
            refused = Client(base, MCP_KEY, MODERN).post("tools/call", {"name": "local.pid", "arguments": {}})
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["code"] == SERVICE_UNAVAILABLE and "'local'" in error["message"]
            assert error["data"]["retryAfterS"] == int(refused.headers["retry-after"])
            legacy = alice.call("tools/call", {"name": "local.pid", "arguments": {}})["error"]
            assert legacy["code"] == SERVICE_UNAVAILABLE
            assert _health(base)["breaker"] == "closed"  # the gateway's capacity, not the upstream failing
        finally:
            release.touch()
            for thread, _ in holds:
                thread.join(30)
        assert [out[0]["result"]["content"][0]["text"] for _, out in holds] == ["released", "released"]
        again = _pid(alice)
        assert again not in (a, b, c) and _health(base)["processes"] == 3  # two principals' and the lists'


def test_an_idle_process_is_stopped_and_the_next_call_starts_another(redis_url: str) -> None:
    with front_gateway(redis_url, {"upstreams": [_local(stdio_idle_s=0.5)]}, api_keys=KEYS) as base:
        alice = Client(base, MCP_KEY, LEGACY).open()
        first = _pid(alice)
        wait_for_sync(lambda: not _exists(first), timeout_s=20, what="the idle process to be stopped")
        second = _pid(alice)
        assert second != first and _exists(second)


def test_disabling_or_removing_the_upstream_stops_its_processes(redis_url: str) -> None:
    with front_gateway(redis_url, {"upstreams": [_local()]}, api_keys=KEYS) as base:
        alice = Client(base, MCP_KEY, LEGACY).open()
        admin_url = base + "/admin/upstreams/local"
        first = _pid(alice)
        assert httpx.patch(admin_url, json={"enabled": False}, headers=ADMIN).status_code == 200
        wait_for_sync(lambda: not _exists(first), timeout_s=20, what="the disabled upstream's process to stop")
        assert httpx.patch(admin_url, json={"enabled": True}, headers=ADMIN).status_code == 200
        second = wait_for_sync(lambda: _pid_or_none(alice), timeout_s=20, what="the upstream enabled again")
        assert isinstance(second, int) and second != first
        assert httpx.delete(admin_url, headers=ADMIN).status_code == 200
        wait_for_sync(lambda: not _exists(second), timeout_s=20, what="the removed upstream's process to stop")
        assert not _stdio_children()


def _pid_or_none(client: Client) -> int | None:
    answer = client.call("tools/call", {"name": "local.pid", "arguments": {}})
    return int(answer["result"]["content"][0]["text"]) if "result" in answer else None
