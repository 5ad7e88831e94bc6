"""A stdio MCP server on the official SDK (``mcp`` 2.3.0) for the proxy's stdio tests:
``python tests/proxy_stdio_server.py``. ``exit_now`` ends the process in the middle of its call."""

from __future__ import annotations

import base64
import os

from mcp.server.mcpserver import Image, MCPServer

PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")

server = MCPServer("stdio-upstream", log_level="WARNING")


@server.tool(description="Echo the text back")
def echo(text: str) -> str:
    return f"stdio:{text}"


@server.tool(description="A 1x1 PNG image")
def image() -> Image:
    return Image(data=PNG_1PX, format="png")


@server.tool(description="Whether the process has environment variable `name`")
def has_env(name: str) -> str:
    return "yes" if name in os.environ else "no"


@server.tool(description="The process ends while this call is in flight")
def exit_now() -> str:
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
