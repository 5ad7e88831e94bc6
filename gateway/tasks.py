"""The MCP tasks extension (``io.modelcontextprotocol/tasks``, SEP-2663) with its store in Redis.

A tool registered with ``task_support`` ("optional" or "required") may answer ``tools/call``
with a task handle (``resultType: "task"``) instead of its result, for clients that declare
the extension in the request's ``_meta`` client capabilities. Its handler runs inline, as an
ordinary call (2026-07-28 ``input_required`` still works), until it calls
:func:`escalate`; from then on it runs as an asyncio task on this replica and the request
returns a ``CreateTaskResult``. The task's state lives in Redis under the principal's hash
tag, so ``tasks/get``, ``tasks/update`` and ``tasks/cancel`` work on any replica:

- status changes are one Lua script each (a cancelled task never turns completed);
- a task that needs client input parks as ``input_required`` with its ``inputRequests``;
  ``tasks/update`` stores answers (any replica) and wakes the owner over pub/sub;
- ``tasks/cancel`` settles the task as ``cancelled`` and tells the owner to stop it;
- every replica refreshes a heartbeat key; a task whose owner stopped heartbeating is
  reported ``failed`` on the next ``tasks/get`` instead of staying ``working`` forever;
- a principal runs at most ``limits.<…>.running_tasks`` tasks at once over every replica:
  each running task holds a lease in the principal's set (``keys.running_tasks``), taken by
  the script that writes the record, renewed by its replica's heartbeat and dropped when the
  task settles; a task beyond the cap is refused (-32029) before its record exists.

Requests that touch no task-supporting tool never reach this module (no extra round trip).
The proxy hosts the tasks of a 2025-11-25 upstream's task-capable tools here too
(:meth:`TaskManager.run` with the forwarded call as the body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT

from gateway import pubsub
from gateway.errors import INTERNAL_ERROR, InvalidParams, McpError, wire_error
from gateway.limits import Limits, exceeded
from gateway.mcp.dispatcher import Call, InputRequired
from gateway.mcp.types import CLIENT_CAPABILITIES_META_KEY, encode
from gateway.registry import Tool, ToolContext
from shared import keys
from shared.aio import pause, stop_if_cancelled
from shared.log_throttle import ThrottledWarning
from shared.text import as_str

log = logging.getLogger(__name__)
_SETTLE_RETRY_LOG = ThrottledWarning(log)  # every task that ends while Redis is away retries

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
TERMINAL = frozenset({"completed", "failed", "cancelled"})
DEFAULT_TTL_MS = 3_600_000
DEFAULT_POLL_INTERVAL_MS = 500
HEARTBEAT_S = 5.0
INPUT_POLL_S = 2.0  # fallback re-check of delivered inputs when a pub/sub wake-up was missed
SETTLE_RETRY_FIRST_S = 0.1  # a task's end not recorded (Redis away) is tried again after this,
SETTLE_RETRY_MAX_S = 2.0  # doubling up to this
_TASK_ID = re.compile(r"[A-Za-z0-9_-]{22}")  # what create() makes: 16 random bytes, base64url

Invoke = Callable[[Call, Tool, dict[str, Any]], Awaitable[dict[str, Any]]]
Body = Callable[[Call], Awaitable[dict[str, Any]]]  # the call's work, given the call it runs as

# KEYS: the principal's running tasks, the task. ARGV: task id, cap (0: none), lease ms, ttl ms,
# then the record's field/value pairs. Returns 0 when the principal already runs ``cap`` tasks
# (nothing is written), else 1.
_CREATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap = tonumber(ARGV[2])
if cap > 0 and redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""

# KEYS[1]: the principal's running tasks. ARGV: lease ms, then the ids of its tasks this replica runs.
_RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], until_ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""

# KEYS: task, pending, inputs, the principal's running tasks. ARGV: status, field ("" for none),
# value, now, ttl_ms, task id. Returns -1 unknown task, 0 already terminal (nothing changes), 1
# settled. The lease goes in every case: a settled task no longer counts, whoever settled it.
_SETTLE = """
redis.call('ZREM', KEYS[4], ARGV[6])
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return -1 end
if s == 'completed' or s == 'failed' or s == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'lastUpdatedAt', ARGV[4])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# KEYS: task, pending. ARGV: now, ttl_ms, then key/request-JSON pairs.
# Returns 0 when the task is gone or terminal (the handler must stop), else 1.
_PARK = """
local s = redis.call('HGET', KEYS[1], 'status')
if not s or s == 'completed' or s == 'failed' or s == 'cancelled' then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], 'status', 'input_required', 'lastUpdatedAt', ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: task, pending, inputs. ARGV: now, ttl_ms, then key/answer-JSON pairs.
# Answers for keys the task is not waiting on are ignored. When nothing is pending any
# more the task is working again. Returns -1 unknown task, else the number of answers taken.
_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local taken = 0
for i = 3, #ARGV, 2 do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    taken = taken + 1
  end
end
if taken > 0 then
  if redis.call('HLEN', KEYS[2]) == 0 and redis.call('HGET', KEYS[1], 'status') == 'input_required' then
    redis.call('HSET', KEYS[1], 'status', 'working')
  end
  redis.call('HSET', KEYS[1], 'lastUpdatedAt', ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return taken
"""


class _TaskGone(Exception):
    """The task was settled elsewhere (cancelled, owner declared dead): stop the handler."""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def negotiated(call: Call) -> bool:
    """True when this request's client declared the tasks extension (per request, SEP-2575)."""
    caps = call.meta.get(CLIENT_CAPABILITIES_META_KEY)
    ext = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(ext, dict) and TASKS_EXTENSION in ext


def _not_found(task_id: str) -> InvalidParams:
    shown = task_id[:64]
    return InvalidParams(f"Task not found: {shown}", {"taskId": shown})


def _missing_extension(what: str) -> McpError:
    return McpError(MISSING_REQUIRED_CLIENT_CAPABILITY, f"{what} needs the {TASKS_EXTENSION} extension",
                    {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}}, http_status=400)


async def escalate(ctx: ToolContext) -> None:
    """Turn the running tool call into a task (no-op when the client cannot take one).

    Called by a task-supporting handler at the point where it stops answering inline:
    before this, ``ctx.request_client`` returns ``input_required`` to the caller (MRTR);
    after it, the request has returned a task handle and ``request_client`` parks the task.
    Raises :class:`~gateway.errors.LimitExceeded` when the principal already runs its
    ``running_tasks``, so a handler escalates before it does what a retry would repeat."""
    if isinstance(ctx, TaskCall):
        await ctx.escalate()


class TaskCall(Call):
    """A :class:`Call` that can outlive its request as a task."""

    __slots__ = ("manager", "task_id", "escalated", "wake", "runner")

    def __init__(self, call: Call, manager: TaskManager) -> None:
        super().__init__(principal=call.principal, request_id=call.request_id,
                         protocol_version=call.protocol_version, state=call.state, meta=call.meta,
                         envelope=call.envelope, session=call.session, emit=call.emit)
        self.responses = dict(call.responses)
        self.manager = manager
        self.task_id: str | None = None
        self.escalated: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.wake = asyncio.Event()
        self.runner: asyncio.Task[Any] | None = None

    async def escalate(self) -> None:
        if self.task_id is not None:
            return
        handle = await self.manager.create(self)
        self.emit = None  # the request's stream is answered with the handle; later notes are dropped
        if not self.escalated.done():
            self.escalated.set_result(handle)

    async def request_client(self, method: str, params: dict[str, Any], key: str) -> dict[str, Any]:
        return (await self.request_client_many({key: {"method": method, "params": params}}))[key]

    async def request_client_many(self, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Several questions at once: inline they become one ``input_required`` result; in a
        task they are all pending together and the task resumes once every one is answered."""
        missing = {k: r for k, r in requests.items() if k not in self.responses}
        if missing and self.task_id is None:
            raise InputRequired(missing)
        if missing:
            self.responses.update(await self.manager.wait_for_input(self, missing))
        return {k: self.responses[k] for k in requests}


class TaskManager:
    """Creates, runs, settles and serves the tasks of one gateway replica; state in Redis."""

    def __init__(self, redis: aioredis.Redis, blocking_redis: aioredis.Redis, replica_id: str, *,
                 limits: Limits, ttl_ms: int = DEFAULT_TTL_MS,
                 poll_interval_ms: int = DEFAULT_POLL_INTERVAL_MS, heartbeat_s: float = HEARTBEAT_S) -> None:
        if ttl_ms <= 0 or poll_interval_ms <= 0 or heartbeat_s <= 0:
            raise ValueError("task ttl_ms, poll_interval_ms and heartbeat_s must be > 0")
        self.redis = redis
        self.blocking_redis = blocking_redis  # pub/sub: no socket timeout
        self.ttl_ms = ttl_ms
        self.poll_interval_ms = poll_interval_ms
        self.heartbeat_s = heartbeat_s
        self.replica_id = replica_id
        self.limits = limits
        self.lease_ms = int(heartbeat_s * 3000)  # a dead replica's tasks stop counting as its heartbeat ends
        self.running: dict[tuple[str, str], TaskCall] = {}
        self._create = self.redis.register_script(_CREATE)
        self._renew = self.redis.register_script(_RENEW)
        self._settle = self.redis.register_script(_SETTLE)
        self._park = self.redis.register_script(_PARK)
        self._update = self.redis.register_script(_UPDATE)
        self._background: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()
        self.stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        try:
            await self._beat()
        except (RedisError, OSError) as exc:  # Redis may come later; the heartbeat loop retries
            log.warning("task heartbeat failed at start: %s", type(exc).__name__)
        self._background = [asyncio.create_task(self._heartbeat(), name="tasks-heartbeat"),
                            asyncio.create_task(self._listen(), name="tasks-listener")]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.subscribed.wait(), 2.0)

    async def stop(self) -> None:
        """Stop local tasks (reported ``failed``: the replica went away), then the loops."""
        self.stopping = True
        for tcall in list(self.running.values()):
            if tcall.runner is not None:
                tcall.runner.cancel()
        runners = [t.runner for t in self.running.values() if t.runner is not None]
        if runners:
            await asyncio.wait(runners, timeout=5.0)
        for bg in self._background:
            bg.cancel()
        for bg in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await bg
        with contextlib.suppress(RedisError, OSError):
            await self.redis.delete(keys.task_replica(self.replica_id))

    async def _beat(self) -> None:
        await self.redis.set(keys.task_replica(self.replica_id), b"1", px=int(self.heartbeat_s * 3000))

    async def _heartbeat(self) -> None:
        while True:
            await pause(self.heartbeat_s)
            try:
                await self._beat()
                await self._renew_leases()
            except (RedisError, OSError) as exc:
                log.warning("task heartbeat failed: %s", type(exc).__name__)

    async def _renew_leases(self) -> None:
        """Keep counting the tasks this replica runs against their principals' caps."""
        by_principal: dict[str, list[str]] = {}
        for principal, task_id in list(self.running):
            by_principal.setdefault(principal, []).append(task_id)
        for principal, task_ids in by_principal.items():
            await self._renew(keys=[keys.running_tasks(principal)], args=[self.lease_ms, *task_ids])

    async def _listen(self) -> None:
        await pubsub.follow(self.blocking_redis, keys.TASKS_CHANNEL, self._on_signal_frame,
                            on_subscribed=self._subscribed, on_lost=self.subscribed.clear, what="tasks channel")

    async def _subscribed(self) -> None:
        self.subscribed.set()
        await self._recheck()  # signals sent while we were not subscribed are lost

    def _on_signal_frame(self, data: bytes) -> None:
        with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError):
            m = orjson.loads(data)
            self._signal(m["t"], m["p"], m["id"])

    async def _recheck(self) -> None:
        for (principal, task_id), tcall in list(self.running.items()):
            tcall.wake.set()
            status = await self.redis.hget(keys.task(principal, task_id), "status")
            if (status is None or as_str(status) in TERMINAL) and tcall.runner is not None:
                tcall.runner.cancel()

    def _signal(self, kind: str, principal: str, task_id: str) -> None:
        tcall = self.running.get((principal, task_id))
        if tcall is None:
            return
        if kind == "cancel" and tcall.runner is not None:
            tcall.runner.cancel()
        elif kind == "input":
            tcall.wake.set()

    async def _publish(self, kind: str, principal: str, task_id: str) -> None:
        self._signal(kind, principal, task_id)  # this replica first, without the round trip
        try:
            await self.redis.publish(keys.TASKS_CHANNEL, orjson.dumps({"t": kind, "p": principal, "id": task_id}))
        except (RedisError, OSError):
            log.warning("could not publish a task %s signal; the owner re-checks on its own", kind)

    # ------------------------------------------------------------------ tools/call
    async def tools_call(self, call: Call, tool: Tool, args: dict[str, Any], invoke: Invoke) -> dict[str, Any]:
        """Run a task-supporting tool: inline for clients without the extension (or -32021 when
        the tool requires it), else until the handler escalates into a task."""
        return await self.run(call, tool.name, tool.task_support, lambda c: invoke(c, tool, args))

    async def run(self, call: Call, name: str, task_support: str | None, body: Body) -> dict[str, Any]:
        """Run ``body`` for tool ``name`` as a task-supporting call: with the call itself for a
        client without the extension (or -32021 when ``task_support`` is "required"), else
        with a :class:`TaskCall` that answers the request once ``body`` escalates."""
        if not call.modern:  # 2025-11-25 has no per-request extension opt-in: run inline
            return await body(call)
        if not negotiated(call):
            if task_support == "required":
                raise _missing_extension(f"tool {name!r}")
            return await body(call)
        tcall = TaskCall(call, self)
        runner = asyncio.create_task(self._run(tcall, body), name=f"mcp-task-{name}")
        tcall.runner = runner
        runner.add_done_callback(_retrieve)
        try:
            await asyncio.wait({runner, tcall.escalated}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if not tcall.escalated.done():
                runner.cancel()
            raise
        if tcall.escalated.done():
            return tcall.escalated.result()
        return runner.result()

    async def _run(self, tcall: TaskCall, body: Body) -> Any:
        try:
            result = await body(tcall)
        except asyncio.CancelledError:
            if tcall.task_id is None:
                raise
            if self.stopping:
                gone = {"code": INTERNAL_ERROR, "message": "The gateway replica running this task shut down"}
                await self._finish(tcall, "failed", "error", orjson.dumps(gone))
            else:
                await self._finish(tcall, "cancelled", "", b"")
            return None
        except _TaskGone:
            self.running.pop((tcall.principal, tcall.task_id or ""), None)
            with contextlib.suppress(RedisError, OSError):  # else its lease runs out by itself
                await self.redis.zrem(keys.running_tasks(tcall.principal), tcall.task_id or "")
            return None
        except BaseException as exc:
            if tcall.task_id is None:
                raise
            if isinstance(exc, InputRequired):  # a handler bypassed request_client inside a task
                exc = McpError(INTERNAL_ERROR, "the tool asked for input in a way a task cannot deliver")
            err = wire_error(exc, tcall.state.config, method="tools/call", modern=tcall.modern).object()
            await self._finish(tcall, "failed", "error", encode(err))
            return None
        if tcall.task_id is None:
            return result
        await self._finish(tcall, "completed", "result", orjson.dumps(result))
        return None

    async def _finish(self, tcall: TaskCall, status: str, field: str, value: bytes) -> None:
        """Record how the task ended. While Redis does not answer the task keeps trying, and its
        place among the running: its outcome exists nowhere else, and a client polling
        ``tasks/get`` would otherwise see it working until its ttl ends. A replica shutting down
        tries once; a cancel (``tasks/cancel`` settled the task already) stops the retries."""
        task_id = tcall.task_id
        if task_id is None:
            raise RuntimeError("a task call finishes only after it was parked as a task")
        give_up_at = time.monotonic() + self.ttl_ms / 1000  # the record is gone by then anyway
        delay_s = SETTLE_RETRY_FIRST_S
        try:
            while True:
                try:
                    await self._settle_task(tcall.principal, task_id, status, field, value)
                    return
                except (RedisError, OSError) as exc:
                    if self.stopping or time.monotonic() >= give_up_at:
                        log.error("could not record the end of task %s (%s)", task_id, type(exc).__name__)
                        return
                    _SETTLE_RETRY_LOG.warning("could not record the end of task %s yet (%s); retrying", task_id,
                                              type(exc).__name__)
                await pause(delay_s)
                delay_s = min(delay_s * 2, SETTLE_RETRY_MAX_S)
        finally:
            self.running.pop((tcall.principal, task_id), None)

    async def _settle_task(self, principal: str, task_id: str, status: str, field: str = "",
                           value: bytes = b"") -> int:
        ks = [keys.task(principal, task_id), keys.task_pending(principal, task_id),
              keys.task_inputs(principal, task_id), keys.running_tasks(principal)]
        return int(await self._settle(keys=ks, args=[status, field, value, _now(), self.ttl_ms, task_id]))

    # ------------------------------------------------------------------ task side
    async def create(self, tcall: TaskCall) -> dict[str, Any]:
        """Write the task record (durable before the handle is returned) and adopt the runner.
        Raises :class:`~gateway.errors.LimitExceeded`, writing nothing, when the principal already
        runs its ``running_tasks``."""
        task_id = secrets.token_urlsafe(16)
        now = _now()
        record: list[EncodableT] = ["status", "working", "createdAt", now, "lastUpdatedAt", now, "ttlMs", self.ttl_ms,
                                    "pollIntervalMs", self.poll_interval_ms, "replica", self.replica_id]
        principal = tcall.principal
        cap = self.limits.of(principal).running_tasks
        created = await self._create(keys=[keys.running_tasks(principal), keys.task(principal, task_id)],
                                     args=[task_id, cap, self.lease_ms, self.ttl_ms, *record])
        if not int(created):
            raise exceeded("running_tasks", f"at most {cap} tasks may run at once: wait for one to end, or "
                           "cancel one (tasks/cancel)", self.limits.cfg.cap_retry_after_s)
        tcall.task_id = task_id
        self.running[(tcall.principal, task_id)] = tcall
        return {"resultType": "task", "taskId": task_id, "status": "working", "createdAt": now,
                "lastUpdatedAt": now, "ttlMs": self.ttl_ms, "pollIntervalMs": self.poll_interval_ms}

    async def wait_for_input(self, tcall: TaskCall, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Park the task as ``input_required`` until ``tasks/update`` answered every request."""
        principal, task_id = tcall.principal, tcall.task_id
        if task_id is None:
            raise RuntimeError("only a task call waits for input")
        pairs: list[Any] = []
        for k, req in requests.items():
            pairs += [k, orjson.dumps(req)]
        tcall.wake.clear()
        parked = await self._park(keys=[keys.task(principal, task_id), keys.task_pending(principal, task_id)],
                                  args=[_now(), self.ttl_ms, *pairs])
        if not int(parked):
            raise _TaskGone
        inputs_key = keys.task_inputs(principal, task_id)
        wanted = list(requests)
        while True:
            stop_if_cancelled()  # a cancel landing as wait_for times out is swallowed below (shared/aio.py)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(inputs_key, wanted)
                pipe.hget(keys.task(principal, task_id), "status")
                raw, status = await pipe.execute()
            if status is None or as_str(status) in TERMINAL:  # settled elsewhere and the signal was missed
                raise _TaskGone
            if all(v is not None for v in raw):
                await self.redis.hdel(inputs_key, *wanted)
                return {k: orjson.loads(v) for k, v in zip(wanted, raw, strict=True)}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tcall.wake.wait(), INPUT_POLL_S)
            tcall.wake.clear()

    # ------------------------------------------------------------------ tasks/* methods
    def _task_id(self, call: Call, p: dict[str, Any], method: str) -> str:
        if not negotiated(call):
            raise _missing_extension(method)
        task_id = p.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            raise InvalidParams("params.taskId must be a non-empty string")
        if _TASK_ID.fullmatch(task_id) is None:  # checked before it becomes part of a Redis key
            raise _not_found(task_id)
        return task_id

    async def get(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        task_id = self._task_id(call, p, "tasks/get")
        principal = call.principal
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys.task(principal, task_id))
            pipe.hgetall(keys.task_pending(principal, task_id))
            record, pending = await pipe.execute()
        if not record:
            raise _not_found(task_id)
        h = {as_str(k): v for k, v in record.items()}
        status = as_str(h["status"])
        owner = as_str(h.get("replica", b""))
        if status not in TERMINAL and owner != self.replica_id and not await self.redis.exists(
                keys.task_replica(owner)):
            err = {"code": INTERNAL_ERROR, "message": "The gateway replica running this task stopped"}
            await self._settle_task(principal, task_id, "failed", "error", orjson.dumps(err))
            return await self.get(call, p)
        out: dict[str, Any] = {"taskId": task_id, "status": status, "createdAt": as_str(h["createdAt"]),
                               "lastUpdatedAt": as_str(h["lastUpdatedAt"]), "ttlMs": int(h["ttlMs"]),
                               "pollIntervalMs": int(h["pollIntervalMs"])}
        if status == "completed" and "result" in h:
            out["result"] = orjson.loads(h["result"])
        elif status == "failed" and "error" in h:
            out["error"] = orjson.loads(h["error"])
        elif status == "input_required":
            out["inputRequests"] = {as_str(k): orjson.loads(v) for k, v in pending.items()}
        return out

    async def update(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        task_id = self._task_id(call, p, "tasks/update")
        answers = p.get("inputResponses")
        if not isinstance(answers, dict) or not all(isinstance(v, dict) for v in answers.values()):
            raise InvalidParams("params.inputResponses must map request keys to result objects")
        pairs: list[Any] = []
        for k, v in answers.items():
            pairs += [k, orjson.dumps(v)]
        principal = call.principal
        ks = [keys.task(principal, task_id), keys.task_pending(principal, task_id),
              keys.task_inputs(principal, task_id)]
        taken = int(await self._update(keys=ks, args=[_now(), self.ttl_ms, *pairs]))
        if taken < 0:
            raise _not_found(task_id)
        if taken:
            await self._publish("input", principal, task_id)
        return {}

    async def cancel(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        task_id = self._task_id(call, p, "tasks/cancel")
        settled = await self._settle_task(call.principal, task_id, "cancelled")
        if settled < 0:
            raise _not_found(task_id)
        if settled:
            await self._publish("cancel", call.principal, task_id)
        return {}


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a runner's outcome as seen (the request or the task record reports it)."""
    if not task.cancelled():
        task.exception()
