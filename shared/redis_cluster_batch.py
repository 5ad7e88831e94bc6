"""Automatic pipelining on a Redis Cluster: each command goes to the pipeline of the master
that serves its key's slot (one ``AutoPipeline`` per node, over that node's own connections),
so concurrent commands still share round trips, one per node.

The slot map is redis-py's (``RedisCluster.keyslot`` / ``get_node_from_key``). Redirections
never reach a caller: on ``MOVED`` the command goes again to the node named and redis-py's
map is read again (once at a time); on ``ASK`` (a slot being migrated) it goes to the node
named after ``ASKING``, on a connection of its own; on ``TRYAGAIN`` (a multi-key command
during a migration) it goes again after a short pause. A node that cannot be reached fails
the command with redis-py's ``ConnectionError`` (the gateway answers 503 with Retry-After)
and has the map read again, so the commands after a failover find the new master.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.exceptions import AskError, MovedError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.log_throttle import ThrottledWarning
from shared.redis_batch import MAX_INFLIGHT, AutoPipeline, PipelineClosed, pack_command

log = logging.getLogger(__name__)
_POSTED_FAILED = ThrottledWarning(log)  # every posted command fails while a master is away

MAX_REDIRECTS = 8  # MOVED / ASK hops of one command before its error reaches the caller
TRYAGAIN_PAUSE_S = 0.02
TRYAGAIN_MAX = 50  # about a second of a migration's multi-key window


class ClusterAutoPipeline:
    """``AutoPipeline`` for a ``RedisCluster`` client: ``submit(packed, key)``."""

    def __init__(self, cluster: aioredis.RedisCluster, *, max_inflight: int = MAX_INFLIGHT,
                 max_batch: int = 16) -> None:
        self.cluster = cluster
        self.max_inflight = max_inflight
        self.max_batch = max_batch
        self._nodes: dict[str, AutoPipeline] = {}  # node name -> its pipeline
        self._slots: dict[int, AutoPipeline] = {}  # slot -> pipeline of its master (from redis-py's map)
        self._stale = False  # the slot map is to be read again before the next command
        self._posted: set[asyncio.Task[Any]] = set()
        self._ready: asyncio.Future[Any] | None = None  # redis-py's first reading of the slot map
        self.redirects = 0  # MOVED and ASK followed (for tests and metrics)
        self.closed = False  # see aclose
        self._own_nodes: list[ClusterNode] = []  # nodes reached before the client's map knew them

    @property
    def batches(self) -> int:
        return sum(p.batches for p in self._nodes.values())

    @property
    def commands(self) -> int:
        return sum(p.commands for p in self._nodes.values())

    async def aclose(self, grace_s: float = 2.0) -> None:
        """``AutoPipeline.aclose`` for every node's pipeline, after the redirections under way,
        before the cluster client closes."""
        self.closed = True
        if self._posted:
            await asyncio.wait(set(self._posted), timeout=grace_s)
        for task in self._posted:
            task.cancel()
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        await asyncio.gather(*self._posted, *(p.aclose(grace_s) for p in self._nodes.values()),
                             return_exceptions=True)
        await asyncio.gather(*(node.disconnect() for node in self._own_nodes), return_exceptions=True)

    async def execute(self, *args: Any, key: str | bytes) -> Any:
        return await self.submit(pack_command(args), key)

    async def submit(self, packed: bytes, key: str | bytes | None = None, replies: int = 1) -> Any:
        """One packed command whose first key is ``key``: its reply, after any redirection.
        ``replies`` > 1: as ``AutoPipeline.submit`` — the commands of ``packed`` go together
        to the node of ``key``'s slot, and together again wherever it is redirected."""
        if key is None:
            raise ValueError("a cluster pipeline routes by key: give the command's key")
        if self.closed:
            raise PipelineClosed()
        if not self._ready_now():
            await self._map_read()
        slot = self.cluster.keyslot(key)
        pipe = self._slots.get(slot)
        if pipe is None:
            pipe = self._at_slot(slot)
        try:
            return await pipe.submit(packed, None, replies)
        except (MovedError, AskError, TryAgainError) as exc:
            return await self._redirected(packed, slot, exc, replies)
        except (RedisConnectionError, RedisTimeoutError):
            self._reread_map()
            raise

    def post(self, packed: bytes, key: str | bytes | None = None) -> asyncio.Future[Any]:
        """Queue one command whose reply nobody needs to wait for (see AutoPipeline.post); it
        follows redirections like any other."""
        slot_key = key if key is not None else b""
        pipe = self._slots.get(self.cluster.keyslot(slot_key)) if key is not None and self._ready_now() else None
        if pipe is not None:  # the usual case: queued with the batch now, a task only for a redirection
            fut = pipe.submit(packed)
            fut.add_done_callback(lambda done: self._posted_reply(done, packed, slot_key))
            return fut
        task = asyncio.get_running_loop().create_task(self.submit(packed, key))
        self._posted.add(task)
        task.add_done_callback(self._posted_done)
        return task

    def _ready_now(self) -> bool:
        return (not self._stale and self._ready is not None and self._ready.done()
                and self._ready.exception() is None)

    def _posted_reply(self, fut: asyncio.Future[Any], packed: bytes, key: str | bytes) -> None:
        """A posted command's reply: a redirection is followed (in a task), other errors logged."""
        if fut.cancelled() or isinstance(fut.exception(), PipelineClosed):
            return
        exc = fut.exception()
        if isinstance(exc, (MovedError, AskError, TryAgainError)):
            task = asyncio.get_running_loop().create_task(self._redirected(packed, self.cluster.keyslot(key), exc))
            self._posted.add(task)
            task.add_done_callback(self._posted_done)
        elif isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
            self._reread_map()
            _POSTED_FAILED.warning("redis cluster: a posted command failed: %s", exc)
        elif exc is not None:
            _POSTED_FAILED.warning("redis cluster: a posted command failed: %s", exc)

    def _posted_done(self, task: asyncio.Task[Any]) -> None:
        self._posted.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), PipelineClosed):
            _POSTED_FAILED.warning("redis cluster: a posted command failed: %s", task.exception())

    async def _map_read(self) -> None:
        """A reading of the slot map (the first, or again after a redirection or a lost node),
        shared by the callers that wait for it (so they go on together, and their commands
        share batches)."""
        if self._ready is None or self._stale or (self._ready.done() and self._ready.exception() is not None):
            if self._ready is not None and self.cluster.nodes_manager.default_node is None:
                # the client was closed (aclose forgets its map): reading the map again would
                # open connections on it that nothing closes any more
                raise RedisConnectionError("the redis cluster client is closed")
            first, self._stale = self._ready is None, False
            self._ready = asyncio.ensure_future(self.cluster.initialize() if first else self._read_map())
        await asyncio.shield(self._ready)

    async def _redirected(self, packed: bytes, slot: int, exc: Exception, replies: int = 1) -> Any:
        """Follow MOVED / ASK / TRYAGAIN until a node answers (bounded)."""
        hops = tries = 0
        call: Awaitable[Any]
        while True:
            if isinstance(exc, MovedError):
                hops += 1
                self.redirects += 1
                pipe = self._slots[slot] = self._at(exc.host, exc.port)
                self._reread_map()
                call = pipe.submit(packed, None, replies)
            elif isinstance(exc, AskError):
                hops += 1
                self.redirects += 1
                call = self._at(exc.host, exc.port).asking(packed, replies)
            else:  # the slot's keys are split between two masters for now: wait, then from the start
                tries, hops = tries + 1, 0
                await asyncio.sleep(TRYAGAIN_PAUSE_S)
                call = (self._slots.get(slot) or self._at_slot(slot)).submit(packed, None, replies)
            try:
                return await call
            except (MovedError, AskError, TryAgainError) as again:
                if hops >= MAX_REDIRECTS or tries >= TRYAGAIN_MAX:
                    raise
                exc = again

    def _at_slot(self, slot: int) -> AutoPipeline:
        """The pipeline of ``slot``'s master in redis-py's slot map."""
        pipe = self._slots[slot] = self._pipeline(self.cluster.nodes_manager.get_node_from_slot(slot))
        return pipe

    def _at(self, host: str, port: int | str) -> AutoPipeline:
        """The pipeline of the node at ``host:port`` (a node the map does not know yet too)."""
        node = self.cluster.get_node(host=host, port=int(port))
        if node is None:
            known = self.cluster.get_default_node()
            kwargs = {k: v for k, v in known.connection_kwargs.items() if k not in ("host", "port")}
            node = ClusterNode(host, int(port), "primary", max_connections=known.max_connections,
                               connection_class=known.connection_class, **kwargs)
            self._own_nodes.append(node)  # not the client's: closing the client leaves it open
        return self._pipeline(node)

    def _pipeline(self, node: ClusterNode) -> AutoPipeline:
        pipe = self._nodes.get(node.name)
        if pipe is None:
            pipe = self._nodes[node.name] = AutoPipeline(node, max_inflight=self.max_inflight,
                                                         max_batch=self.max_batch)
        return pipe

    def _reread_map(self) -> None:
        """Have the next command read the slot map again first. In that command's caller, not a
        task of its own: a reading started as a client closes would open connections after it."""
        self._stale = True

    async def _read_map(self) -> None:
        await self.cluster.nodes_manager.initialize()
        self._slots.clear()


def auto_pipeline(redis: aioredis.Redis | aioredis.RedisCluster, *, max_inflight: int = MAX_INFLIGHT,
                  max_batch: int = 16) -> AutoPipeline | ClusterAutoPipeline:
    """The automatic pipeline for ``redis``: per node on a cluster, one otherwise. Both take
    ``submit(packed, key)`` and are awaited for the reply."""
    if isinstance(redis, aioredis.RedisCluster):
        return ClusterAutoPipeline(redis, max_inflight=max_inflight, max_batch=max_batch)
    return AutoPipeline(redis, max_inflight=max_inflight, max_batch=max_batch)
