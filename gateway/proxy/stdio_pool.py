"""A stdio upstream's processes on one replica: one per principal, each with its own MCP session,
so what the server sends (resource updates, sampling, elicitation, roots) belongs to that
principal alone; and one more, keyed ``CATALOG``, through which the upstream's lists are fetched
(they are the same for every principal, and listing starts no process per principal).

At most ``stdio_max_processes`` principals' processes run at once. A new principal's first call
stops the least recently used idle process to make room; when every one serves a call it is
refused with :class:`~gateway.proxy.errors.StdioCapReached` (HTTP 503, Retry-After). A process
unused for ``stdio_idle_s`` is stopped; one that exits is started again on its principal's next
call. Closing the pool (gateway shutdown, the upstream removed, disabled or changed) stops and
reaps every process.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

from gateway.proxy.errors import StdioCapReached, WireClosed
from gateway.proxy.wire import (
    DEFAULT_WRITE_TIMEOUT_S,
    MAX_LIST_ANSWER_BYTES,
    MAX_MESSAGE_BYTES,
    Hooks,
    Message,
    StdioWire,
)
from shared.aio import spawn

CATALOG = ""  # the key of the lists' process (no principal is named "")

Notes = Callable[[str, Message], Awaitable[None]]  # (principal or CATALOG, message)


class StdioPool:
    def __init__(self, upstream: str, command: list[str], env: Mapping[str, str], max_processes: int,
                 idle_s: float, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        self.upstream = upstream
        self.write_timeout_s = write_timeout_s  # see StdioWire
        self.command = command
        self.env = env
        self.max_processes = max_processes
        self.idle_s = idle_s
        self.notes: Notes | None = None  # what a process sends outside any call (set by the proxy)
        self._wires: collections.OrderedDict[str, StdioWire] = collections.OrderedDict()  # least recently used first
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def running(self) -> int:
        """Processes running now, the lists' one included."""
        return sum(w.running for w in self._wires.values())

    @asynccontextmanager
    async def lease(self, key: str) -> AsyncIterator[StdioWire]:
        """The process of ``key`` (a principal, or CATALOG), held for the block: a held process
        is never stopped for being idle nor to make room."""
        if self._closed:
            raise WireClosed(f"upstream {self.upstream!r} was closed")
        wire = self._wires.get(key)
        evicted = None
        if key != CATALOG and (wire is None or not (wire.leases or wire.running)):  # a process to start
            evicted = self._make_room()
        if wire is None:
            wire = self._wires[key] = StdioWire(self.command, self.env,
                                                Hooks(notify=functools.partial(self._note, key)),
                                                self.write_timeout_s,
                                                MAX_LIST_ANSWER_BYTES if key == CATALOG else MAX_MESSAGE_BYTES)
        self._wires.move_to_end(key)
        wire.leases += 1
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        try:
            if evicted is not None:  # gone before the new principal's process starts
                await asyncio.shield(spawn(evicted.close(), self._stopping,
                                           f"stopping an idle process of upstream {self.upstream!r}"))
            yield wire
        finally:
            wire.leases -= 1
            if wire.leases == 0 and self._wires.get(key) is wire:
                self._wires.move_to_end(key)
                self._timers[key] = asyncio.get_running_loop().call_later(self.idle_s, self._expire, key, wire)

    def _make_room(self) -> StdioWire | None:
        """Room for one more principal's process: None when there is some; else the least
        recently used idle process, taken out (the caller stops it)."""
        held = [(k, w) for k, w in self._wires.items() if k != CATALOG and (w.leases or w.running)]
        if len(held) < self.max_processes:
            return None
        for key, wire in held:
            if wire.leases == 0:
                self._forget(key)
                return wire
        raise StdioCapReached(self.upstream, self.max_processes)

    def _forget(self, key: str) -> None:
        del self._wires[key]
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, key: str, wire: StdioWire) -> None:
        if self._wires.get(key) is wire and wire.leases == 0:
            self._forget(key)
            spawn(wire.close(), self._stopping, f"stopping an idle process of upstream {self.upstream!r}")

    async def _note(self, key: str, msg: Message) -> None:
        if self.notes is not None:
            await self.notes(key, msg)

    async def close(self) -> None:
        """Stop and reap every process (each is given the stdio transport's grace to exit)."""
        self._closed = True
        wires = list(self._wires.values())
        for key in list(self._wires):
            self._forget(key)
        await asyncio.gather(*(w.close() for w in wires), *list(self._stopping), return_exceptions=True)
