"""The upstream MCP server the proxy tests federate, built on the official SDK (``mcp`` 2.3.0).

One :class:`mcp.server.mcpserver.MCPServer` carries everything a proxy must carry across:
a text tool, structured output, an image, a slow tool, a failing tool, progress, a tool that
asks the client (elicitation) and one that samples the client's model, plus a resource, a
resource template and a prompt. ``revision`` reports the protocol revision the request
arrived in, so a test can prove which revision the proxy spoke upstream. ``long_job`` is
declared task-capable (``execution.taskSupport``, which ``MCPServer.tool`` has no argument for)
and leaves a mark when it starts and another when it is cancelled.
"""

from __future__ import annotations

import base64
import os
import uuid
from pathlib import Path
from typing import Annotated, Literal

import anyio
from mcp.server.mcpserver import Context, Elicit, Image, MCPServer, Resolve, Sample
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CreateMessageResult, SamplingMessage, TextContent, ToolListChangedNotification
from mcp_types import Tool as MCPTool
from mcp_types import ToolExecution
from pydantic import BaseModel, Field

PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")
STATIC_URI = "upstream://static"
STATIC_TEXT = "static resource of the upstream"
ITEM_TEMPLATE = "upstream://items/{item_id}"
FAIL_MESSAGE = "the upstream tool failed on purpose"
MARK_DIR_ENV = "UPSTREAM_MARK_DIR"
LEGACY_REVISION = "2025-11-25"
TASK_TOOLS: dict[str, Literal["optional", "required"]] = {"long_job": "optional", "greet_user": "optional"}  # declared taskSupport
CANCELLED_MARK = "cancelled"


def _mark_started(tool: str) -> None:
    """Leave a file ``<tool>-<pid>-<random>`` in ``$UPSTREAM_MARK_DIR`` when a call starts, so a
    test knows the call is in flight on the upstream (not merely sent) and which process to kill
    (a stdio upstream is the proxy's child, not the test's)."""
    mark_dir = os.environ.get(MARK_DIR_ENV)
    if mark_dir:
        (Path(mark_dir) / f"{tool}-{os.getpid()}-{uuid.uuid4().hex}").touch()


class Sum(BaseModel):
    """Structured output of ``add``."""

    total: int
    operands: list[int]


class Name(BaseModel):
    """What ``greet_user`` asks the client for."""

    name: str = Field(description="Your name")


def _ask_name() -> Elicit[Name]:
    return Elicit("What is your name?", Name)


def _sample_reply(prompt: str) -> Sample:
    return Sample([SamplingMessage(role="user", content=TextContent(type="text", text=prompt))], max_tokens=50)


class TaskDeclaringServer(MCPServer):
    """An ``MCPServer`` whose tools in ``TASK_TOOLS`` declare ``execution.taskSupport``."""

    async def list_tools(self) -> list[MCPTool]:
        return [t.model_copy(update={"execution": ToolExecution(task_support=TASK_TOOLS[t.name])})
                if t.name in TASK_TOOLS else t for t in await super().list_tools()]


def build_server(name: str) -> MCPServer:
    """An SDK server named ``name`` with the proxy tests' tools, resources and prompt."""
    server = TaskDeclaringServer(name, instructions=f"upstream {name} for the proxy tests", log_level="WARNING")
    _add_tools(server)
    _add_asking_tools(server)
    _add_resources_and_prompt(server, name)
    return server


def _add_tools(server: MCPServer) -> None:
    @server.tool(description="Echo the text back")
    def echo(text: str) -> str:
        return text

    @server.tool(description="Add two integers; structured output")
    def add(a: int, b: int) -> Sum:
        return Sum(total=a + b, operands=[a, b])

    @server.tool(description="A 1x1 PNG image")
    def image() -> Image:
        return Image(data=PNG_1PX, format="png")

    @server.tool(description="Sleep for `seconds`, then answer")
    async def slow(seconds: float) -> str:
        _mark_started("slow")
        await anyio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool(description="Sleep for `seconds`, then answer; task-capable")
    async def long_job(seconds: float) -> str:
        _mark_started("long_job")
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            _mark_started(CANCELLED_MARK)  # notifications/cancelled reached the handler
            raise
        return f"worked {seconds}"

    @server.tool(description="Always fails")
    def fail() -> str:
        raise ToolError(FAIL_MESSAGE)

    @server.tool(description="Report progress `steps` times, then answer")
    async def progress(steps: int, ctx: Context) -> str:
        for step in range(1, steps + 1):
            await ctx.report_progress(step, steps, f"step {step}")
        return f"{steps} steps done"

    @server.tool(description="The protocol revision this request arrived in")
    def revision(ctx: Context) -> str:
        return ctx.protocol_version or "unknown"

    @server.tool(description="Add a tool called `name` and announce that the tool list changed")
    async def grow(name: str, ctx: Context) -> str:
        server.add_tool(lambda: f"{name} was added at run time", name=name, description="Added by grow")
        if ctx.protocol_version == LEGACY_REVISION:
            await ctx.session.send_notification(ToolListChangedNotification(), related_request_id=ctx.request_id)
        else:
            await ctx.notify_tools_changed()
        return f"added {name}"


def _add_asking_tools(server: MCPServer) -> None:
    @server.tool(description="Ask the client for a name (elicitation), then greet")
    def greet_user(who: Annotated[Name, Resolve(_ask_name)]) -> str:
        return f"Hello, {who.name}!"

    @server.tool(description="Ask the client's model (sampling) to answer `prompt`")
    def ask_model(prompt: str, reply: Annotated[CreateMessageResult, Resolve(_sample_reply)]) -> str:
        content = reply.content
        said = content.text if isinstance(content, TextContent) else str(content)
        return f"model said: {said}"


def _add_resources_and_prompt(server: MCPServer, name: str) -> None:
    @server.resource(STATIC_URI, name="static", mime_type="text/plain")
    def static() -> str:
        return STATIC_TEXT

    @server.resource(ITEM_TEMPLATE, name="item", mime_type="application/json")
    def item(item_id: str) -> str:
        return f'{{"item": "{item_id}", "upstream": "{name}"}}'

    @server.prompt(description="Greet someone by name")
    def greeting(person: str) -> str:
        return f"Please greet {person} warmly."
