"""uvicorn's httptools protocol with one socket write per response instead of two.

uvicorn writes a response's status line and headers, then its body, as two separate
``transport.write`` calls; on uvloop each is a ``send()`` syscall, and on loopback each
syscall also runs the receiving side's TCP path. Profiling ``/mcp`` showed those two
writes as the largest single cost of a trivial ``tools/call``. :class:`CoalescingTransport`
gathers the writes made during one event-loop iteration and sends them together at the
end of it, so a JSON response (``http.response.start`` then ``http.response.body``
without yielding in between) leaves as one segment. Streams are unaffected apart from
the same at-most-one-iteration deferral. Nothing else of uvicorn is changed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """Wraps an asyncio transport: writes within one loop iteration become one write."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if self._transport.is_closing():
            return
        self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(c) for c in self._pending)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, set_protocol ...
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.run(..., http=CoalescingHttpToolsProtocol)``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
