"""Pytest fixtures: upstream MCP servers for the proxy tests, run as real processes.

A test module loads them with ``pytest_plugins = ("tests.proxy_support",)`` and imports
helpers from ``tests.proxy.harness``. ``legacy_upstream`` / ``modern_upstream`` are SDK
servers pinned to 2025-11-25 / 2026-07-28, each on a free port behind a fresh bearer token
(``upstream_token``); the fixture waits until the port answers and stops the process after
the test. ``stdio_upstream`` is the command line a proxy runs for the stdio upstream.
``kill_mid_call`` runs a call, SIGKILLs the upstream once the call is in flight on it, and
hands back how the call ended.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conformance.http_guards import LEGACY, MODERN
from tests.conftest import wait_for
from tests.proxy.harness import CallOutcome, Upstream, start_http_upstream, stdio_upstream_spec, stop_upstream


@pytest.fixture
def upstream_token() -> str:
    """A fresh bearer token per test: easy to look for in responses and logs."""
    return "upstream-secret-" + secrets.token_hex(16)


@pytest.fixture
def legacy_upstream(tmp_path: Path, upstream_token: str) -> Iterator[Upstream]:
    """An SDK upstream that speaks 2025-11-25 sessions only, behind a bearer token."""
    up = start_http_upstream("legacy", LEGACY, tmp_path, upstream_token)
    yield up
    stop_upstream(up)


@pytest.fixture
def modern_upstream(tmp_path: Path, upstream_token: str) -> Iterator[Upstream]:
    """An SDK upstream that speaks 2026-07-28 only, behind a bearer token."""
    up = start_http_upstream("modern", MODERN, tmp_path, upstream_token)
    yield up
    stop_upstream(up)


@pytest.fixture
def stdio_upstream(tmp_path: Path) -> Upstream:
    """The stdio upstream's command line and environment."""
    return stdio_upstream_spec("local", tmp_path)


@pytest.fixture
def kill_mid_call() -> Callable[[Upstream, Callable[[], Awaitable[Any]]], Awaitable[CallOutcome]]:
    """``await kill_mid_call(upstream, call)``: run ``call()`` (it must reach the upstream's
    ``slow`` tool), SIGKILL the upstream as soon as the call has started there, and return how
    the call ended — within ``timeout_s``, or the test fails: a dead upstream must never hang."""

    async def run(up: Upstream, call: Callable[[], Awaitable[Any]], timeout_s: float = 30.0) -> CallOutcome:
        before = up.calls_started()
        task = asyncio.ensure_future(call())
        try:
            await wait_for(lambda: task.done() or up.calls_started() > before, timeout_s=timeout_s,
                           what=f"the call to reach upstream {up.name}")
            if task.done():
                raise AssertionError(f"the call ended before reaching upstream {up.name}: {task.result()!r}")
            up.kill()
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                raise AssertionError(f"the call hung after upstream {up.name} was killed")
            if task.cancelled():  # the client tore its connection down under the call
                return "cancelled", None
            error = task.exception()
            return ("error", error) if error is not None else ("result", task.result())
        finally:
            task.cancel()

    return run
