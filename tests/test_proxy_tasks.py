"""Tasks (SEP-2663) through the proxy to an upstream that has none: the official SDK's server
pinned to 2025-11-25, whose ``long_job`` and ``greet_user`` declare ``execution.taskSupport``.

A 2026-07-28 client that declares the tasks extension gets a task the proxy hosts itself (its
state in Redis): polled to completion with ``tasks/get`` on another proxy replica, parked as
``input_required`` while the upstream asks the client (elicitation) and resumed by
``tasks/update``, and cancelled with ``tasks/cancel``, which cancels the upstream request
(the upstream handler sees the cancellation). Without the extension the same tool is a plain call.
A task's call holds one of the upstream's ``concurrency`` slots for the task's life, so one
principal's tasks take no more than its share of them.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync

from conformance.http_guards import LEGACY
from tests.conftest import wait_for_sync
from tests.gateway_support import stop
from tests.proxy.harness import (
    ALICE_KEY,
    BOB_KEY,
    PROXY_AUTH_ENV,
    Proxy,
    Upstream,
    start_http_upstream,
    start_proxy,
    stop_upstream,
)
from tests.proxy.upstreams.server import CANCELLED_MARK
from tests.proxy_front import MODERN, Client

TASKS = {"extensions": {"io.modelcontextprotocol/tasks": {}}, "elicitation": {}}
TERMINAL = {"completed", "failed", "cancelled"}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    up = start_http_upstream("legacy", LEGACY, tmp_path_factory.mktemp("upstream"),
                             "upstream-secret-" + secrets.token_hex(16))
    yield up
    stop_upstream(up)


@pytest.fixture(scope="module")
def replicas(redis_server: str, upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proxy]]:
    """Two proxy replicas on one Redis database: a task one of them hosts is read on the other."""
    db = redis_server.rsplit("/", 1)[0] + "/4"
    with redis_sync.Redis.from_url(db) as client:
        client.flushdb()
    workdir = tmp_path_factory.mktemp("proxies")
    started: list[Proxy] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(PROXY_AUTH_ENV, f"Bearer {upstream.token}")
            for i in range(2):
                started.append(start_proxy(db, [upstream], Path(workdir) / f"proxy-{i}.log"))
        yield started
    finally:
        for proxy in started:
            stop(proxy.proc)


def client(proxy: Proxy) -> Client:
    return Client(proxy.base, ALICE_KEY, MODERN)


def start_task(proxy: Proxy, tool: str, arguments: dict[str, Any]) -> str:
    created = client(proxy).result("tools/call", {"name": tool, "arguments": arguments}, caps=TASKS)
    assert created["resultType"] == "task" and created["status"] == "working", created
    assert "requestState" not in created and "content" not in created
    return str(created["taskId"])


def task_state(proxy: Proxy, task_id: str) -> dict[str, Any]:
    return client(proxy).result("tasks/get", {"taskId": task_id}, caps=TASKS)


def wait_status(proxy: Proxy, task_id: str, wanted: set[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(task_state(proxy, task_id))
        return seen["status"] in wanted

    wait_for_sync(reached, timeout_s=20, interval_s=0.1, what=lambda: f"task status in {wanted}, last {seen}")
    return seen


def test_a_task_capable_tool_is_listed_with_its_task_support(replicas: list[Proxy]) -> None:
    tools = {t["name"]: t for t in client(replicas[0]).result("tools/list", caps=TASKS)["tools"]}
    assert tools["legacy.long_job"]["execution"] == {"taskSupport": "optional"}
    assert "execution" not in tools["legacy.echo"]


def test_a_proxied_call_runs_as_a_task_polled_on_another_replica(replicas: list[Proxy]) -> None:
    first, second = replicas
    task_id = start_task(first, "legacy.long_job", {"seconds": 0.3})
    done = wait_status(second, task_id, TERMINAL)
    assert done["status"] == "completed", done
    assert done["result"]["content"] == [{"type": "text", "text": "worked 0.3"}]
    assert done["resultType"] == "complete"


def test_without_the_extension_the_tool_is_a_plain_call(replicas: list[Proxy]) -> None:
    out = client(replicas[0]).result("tools/call", {"name": "legacy.long_job", "arguments": {"seconds": 0}})
    assert out["resultType"] == "complete" and "taskId" not in out
    assert out["content"] == [{"type": "text", "text": "worked 0.0"}]


def test_an_upstream_question_parks_the_task_until_tasks_update(replicas: list[Proxy]) -> None:
    first, second = replicas
    task_id = start_task(first, "legacy.greet_user", {})
    parked = wait_status(second, task_id, {"input_required"} | TERMINAL)
    assert parked["status"] == "input_required", parked
    [(key, request)] = parked["inputRequests"].items()
    assert request["method"] == "elicitation/create"
    ack = client(second).result("tasks/update", {"taskId": task_id, "inputResponses": {
        key: {"action": "accept", "content": {"name": "Ada"}}}}, caps=TASKS)
    assert ack == {"resultType": "complete"}
    done = wait_status(first, task_id, TERMINAL)
    assert done["status"] == "completed", done
    assert done["result"]["content"][0]["text"] == "Hello, Ada!"


def test_tasks_cancel_cancels_the_upstream_request(replicas: list[Proxy], upstream: Upstream) -> None:
    first, second = replicas
    started, cancelled = upstream.marks("long_job"), upstream.marks(CANCELLED_MARK)
    task_id = start_task(first, "legacy.long_job", {"seconds": 60})
    wait_for_sync(lambda: upstream.marks("long_job") > started, what="long_job running on the upstream")
    assert client(second).result("tasks/cancel", {"taskId": task_id}, caps=TASKS) == {"resultType": "complete"}
    assert task_state(first, task_id)["status"] == "cancelled"
    wait_for_sync(lambda: upstream.marks(CANCELLED_MARK) > cancelled, timeout_s=15,
                  what="the upstream handler cancelled (notifications/cancelled)")


@pytest.fixture
def narrow(redis_server: str, upstream: Upstream, tmp_path: Path) -> Iterator[Proxy]:
    """A proxy with two slots for the upstream, a principal's share one of them; a call gets 3 s for a slot."""
    db = redis_server.rsplit("/", 1)[0] + "/5"
    with redis_sync.Redis.from_url(db) as client:
        client.flushdb()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PROXY_AUTH_ENV, f"Bearer {upstream.token}")
        proxy = start_proxy(db, [upstream], tmp_path / "proxy.log", concurrency=2, timeout_s=3.0)
    yield proxy
    stop(proxy.proc)


def test_one_principals_tasks_leave_slots_for_another(narrow: Proxy, upstream: Upstream) -> None:
    alice, bob = client(narrow), Client(narrow.base, BOB_KEY, MODERN)
    started = upstream.marks("long_job")
    tasks = [start_task(narrow, "legacy.long_job", {"seconds": 600}) for _ in range(2)]
    try:
        wait_for_sync(lambda: upstream.marks("long_job") > started, what="alice's first task running upstream")
        # Alice's second task waits for her first to end; bob's call is not held behind either.
        answer = bob.call("tools/call", {"name": "legacy.echo", "arguments": {"text": "hi"}})
        assert answer.get("result", {}).get("content") == [{"type": "text", "text": "hi"}], answer
        states: dict[str, dict[str, Any]] = {}

        def one_refused() -> bool:
            states.update({t: task_state(narrow, t) for t in tasks})
            return any(s["status"] == "failed" for s in states.values())

        wait_for_sync(one_refused, timeout_s=20, interval_s=0.2, what=lambda: f"alice's second task refused: {states}")
        [failed] = [s for s in states.values() if s["status"] == "failed"]
        assert "its share of the upstream's concurrency" in str(failed), failed
        assert upstream.marks("long_job") == started + 1
    finally:
        for task_id in tasks:
            alice.call("tasks/cancel", {"taskId": task_id}, caps=TASKS)
