"""The MCP tasks extension (SEP-2663) and SEP-2243 custom headers on real gateway apps sharing
one real Redis: a task created on one replica is read, answered and cancelled through another."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis as redis_sync

from gateway.app import create_app
from gateway.tasks import TASKS_EXTENSION, escalate
from shared import keys
from shared.config import load_config
from tests.conftest import private_redis, wait_for

MODERN = "2026-07-28"
KEYS = {"alice": "alice-key-123", "bob": "bob-key-4567"}
EXT_CAPS = {"extensions": {TASKS_EXTENSION: {}}}


@pytest.fixture
def redis_url(redis_target) -> str:
    """Every test here runs on a single server and on a cluster (tests/conftest.py)."""
    return redis_target.url


class Replica:
    """One gateway app, its lifespan running, reached through an in-process ASGI client."""

    def __init__(self, app: Any, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client
        self.blocked_cancelled = asyncio.Event()

    @property
    def state(self) -> Any:
        return self.app.state.gateway

    async def rpc(self, method: str, params: dict[str, Any] | None = None, *, caps: dict[str, Any] | None = None,
                  principal: str = "alice", headers: dict[str, str] | None = None) -> httpx.Response:
        p = dict(params or {})
        p["_meta"] = {"io.modelcontextprotocol/protocolVersion": MODERN,
                      "io.modelcontextprotocol/clientCapabilities": EXT_CAPS if caps is None else caps}
        h = {"accept": "application/json", "mcp-protocol-version": MODERN, "mcp-method": method,
             "authorization": f"Bearer {KEYS[principal]}"}
        name = p.get("name") if method == "tools/call" else p.get("taskId")
        if isinstance(name, str):
            h["mcp-name"] = name
        h.update(headers or {})
        return await self.client.post("/mcp", json={"jsonrpc": "2.0", "id": 7, "method": method, "params": p},
                                      headers=h)

    async def result(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        got = await self.result_unless_503(method, params, **kw)
        assert got is not None, "503: the store did not answer"
        return got

    async def result_unless_503(self, method: str, params: dict[str, Any] | None = None,
                                **kw: Any) -> dict[str, Any] | None:
        """The result, or None for a 503 (Redis too slow or away): what a client retries."""
        r = await self.rpc(method, params, **kw)
        if r.status_code == 503:
            return None
        assert r.status_code == 200, r.text
        body = r.json()
        assert "result" in body, body
        result: dict[str, Any] = body["result"]
        return result


def _register_blocking_tool(app: Any, replica: Replica) -> None:
    @app.registry.tool("t_block", description="a task that waits until cancelled", task_support="optional",
                             input_schema={"type": "object"})
    async def block(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
        await escalate(ctx)
        try:
            await asyncio.Event().wait()
        finally:
            replica.blocked_cancelled.set()
        return {"content": []}


@contextlib.asynccontextmanager
async def replica(redis_url: str, limits: dict[str, Any] | None = None,
                  redis: dict[str, Any] | None = None) -> AsyncIterator[Replica]:
    cfg = load_config(env={}, overrides={"redis": {"url": redis_url, **(redis or {})}, "limits": limits or {},
                                         "gateway": {"api_keys": KEYS, "request_state_keys": ["00" * 32]}})
    app = create_app(cfg, fixtures="conformance")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        rep = Replica(app, client)
        _register_blocking_tool(app, rep)
        async with app.router.lifespan_context(app):
            yield rep


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[Replica, Replica]]:
    async with replica(redis_url) as a, replica(redis_url) as b:
        yield a, b


async def _status(rep: Replica, task_id: str, wanted: str, principal: str = "alice",
                  retry_503: bool = False) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        ask = rep.result_unless_503 if retry_503 else rep.result
        got = await ask("tasks/get", {"taskId": task_id}, principal=principal)
        return got if got is not None and got["status"] == wanted else None
    return await wait_for(reached, timeout_s=10, interval_s=0.05, what=f"task {task_id} {wanted}")  # type: ignore


async def test_task_created_on_one_replica_is_read_on_another(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    handle = await a.result("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0.2, "label": "x"}})
    assert handle["resultType"] == "task" and handle["status"] == "working"
    assert {"taskId", "createdAt", "lastUpdatedAt", "ttlMs"} <= set(handle)
    assert not {"result", "error", "inputRequests", "requestState", "task"} & set(handle)
    task_id = handle["taskId"]
    first = await b.result("tasks/get", {"taskId": task_id})  # durable before the handle came back
    assert first["taskId"] == task_id and first["resultType"] == "complete"
    done = await _status(b, task_id, "completed")
    assert done["result"]["content"][0]["text"] == "Computed x after 0.2s"
    redis = a.state.redis
    key = keys.task("alice", task_id)
    assert key.startswith("lm:{alice}:") and 0 < await redis.pttl(key) <= handle["ttlMs"]
    # another principal cannot see it; an unknown id is a bad parameter
    other = await b.rpc("tasks/get", {"taskId": task_id}, principal="bob")
    assert other.status_code == 400 and other.json()["error"]["code"] == -32602
    unknown = await b.rpc("tasks/get", {"taskId": "no-such-task"})
    assert unknown.json()["error"]["code"] == -32602


async def test_cancel_on_another_replica_stops_the_running_task(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    task_id = (await a.result("tools/call", {"name": "t_block", "arguments": {}}))["taskId"]
    assert (await b.result("tasks/get", {"taskId": task_id}))["status"] == "working"
    ack = await b.result("tasks/cancel", {"taskId": task_id})
    assert ack == {"resultType": "complete"}
    await asyncio.wait_for(a.blocked_cancelled.wait(), 10)  # pub/sub reached the owner's asyncio task
    got = await a.result("tasks/get", {"taskId": task_id})
    assert got["status"] == "cancelled" and "result" not in got and "error" not in got
    assert await b.result("tasks/cancel", {"taskId": task_id}) == {"resultType": "complete"}  # idempotent
    await wait_for(lambda: not a.state.tasks.running, what="runner forgotten")


async def test_input_required_answered_through_another_replica(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    task_id = (await a.result("tools/call", {"name": "multi_input", "arguments": {}}))["taskId"]
    parked = await _status(b, task_id, "input_required")
    assert set(parked["inputRequests"]) == {"name", "confirm"}
    assert parked["inputRequests"]["name"]["method"] == "elicitation/create"
    ack = await b.result("tasks/update", {"taskId": task_id, "inputResponses": {
        "name": {"action": "accept", "content": {"name": "Ada"}}, "ignored-key": {"x": 1}}})
    assert ack == {"resultType": "complete"}
    partial = await b.result("tasks/get", {"taskId": task_id})
    assert partial["status"] == "input_required" and set(partial["inputRequests"]) == {"confirm"}
    bad = await b.rpc("tasks/update", {"taskId": task_id, "inputResponses": {"confirm": 5}})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == -32602
    await b.result("tasks/update", {"taskId": task_id, "inputResponses": {
        "confirm": {"action": "accept", "content": {"confirm": True}}}})
    done = await _status(b, task_id, "completed")
    assert done["result"]["content"][0]["text"].startswith("Got Ada")


async def test_parked_task_notices_a_cancel_whose_signal_was_lost(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    task_id = (await a.result("tools/call", {"name": "confirm_delete", "arguments": {"filename": "f"}}))["taskId"]
    await _status(b, task_id, "input_required")
    await b.state.tasks._settle_task("alice", task_id, "cancelled")  # settled, but no pub/sub signal sent
    await wait_for(lambda: not a.state.tasks.running, timeout_s=10, what="owner to drop the cancelled task")
    assert (await b.result("tasks/get", {"taskId": task_id}))["status"] == "cancelled"


async def test_errors_settle_as_completed_with_is_error_or_failed(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    failing = (await a.result("tools/call", {"name": "failing_job", "arguments": {}}))["taskId"]
    broken = (await a.result("tools/call", {"name": "protocol_error_job", "arguments": {}}))["taskId"]
    done = await _status(b, failing, "completed")
    assert done["result"]["isError"] is True
    failed = await _status(b, broken, "failed")
    assert failed["error"]["code"] == -32603 and "result" not in failed


async def test_task_surface_is_gated_on_the_extension(pair: tuple[Replica, Replica]) -> None:
    a, _ = pair
    for method, params in (("tasks/get", {"taskId": "x"}), ("tasks/cancel", {"taskId": "x"}),
                           ("tasks/update", {"taskId": "x", "inputResponses": {}})):
        r = await a.rpc(method, params, caps={})
        assert r.status_code == 400 and r.json()["error"]["code"] == -32021, method
    required = await a.rpc("tools/call", {"name": "failing_job", "arguments": {}}, caps={})
    err = required.json()["error"]
    assert required.status_code == 400 and err["code"] == -32021
    assert TASKS_EXTENSION in err["data"]["requiredCapabilities"]["extensions"]
    inline = await a.result("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}, caps={})
    assert inline["resultType"] == "complete" and "taskId" not in inline
    removed = await a.rpc("tasks/list", {})
    assert removed.status_code == 404 and removed.json()["error"]["code"] == -32601
    discover = await a.result("server/discover")
    assert TASKS_EXTENSION in discover["capabilities"]["extensions"]


async def test_task_of_a_dead_replica_is_reported_failed(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    task_id = (await a.result("tools/call", {"name": "t_block", "arguments": {}}))["taskId"]
    heartbeat = a.state.tasks._background[0]
    heartbeat.cancel()
    await a.state.redis.delete(keys.task_replica(a.state.replica_id))  # as if replica a had crashed
    got = await b.result("tasks/get", {"taskId": task_id})
    assert got["status"] == "failed" and got["error"]["code"] == -32603


async def test_shutdown_reports_running_tasks_failed(redis_url: str) -> None:
    async with replica(redis_url) as b:
        async with replica(redis_url) as a:
            task_id = (await a.result("tools/call", {"name": "t_block", "arguments": {}}))["taskId"]
        got = await b.result("tasks/get", {"taskId": task_id})
        assert got["status"] == "failed" and "shut down" in got["error"]["message"]


async def test_running_tasks_are_capped_per_principal_over_every_replica(redis_url: str) -> None:
    limits = {"default": {"running_tasks": 2}}
    async with replica(redis_url, limits) as a, replica(redis_url, limits) as b:
        first = (await a.result("tools/call", {"name": "t_block", "arguments": {}}))["taskId"]
        second = (await b.result("tools/call", {"name": "t_block", "arguments": {}}))["taskId"]
        refused = await a.rpc("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0, "label": "x"}})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        err = refused.json()["error"]
        assert err["code"] == -32029 and err["data"] == {"limit": "running_tasks", "retryAfterS": 1}
        assert "at most 2 tasks" in err["message"]
        assert await a.state.redis.zcard(keys.running_tasks("alice")) == 2  # the refused one left nothing
        assert (await b.rpc("tools/call", {"name": "t_block", "arguments": {}})).status_code == 429
        assert (await b.result("tools/call", {"name": "t_block", "arguments": {}}, principal="bob"))["taskId"]
        inline = await a.result("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}, caps={})
        assert inline["resultType"] == "complete"  # a plain call is no task: the cap does not apply
        stranger = await b.rpc("tasks/cancel", {"taskId": first}, principal="bob")  # not bob's to cancel
        assert stranger.status_code == 400 and stranger.json()["error"]["code"] == -32602
        assert await a.state.redis.zcard(keys.running_tasks("alice")) == 2
        for task_id in (first, second):  # the running tasks were not touched by the refusals
            assert (await a.result("tasks/get", {"taskId": task_id}))["status"] == "working"
        await b.result("tasks/cancel", {"taskId": first})  # a cancelled task frees its place at once
        third = (await b.result("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}))["taskId"]
        await _status(a, third, "completed")  # and so does a completed one
        fourth = await a.result("tools/call", {"name": "t_block", "arguments": {}})
        assert fourth["resultType"] == "task"


async def test_task_cap_holds_for_calls_racing_on_two_replicas(redis_url: str) -> None:
    limits = {"default": {"running_tasks": 3}}
    async with replica(redis_url, limits) as a, replica(redis_url, limits) as b:
        calls = [rep.rpc("tools/call", {"name": "t_block", "arguments": {}}) for rep in (a, b) * 5]
        statuses = sorted(r.status_code for r in await asyncio.gather(*calls))
        assert statuses == [200] * 3 + [429] * 7
        assert len(a.state.tasks.running) + len(b.state.tasks.running) == 3


async def test_a_task_counts_while_its_replica_renews_its_lease(redis_url: str) -> None:
    limits = {"default": {"running_tasks": 1}}
    async with replica(redis_url, limits) as a, replica(redis_url, limits) as b:
        task_id = (await a.result("tools/call", {"name": "t_block", "arguments": {}}))["taskId"]
        running = keys.running_tasks("alice")
        await a.state.redis.zadd(running, {task_id: 1})  # as if its lease had run out
        await a.state.tasks._renew_leases()  # the owner's heartbeat
        assert (await b.rpc("tools/call", {"name": "t_block", "arguments": {}})).status_code == 429
        a.state.tasks._background[0].cancel()  # replica a stops heartbeating: its lease runs out
        await a.state.redis.zadd(running, {task_id: 1})
        assert (await b.result("tools/call", {"name": "t_block", "arguments": {}}))["resultType"] == "task"


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A redis-server of this test alone: it is made to stop answering for a while."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs a redis-server binary of its own")
    with private_redis(binary) as url:
        yield url


async def test_a_task_that_ends_while_redis_is_away_is_settled_once_it_answers(own_redis: str) -> None:
    async with replica(own_redis, redis={"socket_timeout_s": 0.5}) as a:
        release = asyncio.Event()

        @a.app.registry.tool("t_gated", description="a task that ends when released", task_support="optional",
                             input_schema={"type": "object"})
        async def gated(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            await escalate(ctx)
            await release.wait()
            return {"content": [{"type": "text", "text": "released"}]}

        # a 0.5 s timeout can also fire before the pause on a loaded machine: a client retries a 503
        handle = await wait_for(lambda: a.result_unless_503("tools/call", {"name": "t_gated", "arguments": {}}),
                                timeout_s=20, interval_s=0.2, what="the task created")
        task_id = handle["taskId"]  # type: ignore[index]
        with redis_sync.Redis.from_url(own_redis) as admin:
            admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")  # writes wait, then time out
        release.set()
        # not "working" until the task's ttl ends; a read that times out while the pause lasts is retried
        done = await _status(a, task_id, "completed", retry_503=True)
        assert done["result"]["content"][0]["text"] == "released"
        # the runner leaves the set once its write is acknowledged: an answer read by then may come first
        await wait_for(lambda: not a.state.tasks.running, timeout_s=20, what="the settled task's runner forgotten")


HEADER_CASES = [
    ("eu-west", 200),
    ("=?base64?" + base64.b64encode(b"eu-west").decode() + "?=", 200),
    ("  eu-west ", 200),  # optional whitespace is not part of the value
    ("us-east", 400),
    ("=?base64?ZXUtd2VzdA?=", 400),  # padding missing
    ("=?base64?ZXUt!!d2VzdA==?=", 400),  # not in the alphabet
    (None, 400),  # the argument is in the body, its header is not
]


async def test_custom_param_header_must_match_the_argument(pair: tuple[Replica, Replica]) -> None:
    a, _ = pair
    for header, status in HEADER_CASES:
        extra = {"mcp-param-region": header} if header is not None else {}
        r = await a.rpc("tools/call", {"name": "test_header_param", "arguments": {"region": "eu-west"}},
                        headers=extra)
        assert r.status_code == status, (header, r.text)
        if status == 400:
            assert r.json()["error"]["code"] == -32020, header
        else:
            assert r.json()["result"]["content"][0]["text"] == "region=eu-west"
    stray = await a.rpc("tools/call", {"name": "test_header_param", "arguments": {}},
                        headers={"mcp-param-region": "eu-west"})
    assert stray.status_code == 400 and stray.json()["error"]["code"] == -32020  # header without argument
