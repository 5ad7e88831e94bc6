"""How bytes reach one upstream: Streamable HTTP (pooled keep-alive connections, gateway/proxy/http1.py)
or stdio (a subprocess, newline-delimited JSON-RPC; gateway/proxy/stdio_pool.py keeps one per principal).

Both offer :meth:`send`: one JSON-RPC message out, and, for a request, the upstream's answer
back. What arrives before the answer on the same exchange (an SSE response stream, or the
stdio pipe) goes to the :class:`Hooks` of the request: notifications (progress, logging) to
``notify``, server->client requests (sampling, elicitation, roots) to ``ask``, whose reply is
sent back to the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from gateway.mcp.kernel import MAX_JSON_DEPTH
from gateway.mcp.types import SUBSCRIPTION_ID_META_KEY
from gateway.proxy.errors import (
    ForeignAnswer,
    MessageTooLarge,
    NestedTooDeep,
    OutOfRangeInteger,
    Unpassable,
    UntiedError,
    WireClosed,
)
from gateway.proxy.http1 import Origin, Response
from gateway.proxy.names import shown_url

log = logging.getLogger(__name__)

Message = dict[str, Any]
# The most one message from an upstream may take (a JSON body, an SSE event, a stdio line): what
# is longer is a broken or hostile upstream, and is not held in memory to find out how long it is.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The most one answer to a list request (one page of tools/list, resources/list, ...) may take: an
# upstream lists again on every refresh, for everyone, and each page is decoded and checked whole
# before the entry bound applies. A page of 1,000 tools with 8 KiB schemas fits.
MAX_LIST_ANSWER_BYTES = 8 * 1024 * 1024
ENCODER_DEPTH = 254  # the deepest nesting orjson writes
MAX_OPEN_QUESTIONS = 16  # an upstream's requests to the client open at once during one call
STDIO_STOP_GRACE_S = 2.0
# What a stdio process's output may fill in the gateway before it is read: reading pauses at twice
# this, the pipe fills, and the process waits in its writes for the gateway to catch up. A longer
# line is gathered on its own, up to MAX_MESSAGE_BYTES.
STDIO_READ_BUFFER_BYTES = 256 * 1024
DEFAULT_WRITE_TIMEOUT_S = 30.0
STDIO_INHERITED_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "LC_ALL", "TMPDIR",
                                 "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT"})


@dataclass(slots=True)
class Hooks:
    """Where an exchange's side traffic goes (None: dropped, or refused for a request)."""

    notify: Callable[[Message], Awaitable[None]] | None = None
    ask: Callable[[Message], Awaitable[Message]] | None = None
    progress_token: Any = None  # the request's own (its _meta.progressToken): its progress is routed by it


NO_HOOKS = Hooks()


@dataclass(slots=True)
class Answer:
    """The upstream's answer to one message: HTTP status (200 for stdio), the JSON-RPC response
    when there is one, and the response headers (HTTP only)."""

    status: int
    message: Message | None
    headers: Mapping[str, str]


def answers(msg: Message, request_id: Any) -> bool:
    """Whether response ``msg`` is the answer to request ``request_id``: the same id, of the same
    JSON type (``true`` is not ``1``), or an error with id null (JSON-RPC's answer to a request
    whose id the server could not read, as servers do for errors of the transport)."""
    if "id" not in msg:
        return False
    rid = msg["id"]
    return (type(rid) is type(request_id) and rid == request_id) or (rid is None and "error" in msg)


def refusal(request: Message) -> Message:
    return {"jsonrpc": "2.0", "id": request.get("id"),
            "error": {"code": -32601, "message": "the gateway's client cannot answer this request"}}


async def side_traffic(msg: Message, hooks: Hooks) -> Message | None:
    """Hand one non-answer message to the hooks; returns the reply owed to a server request."""
    if "method" not in msg:
        return None
    if "id" in msg:
        return await hooks.ask(msg) if hooks.ask is not None else refusal(msg)
    if hooks.notify is not None:
        await hooks.notify(msg)
    return None


class HttpWire:
    """Streamable HTTP: a POST per message; the answer is JSON or an SSE stream."""

    def __init__(self, url: str, headers: Mapping[str, str], timeout_s: float) -> None:
        self.url = url
        base = {"accept": "application/json, text/event-stream", "content-type": "application/json", **headers}
        self.origin = Origin(url, base, connect_timeout_s=min(timeout_s, 10.0))

    async def send(self, body: bytes, headers: Mapping[str, str], request_id: Any, hooks: Hooks,
                   repeatable: bool = True, limit_bytes: int = MAX_MESSAGE_BYTES) -> Answer:
        """``repeatable``: whether the message may be sent again when a kept-alive connection closes
        before the answer (see gateway/proxy/http1.py); ``limit_bytes``: the most one message of
        the answer may take."""
        async with await self.origin.open(b"POST", headers, body, repeatable) as resp:
            kind = resp.headers.get("content-type", "")
            if kind.startswith("text/event-stream"):
                found = await self._stream(resp, headers, request_id, hooks, limit_bytes)
                return Answer(resp.status, found, resp.headers)
            data = await resp.read(limit_bytes)
            message = _json_object(data) if kind.startswith("application/json") else None
            # An error status's error is the transport's (401, 404 of a lost session, ...), whatever
            # id it carries: servers send one without knowing the request's.
            if message is not None and request_id is not None and "method" not in message \
                    and (resp.status < 400 or "error" not in message) and not answers(message, request_id):
                raise ForeignAnswer
            return Answer(resp.status, message, resp.headers)

    async def _stream(self, resp: Response, headers: Mapping[str, str], request_id: Any,
                      hooks: Hooks, limit_bytes: int) -> Message | None:
        """Read the answer's SSE stream. Notifications are handed over in order; server requests
        are answered concurrently (an upstream may ask several things at once, and the reading
        goes on meanwhile), at most MAX_OPEN_QUESTIONS at a time (more are left unanswered);
        those still unanswered when the answer arrives are dropped."""
        asking: set[asyncio.Task[None]] = set()
        try:
            async for msg in _sse_messages(_lines(resp.chunks(), limit_bytes), limit_bytes):
                if "method" not in msg:
                    # The stream of a request carries that request's answer only (the upstream's
                    # questions are answered with POSTs of their own).
                    if not answers(msg, request_id):
                        raise ForeignAnswer
                    resp.finish_later()  # an upstream slow to end the stream does not hold the answer up
                    return msg
                if "id" in msg and "method" in msg:
                    if len(asking) >= MAX_OPEN_QUESTIONS:
                        continue  # a flood: left unanswered (each answer would be a POST of its own)
                    task = asyncio.create_task(self._answer(msg, hooks, headers))
                    asking.add(task)
                    task.add_done_callback(asking.discard)
                else:
                    await side_traffic(msg, hooks)
            return None
        finally:
            for task in asking:
                task.cancel()

    async def _answer(self, request: Message, hooks: Hooks, headers: Mapping[str, str]) -> None:
        reply = await side_traffic(request, hooks)
        if reply is not None:
            await self.post_reply(reply, headers)

    async def follow(self, method: bytes, headers: Mapping[str, str], body: bytes | None, hooks: Hooks) -> int:
        """Read a standing SSE stream (GET, or a POST such as ``subscriptions/listen``) until it
        ends, handing each message to ``hooks``; returns the HTTP status."""
        async with await self.origin.open(method, headers, body) as resp:
            if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                await resp.read(MAX_MESSAGE_BYTES)
                return resp.status
            async for msg in _sse_messages(_lines(resp.chunks())):
                reply = await side_traffic(msg, hooks)
                if reply is not None:
                    await self.post_reply(reply, headers)
            return resp.status

    async def post_reply(self, reply: Message, headers: Mapping[str, str]) -> None:
        """The answer to a server->client request travels as its own POST on the same session."""
        keep = {k: v for k, v in headers.items() if k in ("mcp-session-id", "mcp-protocol-version")}
        async with await self.origin.open(b"POST", keep, orjson.dumps(reply)) as resp:
            await resp.read(MAX_MESSAGE_BYTES)
            if resp.status >= 400:
                log.warning("upstream %s refused a reply to its request (HTTP %d)", shown_url(self.url), resp.status)

    async def close(self) -> None:
        self.origin.close()


async def _lines(chunks: AsyncIterator[bytes], limit_bytes: int = MAX_MESSAGE_BYTES) -> AsyncIterator[str]:
    """Text lines of a byte stream (``\n``, ``\r\n`` or ``\r`` ends a line, as SSE allows). A
    line is split out only when a chunk brings a line end, so an endless line costs its length
    once, and it ends the stream at ``limit_bytes``."""
    pending = bytearray()
    async for chunk in chunks:
        pending += chunk
        if b"\n" in chunk or b"\r" in chunk:
            held = pending.endswith(b"\r")  # may be the first half of a \r\n
            text = bytes(pending[:-1] if held else pending)
            *whole, rest = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            pending = bytearray(rest + b"\r" if held else rest)
            for line in whole:
                yield line.decode("utf-8", "replace")
        if len(pending) > limit_bytes:
            raise MessageTooLarge(limit_bytes)
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


async def _sse_messages(lines: AsyncIterator[str], limit_bytes: int = MAX_MESSAGE_BYTES) -> AsyncIterator[Message]:
    """JSON-RPC messages of an SSE stream (``data:`` lines up to a blank line form one event,
    of at most ``limit_bytes``)."""
    data: list[str] = []
    size = 0
    async for line in lines:
        if line == "":
            if data:
                msg = _json_object("\n".join(data).encode())
                data, size = [], 0
                if msg is not None:
                    yield msg
        elif line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
            size += len(data[-1]) + 1
            if size > limit_bytes:
                raise MessageTooLarge(limit_bytes)


_decode = msgspec.json.Decoder().decode


def _json_object(data: bytes) -> Message | None:
    """The JSON object ``data`` holds (None: not JSON, or not an object); raises
    :class:`Unpassable` for one the gateway does not pass on (see :func:`_check_passable`).
    Integers are read exactly, so that one outside 64 bits is found rather than read as the
    nearest double."""
    try:
        value = _decode(data)
    except msgspec.DecodeError:
        return None
    except RecursionError:  # too deep even to read (so whose answer it is cannot be told)
        raise NestedTooDeep(MAX_JSON_DEPTH) from None
    if not isinstance(value, dict):
        return None
    _check_passable(value, data)
    return value


def _check_passable(value: Message, data: bytes) -> None:
    """Raise :class:`OutOfRangeInteger` for a message holding an integer outside 64 bits (signed,
    or unsigned as orjson writes them), :class:`NestedTooDeep` for one nested past
    MAX_JSON_DEPTH, the bound of a client's message. Encoding with orjson, which refuses both,
    checks at C speed: inside enough lists that its depth limit is ours, once the message has more
    brackets than that (one with fewer cannot be that deep)."""
    probe: Any = value
    if data.count(b"{") + data.count(b"[") > MAX_JSON_DEPTH:
        for _ in range(ENCODER_DEPTH - MAX_JSON_DEPTH):
            probe = [probe]
    try:
        orjson.dumps(probe)
    except orjson.JSONEncodeError as exc:
        answer_to = value.get("id") if "method" not in value else None
        if str(exc) == "Integer exceeds 64-bit range":
            raise OutOfRangeInteger(answer_to) from None
        raise NestedTooDeep(MAX_JSON_DEPTH, answer_to) from None


class StdioWire:
    """One process of a stdio server: started on first use, restarted on the next use after it
    exits, never again once closed.

    Its output is read as fast as the gateway takes it in, never faster: a notification is handed
    to its hooks before the next line is read (so a flood waits in the pipe, and is passed on in
    order), and at most MAX_OPEN_QUESTIONS of its requests are served at once (one beyond them is
    refused). A process that takes nothing of its input for ``write_timeout_s`` while the gateway
    writes to it is stopped: every request waiting on it fails, and the next use starts another.

    Answers are matched to requests by id (an error with id null, see :meth:`_untied`). What else the server sends goes to hooks: a message
    stamped with a waiting request's subscription id (a ``subscriptions/listen`` stream) to that
    request's; progress to the waiting request that sent its ``progressToken`` (tokens are unique
    among a client's requests in flight, so concurrent calls of one principal each get their own);
    a resource update to ``standing`` (the process serves one principal, so the update is that
    principal's whichever call is in flight); anything else to the oldest request still waiting
    that is not a stream (a stdio exchange carries no other link), else to ``standing``."""

    def __init__(self, command: list[str], env: Mapping[str, str], standing: Hooks = NO_HOOKS,
                 write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S, limit_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.command = command
        self.limit_bytes = limit_bytes  # the longest line it may write (one pipe: every message's bound)
        self.write_timeout_s = write_timeout_s
        # Not the gateway's environment (it holds the gateway's own secrets): the basics a program
        # needs, plus what the upstream's configuration names.
        self.env = {k: v for k, v in os.environ.items() if k in STDIO_INHERITED_ENV} | dict(env)
        self.standing = standing
        self.proc: asyncio.subprocess.Process | None = None
        self.generation = 0  # bumps on every (re)start: the session must be initialized again
        self.session_generation = 0  # the generation a 2025-11-25 session was opened on (0: none)
        self.session_lock = asyncio.Lock()
        self.leases = 0  # holders right now (gateway/proxy/stdio_pool.py): a process without is idle
        self.closed = False
        self._waiting: dict[Any, tuple[asyncio.Future[Message], Hooks]] = {}
        self.streams: set[Any] = set()  # waiting requests answered by a stream (subscriptions/listen)
        self._reader: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self._side: set[asyncio.Task[None]] = set()  # server requests being answered (held until done)
        self._fault: Exception | None = None  # why the gateway stopped the running process, if it did

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def session_open(self) -> bool:
        """Whether the running process has its 2025-11-25 session."""
        return self.running and self.session_generation == self.generation

    async def _ensure(self) -> asyncio.subprocess.Process:
        async with self._start_lock:
            if self.closed:
                raise WireClosed("the stdio server was stopped")
            if self.proc is None or self.proc.returncode is not None:
                try:
                    self.proc = await asyncio.create_subprocess_exec(
                        *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.DEVNULL, env=self.env, limit=STDIO_READ_BUFFER_BYTES)
                except OSError as exc:  # not found, not executable: the operator's to fix, so logged
                    log.warning("stdio upstream %s cannot be started: %s", self.command[0],
                                exc.strerror or type(exc).__name__)
                    # The client is told no more than that: the command is the operator's business.
                    raise WireClosed("its process could not be started") from None
                self.generation += 1
                self._fault = None
                self._reader = asyncio.create_task(self._read(self.proc), name="proxy-stdio-reader")
            return self.proc

    async def send(self, body: bytes, headers: Mapping[str, str], request_id: Any, hooks: Hooks,
                   repeatable: bool = True, limit_bytes: int = MAX_MESSAGE_BYTES) -> Answer:
        """(A pipe has no connection to replace: ``repeatable`` does not apply; its messages share
        one bound, the wire's ``limit_bytes``, which is the request's own for a process serving one
        kind of request, as the lists' process does.)"""
        proc = await self._ensure()
        future: asyncio.Future[Message] | None = None
        if request_id is not None:
            future = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = (future, hooks)
        try:
            await self._write(proc, body)
            return Answer(200, await future if future is not None else None, {})
        finally:
            self._waiting.pop(request_id, None)

    async def exited(self) -> None:
        """Return when the running process has ended (at once when none runs)."""
        if self.proc is not None:
            await self.proc.wait()

    async def _write(self, proc: asyncio.subprocess.Process, body: bytes) -> None:
        if proc.stdin is None or proc.returncode is not None:
            raise WireClosed("the stdio server is not running")
        try:
            proc.stdin.write(body + b"\n")
            async with asyncio.timeout(self.write_timeout_s):
                await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WireClosed("the stdio server closed its input") from exc
        except TimeoutError:
            # Its input pipe is full and stays so: every later write would wait the same, and what
            # the gateway writes meanwhile would pile up in memory. The next use starts another.
            self._fault = WireClosed(f"its process read none of its input for {self.write_timeout_s:g} s "
                                     "and was stopped")
            log.warning("stdio upstream %s: its process read none of its input for %g s; it is stopped",
                        self.command[0], self.write_timeout_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise self._fault from None

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        stdout = proc.stdout
        if stdout is None:
            return
        ended: Exception = WireClosed("the stdio server exited")
        try:
            async for line in _stdio_lines(stdout, self.limit_bytes):
                try:
                    msg = _json_object(line)
                except Unpassable as exc:
                    self._refuse(exc)
                    continue
                if msg is not None:
                    await self._route(proc, msg)
        except MessageTooLarge as exc:
            ended = exc
            log.warning("stdio upstream %s: a line over %d bytes; the process is stopped", self.command[0],
                        self.limit_bytes)
            proc.kill()
            await _discard(stdout)
        except OSError as exc:
            log.warning("stdio upstream %s: %s", self.command[0], type(exc).__name__)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            ended = self._fault or ended
            for future, _ in list(self._waiting.values()):
                if not future.done():
                    future.set_exception(ended)

    async def _route(self, proc: asyncio.subprocess.Process, msg: Message) -> None:
        if "method" not in msg:
            if "error" in msg and "id" in msg and msg["id"] is None:
                self._untied(msg)
                return
            rid = msg.get("id")
            waiting = self._waiting.get(rid) if type(rid) is int else None  # the gateway's ids; true is not 1
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(msg)
            return
        hooks = self._hooks_of(msg)
        if "id" not in msg:  # in order, and the next line waits for it (see the class)
            await self._serve_side(proc, msg, hooks)
        elif len(self._side) >= MAX_OPEN_QUESTIONS:
            await self._serve_side(proc, msg, NO_HOOKS)  # refused at once
        else:  # answered concurrently: an answer may take the client a while
            task = asyncio.create_task(self._serve_side(proc, msg, hooks))
            self._side.add(task)
            task.add_done_callback(self._side.discard)

    def _untied(self, msg: Message) -> None:
        """An error with id null (JSON-RPC's answer to a request whose id the server could not
        read): with one request waiting, that one's answer; with several, which one it answers
        cannot be told, and that one's answer will never come, so each fails at once with
        :class:`UntiedError` rather than one waiting out its timeout."""
        waiting = [future for future, _ in self._waiting.values() if not future.done()]
        if len(waiting) == 1:
            waiting[0].set_result(msg)
            return
        error = msg["error"]
        exc = UntiedError(error.get("code") if isinstance(error, dict) else None)
        log.warning("stdio upstream %s: %s while %d requests were waiting; %s", self.command[0], exc, len(waiting),
                    "each fails with it" if waiting else "dropped")
        for future in waiting:
            future.set_exception(exc)

    def _refuse(self, exc: Unpassable) -> None:
        """A message that cannot be passed on as sent: the request it answers fails with it; any
        other (a notification, a request of the server's) is dropped."""
        rid = exc.answer_to
        waiting = self._waiting.get(rid) if type(rid) is int else None
        if waiting is not None and not waiting[0].done():
            waiting[0].set_exception(exc)
        else:
            log.warning("stdio upstream %s: a message was dropped (it holds %s)", self.command[0], exc)

    def _hooks_of(self, msg: Message) -> Hooks:
        params = msg.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        stream = meta.get(SUBSCRIPTION_ID_META_KEY) if isinstance(meta, dict) else None
        if type(stream) is int and stream in self._waiting:  # the gateway's ids (a list would not even hash)
            return self._waiting[stream][1]
        token = params.get("progressToken") if isinstance(params, dict) else None
        if token is not None and msg.get("method") == "notifications/progress":
            for _, hooks in self._waiting.values():
                if hooks.progress_token == token:
                    return hooks
        if msg.get("method") != "notifications/resources/updated":
            for rid, (_, hooks) in self._waiting.items():
                if rid not in self.streams:
                    return hooks
        return self.standing

    async def _serve_side(self, proc: asyncio.subprocess.Process, msg: Message, hooks: Hooks) -> None:
        try:
            reply = await side_traffic(msg, hooks)
            if reply is not None:
                await self._write(proc, orjson.dumps(reply))
        except Exception:  # noqa: BLE001 - a side message must not take the reader down
            log.warning("stdio upstream %s: could not serve a %s message", self.command[0], msg.get("method"))

    async def close(self) -> None:
        """Stop the process as the MCP stdio transport asks: its input closed, then SIGTERM, then
        SIGKILL, each after ``STDIO_STOP_GRACE_S``; it is reaped before this returns."""
        async with self._start_lock:  # a start under way ends first; none begins after
            self.closed = True
            proc = self.proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            for stop in (proc.terminate, proc.kill):
                try:
                    await asyncio.wait_for(proc.wait(), STDIO_STOP_GRACE_S)
                    break
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        stop()
            await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if proc is not None and proc.stdout is not None:
            await _discard(proc.stdout)
        for task in list(self._side):
            task.cancel()


async def _stdio_lines(stdout: asyncio.StreamReader, limit_bytes: int) -> AsyncIterator[bytes]:
    """The lines of a process's output. One longer than the reader's buffer is gathered here, up
    to ``limit_bytes`` (:class:`MessageTooLarge` past that), so that an ordinary flood of lines
    never holds more than the buffer."""
    while True:
        try:
            yield await stdout.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # the output ended
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:
            yield await _long_line(stdout, await stdout.readexactly(exc.consumed), limit_bytes)


async def _discard(stdout: asyncio.StreamReader) -> None:
    """Read a stopped process's output to its end, dropping it (no more than its pipe held): its
    pipe is closed only then, and reading may have been paused with output waiting."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(STDIO_STOP_GRACE_S):
            while await stdout.read(STDIO_READ_BUFFER_BYTES):
                pass


async def _long_line(stdout: asyncio.StreamReader, start: bytes, limit_bytes: int) -> bytes:
    line = bytearray(start)
    while len(line) <= limit_bytes:
        try:
            line += await stdout.readuntil(b"\n")
            break
        except asyncio.IncompleteReadError as exc:
            line += exc.partial
            break
        except asyncio.LimitOverrunError as exc:
            line += await stdout.readexactly(exc.consumed)
    if len(line) > limit_bytes:
        raise MessageTooLarge(limit_bytes)
    return bytes(line)


Wire = HttpWire | StdioWire
