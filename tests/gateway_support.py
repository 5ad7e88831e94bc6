"""Run a real gateway replica as a subprocess for the gateway tests.

``python tests/gateway_support.py PORT REDIS_URL [API_KEYS] [TTL_S] [CAP]`` starts uvicorn with
the gateway app plus a few test tools (echo with a schema, a tool that logs/progresses,
one that asks the client for sampling). :func:`start_gateway` launches it and waits for
``/healthz``. Extra config (``overrides``, e.g. ``{"gateway": {"oauth": {...}}}``) travels as
JSON in ``$LM_TEST_GATEWAY_OVERRIDES``, so secrets never appear on the command line; ``output``
captures the replica's stdout/stderr and ``log_level`` sets the root logger's level.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES_ENV = "LM_TEST_GATEWAY_OVERRIDES"
LOG_LEVEL_ENV = "LM_TEST_GATEWAY_LOG_LEVEL"


def register_test_tools(registry: Any) -> None:
    from gateway.errors import ToolError

    @registry.tool("t_echo", description="echo", input_schema={
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
        "additionalProperties": False})
    async def echo(ctx: Any, args: dict) -> dict:
        return {"content": [{"type": "text", "text": f"{ctx.principal}:{args['text']}"}]}

    @registry.tool("t_struct", description="structured", input_schema={"type": "object"},
                   output_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    async def struct(ctx: Any, args: dict) -> dict:
        return {"n": 7}

    @registry.tool("t_fail", description="fails", input_schema={"type": "object"})
    async def fail(ctx: Any, args: dict) -> dict:
        raise ToolError("tool said no")

    @registry.tool("t_crash", description="crashes", input_schema={"type": "object"})
    async def crash(ctx: Any, args: dict) -> dict:
        raise RuntimeError("secret internal detail")

    @registry.tool("t_chatty", description="logs and progresses", input_schema={"type": "object"})
    async def chatty(ctx: Any, args: dict) -> dict:
        await ctx.log("info", "working")
        await ctx.progress(1, 2)
        await ctx.progress(2, 2)
        return {"content": [{"type": "text", "text": "done"}]}

    @registry.tool("t_ask", description="asks the client", input_schema={"type": "object"})
    async def ask(ctx: Any, args: dict) -> dict:
        answer = await ctx.request_client("sampling/createMessage", {
            "messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}], "maxTokens": 5}, "q")
        return {"content": [{"type": "text", "text": "got " + answer["content"]["text"]}]}

    @registry.tool("t_sleep", description="sleeps", input_schema={
        "type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]})
    async def sleep(ctx: Any, args: dict) -> dict:
        import asyncio

        await ctx.state.redis.rpush("test:t_sleep:started", ctx.principal)  # the call is in flight here
        try:
            await asyncio.sleep(args["seconds"])
        finally:
            await ctx.state.redis.rpush("test:t_sleep:ended", ctx.principal)
        return {"content": [{"type": "text", "text": "slept"}]}

    @registry.resource("test://r", name="r", mime_type="text/plain")
    async def res(ctx: Any, args: dict) -> list:
        return [{"uri": args["uri"], "mimeType": "text/plain", "text": "resource text"}]

    @registry.tool("t_touch", description="notify resource updated", input_schema={"type": "object"})
    async def touch(ctx: Any, args: dict) -> dict:
        await ctx.state.notify_resource_updated(ctx.principal, "test://r")
        return {"content": [{"type": "text", "text": "ok"}]}


def main() -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import uvicorn_options
    from shared.config import load_config

    port, redis_url = int(sys.argv[1]), sys.argv[2]
    # Gateway tests present bad credentials on purpose, all from 127.0.0.1: the failed-attempt
    # throttle is off unless a test's overrides set it (tests/security/test_auth_throttle.py).
    overrides: dict[str, Any] = {"redis": {"url": redis_url},
                                 "gateway": {"port": port, "request_state_keys": ["00" * 32],
                                             "auth_throttle": {"failures_per_source": 0, "failures_per_credential": 0}}}
    if len(sys.argv) > 3 and sys.argv[3]:
        from shared.config import parse_api_keys
        overrides["gateway"]["api_keys"] = parse_api_keys(sys.argv[3])
    if len(sys.argv) > 4:
        overrides["gateway"]["session_idle_ttl_s"] = int(sys.argv[4])
    if len(sys.argv) > 5:
        overrides["gateway"]["max_sessions_per_principal"] = int(sys.argv[5])
    for section, values in json.loads(os.environ.get(OVERRIDES_ENV) or "{}").items():
        overrides.setdefault(section, {}).update(values)
    log_level = os.environ.get(LOG_LEVEL_ENV, "warning").lower()
    if LOG_LEVEL_ENV in os.environ:
        logging.basicConfig(level=log_level.upper())
    cfg = load_config(env={}, overrides=overrides)
    app = create_app(cfg)
    register_test_tools(app.registry)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level=log_level, timeout_graceful_shutdown=2,
                **uvicorn_options(cfg))


def start_gateway(port: int, redis_url: str, api_keys: str = "", ttl_s: int = 1800,
                  cap: int = 1000, overrides: dict[str, dict[str, Any]] | None = None,
                  output: IO[bytes] | None = None, log_level: str | None = None) -> subprocess.Popen:
    from tests.waiting import listens_on, wait_for_sync

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_URL", None)
    env.pop(OVERRIDES_ENV, None)
    env.pop(LOG_LEVEL_ENV, None)
    if overrides:
        env[OVERRIDES_ENV] = json.dumps(overrides)
    if log_level:
        env[LOG_LEVEL_ENV] = log_level
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(port), redis_url, api_keys, str(ttl_s),
                             str(cap)], cwd=str(ROOT), env=env, stdout=output,
                            stderr=subprocess.STDOUT if output is not None else None)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}")
        try:
            answers = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
        return answers and listens_on(proc.pid, port)  # not another test's server on that port

    wait_for_sync(up, timeout_s=60, interval_s=0.1, what="gateway /healthz")
    return proc


class LoggedGateway:
    """A gateway started by :func:`logged_gateway`: its addresses and the file its output goes to."""

    def __init__(self, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/mcp/ws"
        self.log = log


@contextlib.contextmanager
def logged_gateway(redis_url: str, log: Path, **options: Any) -> Iterator[LoggedGateway]:
    """:func:`start_gateway` on a free port with its stdout and stderr in ``log``; stopped on exit."""
    from shared.net import free_port

    port = free_port()
    with log.open("wb") as out:
        proc = start_gateway(port, redis_url, output=out, **options)
        try:
            yield LoggedGateway(port, log)
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.contextmanager
def two_gateways(redis_url: str, principal_keys: dict[str, str],
                 overrides: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """Two gateway processes (replicas) on one Redis, with the same API keys (principal -> key)
    and config: their URLs."""
    from shared.net import free_port

    api_keys = ",".join(f"{p}:{k}" for p, k in principal_keys.items())
    pa, pb = free_port(), free_port()
    a = start_gateway(pa, redis_url, api_keys=api_keys, overrides=overrides)
    try:
        b = start_gateway(pb, redis_url, api_keys=api_keys, overrides=overrides)
        try:
            yield f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        finally:
            stop(b)
    finally:
        stop(a)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
