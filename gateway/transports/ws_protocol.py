"""uvicorn's sans-I/O websockets protocol, with a refused handshake counted as a finished one
and a silent peer dropped rather than waited on.

The gateway refuses a WebSocket handshake it cannot authenticate with an HTTP 401 and a
``WWW-Authenticate`` challenge (the ASGI denial-response extension, as HTTP answers). uvicorn
sends that response, but leaves its handshake flag unset, so when the endpoint returns it logs
"ASGI callable returned without completing handshake" at ERROR for every refused client —
noise an attacker can produce at will. A denial response that was sent in full ends the
handshake.

A peer that misses a keepalive pong, or never answers the close frame sent to it, is closed
by uvicorn with ``transport.close()``, which first waits for the write buffer to drain. A
client that stopped reading never drains it, so its connection would stay open for good:
its requests' replies held in memory, its session and ``event_streams`` slot kept. Such a
peer is aborted instead (the unsent bytes were for a client that is not reading them).

A peer that does not read what is written to it gets nothing more read of it. uvicorn answers
each ping frame with a pong written at once, without flow control, and goes on reading: a
client that streams pings and never reads would have the gateway buffer pongs, as many bytes
as it sends, until the keepalive drops it (a 300 MB heap in 40 s over loopback). Reading stops
while the write buffer is over its high-water mark (at most one read's worth of answers past
it) and resumes as it drains; the keepalive's ping then waits behind the unread bytes and a
peer that never reads is dropped when its pong does not come.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    """``uvicorn.run(..., ws=GatewayWebSocketProtocol)``."""

    _reading_held = False  # reading stopped because the peer does not read what is written to it

    def pause_writing(self) -> None:
        super().pause_writing()
        self._hold_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._reading_held:
            self._reading_held = False
            if not self.read_paused:  # uvicorn's own pause (a frame the app has not taken) stays
                self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.writable.is_set():  # the app's receive() may have resumed reading meanwhile
            self._hold_reading()

    def _hold_reading(self) -> None:
        if not self.transport.is_closing():
            self._reading_held = True
            self.transport.pause_reading()

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True
        elif message["type"] == "websocket.close" and self.close_timer is not None:
            self.close_timer.cancel()
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.abort)

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        self.transport.abort()
