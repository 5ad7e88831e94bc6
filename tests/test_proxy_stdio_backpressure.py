"""A stdio upstream that writes faster than the gateway takes in, that stops reading its input,
or that sends what no request of the gateway's awaits, on a real process (tests/proxy/flooding_stdio.py):
the gateway holds a bounded part of its output, fails what waits on a process that no longer reads
with a clear error, stops that process and starts another for the next request."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.proxy.errors import WireClosed
from gateway.proxy.wire import (
    MAX_OPEN_QUESTIONS,
    NO_HOOKS,
    STDIO_READ_BUFFER_BYTES,
    Answer,
    Hooks,
    Message,
    StdioWire,
)
from tests.waiting import wait_for

FLOODING = str(Path(__file__).resolve().parent / "proxy" / "flooding_stdio.py")
NOTES = 200_000  # about 17 MB of progress notifications
# The reader's buffer (reading pauses at twice it), what a pipe holds (64 KiB on Linux, up to 1 MiB
# when resized), and the line in hand.
HELD_AT_MOST_BYTES = 2 * STDIO_READ_BUFFER_BYTES + (1 << 20) + 1024


def _wire(tmp_path: Path, hooks: Hooks = NO_HOOKS, write_timeout_s: float = 30.0) -> StdioWire:
    return StdioWire([sys.executable, FLOODING, str(tmp_path / "blocked")], {}, hooks, write_timeout_s)


async def _ask(wire: StdioWire, rid: int, method: str, hooks: Hooks = NO_HOOKS, **params: Any) -> Answer:
    body = orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
    return await wire.send(body, {}, rid, hooks)


def _pid(answer: Answer) -> int:
    assert answer.message is not None
    return int(answer.message["result"]["pid"])


async def test_output_faster_than_the_gateway_takes_it_waits_in_the_pipe_and_all_arrives_in_order(
        tmp_path: Path) -> None:
    """While the one taking the notifications is slow, the gateway reads no further than its
    buffer: the process finds its pipe full having written no more than that, and the gateway
    holds one notification in hand, not a task per line read. Once taken, every one arrives, in
    order, then the answer."""
    release = asyncio.Event()
    seen: list[Any] = []
    taking = 0

    async def notify(msg: Message) -> None:
        nonlocal taking
        taking += 1
        await release.wait()
        seen.append(msg["params"]["progress"])
        taking -= 1

    wire, mark = _wire(tmp_path), tmp_path / "blocked"
    try:
        call = asyncio.create_task(_ask(wire, 1, "flood", Hooks(notify=notify), n=NOTES))
        await wait_for(lambda: taking and mark.exists(), timeout_s=30, what="the process to find its pipe full")
        assert taking == 1 and not wire._side
        assert int(mark.read_text()) <= HELD_AT_MOST_BYTES
        release.set()
        answer = await asyncio.wait_for(call, 60)
        assert answer.message is not None and answer.message["result"] == {"flooded": NOTES}
        assert seen == list(range(NOTES))
    finally:
        await wire.close()


async def test_a_process_that_stops_reading_its_input_is_stopped_and_the_next_request_starts_another(
        tmp_path: Path) -> None:
    wire = _wire(tmp_path, write_timeout_s=1.0)
    try:
        deaf_pid = _pid(await _ask(wire, 1, "pid"))
        stuck = asyncio.create_task(_ask(wire, 2, "deaf"))  # reads no more input, answers nothing
        with pytest.raises(WireClosed, match="read none of its input for 1 s and was stopped"):
            await asyncio.wait_for(_ask(wire, 3, "pid", pad="x" * (4 << 20)), 30)  # more than a pipe holds
        with pytest.raises(WireClosed, match="read none of its input"):
            await asyncio.wait_for(stuck, 30)
        await asyncio.wait_for(wire.exited(), 30)
        assert not Path(f"/proc/{deaf_pid}").exists()
        assert _pid(await asyncio.wait_for(_ask(wire, 4, "pid"), 30)) != deaf_pid
    finally:
        await wire.close()


async def test_what_no_request_awaits_is_dropped_and_a_flood_of_questions_is_refused_beyond_the_bound(
        tmp_path: Path) -> None:
    """Answers to ids the gateway never sent (one of them ``true``), a subscription id that is a
    list, notifications for no request: none of them ends the process or reaches the request.
    Questions beyond MAX_OPEN_QUESTIONS at once are refused, not each given a task."""
    asked: list[Any] = []
    hold = asyncio.Event()
    open_now = most_open = 0

    async def ask(msg: Message) -> Message:
        nonlocal open_now, most_open
        asked.append(msg["id"])
        open_now += 1
        most_open = max(most_open, open_now)
        await hold.wait()
        open_now -= 1
        return {"jsonrpc": "2.0", "id": msg["id"], "result": {}}

    wire = _wire(tmp_path)
    questions = MAX_OPEN_QUESTIONS * 4
    try:
        call = asyncio.create_task(_ask(wire, 7, "crafted", Hooks(ask=ask), questions=questions))
        await wait_for(lambda: len(asked) >= MAX_OPEN_QUESTIONS, timeout_s=30, what="questions within the bound")
        hold.set()
        answer = await asyncio.wait_for(call, 30)
        assert answer.message is not None
        assert most_open == MAX_OPEN_QUESTIONS and answer.message["result"]["refused"] == questions - len(asked)
        assert wire.running
    finally:
        await wire.close()


