"""Through the proxy to an upstream serving the conformance suite's fixtures, in either
revision: SEP-2243 ``Mcp-Param-*`` headers checked at the proxy and sent on, completion of an
upstream prompt, and a client without a capability an upstream tool needs refused with -32021."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.admin_support import MCP_KEY
from tests.conftest import RedisTarget, wait_for_sync
from tests.proxy_front import LEGACY, MODERN, Client, front_gateway, read_stream, upstream_entry

pytest_plugins = ("tests.proxy_front_fixtures",)


@pytest.fixture
def redis_url(redis_target: RedisTarget) -> str:
    """The front gateways' Redis: a single server, then a cluster."""
    return redis_target.url

HEADER_MISMATCH = -32020
MISSING_CAPABILITY = -32021


def _header_call(client: Client, region_header: str | None) -> httpx.Response:
    params = {"name": "up.test_header_param", "arguments": {"region": "eu west"},
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    headers = {**client.auth, "mcp-protocol-version": MODERN, "mcp-method": "tools/call",
               "mcp-name": "up.test_header_param"}
    if region_header is not None:
        headers["mcp-param-region"] = region_header
    return httpx.post(client.url, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                         "params": params})


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_param_headers_are_checked_and_sent_on(redis_url: str, fixtures_upstream: str, upstream_rev: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(fixtures_upstream, revision=upstream_rev)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        assert "up.test_header_param" in client.names()
        ok = _header_call(client, "eu west")
        assert ok.status_code == 200 and ok.json()["result"]["content"][0]["text"] == "region=eu west"
        missing = _header_call(client, None)
        assert missing.status_code == 400 and missing.json()["error"]["code"] == HEADER_MISMATCH
        wrong = _header_call(client, "=?base64?SGVs!!!bG8=?=")
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == HEADER_MISMATCH


@pytest.mark.parametrize(("client_rev", "upstream_rev"), [(LEGACY, MODERN), (MODERN, LEGACY), (MODERN, MODERN)])
def test_completion_of_an_upstream_prompt(redis_url: str, fixtures_upstream: str, client_rev: str, upstream_rev: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(fixtures_upstream, revision=upstream_rev)]}) as base:
        client = Client(base, MCP_KEY, client_rev).open()
        assert "up.test_prompt_with_arguments" in client.names("prompts")
        out = client.result("completion/complete", {"ref": {"type": "ref/prompt", "name": "up.test_prompt_with_arguments"},
                                                    "argument": {"name": "arg1", "value": "pa"}})
        assert set(out["completion"]["values"]) >= {"paris", "park", "party"}


@pytest.mark.parametrize("upstream_rev", [LEGACY, MODERN])
def test_missing_client_capability_is_refused(redis_url: str, fixtures_upstream: str, upstream_rev: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(fixtures_upstream, revision=upstream_rev)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        refused = client.post("tools/call", {"name": "up.test_missing_capability", "arguments": {}}, caps={})
        assert refused.json()["error"]["code"] == MISSING_CAPABILITY and refused.status_code == 400
        allowed = client.result("tools/call", {"name": "up.test_missing_capability", "arguments": {}},
                                caps={"sampling": {}})
        assert allowed["content"][0]["text"] == "Success"


def test_upstream_list_changed_reaches_listen_streams(redis_url: str, fixtures_upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(fixtures_upstream, revision=MODERN)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        seen: list[dict] = []
        params = {"notifications": {"toolsListChanged": True},
                  "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                            "io.modelcontextprotocol/clientCapabilities": {}}}
        headers = {**client.auth, "mcp-protocol-version": MODERN, "mcp-method": "subscriptions/listen"}

        body = {"jsonrpc": "2.0", "id": 7, "method": "subscriptions/listen", "params": params}
        reader = threading.Thread(target=read_stream, daemon=True,
                                  args=("POST", client.url, headers, body, seen, "notifications/tools/list_changed"))
        reader.start()
        wait_for_sync(lambda: seen, timeout_s=10, what="the listen stream's acknowledgement")

        def changed() -> bool:  # the upstream announces the change to the proxy's own standing stream
            client.result("tools/call", {"name": "up.test_trigger_tool_change", "arguments": {}})
            reader.join(0.5)
            return any(m.get("method") == "notifications/tools/list_changed" for m in seen)

        wait_for_sync(changed, timeout_s=20, what="the upstream's tools/list_changed on the client's listen stream")
        note = next(m for m in seen if m.get("method") == "notifications/tools/list_changed")
        assert note["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 7


def test_upstream_tasks_are_followed_through_the_proxy(redis_url: str, fixtures_upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(fixtures_upstream, revision=MODERN)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        caps = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
        created = client.result("tools/call", {"name": "up.slow_compute", "arguments": {"seconds": 0.2}}, caps=caps)
        assert created["resultType"] == "task" and created["ttlMs"] > 0
        task = {"taskId": created["taskId"]}

        def status() -> str:
            return client.result("tasks/get", task, caps=caps)["status"]

        wait_for_sync(lambda: status() == "completed", timeout_s=15, what="the upstream's task to complete")
        done = client.result("tasks/get", task, caps=caps)
        assert done["taskId"] == created["taskId"]
        unknown = client.call("tasks/get", {"taskId": "not-a-task"}, caps=caps)
        assert unknown["error"]["code"] == -32602  # the gateway's own answer for a task nobody created


def test_concurrent_questions_of_a_legacy_upstream_come_in_one_input_required(redis_url: str,
                                                                              fixtures_upstream: str) -> None:
    with front_gateway(redis_url, {"upstreams": [upstream_entry(fixtures_upstream, revision=LEGACY)]}) as base:
        client = Client(base, MCP_KEY, MODERN).open()
        caps = {"sampling": {}, "elicitation": {}, "roots": {}}
        call = {"name": "up.test_input_required_result_multiple_inputs", "arguments": {}}
        first = client.result("tools/call", call, caps=caps)
        assert first["resultType"] == "input_required"
        methods = sorted(r["method"] for r in first["inputRequests"].values())
        assert methods == ["elicitation/create", "roots/list", "sampling/createMessage"]
        answers = {key: {"elicitation/create": {"action": "accept", "content": {"name": "Ada"}},
                         "sampling/createMessage": {"role": "assistant", "model": "m",
                                                    "content": {"type": "text", "text": "Hi"}},
                         "roots/list": {"roots": [{"uri": "file:///r", "name": "r"}]}}[r["method"]]
                   for key, r in first["inputRequests"].items()}
        done = client.result("tools/call", {**call, "requestState": first["requestState"], "inputResponses": answers},
                             caps=caps)
        assert done["content"][0]["text"] == "Name: Ada; Greeting: Hi; Roots: 1"
