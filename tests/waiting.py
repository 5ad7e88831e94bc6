"""Polling waits, the tests' replacement for sleeps: a condition is polled until it holds or
time runs out. Free of pytest, so the drills in tests/ also run from bench/ (bench/drills.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path


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


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (Linux: /proc), not
    merely that something answers there: a server that lost its port to another process answers
    as that process."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False
