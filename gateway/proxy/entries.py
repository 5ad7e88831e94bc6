"""The shape MCP gives the entries of an upstream's lists (tools, prompts, resources, resource
templates), checked before an entry joins the gateway's merged lists.

A client reads a list page whole (the SDK's validates it as one result): an entry of the wrong
shape — a tool without ``inputSchema``, a description that is a number — would cost the client
every entry of the page, the gateway's own and other upstreams' included. The types follow the
MCP schema; fields it does not name pass unchecked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.mcp import param_headers


class _Entry(msgspec.Struct, rename="camel", kw_only=True):
    pass


class Icon(_Entry):
    src: str
    mime_type: str | None = None
    sizes: list[str] | None = None
    theme: Literal["light", "dark"] | None = None


class _Named(_Entry, kw_only=True):
    name: str
    title: str | None = None
    description: str | None = None
    icons: list[Icon] | None = None
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


class ToolAnnotations(_Entry):
    title: str | None = None
    read_only_hint: bool | None = None
    destructive_hint: bool | None = None
    idempotent_hint: bool | None = None
    open_world_hint: bool | None = None


class ToolExecution(_Entry):
    task_support: Literal["forbidden", "optional", "required"] | None = None


class Tool(_Named, kw_only=True):
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None = None
    annotations: ToolAnnotations | None = None
    execution: ToolExecution | None = None


class PromptArgument(_Entry):
    name: str
    title: str | None = None
    description: str | None = None
    required: bool | None = None


class Prompt(_Named, kw_only=True):
    arguments: list[PromptArgument] | None = None


class Annotations(_Entry):
    audience: list[Literal["user", "assistant"]] | None = None
    priority: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    last_modified: str | None = None


class _Readable(_Named, kw_only=True):
    mime_type: str | None = None
    annotations: Annotations | None = None


class Resource(_Readable, kw_only=True):
    uri: str
    size: int | None = None


class ResourceTemplate(_Readable, kw_only=True):
    uri_template: str


SHAPES: dict[str, type[_Entry]] = {"tools": Tool, "prompts": Prompt, "resources": Resource,
                                   "resourceTemplates": ResourceTemplate}


def malformed(kind: str, entry: dict[str, Any]) -> str | None:
    """Why ``entry`` of list ``kind`` is not the shape MCP gives it (msgspec's words, naming the
    field; for a tool, what breaks the rules of its ``x-mcp-header`` declarations), or None when it is."""
    try:
        msgspec.convert(entry, SHAPES[kind])
    except msgspec.ValidationError as exc:
        return str(exc)
    return param_headers.problem(entry["inputSchema"]) if kind == "tools" else None
