"""Test fixtures shared by every test module.

Tests run against a real Redis server: a private ``redis-server`` started for the test
session on a free port (so parallel runs never share state), or — when no binary is on
PATH — the one answering on 127.0.0.1:6379 (database 15). Each test gets a flushed
database. ``wait_for`` replaces sleeps: poll a condition until it holds or time runs out.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis as redis_sync

from shared.net import free_port


def _describe(what: str | Callable[[], str]) -> str:
    """``what`` of a wait: a string, or a callable asked only on timeout (so a message can
    carry a process's output as it was when the wait gave up)."""
    return what() if callable(what) else what


def wait_for_sync(cond: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02,
                  what: str | Callable[[], str] = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {_describe(what)}")
        time.sleep(interval_s)


async def wait_for(cond: Callable[[], Awaitable[object] | object], timeout_s: float = 10.0,
                   interval_s: float = 0.02, what: str | Callable[[], str] = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {_describe(what)}")
        await asyncio.sleep(interval_s)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    binary = shutil.which("redis-server")
    if binary is None or os.environ.get("LEARNMESH_TEST_REDIS_URL"):
        yield os.environ.get("LEARNMESH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
        return
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="lm-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--maxmemory-policy", "noeviction",
                             "--notify-keyspace-events", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis_sync.Redis.from_url(url) as client:
            wait_for_sync(lambda: _ping(client), timeout_s=10, what="redis-server to answer")
        yield url
    finally:  # also when it never answered: no server left running, no process left unreaped
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _ping(client: redis_sync.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis_sync.ConnectionError:
        return False


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A flushed database on the session's Redis server."""
    client = redis_sync.Redis.from_url(redis_server)
    client.flushdb()
    client.close()
    yield redis_server
