"""What the mesh's long-running asyncio loops share.

A background loop catches the errors of what it polls (Redis away, an upstream gone) and
tries again. On Python 3.11 a cancel can reach such a loop disguised or not at all:
``asyncio.wait_for`` returns the result of an await that completed in the same loop turn
as the cancel, and ``asyncio.timeout`` raises ``TimeoutError`` for a cancel that lands as it
expires. The loop would then go on for ever, and closing the event loop (which cancels
each task once) would wait for it for ever. ``Task.cancelling()`` still counts the request,
so each loop asks it once per round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


def cancelling() -> bool:
    """Whether the running task was asked to stop (also when the request was swallowed)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` in a task that was asked to stop and is still running."""
    if cancelling():
        raise asyncio.CancelledError


async def pause(seconds: float) -> None:
    """``asyncio.sleep`` for a background loop's next round, unless it was asked to stop."""
    stop_if_cancelled()
    await asyncio.sleep(seconds)


def spawn(coro: Coroutine[Any, Any, Any], tasks: set[asyncio.Task[Any]], what: str) -> asyncio.Task[Any]:
    """Run ``coro`` in the background, held in ``tasks`` (the owner cancels them when it
    stops) until it ends; a failure is logged as ``what`` failing, never raised to anyone."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)

    def done(t: asyncio.Task[Any]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("%s failed: %s", what, type(t.exception()).__name__)

    task.add_done_callback(done)
    return task
