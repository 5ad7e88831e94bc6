"""One registry of tools, resources, resource templates and prompts, shared by every
transport and protocol revision.

Components register into it with ``register(registry)`` functions (see
``gateway/tools/``). Handlers are ``async def handler(ctx: ToolContext, args: dict)``;
they return either a full MCP result dict (with ``content``) or, for tools with an
``output_schema``, a plain dict that becomes ``structuredContent`` (and a JSON text block).
A tool's schemas are compiled when it registers, its ``x-mcp-header`` declarations checked (a
broken one fails at start); the dispatcher asks the :class:`Tool` whether arguments and results match them.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import jsonschema_rs

from gateway.mcp import param_headers

if TYPE_CHECKING:  # gateway.state builds on the registry; handlers only need the type
    from gateway.state import Gateway


class ToolContext(Protocol):
    """What a handler sees of the request it serves (implemented by the dispatcher)."""

    principal: str           # the authenticated principal; scopes every Redis key
    request_id: Any          # JSON-RPC id of the request
    protocol_version: str    # "2025-11-25" or "2026-07-28"
    state: Gateway           # the replica's components: config, redis, store, workers, samples, ...
    meta: dict[str, Any]     # the request's _meta

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """Send notifications/progress if the request carried a progressToken (else no-op)."""

    async def log(self, level: str, data: Any, logger: str | None = None) -> None:
        """Send notifications/message respecting the session's logging level."""

    async def request_client(self, method: str, params: dict[str, Any], key: str) -> dict[str, Any]:
        """Ask the client (sampling/createMessage, elicitation/create, roots/list) and return its
        result. Legacy sessions: sent on the session stream, answer awaited via Redis. 2026-07-28:
        raises an input-required signal the first time; ``key`` names the answer on retry."""


Handler = Callable[[ToolContext, dict[str, Any]], Awaitable[Any]]
# completion/complete for one variable of a resource template: (caller, the value typed so far,
# the template's other variables the client already resolved) -> candidate values.
TemplateCompleter = Callable[[ToolContext, str, dict[str, str]], Awaitable[list[str]]]
TASK_SUPPORT = (None, "optional", "required")


def compile_schema(schema: dict[str, Any]) -> jsonschema_rs.Validator:
    """A validator built once per schema (draft from ``$schema``, 2020-12 by default); every call
    on the hot path then costs well under a microsecond. References never leave the schema."""
    return jsonschema_rs.validator_for(schema, validate_formats=True, offline=True)


def explain(validator: jsonschema_rs.Validator, instance: Any) -> str:
    """The failure a person should read first, with where it is: ``reason (at a/0/b)``."""
    err = _closest(list(validator.iter_errors(instance)))
    where = "/".join(str(p)[:_EXPLAIN_PART] for p in err.instance_path)
    message = _shortened(err.message)
    return f"{message} (at {_shortened(where)})" if where else message


# The validator's message quotes the value refused: a string of megabytes would come back whole.
_EXPLAIN_CHARS = 400
_EXPLAIN_PART = 64


def _shortened(text: str) -> str:
    half = _EXPLAIN_CHARS // 2
    return text if len(text) <= _EXPLAIN_CHARS else f"{text[:half]}…{text[-half:]}"


_ALTERNATIVES = (jsonschema_rs.ValidationErrorKind.AnyOf, jsonschema_rs.ValidationErrorKind.OneOfNotValid)


def _closest(errors: list[jsonschema_rs.ValidationError]) -> jsonschema_rs.ValidationError:
    """Inside an anyOf/oneOf, the alternative the instance came closest to (fewest errors;
    the first on a tie): "at target: too short" helps, "matches none of 3 schemas" does not."""
    err = errors[0]
    if not isinstance(err.kind, _ALTERNATIVES):
        return err
    branches = [b for b in err.kind.context if b]
    return _closest(min(branches, key=len)) if branches else err


@dataclass
class Tool:
    name: str
    description: str
    input_schema: dict[str, Any]
    handler: Handler
    output_schema: dict[str, Any] | None = None
    title: str | None = None
    annotations: dict[str, Any] | None = None
    # Tasks extension (SEP-2663, gateway/tasks.py): None = always synchronous; "optional" = may run
    # as a task for clients that declare the extension; "required" = only for such clients.
    task_support: str | None = None
    _input_validator: jsonschema_rs.Validator = field(init=False, repr=False, compare=False)
    param_spec: param_headers.Spec = field(init=False, repr=False, compare=False)  # its Mcp-Param-* headers
    _output_validator: jsonschema_rs.Validator | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.task_support not in TASK_SUPPORT:
            raise ValueError(f"tool {self.name!r}: task_support must be one of {TASK_SUPPORT}")
        self._input_validator = compile_schema(self.input_schema)
        problem = param_headers.problem(self.input_schema)
        if problem is not None:  # what MCP has a client leave out, the gateway does not serve
            raise ValueError(f"tool {self.name!r}: {problem}")
        self.param_spec = param_headers.spec(self.input_schema)
        self._output_validator = None if self.output_schema is None else compile_schema(self.output_schema)

    def input_problem(self, args: dict[str, Any]) -> str | None:
        """None when ``args`` match the inputSchema, else what is wrong and where (for the client)."""
        if self._input_validator.is_valid(args):
            return None
        return explain(self._input_validator, args)

    def output_matches(self, out: Any) -> bool:
        """Whether ``out`` matches the outputSchema (True for a tool without one)."""
        return self._output_validator is None or self._output_validator.is_valid(out)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description, "inputSchema": self.input_schema}
        if self.title:
            out["title"] = self.title
        if self.output_schema:
            out["outputSchema"] = self.output_schema
        if self.annotations:
            out["annotations"] = self.annotations
        if self.task_support is not None:  # Tool.execution of both revisions: a proxy in front reads it
            out["execution"] = {"taskSupport": self.task_support}
        return out


def _described(out: dict[str, Any], mime_type: str | None, description: str | None) -> dict[str, Any]:
    """A resource's or template's listing entry: the optional fields only where they are set."""
    if mime_type:
        out["mimeType"] = mime_type
    if description:
        out["description"] = description
    return out


@dataclass
class Resource:
    uri: str
    name: str
    handler: Handler  # args: {"uri": uri}; returns list of contents dicts
    mime_type: str | None = None
    description: str | None = None

    def describe(self) -> dict[str, Any]:
        return _described({"uri": self.uri, "name": self.name}, self.mime_type, self.description)


@dataclass
class ResourceTemplate:
    uri_template: str
    name: str
    handler: Handler  # args: {"uri": uri, **template variables}
    mime_type: str | None = None
    description: str | None = None
    # Whether a matching URI names a resource of the caller (resources/subscribe accepts only
    # those); None: every match does.
    exists: Callable[[ToolContext, dict[str, Any]], Awaitable[bool]] | None = None
    completions: dict[str, TemplateCompleter] = field(default_factory=dict)
    pattern: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        regex = re.escape(self.uri_template)
        regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", regex)
        self.pattern = re.compile(f"^{regex}$")

    def match(self, uri: str) -> dict[str, str] | None:
        m = self.pattern.fullmatch(uri)
        return m.groupdict() if m else None

    def describe(self) -> dict[str, Any]:
        return _described({"uriTemplate": self.uri_template, "name": self.name}, self.mime_type, self.description)


@dataclass
class Prompt:
    name: str
    handler: Handler  # args: prompt arguments; returns {"messages": [...], "description"?}
    description: str | None = None
    arguments: list[dict[str, Any]] = field(default_factory=list)
    completions: dict[str, Callable[[str], list[str]]] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "arguments": self.arguments}
        if self.description:
            out["description"] = self.description
        return out


class Registry:
    """Tools, resources, templates and prompts by name/URI."""

    def __init__(self) -> None:
        self.tools: dict[str, Tool] = {}
        self.resources: dict[str, Resource] = {}
        self.templates: list[ResourceTemplate] = []
        self.prompts: dict[str, Prompt] = {}
        # Per-principal dynamic resources (e.g. the caller's contexts): async fn(ctx) -> list of
        # resource descriptors, appended by resources/list after the static resources.
        self.resource_listers: list[Callable[[ToolContext], Awaitable[list[dict[str, Any]]]]] = []

    def tool(self, name: str, *, description: str, input_schema: dict[str, Any],
             output_schema: dict[str, Any] | None = None, title: str | None = None,
             annotations: dict[str, Any] | None = None,
             task_support: str | None = None) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            if name in self.tools:
                raise ValueError(f"tool {name!r} registered twice")
            self.tools[name] = Tool(name, description, input_schema, fn, output_schema, title, annotations,
                                    task_support)
            return fn
        return deco

    def resource(self, uri: str, *, name: str, mime_type: str | None = None,
                 description: str | None = None) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.resources[uri] = Resource(uri, name, fn, mime_type, description)
            return fn
        return deco

    def resource_template(self, uri_template: str, *, name: str, mime_type: str | None = None,
                          description: str | None = None,
                          completions: dict[str, TemplateCompleter] | None = None,
                          exists: Callable[[ToolContext, dict[str, Any]], Awaitable[bool]] | None = None,
                          ) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.templates.append(ResourceTemplate(uri_template, name, fn, mime_type, description,
                                                   exists, completions or {}))
            return fn
        return deco

    def template(self, uri_template: str) -> ResourceTemplate | None:
        """The template registered as ``uri_template`` (completion/complete names templates so)."""
        return next((t for t in self.templates if t.uri_template == uri_template), None)

    def prompt(self, name: str, *, description: str | None = None,
               arguments: list[dict[str, Any]] | None = None,
               completions: dict[str, Callable[[str], list[str]]] | None = None) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.prompts[name] = Prompt(name, fn, description, arguments or [], completions or {})
            return fn
        return deco

    def resource_lister(self, fn: Callable[[ToolContext], Awaitable[list[dict[str, Any]]]]
                        ) -> Callable[[ToolContext], Awaitable[list[dict[str, Any]]]]:
        """Register a per-principal resource lister (see ``resource_listers``)."""
        self.resource_listers.append(fn)
        return fn

    def find_template(self, uri: str) -> tuple[ResourceTemplate, dict[str, str]] | None:
        for tpl in self.templates:
            params = tpl.match(uri)
            if params is not None:
                return tpl, params
        return None
