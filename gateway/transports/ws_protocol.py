"""uvicorn's sans-I/O websockets protocol, with a refused handshake counted as a finished one.

The gateway refuses a WebSocket handshake it cannot authenticate with an HTTP 401 and a
``WWW-Authenticate`` challenge (the ASGI denial-response extension, as HTTP answers). uvicorn
sends that response, but leaves its handshake flag unset, so when the endpoint returns it logs
"ASGI callable returned without completing handshake" at ERROR for every refused client —
noise an attacker can produce at will. A denial response that was sent in full ends the
handshake; nothing else of uvicorn is changed.
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
