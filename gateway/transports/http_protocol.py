"""uvicorn's httptools protocol with one socket write per response instead of two.

uvicorn writes a response's status line and headers, then its body, as two separate
``transport.write`` calls; on uvloop each is a ``send()`` syscall, and on loopback each
syscall also runs the receiving side's TCP path. Profiling ``/mcp`` showed those two
writes as the largest single cost of a trivial ``tools/call``. :class:`CoalescingTransport`
gathers the writes made during one event-loop iteration and sends them together at the
end of it, so a JSON response (``http.response.start`` then ``http.response.body``
without yielding in between) leaves as one segment. Streams are unaffected apart from
the same at-most-one-iteration deferral. Nothing else of uvicorn is changed.

:class:`CoalescingHttpToolsProtocol` leans on uvicorn internals (``HttpToolsProtocol``, its
``loop`` and ``transport``): pyproject.toml pins the uvicorn versions known to have them, and
tests/test_gateway_http_protocol.py fails when a response of the installed one leaves in more
than one write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

FLUSH_AT_BYTES = 64 * 1024


class CoalescingTransport:
    """Wraps an asyncio transport: writes within one loop iteration become one write."""

    __slots__ = ("_transport", "_loop", "_pending", "_pending_bytes")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._pending_bytes = 0

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
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._pending_bytes = 0
        self._transport.abort()

    def is_closing(self) -> bool:  # asked on every response: spared the __getattr__ detour
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, set_protocol ...
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.run(..., http=CoalescingHttpToolsProtocol)``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
