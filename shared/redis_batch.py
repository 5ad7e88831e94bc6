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
commands leaves at once, so Redis runs one batch while this process gathers the next
(with unbounded batches the two sides took turns: 64 callers got 12,000 appends/s with
one huge batch at a time, 20,000/s with batches of 16 and 4 on the wire).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is a dependency; redis-py's reader is the fallback
    hiredis = None  # type: ignore[assignment]
from redis.exceptions import ResponseError


class AutoPipeline:
    """Coalesces concurrent ``execute(*args)`` calls into pipelined round trips."""

    def __init__(self, redis: aioredis.Redis, *, max_inflight: int = 4, max_batch: int = 16) -> None:
        if max_inflight < 1 or max_batch < 1:
            raise ValueError("max_inflight and max_batch must be >= 1")
        self.redis = redis
        self.max_inflight = max_inflight
        self.max_batch = max_batch
        self._pending: list[tuple[bytes, asyncio.Future[Any]]] = []
        self._inflight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        # Connections this pipeline keeps between batches (at most max_inflight): taking one
        # from redis-py's pool and giving it back costs two lock round trips, its metrics
        # hooks and a readiness probe per batch (~0.7 µs per command in batches of 16).
        self._idle: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0   # round trips made (for benchmarks and tests)
        self.commands = 0  # commands sent

    async def execute(self, *args: Any) -> Any:
        """Send one command (with the next batch) and return its reply; a Redis error
        reply raises ``ResponseError`` for this caller only."""
        return await self.submit(pack_command(args))

    def submit(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue one packed command (``pack_command``) with the next batch; the future gets
        its reply, or ``ResponseError`` for an error reply. For hot callers: one coroutine
        layer less than ``execute`` (each costs ~1 µs). Needs a running event loop."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or the old loop went away with batches unfinished
            self._loop, self._pending, self._inflight, self._scheduled = loop, [], 0, False
            self._idle = []  # their streams belong to the old loop
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((packed, fut))
        if len(self._pending) >= self.max_batch and self._inflight < self.max_inflight:
            self._flush()  # a full batch goes now: Redis works on it while we gather the next
        elif not self._scheduled and self._inflight < self.max_inflight:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending and self._inflight < self.max_inflight:
            batch = self._pending[:self.max_batch]
            del self._pending[:self.max_batch]
            batch = [(a, f) for a, f in batch if not f.done()]  # callers cancelled while waiting
            if not batch:
                continue
            self._inflight += 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[bytes, asyncio.Future[Any]]]) -> None:
        self.batches += 1
        self.commands += len(batch)
        try:
            replies = await self._round_trip(b"".join([packed for packed, _ in batch]), len(batch))
        except BaseException as exc:  # connection lost, timeout, cancelled: every caller hears it
            err = exc if isinstance(exc, Exception) else ConnectionError("redis batch cancelled")
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            if not isinstance(exc, Exception):
                raise
        else:
            for (_, fut), reply in zip(batch, replies, strict=True):
                if fut.done():
                    continue
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
        finally:
            self._inflight -= 1
            if self._pending and not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)

    async def _round_trip(self, packed: bytes, n: int) -> list[Any]:
        """One write of ``n`` packed commands on a redis-py connection (see _connection),
        then their ``n`` replies (error replies as ResponseError objects). Any other failure
        drops the connection (its replies can no longer be matched) and propagates."""
        pool = self.redis.connection_pool
        conn = await self._connection()
        ok = False
        try:
            stream, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
            if hiredis is None or stream is None or writer is None:
                slow = await self._round_trip_slow(conn, packed, n)
                ok = True
                return slow
            # Fast path: the connection redis-py set up (auth, db, TLS), read with one hiredis
            # reader for the whole batch: one await per network read, not per reply.
            parser = hiredis.Reader(replyError=getattr(conn._parser, "parse_error", ResponseError))
            writer.write(packed)
            await writer.drain()
            replies: list[Any] = []
            async with asyncio.timeout(conn.socket_timeout):
                while len(replies) < n:
                    data = await stream.read(1 << 17)
                    if not data:
                        raise ConnectionError("redis closed the connection")
                    parser.feed(data)
                    while (reply := parser.gets()) is not False:
                        replies.append(reply)
            if len(replies) != n:
                raise ConnectionError("redis sent more replies than commands")
            ok = True
            return replies
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            if ok and len(self._idle) < self.max_inflight:
                self._idle.append(conn)
            else:
                await pool.release(conn)

    async def _connection(self) -> Any:
        """A connection for the next batch: one kept from an earlier batch if it is still
        open — one the server closed meanwhile (restart, CLIENT KILL, idle timeout: the
        event loop has seen its end of stream) or that redis-py disconnected goes back to
        the pool — else one from the pool, which connects and checks it."""
        pool = self.redis.connection_pool
        while self._idle:
            conn = self._idle.pop()
            reader = getattr(conn, "_reader", None)
            if conn.is_connected and not (reader is not None and reader.at_eof()):
                return conn
            await conn.disconnect()
            await pool.release(conn)
        return await pool.get_connection()

    @staticmethod
    async def _round_trip_slow(conn: Any, packed: bytes, n: int) -> list[Any]:
        await conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in range(n):
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies


def pack_arg(arg: Any) -> bytes:
    """One RESP bulk string (str, bytes or int)."""
    t = type(arg)  # exact types first: this runs for every argument of every command
    if t is bytes:
        return b"$%d\r\n%b\r\n" % (len(arg), arg)
    if t is str:
        arg = arg.encode()
    elif t is int:
        arg = b"%d" % arg
    elif isinstance(arg, bytes):
        arg = bytes(arg)
    elif isinstance(arg, str):
        arg = str(arg).encode()
    elif isinstance(arg, int) and not isinstance(arg, bool):
        arg = b"%d" % arg
    elif isinstance(arg, (bytearray, memoryview)):
        arg = bytes(arg)
    else:
        raise TypeError(f"cannot send {type(arg).__name__} to Redis")
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def pack_args(args: tuple[Any, ...] | list[Any]) -> bytes:
    """RESP bulk strings of ``args`` (str, bytes or int). Ours rather than redis-py's
    ``pack_command`` because the context store sends ~20 arguments per call and redis-py's
    general encoder was a third of the client's time per operation (profiled)."""
    return b"".join([pack_arg(a) for a in args])


def pack_command(args: tuple[Any, ...] | list[Any]) -> bytes:
    """RESP encoding of one command (an array of bulk strings)."""
    return b"*%d\r\n%b" % (len(args), pack_args(args))
