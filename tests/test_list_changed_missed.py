"""A list that changes while a 2025-11-25 session has no event stream open: the session is told as
soon as it opens one again, on another replica too — the gateway's own list announced to one
principal, an upstream's list to every principal that may see it and no other; a stream that
stayed open is told once, as before. Two gateway replicas, on a single Redis and on a cluster."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.mcp.list_revisions import ListRevisions
from gateway.state import Gateway
from shared import keys
from shared.redis_client import AsyncRedis
from tests.admin_support import MCP_KEY, LiveServer, admin_config
from tests.conftest import RedisTarget, wait_for, wait_for_sync
from tests.proxy.harness import Upstream
from tests.proxy_front import BOB_KEY, LEGACY, Client, Stream, get_stream, publish_control

pytest_plugins = ("tests.proxy_support",)  # its fixtures: the SDK upstream processes

TOKEN_ENV = "LM_TEST_MISSED_LIST_TOKEN"
TOOLS_CHANGED = "notifications/tools/list_changed"
RESOURCES_CHANGED = "notifications/resources/list_changed"
PROMPTS_CHANGED = "notifications/prompts/list_changed"


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    return redis_target.url


@pytest.fixture
async def r(redis_target: RedisTarget) -> AsyncIterator[AsyncRedis]:
    client = redis_target.async_client()
    yield client
    await client.aclose()


@contextmanager
def replica(redis_url: str, proxy: dict[str, Any]) -> Iterator[tuple[str, Gateway]]:
    """A gateway replica (principals alice and bob) and its Gateway, to see which streams it holds."""
    app = create_app(admin_config(redis_url, gateway={"api_keys": {"alice": MCP_KEY, "bob": BOB_KEY}}, proxy=proxy))
    with LiveServer(app) as server:
        yield server.url, app.state.gateway


def visit(client: Client, principal: str, gateway: Gateway) -> str:
    """Open the session's GET stream, read its first event id and hang up; the id, once the replica
    has let go of the stream (what a client resumes from with ``Last-Event-ID``)."""
    headers = {**client.auth, "mcp-session-id": client.sid or "", "mcp-protocol-version": LEGACY}
    with httpx.stream("GET", client.url, headers=headers, timeout=10) as resp:
        assert resp.status_code == 200
        last = next(line[3:].strip() for line in resp.iter_lines() if line.startswith("id:"))
    wait_for_sync(lambda: client.sid not in gateway.session_streams.get(principal, {}), timeout_s=10,
                  what="the replica to notice the stream closed")
    return last


def moved(client: Client, base: str) -> Client:
    """The same session, reached through another replica."""
    other = Client(base, "", LEGACY)
    other.auth, other.sid = dict(client.auth), client.sid
    return other


def settle(redis_url: str, streams: dict[str, list[Stream]]) -> None:
    """Announce a prompts change to each principal and wait until each of its streams has it: what
    the gateway logged for a stream before that is on the stream by then."""
    for principal, group in streams.items():
        publish_control(redis_url, {"t": "lc", "p": principal, "k": "prompts", "o": "another-replica"})
        for stream in group:
            wait_for_sync(lambda s=stream: PROMPTS_CHANGED in s.methods(), timeout_s=10,
                          what=f"the prompts/list_changed on a stream of {principal}")


def test_own_list_change_reaches_a_session_whose_stream_was_closed(redis_url: str) -> None:
    with replica(redis_url, {}) as (a, gw_a), replica(redis_url, {}) as (b, _):
        stayed = Client(b, MCP_KEY, LEGACY).open()
        stayed_stream = get_stream(stayed)
        alice, bob = Client(a, MCP_KEY, LEGACY).open(), Client(a, BOB_KEY, LEGACY).open()
        alice_last, bob_last = visit(alice, "alice", gw_a), visit(bob, "bob", gw_a)

        assert stayed.result("tools/call", {"name": "context_append", "arguments": {
            "context_id": "conv", "modality": "text", "text": "hello"}})  # alice's resources list changed
        assert stayed.result("tools/call", {"name": "context_fork", "arguments": {
            "context_id": "conv", "new_context_id": "conv2"}})  # and again
        wait_for_sync(lambda: stayed_stream.methods().count(RESOURCES_CHANGED) == 2, timeout_s=10,
                      what="both resources/list_changed on the stream that stayed open")

        alice_stream = get_stream(moved(alice, b), alice_last)
        wait_for_sync(lambda: RESOURCES_CHANGED in alice_stream.methods(), timeout_s=10,
                      what="resources/list_changed on the reopened stream, on the other replica")
        bob_stream = get_stream(moved(bob, b), bob_last)
        settle(redis_url, {"alice": [stayed_stream, alice_stream], "bob": [bob_stream]})
        assert RESOURCES_CHANGED not in bob_stream.methods()  # the change was alice's
        assert stayed_stream.methods().count(RESOURCES_CHANGED) == 2  # each change once
        assert alice_stream.methods().count(RESOURCES_CHANGED) == 1  # the changes it missed, once


def test_upstream_change_reaches_reopened_streams_that_may_see_it(redis_url: str, legacy_upstream: Upstream,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, f"Bearer {legacy_upstream.token}")
    entry = {"name": "up", "url": legacy_upstream.url, "headers_from_env": {"Authorization": TOKEN_ENV},
             "timeout_s": 10.0, "revision": legacy_upstream.revision}
    proxy = {"upstreams": [entry], "allow": {"principals": {"alice": ["up"]}}, "list_ttl_s": 3600.0}
    with replica(redis_url, proxy) as (a, gw_a), replica(redis_url, proxy) as (b, _):
        stayed = Client(b, MCP_KEY, LEGACY).open()
        stayed_stream = get_stream(stayed)
        alice, bob = Client(a, MCP_KEY, LEGACY).open(), Client(a, BOB_KEY, LEGACY).open()
        assert "up.echo" in alice.names()  # the lists are now kept: only an announced change refreshes them
        alice_last, bob_last = visit(alice, "alice", gw_a), visit(bob, "bob", gw_a)
        names = (f"added_{i}" for i in itertools.count())
        added: list[str] = []

        def told() -> bool:  # the replicas may still be opening their own streams on the upstream
            added.append(next(names))
            assert stayed.result("tools/call", {"name": "up.grow", "arguments": {"name": added[-1]}})
            return TOOLS_CHANGED in stayed_stream.methods()

        wait_for_sync(told, timeout_s=30, interval_s=0.3, what="the upstream's tools/list_changed on the open stream")

        alice_b = moved(alice, b)
        alice_stream = get_stream(alice_b, alice_last)
        wait_for_sync(lambda: TOOLS_CHANGED in alice_stream.methods(), timeout_s=10,
                      what="tools/list_changed on alice's reopened stream, on the other replica")
        assert f"up.{added[-1]}" in alice_b.names()
        bob_stream = get_stream(moved(bob, b), bob_last)
        settle(redis_url, {"bob": [bob_stream]})
        assert TOOLS_CHANGED not in bob_stream.methods()  # the allow-list keeps bob from the upstream


async def test_a_revision_hash_that_expired_starts_above_what_sessions_recorded(r: AsyncRedis) -> None:
    """A principal's revisions expire like an idle session; a session that outlived them must still
    see a later change as a change, so the hash must not count from the start again."""
    revisions = ListRevisions(r, ttl_s=60)
    first = await revisions.bump("alice", "resources", None)
    assert first is not None and await r.ttl(keys.principal_list_revisions("alice")) > 0

    async def clock_passed_it() -> bool:
        seconds, micros = await r.time()
        return int(seconds) * 1000 + int(micros) // 1000 > first

    await wait_for(clock_passed_it, timeout_s=5, what="the Redis clock to pass the first revision")
    await r.delete(keys.principal_list_revisions("alice"))  # as if it expired
    again = await revisions.bump("alice", "resources", None)
    assert again is not None and again > first
    assert await revisions.bump(None, "tools", "up") != await revisions.bump(None, "tools", "up")
