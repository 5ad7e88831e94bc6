"""SEP-2243 ``x-mcp-header`` declarations of a tool's ``inputSchema``: which are valid, and the
``Mcp-Param-*`` header each declared argument travels in, at any depth of ``properties``. The one
place holding those rules: the kernel checks a client's headers against a tool's declarations (the
gateway's own tools and proxied ones), the proxy writes them to a 2026-07-28 upstream.

An upstream's header name is written into the gateway's own requests: a name
that is not an HTTP token (a CR/LF, a colon, a space, a character outside ASCII) would break or
smuggle headers of the request, and one that is huge would have it refused. MCP asks a client to
leave out of ``tools/list`` a tool whose declarations break its rules (and to log why): each name
an RFC 9110 token, unique whatever its case, on a ``string``, ``integer`` or ``boolean`` property
reached from the schema's root through ``properties`` alone. The gateway adds a bound on the
name's length, ``MAX_HEADER_NAME_CHARS``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

X_MCP_HEADER = "x-mcp-header"
HEADER_PREFIX = "mcp-param-"
MAX_HEADER_NAME_CHARS = 128
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TYPES = frozenset({"string", "integer", "boolean"})
# JSON Schema keywords whose values are schemas: a declaration under one of them is not reached
# through ``properties`` alone (it may apply to no argument, or to many).
_ONE = frozenset({"items", "contains", "unevaluatedItems", "additionalProperties", "propertyNames",
                  "unevaluatedProperties", "not", "if", "then", "else", "contentSchema"})
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_MAP = frozenset({"patternProperties", "dependentSchemas", "$defs", "definitions"})

Path = tuple[str, ...]
Spec = tuple[tuple[Path, str], ...]  # (argument path, lower-case header name)


def _positions(schema: Any) -> Iterator[tuple[Path | None, dict[str, Any]]]:
    """Every schema in ``schema`` with its path of ``properties`` keys (None once another
    keyword was crossed). An explicit stack: however deep an upstream nests it."""
    stack: list[tuple[Path | None, Any]] = [((), schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                stack.extend(((*path, name) if path is not None else None, sub) for name, sub in value.items())
            elif key in _ONE:
                stack.append((None, value))
            elif key in _LIST and isinstance(value, list):
                stack.extend((None, sub) for sub in value)
            elif key in _MAP and isinstance(value, dict):
                stack.extend((None, sub) for sub in value.values())


def problem(schema: Any) -> str | None:
    """Why the tool of ``inputSchema`` ``schema`` may not be listed for its ``x-mcp-header``
    declarations, or None."""
    seen: dict[str, str] = {}
    for path, node in _positions(schema):
        if X_MCP_HEADER not in node:
            continue
        if not path:
            return f"{X_MCP_HEADER} where no argument is reached through properties alone"
        where = ".".join(path)[:MAX_HEADER_NAME_CHARS]
        name = node[X_MCP_HEADER]
        if not isinstance(name, str) or not name:
            return f"property {where!r}: {X_MCP_HEADER} is not a non-empty string"
        if len(name) > MAX_HEADER_NAME_CHARS:
            return f"property {where!r}: {X_MCP_HEADER} is over {MAX_HEADER_NAME_CHARS} characters"
        if not _TOKEN.fullmatch(name):
            return f"property {where!r}: {X_MCP_HEADER} {name!r} is not an HTTP header name (RFC 9110 token)"
        kind = node.get("type")
        if not isinstance(kind, str) or kind not in _TYPES:
            return f"property {where!r}: {X_MCP_HEADER} on a property whose type is not string, integer or boolean"
        if name.lower() in seen:
            return f"property {where!r}: {X_MCP_HEADER} {name!r} is also property {seen[name.lower()]!r}'s"
        seen[name.lower()] = where
    return None


def spec(schema: dict[str, Any]) -> Spec:
    """The headers a valid schema (see :func:`problem`) declares, by argument path."""
    return tuple((path, HEADER_PREFIX + node[X_MCP_HEADER].lower()) for path, node in _positions(schema)
                 if path and isinstance(node.get(X_MCP_HEADER), str))


def header_form(value: object) -> str | None:
    """How a primitive argument reads in a header (JSON spelling for numbers and booleans)."""
    if value is None or isinstance(value, (dict, list)):
        return None
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def each_value(declared: Spec, args: dict[str, Any]) -> Iterator[tuple[Path, str, str | None]]:
    """(argument path, header, the argument as :func:`header_form` spells it) for each declared
    header; None where the argument is absent or null."""
    for path, header in declared:
        node: Any = args
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        yield path, header, header_form(node)


def values(declared: Spec, args: dict[str, Any]) -> dict[str, str]:
    """The headers a call with these arguments carries (absent or null arguments have none)."""
    return {header: value for _, header, value in each_value(declared, args) if value is not None}
