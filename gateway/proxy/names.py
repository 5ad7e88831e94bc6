"""How upstream names and URIs look to the gateway's clients, and back.

Tools and prompts: ``<namespace>.<name>`` (dots are legal in MCP names), or the name itself
for an upstream mounted with the empty namespace. Resources: ``upstream://<upstream>/<uri>``
with the upstream's URI percent-escaped whole, so any URI (with its own scheme, slashes and
query) maps back exactly; templates keep their ``{variables}`` unescaped so a client still
expands them.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

URI_SCHEME = "upstream://"
_VARIABLE = re.compile(r"(\{[^}]*\})")


def exposed(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def wrap_uri(upstream: str, uri: str) -> str:
    return f"{URI_SCHEME}{upstream}/{quote(uri, safe='')}"


def wrap_template(upstream: str, template: str) -> str:
    parts = _VARIABLE.split(template)
    return f"{URI_SCHEME}{upstream}/" + "".join(p if _VARIABLE.fullmatch(p) else quote(p, safe="") for p in parts)


def unwrap_uri(uri: str) -> tuple[str, str] | None:
    """(upstream name, its own URI) of a wrapped URI; None for any other URI."""
    if not uri.startswith(URI_SCHEME):
        return None
    upstream, sep, rest = uri[len(URI_SCHEME):].partition("/")
    if not sep or not upstream:
        return None
    return upstream, unquote(rest)
