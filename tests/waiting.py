"""Polling waits, the tests' replacement for sleeps: a condition is polled until it holds or
time runs out. Free of pytest, so the drills in tests/ also run from bench/ (bench/drills.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


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
