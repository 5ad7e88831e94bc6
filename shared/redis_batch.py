"""Automatic pipelining for redis-py asyncio: commands that many coroutines issue at the
same time go to Redis together, as one pipelined write, instead of one write-and-wait each.

Why: with redis-py's asyncio client every command costs about 70 µs of client CPU (pool
checkout, per-command write, per-reply read, pool release) and one read/write syscall
pair in redis-server; the same command inside a pipeline of 16 costs about 20 µs. A
gateway serving many sessions issues context operations concurrently, so batching them
is where most of the client's time goes. Each command still runs on its own — a pipeline
is not a transaction — and each caller gets its own reply or its own error.

Batching is adaptive and adds no timer: a command goes out on the next event-loop turn if
fewer than ``max_inflight`` batches are on the wire; otherwise it waits for the next free
slot, and whatever accumulated meanwhile goes out together. With one caller this is a plain
round trip; under load batches grow by themselves. A batch that reaches ``max_batch``
commands leaves at once, so Redis runs one batch while this process gathers the next (one
unbounded batch at a time makes the two sides take turns: 64 callers got 12,000 appends/s
that way, 20,000/s with batches of 16 and 4 on the wire). For the same reason what is
waiting is spread over the free slots: 4 callers make 4 round trips of one command, not one
of 4, so Redis runs one while this process prepares or reads the others (4 callers: twice
the appends and reads per second, half the median latency).

Connections: redis-py opens them (its auth, database, TLS, handshake), then the pipeline
takes each over (``_Link``: the transport gets our protocol) and keeps it. A batch is written
from the event-loop callback that forms it, and its replies are parsed by hiredis in the
loop's read callback, each handed to its caller's future there: no task, stream reader or
``await`` per batch (a task per batch reading redis-py's stream costs 8.4 rather than 6.3 µs
of client CPU per ``PING`` at 64 callers, 104 rather than 57 µs per round trip with one
caller). Taking a connection over leans on redis-py internals, all of them in
``_RedisPyConnection``; a connection that cannot be taken over is read redis-py's way, and
the pipeline says so (``slow_path``, and a warning). A batch whose replies have not all come
within the connection's ``socket_timeout`` fails with redis-py's ``TimeoutError`` (one
watchdog timer per pipeline, not one per batch) and its connection is closed; a connection
the server closes fails only its batch, with redis-py's ``ConnectionError`` — the errors the
gateway answers with 503 and Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection, Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.log_throttle import ThrottledWarning

log = logging.getLogger(__name__)


class PipelineClosed(RedisConnectionError):
    """A command given to a pipeline after :meth:`AutoPipeline.aclose` (the process is stopping)."""

    def __init__(self) -> None:
        super().__init__("the redis pipeline is closed (the process is stopping)")

_POSTED_FAILED = ThrottledWarning(log)  # every posted command fails while Redis is away

# What taking a connection over needs: its transport, the protocol redis-py reads it with
# (told when the connection closes), and redis-py's error-reply class for hiredis.
_Stream = tuple[asyncio.Transport, asyncio.BaseProtocol, Callable[[str], Exception]]
# Where connections come from: a client's pool, or one node of a cluster client.
_Source = aioredis.ConnectionPool | ClusterNode


class _RedisPyConnection:
    """A connection of redis-py's as this module uses it: the only code here that touches
    redis-py connection objects. Taking one over reads redis-py internals — the stream
    writer's transport (``_writer``), the stream reader and its buffer (``_reader``), the
    parser's error-reply class (``_parser``) — which are not redis-py API: pyproject.toml pins
    the redis-py versions known to have them, and tests/test_redis_batch.py fails when a
    connection of the installed redis-py cannot be taken over. A connection comes from a
    client's pool (one server) or from a cluster node's own connections (``ClusterNode``'s
    ``acquire_connection`` / ``release``: so closing the cluster client closes it too)."""

    def __init__(self, source: _Source, conn: AbstractConnection) -> None:
        self.source = source
        self.conn = conn

    @classmethod
    async def open(cls, source: _Source) -> _RedisPyConnection:
        """A connection from ``source``, connected: redis-py's auth, database, TLS and handshake done."""
        try:
            if isinstance(source, aioredis.ConnectionPool):
                return cls(source, await source.get_connection())
            conn = source.acquire_connection()
            try:
                await conn.connect()
            except BaseException:
                await conn.disconnect()
                source.release(conn)
                raise
            return cls(source, conn)
        except RuntimeError as exc:
            # uvloop's transport refuses a write once the server closed the socket mid-handshake
            # (a node restarting); redis-py lets that through as RuntimeError, not ConnectionError.
            raise RedisConnectionError(f"redis closed the connection while connecting: {exc}") from None

    @property
    def socket_timeout_s(self) -> float | None:
        timeout = self.conn.socket_timeout
        return float(timeout) if timeout else None

    def stream(self) -> _Stream | str:
        """What taking this freshly opened connection over needs, or why it cannot be."""
        writer, reader = getattr(self.conn, "_writer", None), getattr(self.conn, "_reader", None)
        transport = getattr(writer, "transport", None)
        if transport is None or reader is None:
            return f"redis-py {redis.__version__}: its connection has no stream writer and reader"
        if not hasattr(transport, "set_protocol"):
            return f"{type(transport).__name__} cannot change its protocol"
        if transport.is_closing():
            return "the connection closed as it opened"
        if getattr(reader, "_buffer", b""):
            return "redis-py has already read bytes from the connection"
        reply_error = getattr(getattr(self.conn, "_parser", None), "parse_error", ResponseError)
        return transport, transport.get_protocol(), reply_error

    def lost(self) -> bool:
        """Closed by redis-py, or by the server (its reader saw the end of the stream)."""
        reader = getattr(self.conn, "_reader", None)
        return not self.conn.is_connected or (reader is not None and reader.at_eof())

    async def round_trip(self, packed: bytes, n: int) -> list[Any]:
        """Write ``n`` packed commands and read their replies redis-py's way; an error reply
        is returned in its place, not raised."""
        await self.conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in range(n):
            try:
                replies.append(await self.conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies

    async def release(self) -> None:
        """Back to redis-py's pool (or node), open."""
        if isinstance(self.source, aioredis.ConnectionPool):
            await self.source.release(self.conn)
        else:
            self.source.release(cast(Connection, self.conn))

    async def close(self, *, nowait: bool = False) -> None:
        """Disconnect, and back to redis-py's pool (or node)."""
        try:
            await self.conn.disconnect(nowait=nowait)
        finally:
            await self.release()

    async def asking(self, packed: bytes, replies: int = 1) -> Any:
        """``replies`` commands sent after ``ASKING`` on a connection of its own (a key of a
        slot being migrated, answered by the node importing it): their outcome as
        ``AutoPipeline.submit`` gives it."""
        ok = False
        try:
            got = (await self.round_trip(_ASKING + packed, replies + 1))[1:]  # after ASKING's +OK
            ok = True
        finally:
            await (self.release() if ok else self.close())
        return _outcome(got, replies)


class _Replies(asyncio.Future[list[Any]]):
    """The future of several commands submitted together (``AutoPipeline.submit`` with
    ``replies``): it gets the list of their replies, or the first error among them."""

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.got: list[Any] = []
        self.parts = [_Part(self) for _ in range(n)]  # where a connection puts each reply, in order

    def add(self, reply: Any) -> None:
        if self.done():
            return
        if isinstance(reply, Exception):
            self.set_exception(reply)
            return
        self.got.append(reply)
        if len(self.got) == len(self.parts):
            self.set_result(self.got)


class _Part:
    """One reply's place in a ``_Replies``: a connection hands it a reply as it would a future."""

    __slots__ = ("whole",)

    def __init__(self, whole: _Replies) -> None:
        self.whole = whole

    def done(self) -> bool:
        return self.whole.done()

    def set_result(self, reply: Any) -> None:
        self.whole.add(reply)

    set_exception = set_result


# Where a connection puts one reply: a caller's future, or its part of several (_Part).
_Sink = asyncio.Future[Any] | _Part


def _sinks(batch: list[tuple[bytes, asyncio.Future[Any]]]) -> list[_Sink]:
    """Where the replies of ``batch`` go, in order (a submission of several has one place each)."""
    out: list[_Sink] = []
    for _, fut in batch:
        if type(fut) is _Replies:
            out.extend(fut.parts)
        else:
            out.append(fut)
    return out


def _outcome(replies: list[Any], n: int) -> Any:
    """What ``AutoPipeline.submit`` gives for ``replies`` of a submission of ``n`` commands."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies[0] if n == 1 else replies


class _Link(asyncio.Protocol):
    """A connection the pipeline took over from redis-py after redis-py opened it: its
    replies are parsed as they arrive, in the event loop's read callback, and each one goes
    straight to its caller's future — no task, no stream reader, no await per batch. One
    batch on it at a time."""

    def __init__(self, pipeline: AutoPipeline, conn: _RedisPyConnection, transport: asyncio.Transport,
                 stream_protocol: asyncio.BaseProtocol, reply_error: Callable[[str], Exception]) -> None:
        self.pipeline = pipeline
        self.conn = conn  # given back to redis-py's pool when this closes
        self.timeout_s = conn.socket_timeout_s
        self.transport = transport
        self.stream_protocol = stream_protocol  # redis-py's: told when the connection closes
        self.parser = hiredis.Reader(replyError=reply_error)
        self.waiting: deque[_Sink] = deque()
        self.busy = False  # a batch is on the wire
        self.sent_at = 0.0  # loop time its batch was written (see AutoPipeline._watch)
        self.closed = False

    def data_received(self, data: bytes) -> None:
        parser, waiting = self.parser, self.waiting
        try:
            parser.feed(data)
            while (reply := parser.gets()) is not False:
                if not waiting:
                    raise RedisConnectionError("redis sent more replies than commands")
                fut = waiting.popleft()
                if fut.done():  # its caller was cancelled
                    continue
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
        except Exception as exc:  # noqa: BLE001 - garbage on the wire: nothing after it can be matched
            self.fail(exc if isinstance(exc, RedisConnectionError) else RedisConnectionError(f"redis reply unreadable: {exc}"))
            return
        if self.busy and not waiting:
            self.busy = False
            self.pipeline._batch_done(self)

    def eof_received(self) -> bool:
        return False  # close: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError("redis closed the connection") if exc is None else
                  RedisConnectionError(f"redis connection lost: {exc}"))
        try:  # redis-py's side hears it too (its close waiter, its reader's end of stream)
            self.stream_protocol.connection_lost(exc)
        except Exception:  # noqa: BLE001, S110 - best effort: the connection is gone either way
            pass

    def fail(self, err: Exception) -> None:
        """Close for good: every caller waiting on it gets ``err``."""
        if not self.closed:
            self.closed = True
            self.transport.abort()  # nothing written and unanswered is of use; close() would wait for a peer that may not read
            self.pipeline._link_closed(self)
        waiting, self.waiting = self.waiting, deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(err)
        if self.busy:
            self.busy = False
            self.pipeline._batch_done(self)


_Batch = list[tuple[bytes, asyncio.Future[Any]]]


MAX_INFLIGHT = 4  # a pipeline's batches on the wire at once: the connections it keeps (per node)


class AutoPipeline:
    """Coalesces concurrent ``execute(*args)`` calls into pipelined round trips."""

    def __init__(self, redis: aioredis.Redis | ClusterNode, *, max_inflight: int = MAX_INFLIGHT,
                 max_batch: int = 16) -> None:
        """``redis``: a client of one server, or one node of a cluster client (see
        shared.redis_cluster_batch, which routes commands to each node's pipeline)."""
        if max_inflight < 1 or max_batch < 1:
            raise ValueError("max_inflight and max_batch must be >= 1")
        self.source: _Source = redis if isinstance(redis, ClusterNode) else redis.connection_pool
        self.max_inflight = max_inflight
        self.max_batch = max_batch
        self._pending: _Batch = []
        self._inflight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()  # batches that need a connection first (_send)
        self._closing: set[asyncio.Task[None]] = set()  # connections going back to redis-py closed
        # Connections kept between batches (at most max_inflight): taken over (see _Link), or
        # read redis-py's way where that was not possible.
        self._idle: list[_Link | _RedisPyConnection] = []
        self._links: set[_Link] = set()  # every open connection taken over
        self._watching = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0   # round trips made (for benchmarks and tests)
        self.commands = 0  # commands sent
        self.slow_path: str | None = None  # why a connection was last read redis-py's way; None: never
        self.closed = False  # see aclose
        self._drained: asyncio.Event | None = None  # set when nothing is queued or on the wire (aclose waits)

    async def execute(self, *args: Any) -> Any:
        """Send one command (with the next batch) and return its reply; a Redis error
        reply raises ``ResponseError`` for this caller only."""
        return await self.submit(pack_command(args))

    def submit(self, packed: bytes, key: str | bytes | None = None, replies: int = 1) -> asyncio.Future[Any]:
        """Queue one packed command (``pack_command``) with the next batch; the future gets
        its reply, or ``ResponseError`` for an error reply. For hot callers: one coroutine
        layer less than ``execute`` (each costs ~1 µs). Needs a running event loop. ``key``
        (the command's first key) routes on a cluster (shared.redis_cluster_batch); one
        server needs none.

        ``replies`` > 1: ``packed`` holds that many commands, which go in the same batch on
        the same connection, in order — a write and the ``WAIT`` that confirms it (WAIT counts
        only the writes of its own connection); the future gets the list of their replies, or
        the first error reply among them raised."""
        loop = asyncio.get_running_loop()
        if self.closed:
            fut: asyncio.Future[Any] = loop.create_future()
            fut.set_exception(PipelineClosed())
            return fut
        if loop is not self._loop:  # first use, or the old loop went away with batches unfinished
            self._loop, self._pending, self._inflight, self._scheduled = loop, [], 0, False
            self._idle, self._links, self._watching = [], set(), False  # they belong to the old loop
        fut = loop.create_future() if replies == 1 else _Replies(replies, loop)
        self._pending.append((packed, fut))
        if len(self._pending) >= self.max_batch and self._inflight < self.max_inflight:
            self._flush()  # a full batch goes now: Redis works on it while we gather the next
        elif not self._scheduled and self._inflight < self.max_inflight:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def post(self, packed: bytes, key: str | bytes | None = None) -> asyncio.Future[Any]:
        """Queue one packed command whose reply nobody needs to wait for (bookkeeping that
        rides along with the next batch); an error reply or a lost connection is logged. The
        future returned says when it is done, for whoever wants to read its effect."""
        fut = self.submit(packed, key)
        fut.add_done_callback(_log_failure)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending and self._inflight < self.max_inflight:
            # What is waiting, spread over the free slots (at most max_batch a batch): a few
            # callers get a round trip each, so Redis runs one while this process prepares
            # or reads the others; many callers fill whole batches.
            size = min(self.max_batch, -(-len(self._pending) // (self.max_inflight - self._inflight)))
            batch = self._pending[:size]
            del self._pending[:size]
            batch = [(a, f) for a, f in batch if not f.done()]  # callers cancelled while waiting
            if not batch:
                continue
            self._inflight += 1
            self.batches += 1
            self.commands += len(batch)
            kept = self._idle.pop() if self._idle else None
            if isinstance(kept, _Link):
                if not kept.closed:  # the usual case: written here and now, no task
                    self._write(kept, batch)
                    continue
                kept = None
            self._spawn(self._send(batch, kept), self._tasks)
        if self._drained is not None and not self._inflight and not self._pending:
            self._drained.set()  # what waited was all cancelled

    async def asking(self, packed: bytes, replies: int = 1) -> Any:
        """``packed`` after ``ASKING``, outside the batches (see _RedisPyConnection.asking)."""
        if self.closed:
            raise PipelineClosed()
        return await (await _RedisPyConnection.open(self.source)).asking(packed, replies)

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Stop, before the client it draws connections from closes: what is queued or on the
        wire gets its replies (within ``grace_s``, else ``ConnectionError``), then every
        connection the pipeline holds closes. A later command fails with ``ConnectionError``.
        Closed after the client instead, a batch still opening a connection would open it on a
        closed client, where nothing closes it."""
        if self.closed:
            return
        self.closed = True
        if self._loop is None:
            return
        if self._pending or self._inflight:
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await self._drained.wait()
        err = PipelineClosed()
        pending, self._pending = self._pending, []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(err)
        for link in list(self._links):
            link.fail(err)
        idle, self._idle = self._idle, []
        for conn in idle:
            if isinstance(conn, _RedisPyConnection):
                self._spawn(conn.close(nowait=True), self._closing)
        for task in self._tasks:  # batches still connecting, or read redis-py's way
            task.cancel()
        while self._tasks or self._closing:
            await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)

    @staticmethod
    def _spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop ``submit`` bound this pipeline to (set before any batch exists)."""
        if self._loop is None:
            raise RuntimeError("the pipeline has no loop before its first submit")
        return self._loop

    def _write(self, link: _Link, batch: _Batch) -> None:
        loop = self._running_loop()
        link.busy = True
        link.waiting.extend(_sinks(batch))
        link.sent_at = loop.time()
        link.transport.write(b"".join([packed for packed, _ in batch]))
        if not self._watching and link.timeout_s:
            self._watching = True
            loop.call_later(link.timeout_s / 4, self._watch)

    def _watch(self) -> None:
        """Fail a batch whose replies have not all come within the connection's socket
        timeout (a dead or stuck peer is reported, never waited on for ever): one timer per
        pipeline while batches are on the wire, not one per batch."""
        loop = self._running_loop()
        now = loop.time()
        busy = [link for link in self._links if link.busy]
        for link in busy:
            if link.timeout_s and now - link.sent_at > link.timeout_s:
                link.fail(RedisTimeoutError(f"no reply from redis within {link.timeout_s} s"))
        timeouts = [link.timeout_s for link in busy if link.busy and link.timeout_s]
        if timeouts:
            loop.call_later(min(timeouts) / 4, self._watch)
        else:
            self._watching = False

    def _batch_done(self, link: _Link) -> None:
        """``link``'s batch has all its replies (or failed): keep the link, free its slot."""
        if not link.closed and len(self._idle) < self.max_inflight:
            self._idle.append(link)
        elif not link.closed:
            link.fail(RedisConnectionError("closed: more connections than batches on the wire"))
        self._slot_free()

    def _link_closed(self, link: _Link) -> None:
        """A taken-over connection closed: out of the pool of links, back to redis-py's."""
        self._links.discard(link)
        if link in self._idle:
            self._idle.remove(link)
        self._spawn(link.conn.close(nowait=True), self._closing)

    async def _send(self, batch: _Batch, kept: _RedisPyConnection | None) -> None:
        """A batch that needs a connection first, or is read redis-py's way."""
        try:
            conn = await self._connection(kept)
            if isinstance(conn, _Link):
                self._write(conn, batch)
                return
            sinks = _sinks(batch)
            replies = await self._round_trip_slow(conn, b"".join([packed for packed, _ in batch]), len(sinks))
        except BaseException as exc:  # connection lost, timeout, cancelled: every caller hears it
            err = exc if isinstance(exc, Exception) else RedisConnectionError("redis batch cancelled")
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            self._slot_free()
            if not isinstance(exc, Exception):
                raise
        else:
            for sink, reply in zip(sinks, replies, strict=True):
                if sink.done():
                    continue
                if isinstance(reply, Exception):
                    sink.set_exception(reply)
                else:
                    sink.set_result(reply)
            self._slot_free()

    def _slot_free(self) -> None:
        """A batch is over: its slot is free for what waits (on the next loop turn)."""
        self._inflight -= 1
        if self._drained is not None and not self._inflight and not self._pending:
            self._drained.set()
        if self._pending and not self._scheduled:
            self._scheduled = True
            self._running_loop().call_soon(self._flush)

    async def _connection(self, kept: _RedisPyConnection | None) -> _Link | _RedisPyConnection:
        """A connection for the next batch: a fresh redis-py connection taken over (see
        _Link) — or, where that is not possible, read redis-py's way (``kept``, if still
        open: one the server closed meanwhile goes back to the pool)."""
        if kept is not None:
            if not kept.lost():
                return kept
            await kept.close()
        conn = await _RedisPyConnection.open(self.source)
        stream = conn.stream()
        if isinstance(stream, str):
            if self.slow_path is None:
                log.warning("redis batches are read redis-py's way (slower): %s", stream)
            self.slow_path = stream
            return conn
        link = _Link(self, conn, *stream)
        stream[0].set_protocol(link)
        self._links.add(link)
        return link

    async def _round_trip_slow(self, conn: _RedisPyConnection, packed: bytes, n: int) -> list[Any]:
        """One batch on a connection not taken over; the connection is kept for the next
        batch, or dropped after a failure (its replies can no longer be matched)."""
        ok = False
        try:
            replies = await conn.round_trip(packed, n)
            ok = True
            return replies
        finally:
            if ok and len(self._idle) < self.max_inflight:
                self._idle.append(conn)
            elif ok:
                await conn.release()
            else:
                await conn.close()


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None and not isinstance(fut.exception(), PipelineClosed):
        _POSTED_FAILED.warning("redis: a posted command failed: %s", fut.exception())


_EXACT = (str, bytes, int)
_ASKING = hiredis.pack_command(("ASKING",))  # what hiredis packs as given (see pack_command)
# hiredis's stub types the argument as a 1-tuple and the result as Any.
_pack = cast(Callable[[tuple[str | bytes | int, ...]], bytes], hiredis.pack_command)


def _plain(arg: Any) -> str | bytes | int:
    """``arg`` as one of the exact types hiredis packs (it refuses bytearray and int subclasses)."""
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return bytes(arg)
    if isinstance(arg, str):
        return str(arg)
    if isinstance(arg, int) and not isinstance(arg, bool):
        return int(arg)
    raise TypeError(f"cannot send {type(arg).__name__} to Redis")


def pack_command(args: Sequence[Any]) -> bytes:
    """RESP encoding of one command (an array of bulk strings) of str, bytes or int
    arguments. Not bool (``True`` would go as "1", rarely what was meant) and not float (its
    text form is the caller's choice: ``repr`` and ``%.17g`` differ)."""
    for a in args:
        if type(a) not in _EXACT:
            return _pack(tuple([a if type(a) in _EXACT else _plain(a) for a in args]))
    return _pack(tuple(args))


def pack_bulk(args: tuple[str | bytes | int, ...]) -> bytes:
    """The bulk strings of ``args`` (exactly str, bytes or int) without the command's array
    header: arguments that follow a header packed elsewhere (the context store's cached
    command heads, see shared/context/scripts.py)."""
    packed = _pack(args)
    return packed[packed.index(b"\n") + 1:]
