"""Background loops stop when asked even if a cancel was swallowed on the way (shared/aio.py)."""

from __future__ import annotations

import asyncio

import pytest

from shared.aio import pause, stop_if_cancelled


async def _loop_that_loses_one_cancel(rounds: list[int]) -> None:
    """A retry loop whose polled call swallows the cancel, as asyncio.wait_for does on
    Python 3.11 when the awaited call completes in the same loop turn."""
    while True:
        rounds.append(1)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # swallowed: the loop carries on as after an ordinary poll
        await pause(0.01)


async def test_a_loop_stops_at_its_next_pause_after_a_swallowed_cancel() -> None:
    rounds: list[int] = []
    task = asyncio.create_task(_loop_that_loses_one_cancel(rounds))
    while not rounds:
        await asyncio.sleep(0)
    task.cancel()  # once, as closing an event loop does
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()
    assert len(rounds) == 1


async def test_pause_sleeps_in_a_task_not_asked_to_stop() -> None:
    async def one_round() -> str:
        stop_if_cancelled()
        await pause(0)
        return "slept"
    assert await asyncio.create_task(one_round()) == "slept"


async def test_stop_if_cancelled_raises_only_after_a_cancel_request() -> None:
    async def body() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        stop_if_cancelled()
    task = asyncio.create_task(body())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
