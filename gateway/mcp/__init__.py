"""The MCP kernel, shared by every transport and both protocol revisions.

- ``types``: the vocabulary — revisions, ``_meta`` keys, JSON-RPC messages as msgspec structs.
- ``kernel``: what happens to a message between the transport and the dispatcher — decoding,
  revision negotiation, the 2026-07-28 envelope checks, legacy session resolution.
- ``dispatcher``: one ``_handle_<method>`` per MCP method; the :class:`~gateway.mcp.dispatcher.Call`
  a handler sees.
- ``sessions``: 2025-11-25 sessions, their event logs and pending client requests, in Redis.
- ``request_state``: the sealed ``requestState`` of 2026-07-28 multi-round-trip requests.

The transports that move the bytes live in ``gateway/transports/``; exceptions become wire
errors in ``gateway/errors.py``.
"""
