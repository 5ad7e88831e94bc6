"""The official SDK client through the learnmesh proxy to the official SDK's servers, end to end.

Every piece is a real process: two SDK upstreams over Streamable HTTP, one speaking only
2025-11-25 and one only 2026-07-28, each behind its own bearer token; the stdio SDK upstream
the proxy runs itself; and a learnmesh gateway whose ``proxy`` section mounts all three
(``legacy.*``, ``modern.*``, ``local.*``). The SDK client connects to the gateway in legacy
mode (2025-11-25 sessions) and pinned to 2026-07-28, so each pair crosses the revision
boundary at least once. The proxy logs at DEBUG into a file that is searched for the token.
The module runs once per Redis kind (single server, cluster), each with a gateway of its own.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from mcp.shared.exceptions import MCPError

from conformance.http_guards import LEGACY, MODERN
from shared import keys
from shared.redis_client import close_sync
from tests.conftest import RedisTarget
from tests.gateway_support import stop
from tests.proxy.harness import (
    ADMIN_KEY,
    ALICE_KEY,
    BOB_KEY,
    ELICITED_NAME,
    PROXY_AUTH_ENV,
    SAMPLED_TEXT,
    Proxy,
    Upstream,
    launch,
    leaf_errors,
    sdk_client,
    start_http_upstream,
    start_proxy,
    stdio_upstream_spec,
    stop_upstream,
)
from tests.proxy.upstreams.server import FAIL_MESSAGE, PNG_1PX, STATIC_TEXT, STATIC_URI

pytest_plugins = ("tests.proxy_support",)

MODES = ["legacy", MODERN]
UPSTREAMS = ["legacy", "modern", "local"]
ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB = {"Authorization": f"Bearer {BOB_KEY}"}


@pytest.fixture(scope="module")
def upstream_token() -> str:
    return "upstream-secret-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory, upstream_token: str) -> Iterator[dict[str, Upstream]]:
    """One set of upstream processes for the module (a test that kills one starts it again)."""
    workdir = tmp_path_factory.mktemp("upstreams")
    started: dict[str, Upstream] = {}
    try:
        started["legacy"] = start_http_upstream("legacy", LEGACY, workdir, upstream_token)
        started["modern"] = start_http_upstream("modern", MODERN, workdir, upstream_token)
        started["local"] = stdio_upstream_spec("local", workdir)
        yield started
    finally:
        for up in started.values():
            stop_upstream(up)


@pytest.fixture(scope="module")
def proxy(redis_target_module: RedisTarget, upstreams: dict[str, Upstream], upstream_token: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """The proxy gateway of one Redis kind (its Redis flushed as the kind's run begins); bob may
    use the modern and stdio upstreams only."""
    allow = {"principals": {"alice": ["*"], "bob": ["modern", "local"]}}
    with pytest.MonkeyPatch.context() as env:  # what the gateway process inherits
        env.setenv(PROXY_AUTH_ENV, f"Bearer {upstream_token}")
        gateway = start_proxy(redis_target_module.url, list(upstreams.values()),
                              tmp_path_factory.mktemp("proxy") / "proxy.log", allow=allow)
    yield gateway
    stop(gateway.proc)


def expected_revision(name: str, upstreams: dict[str, Upstream]) -> set[str]:
    """What the upstream may see: its pinned revision; the stdio one serves both."""
    revision = upstreams[name].revision
    return {LEGACY, MODERN} if revision == "both" else {revision}


@pytest.mark.parametrize("mode", MODES)
async def test_tools_of_every_upstream_are_listed_namespaced(proxy: Proxy, mode: str) -> None:
    async with sdk_client(proxy.url, mode, ALICE) as client:
        names = {t.name for t in (await client.list_tools()).tools}
    for ns in UPSTREAMS:
        assert {f"{ns}.echo", f"{ns}.add", f"{ns}.slow", f"{ns}.greet_user"} <= names, names
    assert "echo" not in names
    assert "t_echo" in names  # the gateway's own tools stay beside the upstreams'


@pytest.mark.parametrize("upstream", UPSTREAMS)
@pytest.mark.parametrize("mode", MODES)
async def test_calls_reach_each_upstream(proxy: Proxy, upstreams: dict[str, Upstream], redis_target_module: RedisTarget,
                                         mode: str, upstream: str) -> None:
    async with sdk_client(proxy.url, mode, ALICE) as client:
        echoed = await client.call_tool(f"{upstream}.echo", {"text": "through"})
        assert not echoed.is_error and echoed.content[0].text == "through"
        added = await client.call_tool(f"{upstream}.add", {"a": 20, "b": 22})
        assert added.structured_content == {"total": 42, "operands": [20, 22]}
        image = (await client.call_tool(f"{upstream}.image", {})).content[0]
        assert image.mime_type == "image/png" and base64.b64decode(image.data) == PNG_1PX
        failed = await client.call_tool(f"{upstream}.fail", {})
        assert failed.is_error and FAIL_MESSAGE in failed.content[0].text
        seen = (await client.call_tool(f"{upstream}.revision", {})).content[0].text
        assert seen in expected_revision(upstream, upstreams)
    if upstream == "legacy":  # its 2025-11-25 session is held in this kind's Redis, for any replica
        assert upstream_sessions(redis_target_module, "alice", upstream)


def upstream_sessions(target: RedisTarget, principal: str, upstream: str) -> list[bytes]:
    """The keys of ``principal``'s sessions at ``upstream`` (keys.proxy_session), on every master."""
    client = target.sync_client()
    try:
        return list(client.scan_iter(match=keys.proxy_session(principal, f"{upstream}/*")))
    finally:
        close_sync(client)


@pytest.mark.parametrize("upstream", UPSTREAMS)
@pytest.mark.parametrize("mode", MODES)
async def test_progress_crosses_the_proxy(proxy: Proxy, mode: str, upstream: str) -> None:
    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async with sdk_client(proxy.url, mode, ALICE) as client:
        done = await client.call_tool(f"{upstream}.progress", {"steps": 3}, progress_callback=on_progress)
    assert done.content[0].text == "3 steps done"
    assert seen == [1, 2, 3]


@pytest.mark.parametrize("upstream", UPSTREAMS)
@pytest.mark.parametrize("mode", MODES)
async def test_upstream_questions_reach_the_client(proxy: Proxy, mode: str, upstream: str) -> None:
    """Elicitation and sampling asked by the upstream are answered by the SDK client's callbacks,
    the way the client's revision expects (its session's stream, or input_required)."""
    async with sdk_client(proxy.url, mode, ALICE) as client:
        greeted = await client.call_tool(f"{upstream}.greet_user", {})
        assert greeted.content[0].text == f"Hello, {ELICITED_NAME}!", greeted
        sampled = await client.call_tool(f"{upstream}.ask_model", {"prompt": "Capital of France?"})
        assert sampled.content[0].text == f"model said: {SAMPLED_TEXT}", sampled


@pytest.mark.parametrize("upstream", UPSTREAMS)
@pytest.mark.parametrize("mode", MODES)
async def test_resources_and_prompts_cross_the_proxy(proxy: Proxy, mode: str, upstream: str) -> None:
    async with sdk_client(proxy.url, mode, ALICE) as client:
        listed = [str(r.uri) for r in (await client.list_resources()).resources]
        static = [uri for uri in listed if uri.endswith(quote(STATIC_URI, safe="")) and f"/{upstream}/" in uri]
        assert len(static) == 1, listed
        read = await client.read_resource(static[0])
        assert read.contents[0].text == STATIC_TEXT
        templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates
                     if f"/{upstream}/" in t.uri_template or t.uri_template.startswith(f"{upstream}")]
        assert len(templates) == 1, templates
        item = await client.read_resource(templates[0].replace("{item_id}", "42"))
        assert '"item": "42"' in item.contents[0].text
        prompt = await client.get_prompt(f"{upstream}.greeting", {"person": "Grace"})
        assert prompt.messages[0].content.text == "Please greet Grace warmly."


@pytest.mark.parametrize("mode", MODES)
async def test_principal_denied_an_upstream(proxy: Proxy, mode: str) -> None:
    async with sdk_client(proxy.url, mode, BOB) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert "modern.echo" in names and "local.echo" in names
        assert not any(n.startswith("legacy.") for n in names), names
        try:
            denied = await client.call_tool("legacy.echo", {"text": "x"})
        except MCPError as exc:
            assert "legacy" in str(exc) or "not" in str(exc).lower()
        else:
            assert denied.is_error, denied
            assert "secret" not in denied.content[0].text
        assert (await client.call_tool("modern.echo", {"text": "ok"})).content[0].text == "ok"


async def test_credentials_never_leave_the_proxy(proxy: Proxy, upstreams: dict[str, Upstream],
                                                 upstream_token: str) -> None:
    """Every answer (MCP in both revisions, the admin API) and every log line of the proxy,
    at DEBUG, is searched for the bearer token it sends upstream."""
    answers = [*await raw_mcp_answers(proxy, LEGACY), *await raw_mcp_answers(proxy, MODERN)]
    async with httpx.AsyncClient(timeout=10) as http:
        admin = await http.get(f"{proxy.base}/admin/upstreams", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200, admin.text
    assert "legacy" in admin.text
    answers.append(admin.text)
    assert any("through" in a for a in answers)
    leaks = [a for a in answers if upstream_token in a]
    assert not leaks, leaks[0][:300]
    log = proxy.log()
    assert "DEBUG" in log  # the log really is at DEBUG
    assert upstream_token not in log, [line for line in log.splitlines() if upstream_token in line][:3]


async def raw_mcp_answers(proxy: Proxy, revision: str) -> list[str]:
    """The raw bodies of a few MCP exchanges with the proxy, including a failing call."""
    from tests.proxy_front import Client

    client = Client(proxy.base, ALICE_KEY, revision).open()
    calls = [("tools/list", {}), ("tools/call", {"name": "legacy.echo", "arguments": {"text": "through"}}),
             ("tools/call", {"name": "modern.fail", "arguments": {}}),
             ("tools/call", {"name": "legacy.echo", "arguments": {"text": 5}}),
             ("resources/list", {}), ("prompts/list", {})]
    return [client.post(method, params).text for method, params in calls]


async def test_a_refused_upstream_credential_is_reported_not_echoed(redis_target_module: RedisTarget,
                                                                    legacy_upstream: Upstream, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong token: the upstream answers 401; the client gets a clear error naming the
    upstream, and neither the answer nor the log carries the token that was tried. The gateway
    shares the module proxy's Redis; it is called as bob, whom that proxy never lets reach a
    ``legacy`` upstream, so the two never share an upstream session."""
    wrong = "wrong-" + legacy_upstream.token
    monkeypatch.setenv(PROXY_AUTH_ENV, f"Bearer {wrong}")
    gateway = start_proxy(redis_target_module.url, [legacy_upstream], tmp_path / "proxy.log")
    try:
        with pytest.raises(BaseException) as caught:
            async with sdk_client(gateway.url, MODERN, BOB) as client:
                result = await client.call_tool("legacy.echo", {"text": "x"})
                assert result.is_error, result
                raise AssertionError(result.content[0].text)
        texts = [str(e) for e in leaf_errors(caught.value)]
        assert any("legacy" in t or "bearer token" in t for t in texts), texts  # the proxy's or the upstream's words
        assert not any(wrong in t for t in texts)
        assert wrong not in gateway.log()
    finally:
        stop(gateway.proc)


@pytest.mark.parametrize(("mode", "upstream"), [("legacy", "modern"), (MODERN, "legacy"), (MODERN, "local")])
async def test_upstream_killed_mid_call(proxy: Proxy, upstreams: dict[str, Upstream], kill_mid_call: Any,
                                        mode: str, upstream: str) -> None:
    """A clear error for the call in flight, no hang; the other upstreams and the gateway's own
    tools keep working on the same connection."""
    victim = upstreams[upstream]
    other = "legacy" if upstream != "legacy" else "modern"
    async with sdk_client(proxy.url, mode, ALICE) as client:
        outcome, value = await kill_mid_call(victim, lambda: client.call_tool(f"{upstream}.slow", {"seconds": 60}))
        if outcome == "result":
            assert value.is_error, value
            text = value.content[0].text
        else:
            assert outcome == "error" and isinstance(value, MCPError), (outcome, value)
            text = str(value)
        assert upstream in text, text
        assert (await client.call_tool(f"{other}.echo", {"text": "still here"})).content[0].text == "still here"
        own = await client.call_tool("t_echo", {"text": "own"})
        assert own.content[0].text == "alice:own"
    launch(victim)  # for the tests after this one
