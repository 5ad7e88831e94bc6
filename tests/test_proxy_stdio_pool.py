"""The stdio process pool on its own, with real processes (a line-echoing JSON-RPC responder
that answers every request with its pid): a principal whose process died takes room like a new
one, a held process is never the one stopped, and closing reaps every process."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import orjson
import pytest

from gateway.proxy.errors import StdioCapReached, WireClosed
from gateway.proxy.stdio_pool import CATALOG, StdioPool
from gateway.proxy.wire import NO_HOOKS, StdioWire

RESPONDER = """
import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" in msg and "method" in msg:
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": {"pid": os.getpid()}}), flush=True)
"""


def _pool(max_processes: int) -> StdioPool:
    return StdioPool("local", [sys.executable, "-c", RESPONDER], {}, max_processes, idle_s=300.0)


async def _pid(wire: StdioWire) -> int:
    answer = await wire.send(orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}), {}, 1, NO_HOOKS)
    assert answer.message is not None
    return int(answer.message["result"]["pid"])


async def _pid_of(pool: StdioPool, key: str) -> int:
    async with pool.lease(key) as wire:
        return await _pid(wire)


def _exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def test_a_principal_whose_process_died_takes_room_like_a_new_one() -> None:
    pool = _pool(max_processes=1)
    try:
        first = await _pid_of(pool, "alice")
        os.kill(first, signal.SIGKILL)
        async with pool.lease("alice") as wire:
            await wire.exited()
        bob = await _pid_of(pool, "bob")  # alice's process is gone: room without stopping anyone
        again = await _pid_of(pool, "alice")  # started again: bob's, idle, makes room
        assert again != first and _exists(again) and not _exists(bob)
        assert pool.running == 1
    finally:
        await pool.close()


async def test_a_held_process_is_never_stopped_to_make_room() -> None:
    pool = _pool(max_processes=1)
    try:
        listed = await _pid_of(pool, CATALOG)  # the lists' process is not counted
        async with pool.lease("alice") as wire:
            alice = await _pid(wire)
            with pytest.raises(StdioCapReached) as refused:
                async with pool.lease("bob"):
                    pass
            assert "'local'" in refused.value.message and refused.value.http_status == 503
        assert await _pid_of(pool, "bob") != alice and not _exists(alice) and _exists(listed)
    finally:
        await pool.close()


async def test_closing_reaps_every_process_and_starts_none_after() -> None:
    pool = _pool(max_processes=4)
    pids = [await _pid_of(pool, key) for key in (CATALOG, "alice", "bob")]
    assert all(_exists(pid) for pid in pids) and pool.running == 3
    await pool.close()
    assert not [pid for pid in pids if _exists(pid)]
    with pytest.raises(WireClosed):
        async with pool.lease("alice"):
            pass
