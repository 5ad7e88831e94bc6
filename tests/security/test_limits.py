"""Quotas and rate limits per principal (issue 21, item 5): one principal can no longer use up
what the others share. Each limit against real gateway processes sharing one real Redis:
the refusal (HTTP 429 + Retry-After, or the JSON-RPC error -32029 with ``data.retryAfterS``),
nothing written by the refused call, another principal unaffected, and the refusal counted
in ``learnmesh_limit_exceeded_total``.

Limits are set so that time cannot refill them during a test (one token per 1000 s): the
assertions do not depend on how fast the machine runs.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from shared import keys
from shared.config import ConfigError, load_config
from shared.samples import CLUSTER_SAMPLE_PARTITIONS
from tests.conftest import RedisTarget, free_port, wait_for, wait_for_sync
from tests.gateway_support import start_gateway, stop, two_gateways
from tests.test_gateway_http import ACCEPT, init, legacy, modern, rpc

SLOW = 0.001  # tokens per second: none come back while a test runs
KEYS = {p: f"key-{p}-0123456789" for p in ("flood", "learner", "heavy", "subber", "wsuser", "listener", "sneak",
                                             "streamer", "calm")}
LIMITS = {
    "flood": {"requests_per_s": SLOW, "requests_burst": 3},
    "learner": {"learn_samples_per_s": SLOW, "learn_samples_burst": 5},
    "heavy": {"learn_bytes_per_s": SLOW, "learn_bytes_burst": 400},
    "subber": {"subscriptions_per_session": 2},
    "wsuser": {"ws_concurrent_requests": 2},
    "listener": {"listen_streams": 2},
    "sneak": {"requests_per_s": SLOW, "requests_burst": 4},
    "streamer": {"event_streams": 2},
}


def auth(principal: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[principal]}"}


@pytest.fixture(scope="module")
def replicas(redis_target_module: RedisTarget) -> Iterator[tuple[str, str]]:
    overrides: dict[str, dict[str, Any]] = {"limits": {"principals": LIMITS}, "learning": {"teachers": ["*"]},
                                            "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}"}}
    with two_gateways(redis_target_module.url, KEYS, overrides) as urls:
        yield urls


def call(base: str, principal: str, method: str, params: dict | None = None, rid: int = 1) -> httpx.Response:
    body, headers = modern(method, params, rid)
    return httpx.post(base + "/mcp", json=body, headers={**headers, **auth(principal)}, timeout=10)


def tool(base: str, principal: str, name: str, args: dict, rid: int = 1) -> httpx.Response:
    return call(base, principal, "tools/call", {"name": name, "arguments": args}, rid)


def append(base: str, principal: str, context_id: str) -> httpx.Response:
    return tool(base, principal, "context_append", {"context_id": context_id, "modality": "text", "text": "x"})


def assert_limited(r: httpx.Response, limit: str) -> dict:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == -32029 and error["data"]["limit"] == limit, error
    assert int(r.headers["retry-after"]) == error["data"]["retryAfterS"] >= 1
    return error


def limit_count(base: str, limit: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    line = f'learnmesh_limit_exceeded_total{{limit="{limit}"}} '
    found = [float(row[len(line):]) for row in text.splitlines() if row.startswith(line)]
    return found[0] if found else 0.0


def logged_samples(store: Any, principal: str) -> int:
    return sum(int(f[b"n"]) for part in range(CLUSTER_SAMPLE_PARTITIONS)  # every partition a cluster may have
               for _, f in store.xrange(keys.sample_log(part)) if f[b"p"] == principal.encode())


def test_request_rate_is_one_bucket_over_every_replica(replicas: tuple[str, str], store: Any) -> None:
    a, b = replicas
    before = limit_count(a, "requests")
    # three requests, spread over both replicas, use up the burst of 3
    assert append(a, "flood", "c1").status_code == 200
    assert append(b, "flood", "c2").status_code == 200
    assert call(a, "flood", "tools/list").status_code == 200
    # the fourth is refused on either replica, before it does anything
    error = assert_limited(append(b, "flood", "c3"), "requests")
    assert error["data"]["retryAfterS"] > 60  # one token per 1000 s
    assert not store.hexists(keys.ctx_meta("flood"), "c3")
    assert store.hexists(keys.ctx_meta("flood"), "c2")
    # a legacy session is refused the same way (HTTP 429, not an error on a 200)
    r = httpx.post(a + "/mcp", json=rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}}),
                   headers={"accept": ACCEPT, **auth("flood")}, timeout=10)
    assert_limited(r, "requests")
    # another principal is not slowed down by it
    for i in range(5):
        assert append(a if i % 2 else b, "calm", f"calm{i}").status_code == 200
    assert limit_count(b, "requests") >= 1 and limit_count(a, "requests") > before


def test_learn_quota_in_samples(replicas: tuple[str, str], store: Any) -> None:
    a, b = replicas
    batch = [{"input": f"q{i}", "target": " a"} for i in range(4)]
    ok = tool(a, "learner", "learn", {"samples": batch})
    assert ok.status_code == 200 and len(ok.json()["result"]["structuredContent"]["ids"]) == 4
    # 4 of 5 spent; 2 more are over the quota on the other replica too, and nothing is logged
    assert_limited(tool(b, "learner", "learn", {"samples": batch[:2]}), "learn_samples")
    assert logged_samples(store, "learner") == 4
    # what was refused took nothing: the one sample left still fits
    assert tool(b, "learner", "learn", batch[0]).status_code == 200
    assert logged_samples(store, "learner") == 5
    # more than the whole burst in one call can never fit: a clear bad-input error, not a wait
    r = tool(a, "learner", "learn", {"samples": [batch[0]] * 6})
    assert r.status_code == 400 and "split it" in r.json()["error"]["message"]
    # another principal teaches as much as it likes
    assert tool(a, "calm", "learn", {"samples": [batch[0]] * 20}).status_code == 200
    assert logged_samples(store, "calm") == 20


def test_learn_quota_in_bytes(replicas: tuple[str, str], store: Any) -> None:
    a, b = replicas
    sample = {"input": "q" * 150, "target": " a"}  # ~190 bytes as logged
    assert tool(a, "heavy", "learn", sample).status_code == 200
    assert tool(b, "heavy", "learn", sample).status_code == 200
    error = assert_limited(tool(a, "heavy", "learn", sample), "learn_bytes")
    assert "bytes" in error["message"]
    assert logged_samples(store, "heavy") == 2
    assert tool(a, "calm", "learn", {"samples": [sample] * 10}).status_code == 200


def test_subscriptions_per_session_need_existing_resources(replicas: tuple[str, str],
                                                           store: Any) -> None:
    a, _ = replicas
    for cid in ("s1", "s2", "s3"):
        assert append(a, "subber", cid).status_code == 200
    for cid in ("theirs", "theirs2", "theirs3"):
        assert append(a, "calm", cid).status_code == 200
    url = a + "/mcp"
    sid = init(url, auth("subber"))
    subs = keys.session_subscriptions("subber", sid)

    def subscribe(uri: str) -> httpx.Response:
        return legacy(url, sid, rpc("resources/subscribe", {"uri": uri}), **auth("subber"))

    # names that are no resource of this principal: the spec's resource-not-found, nothing stored
    for uri in ("context://nope/text", "context://theirs/text", "context://s1/smell", "urn:anything:" + "x" * 500):
        r = subscribe(uri)
        assert r.json()["error"]["code"] == -32002 and "not found" in r.json()["error"]["message"], (uri, r.text)
    assert store.scard(subs) == 0
    assert subscribe("context://s1/text").json()["result"] == {}
    assert subscribe("context://s2/text").json()["result"] == {}
    assert subscribe("context://s1/text").json()["result"] == {}  # the same one again: still two
    assert_limited(subscribe("context://s3/text"), "subscriptions")
    assert store.smembers(subs) == {b"context://s1/text", b"context://s2/text"}
    assert not store.exists(keys.resource_subscribers("subber", "context://s3/text"))
    # a listen stream may not carry more URIs than a session either
    body, headers = modern("subscriptions/listen", {"notifications": {"resourceSubscriptions": [
        "context://s1/text", "context://s2/text", "context://s3/text"]}})
    assert_limited(httpx.post(url, json=body, headers={**headers, **auth("subber")}, timeout=10), "subscriptions")
    # another principal's session holds more
    other = init(url, auth("calm"))
    for cid in ("theirs", "theirs2", "theirs3"):
        r = legacy(url, other, rpc("resources/subscribe", {"uri": f"context://{cid}/text"}), **auth("calm"))
        assert r.json()["result"] == {}


def test_requests_in_flight_per_websocket(replicas: tuple[str, str]) -> None:
    a, _ = replicas
    ws_url = a.replace("http://", "ws://") + "/mcp/ws"

    def frame(rid: int, method: str, params: dict) -> str:
        body, _ = modern(method, params, rid)
        return orjson.dumps(body).decode()

    async def scenario() -> None:
        async with ws_connect(ws_url, subprotocols=["mcp"], additional_headers=auth("wsuser")) as ws:
            # two listen streams stay in flight for as long as the connection lives
            for rid in (1, 2):
                await ws.send(frame(rid, "subscriptions/listen", {"notifications": {"toolsListChanged": True}}))
                ack = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
                assert ack["method"] == "notifications/subscriptions/acknowledged"
            await ws.send(frame(3, "tools/list", {}))
            refused = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
            assert refused["id"] == 3 and refused["error"]["code"] == -32029
            assert refused["error"]["data"]["limit"] == "ws_concurrent_requests"
            assert refused["error"]["data"]["retryAfterS"] >= 1
            # another principal's connection is not held back
            async with ws_connect(ws_url, subprotocols=["mcp"], additional_headers=auth("calm")) as other:
                for rid in (1, 2, 3):
                    await other.send(frame(rid, "subscriptions/listen", {"notifications": {"toolsListChanged": True}}))
                    assert "method" in orjson.loads(await asyncio.wait_for(other.recv(), 10))
                await other.send(frame(4, "tools/list", {}))
                assert "tools" in orjson.loads(await asyncio.wait_for(other.recv(), 10))["result"]

    asyncio.run(scenario())


async def _listen(client: httpx.AsyncClient, base: str, principal: str, opened: asyncio.Queue[int]) -> None:
    """Hold a subscriptions/listen stream open; put its status on ``opened`` once known."""
    body, headers = modern("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
    async with client.stream("POST", base + "/mcp", json=body, headers={**headers, **auth(principal)}) as r:
        if r.status_code != 200:
            await r.aread()
        await opened.put(r.status_code)
        if r.status_code == 200:
            async for _ in r.aiter_lines():
                pass


def test_listen_streams_per_principal_over_every_replica(replicas: tuple[str, str],
                                                         store: Any) -> None:
    a, b = replicas
    leases = keys.listen_leases("listener")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            opened: asyncio.Queue[int] = asyncio.Queue()
            streams = [asyncio.create_task(_listen(client, base, "listener", opened)) for base in (a, b)]
            assert [await asyncio.wait_for(opened.get(), 10) for _ in streams] == [200, 200]
            assert store.zcard(leases) == 2
            body, headers = modern("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
            third = await client.post(a + "/mcp", json=body, headers={**headers, **auth("listener")})
            assert_limited(third, "listen_streams")
            assert store.zcard(leases) == 2
            # another principal opens streams of its own
            mine = asyncio.create_task(_listen(client, b, "calm", opened))
            assert await asyncio.wait_for(opened.get(), 10) == 200
            # a stream that ends gives its place back (on the replica that held it)
            streams[1].cancel()
            await wait_for(lambda: store.zcard(leases) == 1, timeout_s=10, what="the closed stream's lease to go")
            again = asyncio.create_task(_listen(client, a, "listener", opened))
            assert await asyncio.wait_for(opened.get(), 10) == 200
            for t in (streams[0], mine, again):
                t.cancel()
            await asyncio.gather(*streams, mine, again, return_exceptions=True)

    asyncio.run(scenario())


async def _refused_handshake(ws_url: str, principal: str) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of a WebSocket handshake the gateway refuses."""
    with pytest.raises(InvalidStatus) as refused:
        async with ws_connect(ws_url, subprotocols=["mcp"], additional_headers=auth(principal), open_timeout=10):
            pass
    response = refused.value.response
    return response.status_code, {k.lower(): v for k, v in response.headers.raw_items()}, orjson.loads(response.body)


def test_streams_tickets_and_handshakes_count_against_the_request_rate(replicas: tuple[str, str],
                                                                        store: Any) -> None:
    a, b = replicas
    url, ws_url = a + "/mcp", b.replace("http://", "ws://") + "/mcp/ws"
    headers = {"accept": ACCEPT, "mcp-protocol-version": "2025-11-25", **auth("sneak")}

    async def handshake() -> None:
        async with ws_connect(ws_url, subprotocols=["mcp"], additional_headers=auth("sneak"), open_timeout=10):
            pass

    # four requests of every kind but a POST to /mcp use up the burst of 4
    sid = init(url, auth("sneak"))
    assert httpx.post(b + "/mcp/ws-ticket", headers=auth("sneak"), timeout=10).status_code == 200
    assert httpx.delete(url, headers={**headers, "mcp-session-id": "A" * 43}, timeout=10).status_code == 404
    asyncio.run(handshake())
    # now each of them is refused before it does anything, on either replica
    with httpx.stream("GET", url, headers={**headers, "accept": "text/event-stream", "mcp-session-id": sid},
                      timeout=10) as stream:
        assert stream.status_code == 429  # else an open stream, which never ends
        stream.read()
    assert_limited(stream, "requests")
    assert_limited(httpx.delete(url, headers={**headers, "mcp-session-id": sid}, timeout=10), "requests")
    assert store.exists(keys.session("sneak", sid))  # the refused DELETE ended nothing
    ticket = httpx.post(b + "/mcp/ws-ticket", headers=auth("sneak"), timeout=10)
    assert ticket.status_code == 429 and int(ticket.headers["retry-after"]) > 60, ticket.text
    assert ticket.json()["error"] == "limit_exceeded" and "ticket" not in ticket.json()
    status, got, body = asyncio.run(_refused_handshake(ws_url, "sneak"))
    assert status == 429 and int(got["retry-after"]) > 60 and body["error"] == "limit_exceeded", (status, body)
    wait_for_sync(lambda: store.zcard(keys.stream_leases("sneak")) == 0, timeout_s=10,
                  what="no stream held: the first connection closed, the refused one never opened")
    # another principal does all of it
    assert httpx.post(a + "/mcp/ws-ticket", headers=auth("calm"), timeout=10).status_code == 200


async def _event_stream(client: httpx.AsyncClient, url: str, principal: str, sid: str,
                        opened: asyncio.Queue[int], events: asyncio.Queue[dict] | None = None) -> None:
    """Hold a session's GET stream open; put its status on ``opened``, its messages on ``events``."""
    headers = {"accept": "text/event-stream", "mcp-session-id": sid, "mcp-protocol-version": "2025-11-25",
               **auth(principal)}
    async with client.stream("GET", url, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
        await opened.put(r.status_code)
        async for line in r.aiter_lines():
            if events is not None and line.startswith("data:") and line[5:].strip():
                await events.put(orjson.loads(line[5:]))


def test_event_streams_per_principal_over_every_replica(replicas: tuple[str, str], store: Any) -> None:
    a, b = replicas
    leases = keys.stream_leases("streamer")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            sid = init(a + "/mcp", auth("streamer"))
            opened: asyncio.Queue[int] = asyncio.Queue()
            stream = asyncio.create_task(_event_stream(client, a + "/mcp", "streamer", sid, opened))
            assert await asyncio.wait_for(opened.get(), 10) == 200
            async with ws_connect(b.replace("http://", "ws://") + "/mcp/ws", subprotocols=["mcp"],
                                  additional_headers=auth("streamer"), open_timeout=10):
                assert store.zcard(leases) == 2
                # a third stream is refused on either replica, as a GET or as a handshake
                async with client.stream("GET", b + "/mcp", headers={
                        "accept": "text/event-stream", "mcp-session-id": sid, **auth("streamer")}) as third:
                    assert third.status_code == 429  # else an open stream, which never ends
                    await third.aread()
                assert_limited(third, "event_streams")
                status, got, body = await _refused_handshake(a.replace("http://", "ws://") + "/mcp/ws", "streamer")
                assert status == 429 and got["retry-after"] == "1" and "event streams" in body["error_description"]
                assert store.zcard(leases) == 2
                # another principal's streams are not held back
                mine = init(b + "/mcp", auth("calm"))
                others = [asyncio.create_task(_event_stream(client, base + "/mcp", "calm", mine, opened))
                          for base in (a, b, b)]
                assert [await asyncio.wait_for(opened.get(), 10) for _ in others] == [200, 200, 200]
            # a connection that ends gives its place back
            await wait_for(lambda: store.zcard(leases) == 1, timeout_s=10, what="the closed connection's lease to go")
            again = asyncio.create_task(_event_stream(client, b + "/mcp", "streamer", sid, opened))
            assert await asyncio.wait_for(opened.get(), 10) == 200
            for t in (stream, again, *others):
                t.cancel()
            await asyncio.gather(stream, again, *others, return_exceptions=True)

    asyncio.run(scenario())


def test_server_requests_awaiting_answers_are_event_streams(replicas: tuple[str, str], store: Any) -> None:
    """A 2025-11-25 tool call that asks the client (sampling) waits on Redis for the answer, as a
    stream does: those waits count among the principal's event streams."""
    a, b = replicas
    url = a + "/mcp"
    sid = init(url, auth("streamer"))
    headers = {"accept": ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": "2025-11-25", **auth("streamer")}

    async def ask(client: httpx.AsyncClient, rid: int, out: asyncio.Queue[tuple[int, dict]]) -> None:
        body = rpc("tools/call", {"name": "t_ask", "arguments": {}}, rid=rid)
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200 or r.headers["content-type"].startswith("application/json"):
                await out.put((r.status_code, orjson.loads(await r.aread())))
                return
            async for line in r.aiter_lines():
                if line.startswith("data:") and line[5:].strip():
                    await out.put((r.status_code, orjson.loads(line[5:])))

    async def answer(client: httpx.AsyncClient, request: dict) -> None:
        reply = {"jsonrpc": "2.0", "id": request["id"],
                 "result": {"role": "assistant", "content": {"type": "text", "text": "A"}, "model": "m"}}
        assert (await client.post(b + "/mcp", json=reply, headers=headers)).status_code == 202

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            queues = [asyncio.Queue[tuple[int, dict]]() for _ in range(4)]
            calls = [asyncio.create_task(ask(client, rid, queues[rid - 1])) for rid in (1, 2)]
            asked = [(await asyncio.wait_for(q.get(), 10))[1] for q in queues[:2]]
            assert [m["method"] for m in asked] == ["sampling/createMessage"] * 2
            assert store.zcard(keys.stream_leases("streamer")) == 2
            # a third question would hold a third connection: the call is refused at once
            calls.append(asyncio.create_task(ask(client, 3, queues[2])))
            status, refused = await asyncio.wait_for(queues[2].get(), 10)
            assert status == 429 and refused["error"]["code"] == -32029, refused
            assert refused["error"]["data"]["limit"] == "event_streams"
            # an answer ends a wait and gives its place back
            await answer(client, asked[0])
            assert (await asyncio.wait_for(queues[0].get(), 10))[1]["result"]["content"][0]["text"] == "got A"
            calls.append(asyncio.create_task(ask(client, 4, queues[3])))
            fourth = (await asyncio.wait_for(queues[3].get(), 10))[1]
            assert fourth["method"] == "sampling/createMessage"
            for request, queue in ((asked[1], queues[1]), (fourth, queues[3])):
                await answer(client, request)
                assert "result" in (await asyncio.wait_for(queue.get(), 10))[1]
            await asyncio.gather(*calls)

    asyncio.run(scenario())


def test_one_principals_streams_leave_the_redis_pool_to_the_others(redis_server: str, redis_url: str) -> None:
    """Every open event stream holds a connection of its replica's pool of blocking Redis
    connections: a principal opening streams without end must not take the pool from the others."""
    port = free_port()
    proc = start_gateway(port, redis_server, api_keys=f"streamer:{KEYS['streamer']},calm:{KEYS['calm']}",
                         overrides={"redis": {"max_connections": 6}, "limits": {"principals": LIMITS}})
    url = f"http://127.0.0.1:{port}/mcp"

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            theirs = init(url, auth("streamer"))
            opened: asyncio.Queue[int] = asyncio.Queue()
            flood, statuses = [], []
            for _ in range(6):  # one after the other: the pool's other users are not crowded out meanwhile
                flood.append(asyncio.create_task(_event_stream(client, url, "streamer", theirs, opened)))
                statuses.append(await asyncio.wait_for(opened.get(), 10))
            assert statuses == [200, 200, 429, 429, 429, 429], statuses
            # the other principal's stream gets what its session logs (notes of a call answered as JSON)
            mine = init(url, auth("calm"))
            events: asyncio.Queue[dict] = asyncio.Queue()
            stream = asyncio.create_task(_event_stream(client, url, "calm", mine, opened, events))
            assert await asyncio.wait_for(opened.get(), 10) == 200
            r = await client.post(url, json=rpc("tools/call", {"name": "t_chatty", "arguments": {}}),
                                  headers={"accept": "application/json", "mcp-session-id": mine,
                                           "mcp-protocol-version": "2025-11-25", **auth("calm")})
            assert r.json()["result"]["content"][0]["text"] == "done"
            note = await asyncio.wait_for(events.get(), 10)
            assert note["method"] == "notifications/message" and note["params"]["data"] == "working", note
            for t in (*flood, stream):
                t.cancel()
            await asyncio.gather(*flood, stream, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        stop(proc)


def test_the_sample_log_is_bounded_by_what_the_trainer_has_not_trained(redis_server: str, redis_url: str) -> None:
    store = redis_sync.Redis.from_url(redis_server)  # one log partition: the bound is exact
    admin_key = "admin-key-0123456789"
    port = free_port()
    proc = start_gateway(port, redis_server, api_keys=f"calm:{KEYS['calm']},learner:{KEYS['learner']}", overrides={
        "limits": {"max_sample_backlog": 6, "backlog_retry_after_s": 7},
        "trainer": {"max_learn_batch": 4, "samples_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "learning": {"teachers": ["calm", "learner"]},
        "gateway": {"admin_keys": {"root": {"key": admin_key, "role": "admin"}}}})
    base = f"http://127.0.0.1:{port}"
    try:
        four = {"samples": [{"input": f"q{i}", "target": " a"} for i in range(4)]}
        assert tool(base, "calm", "learn", four).status_code == 200
        assert tool(base, "learner", "learn", {"samples": four["samples"][:2]}).status_code == 200
        entries = store.xlen(keys.SAMPLE_LOG)
        # six samples wait for a trainer: the next one is refused for every principal, not trimmed
        error = assert_limited(tool(base, "calm", "learn", four["samples"][0]), "sample_backlog")
        assert error["data"]["retryAfterS"] == 7 and "trainer" in error["message"]
        r = httpx.post(base + "/admin/samples", json={"principal": "learner", "samples": four["samples"][:1]},
                       headers={"authorization": f"Bearer {admin_key}"}, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert store.xlen(keys.SAMPLE_LOG) == entries and int(store.get(keys.SAMPLE_SEQ)) == 6
        # the trainer commits what it trained: room again, exactly that much
        store.hset(keys.TRAINER_OFFSET, mapping={"seq": 4, "log": store.get(keys.SAMPLE_LOG_ID)})
        assert tool(base, "learner", "learn", four).status_code == 200
        assert_limited(tool(base, "learner", "learn", four["samples"][0]), "sample_backlog")
        assert int(store.get(keys.SAMPLE_SEQ)) == 10
        # the committed seq of another (older) log does not count for this one
        store.hset(keys.TRAINER_OFFSET, mapping={"seq": 10, "log": "0123456789abcdef"})
        assert tool(base, "calm", "learn", four["samples"][0]).status_code == 429
        assert limit_count(base, "sample_backlog") >= 3
    finally:
        stop(proc)
        store.close()


@pytest.mark.parametrize(("limits", "message"), [
    ({"principals": {"alice": {"requests_per_s": -1}}}, "limits: principals.alice: requests_per_s"),
    ({"principals": {"alice": {"request_per_s": 5.0}}}, "principals.alice: request_per_s: unknown key"),
    ({"default": {"listen_streams": "many"}}, "limits.default.listen_streams"),
    ({"max_sample_backlog": 10}, "limits.max_sample_backlog must be 0 or >= trainer.max_learn_batch"),
])
def test_a_bad_limit_fails_at_start_naming_its_key(limits: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(env={}, overrides={"limits": limits})
    overrides = load_config(env={}, overrides={"limits": {"principals": {"alice": {"requests_per_s": 5.0}}}})
    assert overrides.limits.of("alice").requests_per_s == 5.0 and overrides.limits.of("bob").requests_per_s == 1000
