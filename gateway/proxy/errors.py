"""What can go wrong between the gateway and an upstream, as exceptions the error map knows."""

from __future__ import annotations

from gateway.errors import UPSTREAM_FAILED, McpError, Unavailable


class UpstreamFailed(McpError):
    """The upstream could not serve the call: unreachable, too slow, broken answer, or its
    breaker is open. ``reason`` is one of ``unreachable``, ``timeout``, ``protocol``,
    ``breaker_open``, ``busy``; the message names the upstream, never its credentials."""

    def __init__(self, upstream: str, reason: str, message: str) -> None:
        super().__init__(UPSTREAM_FAILED, message, {"upstream": upstream, "reason": reason})
        self.upstream = upstream
        self.reason = reason


class StdioCapReached(Unavailable):
    """Every one of a stdio upstream's ``stdio_max_processes`` processes on this replica serves
    a call (none idle to stop for a new principal): the overload answer, HTTP 503 with a
    Retry-After (gateway/errors.py). Not a failure of the upstream."""

    def __init__(self, upstream: str, cap: int) -> None:
        super().__init__(f"upstream {upstream!r} runs its {cap} stdio processes on this replica, all in use; "
                         "retry later")
        self.upstream = upstream


class WireClosed(Exception):
    """The connection to the upstream ended before its answer (a stdio process exited)."""


class MessageTooLarge(Exception):
    """The upstream sent one message (a JSON body, an SSE event or line, a stdio line; an HTTP
    response head) over ``limit_bytes``: it was not read further, and its connection or process
    is dropped. Not a :class:`WireClosed`: sending the request again would only meet it again."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"a message over {limit_bytes} bytes")
        self.limit_bytes = limit_bytes


class ForeignAnswer(Exception):
    """The upstream answered a request with a response that is not the request's (another id, no
    id): a broken answer, never taken for the result."""


class Unpassable(Exception):
    """The upstream sent a message the gateway does not pass on as sent. ``answer_to``: the id of
    the request it answers, when it is an answer (None otherwise); ``note``: what the client's
    error message adds after naming it."""

    note = ""

    def __init__(self, what: str, answer_to: object = None) -> None:
        super().__init__(what)
        self.answer_to = answer_to


class UntiedError(Unpassable):
    """A stdio upstream sent an error with id null (JSON-RPC's answer to a request whose id the
    server could not read) while several of the gateway's requests were waiting on it: which one it
    answers cannot be told, and that one would wait out its timeout for an answer that never
    comes, so each of them fails with it."""

    note = "; it names no request, and others were waiting: whether the request was acted on is unknown"

    def __init__(self, code: object) -> None:
        super().__init__(f"an error (code {code if type(code) is int else 'not a number'}) with id null")


class OutOfRangeInteger(Unpassable):
    """The upstream sent a message holding an integer outside the 64-bit range. JSON readers
    (the gateway's among them) keep such a number as the nearest double, so the client would get
    another number than the upstream sent: the message is refused, never passed on altered."""

    note = "; it is not passed on altered"

    def __init__(self, answer_to: object = None) -> None:
        super().__init__("an integer outside the 64-bit range", answer_to)


class NestedTooDeep(Unpassable):
    """The upstream sent a message nested deeper than a client may send the gateway
    (``gateway.mcp.kernel.MAX_JSON_DEPTH``): what the gateway keeps of an answer (a task's result,
    a question parked for the client) is written again by a JSON writer that stops at 254 levels,
    and clients' own readers give up not far past that."""

    def __init__(self, depth: int, answer_to: object = None) -> None:
        super().__init__(f"a message nested deeper than {depth} levels", answer_to)
