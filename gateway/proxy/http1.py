"""A lean HTTP/1.1 keep-alive client for one upstream origin, on asyncio and ``httptools``
(the C parser uvicorn already brings).

Why not a general client: a proxied call is one small POST and one small answer (JSON, or an
SSE stream of a few events), and the proxy's budget is a fraction of a millisecond per call.
General clients spend most of that on machinery this path never uses (per-request objects,
pool bookkeeping, async-library detection). Here a request is one prebuilt header block and one
``write``; a response is parsed as it arrives and handed over as body chunks; idle connections
are reused. Redirects, proxies, cookies and HTTP/2 are not needed and not offered.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import httptools

from gateway.proxy.errors import MessageTooLarge, WireClosed
from shared.aio import spawn

MAX_IDLE_CONNECTIONS = 64
# A kept-alive connection idle this long is closed rather than reused. Servers drop idle
# connections on their own clock (uvicorn and Node after 5 s), and a request written just as the
# close crosses it fails; a tool call is then not sent again (see Origin.open), so the pool lets
# a connection go before the shortest common server timeout instead.
MAX_IDLE_S = 4.0
MAX_HEAD_BYTES = 64 * 1024  # a response's status line and headers
FINISH_GRACE_S = 5.0  # how long a response read to its answer may take to end before its connection is dropped
# A response's body received and not read yet: past this the connection stops reading, so an
# upstream sending faster than the gateway passes its stream on waits in its own writes.
MAX_BUFFERED_BYTES = 256 * 1024


class HttpProtocolError(WireClosed):
    """The upstream's bytes are not HTTP/1.1 this client can read."""


class Response:
    """One response as it arrives: status and headers first, then the body in chunks."""

    __slots__ = ("status", "headers", "_chunks", "_more", "complete", "keep_alive", "error", "_head", "finishing",
                 "head_bytes", "buffered_bytes", "_resume")

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._more = asyncio.Event()
        self._head = asyncio.Event()
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.finishing = False
        self.head_bytes = 0  # received while the head was incomplete
        self.buffered_bytes = 0  # of the body, received and not read yet
        self._resume: Callable[[], None] | None = None  # the connection's reading, paused past MAX_BUFFERED_BYTES

    def finish_later(self) -> None:
        """The reader has what it needed: the rest need not hold it up (see :class:`Exchange`)."""
        self.finishing = True

    async def head(self) -> None:
        await self._head.wait()
        if self.error is not None and not self.status:
            raise self.error

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self.buffered_bytes -= len(chunk)
                if self._resume is not None and self.buffered_bytes <= MAX_BUFFERED_BYTES:
                    self._resume()
                yield chunk
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            self._more.clear()
            await self._more.wait()

    async def read(self, limit_bytes: int) -> bytes:
        """The whole body; MessageTooLarge once it passes ``limit_bytes`` (announced or sent)."""
        announced = self.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > limit_bytes:
            raise MessageTooLarge(limit_bytes)
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit_bytes:
                raise MessageTooLarge(limit_bytes)
            parts.append(chunk)
        return b"".join(parts)

    # parser side
    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered_bytes += len(data)
        self._more.set()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._head.set()
        self._more.set()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; ``httptools`` calls the ``on_*`` methods while parsing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0  # loop time it went back to the pool
        self.paused = False  # reading, for a response whose reader is behind (see MAX_BUFFERED_BYTES)
        self._header: bytes = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(HttpProtocolError(f"unreadable HTTP answer ({type(exc).__name__})"))
            return
        response = self.response
        if response is not None and not response.status:  # all of it was head: the parser holds it
            response.head_bytes += len(data)
            if response.head_bytes > MAX_HEAD_BYTES:
                self._abort(MessageTooLarge(MAX_HEAD_BYTES))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response.complete:
            self.response._fail(WireClosed("the upstream closed the connection"))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def _abort(self, exc: BaseException) -> None:
        if self.response is not None:
            self.response._fail(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self.parser.get_status_code()
            self.response._head.set()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._push(body)
            if self.response.buffered_bytes > MAX_BUFFERED_BYTES and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            response.keep_alive = self.parser.should_keep_alive()
            response.complete = True
            response._more.set()


class Origin:
    """Pooled keep-alive connections to one ``http(s)://host:port`` and one path on it."""

    def __init__(self, url: str, headers: Mapping[str, str], connect_timeout_s: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.target = ((parts.path or "/") + (f"?{parts.query}" if parts.query else "")).encode()
        host = self.host if parts.port is None else f"{self.host}:{parts.port}"
        self.fixed = b"".join(_line(k, v) for k, v in {"host": host, **headers}.items())
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._finishing: set[asyncio.Task[None]] = set()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self.tls,
                                                   server_hostname=self.host if self.tls else None)
        return conn

    def _request_bytes(self, method: bytes, headers: Mapping[str, str], body: bytes | None) -> bytes:
        parts = [method, b" ", self.target, b" HTTP/1.1\r\n", self.fixed]
        parts.extend(_line(k, v) for k, v in headers.items())
        if body is not None:
            parts.append(b"content-length: %d\r\n" % len(body))
        parts.append(b"\r\n")
        if body is not None:
            parts.append(body)
        return b"".join(parts)

    async def open(self, method: bytes, headers: Mapping[str, str], body: bytes | None,
                   repeatable: bool = True) -> Exchange:
        """Send a request; the :class:`Exchange` has the response once its head has arrived. A
        reused connection that turns out closed before any answer is replaced, the request sent
        again, only when it is ``repeatable``: the upstream may have dropped the idle connection
        just then, or it may have received the request and failed on it."""
        data = self._request_bytes(method, headers, body)
        if self._idle:
            self._drop_stale(asyncio.get_running_loop().time() - MAX_IDLE_S)
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            try:
                return await self._send(conn, data)
            except WireClosed:
                if not repeatable:
                    raise
        return await self._send(await self._connect(), data)

    async def _send(self, conn: _Connection, data: bytes) -> Exchange:
        response = conn.response = Response()
        response._resume = conn.resume
        if conn.transport is None or conn.closed:
            raise WireClosed("connection closed")
        conn.transport.write(data)
        try:
            await response.head()
        except BaseException:
            conn.close()
            raise
        return Exchange(self, conn, response)

    def release(self, conn: _Connection, response: Response) -> None:
        if (response.finishing and not response.complete and not conn.closed
                and len(self._finishing) < MAX_IDLE_CONNECTIONS):  # more are closed: the upstream lingers
            response.finishing = False
            spawn(self._finish(conn, response), self._finishing, "reading the rest of an upstream's response")
            return
        conn.response = None
        conn.resume()  # what the reader left unread is dropped with the response
        if response.complete and response.keep_alive and not conn.closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            conn.close()

    def _drop_stale(self, cutoff: float) -> None:
        """Close the idle connections that went idle before ``cutoff`` (the oldest come first)."""
        stale = 0
        for conn in self._idle:
            if conn.idle_since >= cutoff:
                break
            conn.close()
            stale += 1
        if stale:
            del self._idle[:stale]

    async def _finish(self, conn: _Connection, response: Response) -> None:
        """Read the rest of a response whose answer was taken, dropping it, so that its connection
        can be reused; an upstream that holds the stream open past ``FINISH_GRACE_S`` (MCP asks
        a server to end it after the answer) loses the connection instead."""
        try:
            async with asyncio.timeout(FINISH_GRACE_S):
                async for _ in response.chunks():
                    pass
        except (TimeoutError, WireClosed):
            pass
        finally:
            self.release(conn, response)

    def close(self) -> None:
        for task in self._finishing:
            task.cancel()
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class Exchange:
    """A response being read; leaving the ``async with`` returns the connection to the pool when
    the response was read to its end, and closes it otherwise, unless the reader called
    :meth:`Response.finish_later`: then the rest is read in the background."""

    __slots__ = ("origin", "conn", "response")

    def __init__(self, origin: Origin, conn: _Connection, response: Response) -> None:
        self.origin = origin
        self.conn = conn
        self.response = response

    async def __aenter__(self) -> Response:
        return self.response

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.response.finishing = False
        self.origin.release(self.conn, self.response)


def _line(name: str, value: str) -> bytes:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
        raise ValueError(f"header {name} has a line break")
    return f"{name}: {value}\r\n".encode("latin-1")
