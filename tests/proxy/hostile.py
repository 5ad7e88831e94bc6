"""A hostile (or merely broken) Streamable-HTTP upstream for the proxy's attack tests: raw HTTP/1.1
on asyncio, in a thread of the test process, so it can send what no SDK server would and the test
can see what reached it.

It speaks 2025-11-25 (``initialize`` opens a session; a GET stream is not offered). ``tools/list``
lists :attr:`HostileUpstream.tools`; ``tools/call`` of tool ``<behaviour>`` runs the coroutine of
that name below, which writes whatever bytes it likes to the socket (any other tool: ``echo``); ``resources/subscribe``
is answered once :attr:`HostileUpstream.subscribe_gate` is set: it fails (HTTP 503)
:attr:`HostileUpstream.subscribe_failures` times, then succeeds. What it received is kept in
``requests`` (the JSON bodies, with the request headers under ``"_headers"`` and the request
target, query included, under ``"_target"``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from shared.net import free_port
from tests.conftest import wait_for_sync

SESSION_ID = "hostile-session"
CHUNK = b"a" * (64 * 1024)

Behaviour = Callable[["HostileUpstream", asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


def _head(status: int, kind: str, length: int | None = None, extra: str = "") -> bytes:
    size = f"content-length: {length}\r\n" if length is not None else ""
    return (f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\n{size}mcp-session-id: {SESSION_ID}\r\n{extra}"
            "\r\n").encode()


def _json(writer: asyncio.StreamWriter, message: dict[str, Any], status: int = 200) -> None:
    body = orjson.dumps(message)
    writer.write(_head(status, "application/json", len(body)) + body)


def _result(request: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def _text(request: dict[str, Any], text: str) -> dict[str, Any]:
    return _result(request, {"content": [{"type": "text", "text": text}]})


async def _endless(up: HostileUpstream, writer: asyncio.StreamWriter, prefix: bytes) -> None:
    """``prefix``, then bytes without end (until ``up.endless_bytes``) or until the gateway hangs up."""
    writer.write(prefix)
    try:
        while up.sent < up.endless_bytes:
            writer.write(CHUNK)
            up.sent += len(CHUNK)
            await writer.drain()
    except (ConnectionError, OSError):
        up.hung_up.set()


async def huge_json(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A JSON answer far larger than any sane limit (its length announced up front)."""
    opening = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"' % request["id"]
    await _endless(up, writer, _head(200, "application/json", up.endless_bytes + 1024) + opening)


async def huge_sse_line(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """An SSE answer whose one ``data:`` line never ends."""
    await _endless(up, writer, _head(200, "text/event-stream") + b"data: ")


async def huge_sse_event(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """An SSE event of short ``data:`` lines that never ends (no blank line)."""
    writer.write(_head(200, "text/event-stream"))
    try:
        while up.sent < up.endless_bytes:
            writer.write(b"data: " + CHUNK[:1000] + b"\n")
            up.sent += 1007
            await writer.drain()
    except (ConnectionError, OSError):
        up.hung_up.set()


async def huge_head(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A response head that never ends: one header value without end."""
    await _endless(up, writer, b"HTTP/1.1 200 X\r\nx-junk: ")


async def many_headers(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A response head of headers without end, each of its own name."""
    writer.write(b"HTTP/1.1 200 X\r\n")
    try:
        n = 0
        while up.sent < up.endless_bytes:
            line = b"x-junk-%d: %s\r\n" % (n, b"a" * 1000)
            writer.write(line)
            up.sent += len(line)
            n += 1
            if n % 64 == 0:
                await writer.drain()
    except (ConnectionError, OSError):
        up.hung_up.set()


async def note_flood(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """Progress for the call, ``up.endless_bytes`` of it, written faster than it is read: the
    writer waits only once 1 MiB waits in its own buffer (the socket's full: ``up.blocked`` is
    set then), then the answer."""
    token = request["params"].get("_meta", {}).get("progressToken")
    note = b"data: " + orjson.dumps({"jsonrpc": "2.0", "method": "notifications/progress", "params": {
        "progressToken": token, "progress": 1, "message": "x" * 4000}}) + b"\n\n"
    writer.write(_head(200, "text/event-stream"))
    try:
        while up.sent < up.endless_bytes:
            writer.write(note)
            up.sent += len(note)
            up.notes += 1
            if writer.transport.get_write_buffer_size() > 1 << 20:
                up.blocked.set()
                await writer.drain()
            else:
                await asyncio.sleep(0)
        writer.write(b"data: " + orjson.dumps(_text(request, "flooded")) + b"\n\n")
        writer.close()
    except (ConnectionError, OSError):
        up.hung_up.set()


async def answer_then_linger(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """The answer on the SSE stream, then the stream held open (comments now and then) instead of ended."""
    writer.write(_head(200, "text/event-stream") + b"data: " + orjson.dumps(_text(request, "answered")) + b"\n\n")
    try:
        while not up.stopping.is_set():
            writer.write(b": still here\n\n")
            await writer.drain()
            await asyncio.sleep(0.2)
    except (ConnectionError, OSError):
        up.hung_up.set()


async def ask_flood(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """Server->client requests by the thousand during the call, then the answer."""
    writer.write(_head(200, "text/event-stream"))
    for n in range(up.flood):
        ask = {"jsonrpc": "2.0", "id": f"ask-{n}", "method": "roots/list", "params": {"n": n}}
        writer.write(b"data: " + orjson.dumps(ask) + b"\n\n")
    await writer.drain()
    await asyncio.sleep(up.flood_hold_s)
    writer.write(b"data: " + orjson.dumps(_text(request, "flooded")) + b"\n\n")
    writer.close()


async def hang_up(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """The connection closed under the call, no answer (a crash, a proxy in between giving up)."""
    writer.close()


async def churn(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """``up.flood`` announcements that its tools list changed, then the answer."""
    changed = b"data: " + orjson.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}) + b"\n\n"
    writer.write(_head(200, "text/event-stream") + changed * up.flood)
    writer.write(b"data: " + orjson.dumps(_text(request, "churned")) + b"\n\n")
    writer.close()


async def side_notes(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A log message at a level MCP does not have, progress for a token the call did not send and
    for the one it did, then the answer."""
    token = request["params"].get("_meta", {}).get("progressToken")
    notes = [{"method": "notifications/message", "params": {"level": "verbose", "data": "odd level"}},
             {"method": "notifications/progress", "params": {"progressToken": "not-this-call", "progress": 1}},
             {"method": "notifications/progress", "params": {"progressToken": token, "progress": 2}}]
    writer.write(_head(200, "text/event-stream") + b"".join(
        b"data: " + orjson.dumps({"jsonrpc": "2.0", **note}) + b"\n\n" for note in notes))
    writer.write(b"data: " + orjson.dumps(_text(request, "noted")) + b"\n\n")
    writer.close()


async def make_task(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A 2026-07-28 CreateTaskResult for task ``up.task_id`` (lived ``up.task_ttl_ms``)."""
    _json(writer, _result(request, {"resultType": "task", "taskId": up.task_id, "status": "working",
                                    "ttlMs": up.task_ttl_ms, "createdAt": "2026-01-01T00:00:00Z"}))


async def hold(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """No answer until :attr:`HostileUpstream.release` is set (a call that takes as long as a test needs)."""
    up.holding += 1
    await asyncio.get_running_loop().run_in_executor(None, up.release.wait)
    _json(writer, _text(request, "held"))


async def echo(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    _json(writer, _text(request, "echo"))


async def wrong_id(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A result for another request than the one asked."""
    _json(writer, {**_text(request, "not yours"), "id": request["id"] + 1000})


async def no_id(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A result without an id."""
    _json(writer, {"jsonrpc": "2.0", "result": {"content": [{"type": "text", "text": "whose?"}]}})


async def true_id(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A result whose id is ``true`` (equal to 1 in a language that mixes the two)."""
    _json(writer, {**_text(request, "true"), "id": True})


async def sse_wrong_id(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """On an SSE stream, a result for another request, then the stream ends."""
    wrong = {**_text(request, "not yours"), "id": request["id"] + 1000}
    writer.write(_head(200, "text/event-stream") + b"data: " + orjson.dumps(wrong) + b"\n\n")
    writer.close()


async def error(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """The JSON-RPC error ``up.error`` (e.g. one in the gateway's own codes, to pass for the gateway)."""
    _json(writer, {"jsonrpc": "2.0", "id": request["id"], "error": up.error})


def _what_it_was_sent(request: dict[str, Any]) -> str:
    """What the request carried that a careless server might echo: its credentials."""
    return f"authorization={request['_headers'].get('authorization')} target={request['_target']}"


async def leak_error(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """An error quoting the credentials it was sent, in its message and its data."""
    said = _what_it_was_sent(request)
    _json(writer, {"jsonrpc": "2.0", "id": request["id"],
                   "error": {"code": -32603, "message": f"refused: {said}", "data": {"echo": [said]}}})


async def leak_result(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A log line, then a result, quoting the credentials it was sent."""
    said = _what_it_was_sent(request)
    note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "error", "data": said}}
    answer = _text(request, said)
    writer.write(_head(200, "text/event-stream") + b"".join(b"data: " + orjson.dumps(m) + b"\n\n" for m in (note, answer)))
    writer.close()


async def big_int(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A result holding an integer beyond 64 bits."""
    body = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[],"structuredContent":{"n":%s}}}' % (
        request["id"], b"1" + b"0" * 30)
    writer.write(_head(200, "application/json", len(body)) + body)


async def big_int_sse(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """On an SSE stream, a result holding an integer below -2**63."""
    body = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[],"structuredContent":{"n":[-%s]}}}' % (
        request["id"], b"9" * 25)
    writer.write(_head(200, "text/event-stream") + b"data: " + body + b"\n\n")
    writer.close()


async def edge_ints(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A result holding the integers at either end of what 64 bits hold (signed and unsigned)."""
    _json(writer, _result(request, {"content": [], "structuredContent": {"n": [-(1 << 63), (1 << 64) - 1]}}))


def nested(depth: int) -> bytes:
    """JSON of ``depth`` objects nested in one another (written by hand: JSON writers stop short)."""
    return b'{"a":' * depth + b"{}" + b"}" * depth


async def deep(up: HostileUpstream, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    """A result whose structured content is nested ``up.depth`` objects deep."""
    body = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[],"structuredContent":%s}}' % (request["id"], nested(up.depth))
    writer.write(_head(200, "application/json", len(body)) + body)


BEHAVIOURS: dict[str, Behaviour] = {f.__name__: f for f in (
    huge_json, huge_head, many_headers, huge_sse_line, huge_sse_event, note_flood, answer_then_linger, ask_flood, churn, hang_up,
    make_task, side_notes, hold, echo, wrong_id, no_id, true_id, sse_wrong_id, error, leak_error, leak_result, big_int, big_int_sse, edge_ints,
    deep)}


class HostileUpstream:
    """The server; ``tools`` is what ``tools/list`` answers (default: one tool per behaviour)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.tools: list[dict[str, Any]] = [{"name": n, "inputSchema": {"type": "object"}} for n in BEHAVIOURS]
        self.requests: list[dict[str, Any]] = []
        self.endless_bytes = 1 << 30
        self.flood = 0
        self.label = "hostile"  # what its tasks/get answers carry
        self.task_id, self.task_ttl_ms = "task-1", 60_000
        self.page_delay_s = 0.0  # how long each tools/list page takes
        self.endless_pages = False  # every tools/list page names a next one (see _page)
        self.same_cursor = False
        self.page_tools = 0
        self.pages_sent = 0
        self.flood_hold_s = 0.0  # how long the flood stays unanswered before the call's answer
        self.error: dict[str, Any] = {"code": -32603, "message": "failed"}  # what tool ``error`` answers
        self.subscribe_failures = 0  # resources/subscribe requests answered HTTP 503 (as if down) before it accepts
        self.subscribe_gate = threading.Event()  # resources/subscribe is answered once this is set
        self.subscribe_gate.set()
        self.depth = 0  # how deep tool ``deep`` nests its answer
        self.refuse_replies = False  # answers the gateway POSTs to its questions get HTTP 403
        self.version: Any = "2025-11-25"  # what its initialize answers as the protocol version
        self.holding = 0  # calls of tool ``hold`` begun
        self.release = threading.Event()  # tool ``hold`` answers once this is set
        self.sent = 0
        self.hung_up = threading.Event()  # the gateway closed a connection under an answer being sent
        self.blocked = threading.Event()  # tool note_flood found the gateway reading no more
        self.notes = 0  # notifications tool note_flood sent
        self.stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def methods(self) -> list[str]:
        return [r.get("method", "") for r in list(self.requests)]

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            while not self.stopping.is_set():
                await asyncio.sleep(0.05)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if lines[0].startswith("GET"):
                    writer.write(b"HTTP/1.1 405 X\r\ncontent-length: 0\r\n\r\n")
                    continue
                message = {**orjson.loads(body), "_headers": headers, "_target": lines[0].split(" ")[1]}
                self.requests.append(message)
                await self._answer(writer, message)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def _page(self, cursor: Any) -> dict[str, Any]:
        """A tools/list page: ``tools``, or with ``page_tools`` that many new tools per page, named
        by the page; the next page is named when ``endless_pages``, as ``page-<n+1>`` (or ``more``,
        always the same, when ``same_cursor``)."""
        n = int(cursor.removeprefix("page-")) if isinstance(cursor, str) and cursor.startswith("page-") else 0
        self.pages_sent += 1
        tools = [{"name": f"p{n}_{i}", "inputSchema": {"type": "object"}} for i in range(self.page_tools)] \
            if self.page_tools else self.tools
        if not self.endless_pages:
            return {"tools": tools}
        return {"tools": tools, "nextCursor": "more" if self.same_cursor else f"page-{n + 1}"}

    async def _answer(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        method = message.get("method", "")
        if "id" not in message:
            writer.write(b"HTTP/1.1 202 X\r\ncontent-length: 0\r\n\r\n")
        elif "method" not in message and self.refuse_replies:
            writer.write(b"HTTP/1.1 403 X\r\ncontent-length: 0\r\n\r\n")
        elif method == "initialize":
            _json(writer, _result(message, {"protocolVersion": self.version, "capabilities": {"tools": {}},
                                            "serverInfo": {"name": "hostile", "version": "1"}}))
        elif method == "tools/list":
            await asyncio.sleep(self.page_delay_s)
            _json(writer, _result(message, self._page((message.get("params") or {}).get("cursor"))))
        elif method == "tasks/get":
            _json(writer, _result(message, {"taskId": message["params"]["taskId"], "status": "working",
                                            "statusMessage": f"task of {self.label}"}))
        elif method == "tools/call":
            await BEHAVIOURS.get(message["params"]["name"], echo)(self, writer, message)
        elif method == "resources/subscribe":
            await asyncio.get_running_loop().run_in_executor(None, self.subscribe_gate.wait)
            if self.subscribe_failures > 0:
                self.subscribe_failures -= 1
                writer.write(b"HTTP/1.1 503 X\r\ncontent-length: 0\r\n\r\n")
            else:
                _json(writer, _result(message, {}))
        else:
            _json(writer, {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "no"}})


@contextmanager
def hostile_upstream() -> Iterator[HostileUpstream]:
    up = HostileUpstream()
    up._thread.start()
    wait_for_sync(up._ready.is_set, timeout_s=10, what="the hostile upstream to listen")
    try:
        yield up
    finally:
        up.stopping.set()
        up.release.set()
        up._thread.join(10)
