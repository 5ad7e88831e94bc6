"""A stdio MCP server on the official SDK (``mcp`` 2.3.0) for the proxy's stdio tests:
``python tests/proxy_stdio_server.py``. ``exit_now`` ends the process in the middle of its call;
``pid`` tells which process (one per principal) serves the caller; ``touch`` announces that a
resource changed (to a 2025-11-25 session that subscribed to it, or to 2026-07-28 listen streams);
``hold`` stays in flight until the test lets it go; ``steps`` does too, between two progress
reports."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import anyio
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.types import EmptyResult, SubscribeRequestParams, UnsubscribeRequestParams

PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")

LEGACY_REVISION = "2025-11-25"
HOLD_LIMIT_S = 60.0

server = MCPServer("stdio-upstream", log_level="WARNING")
subscribed: set[str] = set()  # this process's one 2025-11-25 session's resource subscriptions


@server.tool(description="Echo the text back")
def echo(text: str) -> str:
    return f"stdio:{text}"


@server.tool(description="A 1x1 PNG image")
def image() -> Image:
    return Image(data=PNG_1PX, format="png")


@server.tool(description="Whether the process has environment variable `name`")
def has_env(name: str) -> str:
    return "yes" if name in os.environ else "no"


@server.tool(description="Environment variable `name` as a careless server would show it")
def show_env(name: str) -> str:
    return f"{name}={os.environ.get(name)}"


@server.tool(description="The process ends while this call is in flight")
def exit_now() -> str:
    os._exit(3)


@server.tool(description="The id of the process serving this call")
def pid() -> str:
    return str(os.getpid())


@server.tool(description="Announce that resource `uri` changed")
async def touch(uri: str, ctx: Context) -> str:
    if ctx.protocol_version == LEGACY_REVISION:
        if uri in subscribed:
            await ctx.session.send_resource_updated(uri)
    else:
        await ctx.notify_resource_updated(uri)
    return "touched"


@server.tool(description="Leave file `mark`, then answer once file `release` exists")
async def hold(mark: str, release: str) -> str:
    Path(mark).touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not Path(release).exists() and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    return "released"


@server.tool(description="Report progress `label` 1/2, leave file `mark`, then once file `release` exists 2/2")
async def steps(label: str, mark: str, release: str, ctx: Context) -> str:
    await ctx.report_progress(1, 2, label)
    await hold(mark, release)
    await ctx.report_progress(2, 2, label)
    return label


@server.resource("note://{name}", name="note", mime_type="text/plain")
def note(name: str) -> str:
    return f"note {name}"


async def _subscribe(ctx: ServerRequestContext, params: SubscribeRequestParams) -> EmptyResult:
    subscribed.add(str(params.uri))
    return EmptyResult()


async def _unsubscribe(ctx: ServerRequestContext, params: UnsubscribeRequestParams) -> EmptyResult:
    subscribed.discard(str(params.uri))
    return EmptyResult()


server._lowlevel_server.add_request_handler("resources/subscribe", SubscribeRequestParams, _subscribe)
server._lowlevel_server.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, _unsubscribe)


if __name__ == "__main__":
    server.run("stdio")
