"""Evictions reach a principal's clients: a context the store evicts inside any operation of
that principal (idle here, with a one-second ``context.idle_ttl_s``) sends
``notifications/resources/list_changed`` once to its 2025-11-25 session stream and its
2026-07-28 ``subscriptions/listen`` stream; another principal is told nothing. A real gateway
on a real Redis (single server and cluster)."""

from __future__ import annotations

from gateway.app import create_app
from shared import keys
from tests.admin_support import MCP_KEY, LiveServer, admin_config
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import (
    BOB_KEY,
    LEGACY,
    MODERN,
    Client,
    Stream,
    get_stream,
    listen_stream,
    publish_control,
)

RESOURCES_CHANGED = "notifications/resources/list_changed"
PROMPTS_CHANGED = "notifications/prompts/list_changed"


def settle(redis_url: str, principal: str, streams: list[Stream]) -> None:
    """Announce a prompts change to ``principal`` and wait until each stream has it: whatever the
    gateway sent the streams before is on them by then."""
    marks = [s.methods().count(PROMPTS_CHANGED) for s in streams]
    publish_control(redis_url, {"t": "lc", "p": principal, "k": "prompts", "o": "another-replica"})
    for stream, mark in zip(streams, marks, strict=True):
        wait_for_sync(lambda s=stream, m=mark: s.methods().count(PROMPTS_CHANGED) > m, timeout_s=10,
                      what=f"the prompts/list_changed marker on a stream of {principal}")


def told(streams: list[Stream]) -> list[int]:
    return [s.methods().count(RESOURCES_CHANGED) for s in streams]


def test_idle_eviction_inside_a_read_announces_the_list_change(redis_target: RedisTarget) -> None:
    # 3 s idle: "fresh" must stay in use from its append, through opening and settling the
    # streams, to its first read, which on a loaded machine can take more than a second
    cfg = admin_config(redis_target.url, gateway={"api_keys": {"alice": MCP_KEY, "bob": BOB_KEY}},
                       context={"idle_ttl_s": 3})
    redis = redis_target.sync_client()
    with LiveServer(create_app(cfg)) as server:
        alice, alice_modern = Client(server.url, MCP_KEY, LEGACY).open(), Client(server.url, MCP_KEY, MODERN)
        bob = Client(server.url, BOB_KEY, LEGACY).open()
        for cid in ("old", "fresh"):
            assert alice.result("tools/call", {"name": "context_append", "arguments": {
                "context_id": cid, "modality": "text", "text": "hello"}})["structuredContent"]["version"] == 1
        streams, bob_streams = [get_stream(alice), listen_stream(alice_modern, {"resourcesListChanged": True, "promptsListChanged": True})], [get_stream(bob)]
        settle(redis_target.url, "alice", streams)
        settle(redis_target.url, "bob", bob_streams)
        before, bob_before = told(streams), told(bob_streams)

        def old_evicted() -> bool:  # each read of "fresh" keeps it in use and expires what is idle
            got = alice.result("tools/call", {"name": "context_get", "arguments": {"context_id": "fresh"}})
            assert got["structuredContent"]["context_id"] == "fresh"
            return not redis.hexists(keys.ctx_meta("alice"), "old")

        wait_for_sync(old_evicted, timeout_s=15, interval_s=0.2, what="the idle context to be evicted")
        wait_for_sync(lambda: all(n > b for n, b in zip(told(streams), before, strict=True)), timeout_s=10,
                      what="resources/list_changed on both of alice's streams")
        settle(redis_target.url, "alice", streams)
        settle(redis_target.url, "bob", bob_streams)
        assert told(streams) == [b + 1 for b in before]  # once, not once per operation or per stream read
        assert told(bob_streams) == bob_before
        listed = alice.result("resources/list")["resources"]
        assert [r["uri"] for r in listed] == ["context://fresh/text"]
    redis.close()


def test_a_read_of_the_context_that_just_went_idle_fails_and_still_announces(redis_target: RedisTarget) -> None:
    """The call evicts the context it names, then answers "not found": the eviction is
    announced all the same."""
    cfg = admin_config(redis_target.url, gateway={"api_keys": {"alice": MCP_KEY}}, context={"idle_ttl_s": 1})
    redis = redis_target.sync_client()
    with LiveServer(create_app(cfg)) as server:
        alice = Client(server.url, MCP_KEY, LEGACY).open()
        assert alice.result("tools/call", {"name": "context_append", "arguments": {
            "context_id": "gone", "modality": "text", "text": "hello"}})["structuredContent"]["version"] == 1
        streams = [get_stream(alice)]
        settle(redis_target.url, "alice", streams)
        before = told(streams)
        used_ms = int(redis.hget(keys.ctx_meta("alice"), b"\x00ugone")) // 1000  # last use (see context.lua)
        for key in keys.ctx_keys("alice"):  # Redis keeps them, as a principal's other activity would:
            redis.pexpire(key, 60_000)      # else it may expire them whole, with no operation to report it

        def idle() -> bool:  # read without an operation: nothing touches or evicts it meanwhile
            sec, usec = redis.time()
            return sec * 1000 + usec // 1000 >= used_ms + 1000
        wait_for_sync(idle, timeout_s=10, interval_s=0.1, what="the context to be idle for idle_ttl_s")
        got = alice.call("tools/call", {"name": "context_get", "arguments": {"context_id": "gone"}})
        assert got["error"]["data"] == {"kind": "context_not_found", "context_id": "gone"}, got
        wait_for_sync(lambda: told(streams)[0] > before[0], timeout_s=10,
                      what="resources/list_changed after the failed read")
        assert alice.result("resources/list")["resources"] == []
    redis.close()
