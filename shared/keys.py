"""Every Redis key learnmesh uses is built here.

All keys that belong to one principal carry the Redis Cluster hash tag ``{principal}``
so a Lua script touching them never spans slots. Principal names are validated at the
edge (auth) and never contain ``{`` or ``}``.
"""

from __future__ import annotations

PREFIX = "lm:"


def _tag(principal: str) -> str:
    return "{" + principal + "}"


# ---------------------------------------------------------------- gateway / MCP sessions
def session(session_id: str) -> str:
    """Hash: principal, protocol version, capabilities, log level (legacy 2025-11-25 sessions)."""
    return f"{PREFIX}sess:{session_id}"


def session_events(session_id: str) -> str:
    """Stream: SSE events of one session (for Last-Event-ID replay)."""
    return f"{PREFIX}sess:{session_id}:events"


def session_pending(session_id: str) -> str:
    """Hash: server->client request id -> waiting marker."""
    return f"{PREFIX}sess:{session_id}:pending"


def principal_sessions(principal: str) -> str:
    """Sorted set: session ids of a principal scored by last use (for the per-principal cap)."""
    return f"{PREFIX}{_tag(principal)}:sessions"


SESSION_INVALIDATE_CHANNEL = f"{PREFIX}sessions:invalidate"


def session_channel(session_id: str) -> str:
    """Pub/sub channel: messages for a session's open stream, whichever replica holds it."""
    return f"{PREFIX}sess:{session_id}:chan"


def response_channel(session_id: str, request_id: str) -> str:
    """Pub/sub channel: a client's response to a server->client request."""
    return f"{PREFIX}sess:{session_id}:resp:{request_id}"


# ---------------------------------------------------------------- context store
# (context store keys: see the block added by the context store)

# ---------------------------------------------------------------- samples / trainer
SAMPLE_LOG = f"{PREFIX}samples"
TRAINER_OFFSET = f"{PREFIX}trainer:offset"

# ---------------------------------------------------------------- model versions / workers
MODEL_VERSION = f"{PREFIX}model:version"

# ---------------------------------------------------------------- audit
AUDIT_STREAM = f"{PREFIX}audit"
