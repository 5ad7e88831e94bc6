"""The official Python SDK client (``mcp`` v2) against a live gateway, in both revisions.

The gateway runs as a real process (``learnmesh gateway --fixtures conformance``) on a free
port with the test's Redis; the SDK client talks Streamable HTTP to it: in legacy mode
(2025-11-25 initialize handshake, ``Mcp-Session-Id``) and pinned to 2026-07-28
(stateless, per-request ``_meta``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import Client

from tests.conftest import RedisTarget, free_port, wait_for_sync

ROOT = Path(__file__).resolve().parents[1]
MODES = ["legacy", "2026-07-28"]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture
def gateway_url(redis_target: RedisTarget, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    env["REDIS_URL"] = redis_target.url
    log = (tmp_path / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
         "--fixtures", "conformance"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_sync(lambda: proc.poll() is not None or _healthy(f"http://127.0.0.1:{port}/healthz"),
                      timeout_s=30, what="gateway /healthz")
        if proc.poll() is not None:
            raise AssertionError("gateway exited at start:\n" + (tmp_path / "gateway.log").read_text())
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("mode", MODES)
async def test_sdk_client_lists_calls_reads_and_gets(gateway_url: str, mode: str) -> None:
    async with Client(gateway_url, mode=mode, cache=None) as client:
        tools = await client.list_tools()
        names = {t.name for t in tools.tools}
        assert {"test_simple_text", "test_image_content", "test_error_handling"} <= names

        called = await client.call_tool("test_simple_text", {})
        assert not called.is_error
        assert called.content[0].text == "This is a simple text response for testing."

        failed = await client.call_tool("test_error_handling", {})
        assert failed.is_error
        assert "intentionally returns an error" in failed.content[0].text

        read = await client.read_resource("test://static-text")
        assert read.contents[0].text == "This is the content of the static text resource."

        templated = await client.read_resource("test://template/42/data")
        assert '"id": "42"' in templated.contents[0].text

        prompt = await client.get_prompt("test_prompt_with_arguments", {"arg1": "alpha", "arg2": "beta"})
        assert prompt.messages[0].content.text == "Prompt with arguments: arg1='alpha', arg2='beta'"


async def test_sdk_client_answers_input_required_on_2026(gateway_url: str) -> None:
    """The SDK drives the 2026-07-28 input_required loop; the gateway's sealed requestState
    carries the first answer into the second round."""
    async def elicit(context, params):  # noqa: ANN001, ANN202 - SDK callback signature
        from mcp.types import ElicitResult
        field = next(iter(params.requested_schema["properties"]))
        return ElicitResult(action="accept", content={field: "Ada" if field == "name" else "green"})

    async with Client(gateway_url, mode="2026-07-28", cache=None, elicitation_callback=elicit) as client:
        out = await client.call_tool("test_input_required_result_multi_round", {})
        assert out.content[0].text == "Multi-round complete for Ada who likes green"
