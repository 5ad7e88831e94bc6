"""An upstream's ``concurrency`` slots, shared fairly between principals.

A call holds its slot for as long as it runs, and a call the gateway hosts as a task runs for as
long as the task lives (up to its ``ttlMs``). Were the slots first come, first served, one
principal's slow calls could hold all of them and every other principal's calls would wait and
fail ``busy``. So a principal holds at most ``share`` slots at once; its further calls wait for
one of its own to end, while other principals' calls still find the slots it cannot take.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


class NoSlot(Exception):
    """No slot was free before the deadline. ``own_share``: the principal's own share was full
    (its calls are what it waits for), else every slot of the upstream was taken."""

    def __init__(self, own_share: bool) -> None:
        super().__init__("own share full" if own_share else "all slots taken")
        self.own_share = own_share


@dataclass(slots=True)
class _Share:
    slots: asyncio.Semaphore
    users: int = 0  # calls holding one of its slots or waiting for one


@dataclass(slots=True)
class FairGate:
    """``slots`` calls in flight at once, at most ``share`` of them (capped at ``slots``) one
    principal's. A principal's entry lives while it has calls holding or waiting, so the map
    holds no more principals than there are calls."""

    slots: int
    share: int
    _all: asyncio.Semaphore = field(init=False)
    _principals: dict[str, _Share] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.share = max(1, min(self.share, self.slots))
        self._all = asyncio.Semaphore(self.slots)

    async def take(self, principal: str, deadline: float) -> None:
        """One slot for ``principal`` (given back with :meth:`give`), or :class:`NoSlot` once the
        loop's clock passes ``deadline``."""
        share = self._principals.get(principal)
        if share is None:
            share = self._principals[principal] = _Share(asyncio.Semaphore(self.share))
        share.users += 1
        try:
            if not await _acquire(share.slots, deadline):
                raise NoSlot(own_share=True)
            try:
                if not await _acquire(self._all, deadline):
                    raise NoSlot(own_share=False)
            except BaseException:
                share.slots.release()
                raise
        except BaseException:
            self._leave(principal, share)
            raise

    def give(self, principal: str) -> None:
        share = self._principals[principal]
        self._all.release()
        share.slots.release()
        self._leave(principal, share)

    def _leave(self, principal: str, share: _Share) -> None:
        share.users -= 1
        if share.users == 0:
            del self._principals[principal]


async def _acquire(slots: asyncio.Semaphore, deadline: float) -> bool:
    """Whether a slot of ``slots`` was taken by ``deadline``; a free one is taken without
    suspending, so no timer is armed for it."""
    if not slots.locked():
        await slots.acquire()
        return True
    try:
        async with asyncio.timeout_at(deadline):
            await slots.acquire()
    except TimeoutError:
        return False
    return True
