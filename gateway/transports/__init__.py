"""The transports that carry MCP messages; each only moves bytes and leaves the protocol
to the kernel in ``gateway/mcp/``.

- ``streamable_http``: MCP Streamable HTTP at ``/mcp`` (JSON or SSE answers, GET streams).
- ``websocket``: MCP over WebSocket at ``/mcp/ws`` (the SEP-1288 draft).
- ``edge``: what every HTTP request passes before routing (body limit, admin key, CORS).
- ``cors``: the CORS headers of allowed browser origins, which the edge adds.
- ``http_protocol``: uvicorn's HTTP protocol with one socket write per response and read deadlines.
- ``ws_protocol``: uvicorn's WebSocket protocol, with a refused handshake logged as none.
"""
