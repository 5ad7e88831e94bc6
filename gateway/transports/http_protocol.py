"""uvicorn's httptools protocol with one socket write per response instead of two, and read
deadlines uvicorn does not have.

uvicorn writes a response's status line and headers, then its body, as two separate
``transport.write`` calls; on uvloop each is a ``send()`` syscall, and on loopback each
syscall also runs the receiving side's TCP path. Profiling ``/mcp`` showed those two
writes as the largest single cost of a trivial ``tools/call``. :class:`CoalescingTransport`
gathers the writes made during one event-loop iteration and sends them together at the
end of it, so a JSON response (``http.response.start`` then ``http.response.body``
without yielding in between) leaves as one segment. Streams are unaffected apart from
the same at-most-one-iteration deferral.

uvicorn waits for request headers and bodies forever (its keep-alive timeout only covers an
idle connection between requests, and nothing covers a connection that never sends a byte),
so a few hundred connections that trickle out a header each (slowloris) hold the server.
:class:`GatewayHttpProtocol` closes a connection whose headers are not complete within
``gateway.header_timeout_s``, and cuts off a body not received within ``gateway.body_timeout_s``
(408). Timers are armed only when a read leaves a message unfinished, so a request that
arrives in one segment costs none. Nor does httptools bound the size of the headers it
gathers: within the deadline a client that streams one endless header makes the server buffer
all of it (twice over), so a request whose headers pass ``gateway.max_header_bytes`` is
answered 431 and its connection closed. :func:`http_protocol` binds the configured limits.

A response that starts before its request's body has arrived in full says ``Connection:
close`` and closes the connection once sent (with the bounded linger below). uvicorn would keep
it for the next request and read and drop the rest of the body until the body deadline: a
refusal sent before the body was read (401 without credentials, 403 for a foreign Origin, 405)
let a client without a key stream an endless chunked body into the gateway for
``gateway.body_timeout_s`` (gigabytes a second over loopback), where the linger drops at most
``LINGER_MAX_BYTES`` for at most ``LINGER_MAX_S``.

:class:`GatewayHttpProtocol` leans on uvicorn internals (``HttpToolsProtocol``, its ``loop``
and ``transport``): pyproject.toml pins the uvicorn versions known to have them, and
tests/test_gateway_http_protocol.py fails when a response of the installed one leaves in more
than one write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.config import GatewayConfig

FLUSH_AT_BYTES = 64 * 1024
# Closing while the peer still sends a refused body would reset the connection, and a reset
# discards the answer the peer has not read yet (413: a client sees a broken connection, not
# the error). Such a close sends the answer and a FIN, then reads and drops what still
# arrives: until the peer ends its side or pauses LINGER_IDLE_S, at most LINGER_MAX_S and
# LINGER_MAX_BYTES.
LINGER_IDLE_S = 1.0
LINGER_MAX_S = 5.0
LINGER_MAX_BYTES = 64 * 1024 * 1024
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class CoalescingTransport:
    """Wraps an asyncio transport: writes within one loop iteration become one write."""

    __slots__ = ("_transport", "_loop", "_pending", "_pending_bytes", "_linger", "_closing")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 linger: Callable[[], bool] | None = None) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._linger = linger  # asked at close: whether the peer may still be sending (see LINGER_*)
        self._closing = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= FLUSH_AT_BYTES:
            # Large output goes to the real transport now, so its write buffer limits
            # (pause_writing -> uvicorn's flow control) apply as they would without us.
            self._flush()

    def writelines(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._pending_bytes = 0
        if self._transport.is_closing():
            return
        self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._pending_bytes

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        if not self._closing and self._linger is not None and self._transport.can_write_eof() and self._linger():
            self._closing = True
            self._transport.write_eof()  # the answer, then FIN; the protocol closes after the linger
            return
        self._closing = True
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._pending_bytes = 0
        self._transport.abort()

    def is_closing(self) -> bool:  # asked on every response: spared the __getattr__ detour
        return self._closing or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, set_protocol ...
        return getattr(self._transport, name)


DISCONNECT = "learnmesh.disconnect"  # the scope key of a request's :class:`Disconnect`


class Disconnect:
    """A connection's going away, told to the requests on it that must stop with it (a
    2026-07-28 ``tools/call``, a listen stream): a callback, where watching ``receive()`` for
    ``http.disconnect`` would take a task of its own per request, which cost a trivial call
    about 40% of its CPU."""

    __slots__ = ("gone", "_callbacks")

    def __init__(self) -> None:
        self.gone = False
        self._callbacks: set[Callable[[], None]] = set()

    def add(self, callback: Callable[[], None]) -> None:
        self._callbacks.add(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def fire(self) -> None:
        self.gone = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: the request's headers passed ``max_header_bytes``."""


class GatewayHttpProtocol(HttpToolsProtocol):
    """``uvicorn.run(..., http=http_protocol(cfg.gateway))``: coalesced writes and read deadlines."""

    header_timeout_s = GatewayConfig.header_timeout_s
    body_timeout_s = GatewayConfig.body_timeout_s
    max_header_bytes = GatewayConfig.max_header_bytes

    _deadline: asyncio.TimerHandle | None = None
    _in_headers = False  # a request's first byte arrived, its headers are not complete yet
    _in_body = False  # headers complete, the body is not
    _upgraded = False
    _header_bytes = 0  # bytes of reads that ended inside the current request's headers
    _parsed_header_bytes = 0  # the current request's target and headers as the parser gave them
    _too_large = False
    _keep_alive = True  # what uvicorn decided for the current request, once its body has arrived
    _lingering = False  # answered and half-closed; dropping what the peer still sends
    _linger_left = 0
    _linger_until = 0.0
    _raw: asyncio.Transport
    _disconnect: Disconnect | None = None  # one per connection, made with its first request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._raw = transport  # type: ignore[assignment]  # a TCP transport
        super().connection_made(CoalescingTransport(transport, self.loop, self._start_linger))  # type: ignore[arg-type]
        self._arm(self.header_timeout_s)  # a connection that never sends a byte is a slowloris too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        if self._disconnect is not None:
            self._disconnect.fire()

    def _start_linger(self) -> bool:
        """At close: linger (see LINGER_*) when a request's body is still coming."""
        if not self._in_body:
            return False
        self._lingering = True
        self._linger_left = LINGER_MAX_BYTES
        self._linger_until = self.loop.time() + LINGER_MAX_S
        self._disarm()
        self._arm(LINGER_IDLE_S)
        self._raw.resume_reading()  # uvicorn may have paused it while the app did not read the body
        return True

    def eof_received(self) -> None:
        if self._lingering:  # the peer sent all it had: the linger is over
            self._disarm()
            self._raw.close()
            return
        super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # dropped, not parsed: the request was answered
            self._linger_left -= len(data)
            self._disarm()
            if self._linger_left < 0 or self.loop.time() >= self._linger_until:
                self._raw.close()
            else:
                self._arm(min(LINGER_IDLE_S, self._linger_until - self.loop.time()))
            return
        super().data_received(data)
        if self._in_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._disarm()
                self.transport.write(_TOO_LARGE_431)
                self.transport.close()
                return
        if self._deadline is not None or self._upgraded or self.transport.is_closing():
            return
        if self._in_body:
            self._arm(self.body_timeout_s)
        elif self._in_headers or self.cycle is None or self.cycle.response_complete:
            # Unfinished headers, or bytes between requests that start none (bare CRLFs stop
            # uvicorn's keep-alive timer and nothing would re-arm it).
            self._arm(self.header_timeout_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._disconnect is None:
            self._disconnect = Disconnect()
        self.scope[DISCONNECT] = self._disconnect  # type: ignore[literal-required]
        self._in_headers = True
        self._header_bytes = self._parsed_header_bytes = 0

    # Reads that end inside the headers bound what an unfinished header buffers; the parser's
    # callbacks count the headers exactly, also those that arrive complete in one read.
    def on_url(self, url: bytes) -> None:
        self._count_header(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_header(self, n: int) -> None:
        self._parsed_header_bytes += n
        if self._parsed_header_bytes > self.max_header_bytes:
            self._too_large = True
            raise _HeadersTooLarge  # stops the parser: the request never reaches the app

    def send_400_response(self, msg: str) -> None:
        """What uvicorn answers when the parser stops; 431 where the headers' size stopped it."""
        if not self._too_large:
            super().send_400_response(msg)
            return
        self._disarm()
        self.transport.write(_TOO_LARGE_431)
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_headers = False
        super().on_headers_complete()
        if self.parser.should_upgrade() and self._should_upgrade():
            self._upgraded = True  # the WebSocket protocol takes the connection over
        else:
            self._in_body = True
            # Until the body has arrived, an answer closes the connection (see the module docstring).
            self._keep_alive = self.cycle.keep_alive
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        self._disarm()
        if self._in_body and not self.cycle.response_started:
            self.cycle.keep_alive = self._keep_alive
        self._in_body = False
        super().on_message_complete()


    def _arm(self, delay_s: float) -> None:
        self._deadline = self.loop.call_later(delay_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._lingering:
            self._raw.close()
            return
        if self.transport.is_closing():
            return
        cycle = self.cycle
        idle = cycle is None or cycle.response_complete
        if self._in_body and cycle is not None and not cycle.response_complete:
            if not cycle.response_started:
                self.transport.write(_TIMEOUT_408)
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its sends are dropped
            cycle.message_event.set()
        elif self._in_headers and idle:
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


def http_protocol(cfg: GatewayConfig) -> type[GatewayHttpProtocol]:
    """The protocol class with ``cfg``'s read deadlines and header limit (uvicorn builds one per connection)."""
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,),
                {"header_timeout_s": cfg.header_timeout_s, "body_timeout_s": cfg.body_timeout_s,
                 "max_header_bytes": cfg.max_header_bytes})
