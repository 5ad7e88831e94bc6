"""Replicas that share a principal's upstream session (2025-11-25) or the upstream's credential
(2026-07-28) send it request ids that never collide: an upstream routes answers and
cancellations by id, so two calls under one id would get each other's fate."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.admin_support import MCP_KEY
from tests.conftest import wait_for_sync
from tests.proxy.harness import Upstream, start_http_upstream, stop_upstream
from tests.proxy_front import LEGACY, Client, front_gateway


@pytest.fixture
def sdk_upstream(tmp_path: Path) -> Iterator[Upstream]:
    up = start_http_upstream("sdk", LEGACY, tmp_path)
    yield up
    stop_upstream(up)


def test_replicas_sharing_an_upstream_session_never_take_each_others_answers(redis_url: str,
                                                                             sdk_upstream: Upstream) -> None:
    proxy = {"upstreams": [{"name": "up", "url": sdk_upstream.url, "revision": LEGACY, "timeout_s": 15.0}]}
    with front_gateway(redis_url, proxy) as a, front_gateway(redis_url, proxy) as b:
        first, second = Client(a, MCP_KEY, LEGACY).open(), Client(b, MCP_KEY, LEGACY).open()
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(first.call, "tools/call", {"name": "up.slow", "arguments": {"seconds": 6}})
            wait_for_sync(lambda: sdk_upstream.marks("slow") == 1, timeout_s=10, what="the slow call upstream")
            # Replica b continues replica a's upstream session, with as many calls as it takes its
            # ids to pass those replica a has used.
            for n in range(30):
                echo = second.result("tools/call", {"name": "up.echo", "arguments": {"text": f"b{n}"}})
                assert echo["content"][0]["text"] == f"b{n}"
            answer = slow.result(timeout=30)
        assert "result" in answer, answer
        assert answer["result"]["content"][0]["text"] == "slept 6.0"
