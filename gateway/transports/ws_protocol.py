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
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    """``uvicorn.run(..., ws=GatewayWebSocketProtocol)``."""

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
