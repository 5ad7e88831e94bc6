"""How upstream names and URIs look to the gateway's clients, and back; how an upstream's own
URL looks wherever the gateway shows or logs it.

Tools and prompts: ``<namespace>.<name>`` (dots are legal in MCP names), or the name itself
for an upstream mounted with the empty namespace. Resources: ``upstream://<upstream>/<uri>``
with the upstream's URI percent-escaped whole, so any URI (with its own scheme, slashes and
query) maps back exactly; templates keep their ``{variables}`` unescaped so a client still
expands them.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

URI_SCHEME = "upstream://"
_VARIABLE = re.compile(r"(\{[^}]*\})")


def shown_url(url: str) -> str:
    """An upstream's ``url`` as admin reads and log lines show it: without user info and fragment,
    and with every query value replaced by ``***`` (some servers take their key as ``?api_key=``;
    the names stay, so an operator sees which parameters it has). One that does not parse (the
    configuration refuses those, so only an entry stored otherwise) is shown as unparsable."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return "(unparsable)"
    netloc = f"[{host}]" if ":" in host else host
    netloc = f"{netloc}:{port}" if port else netloc
    query = "&".join(f"{quote(name, safe='')}=***" for name, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


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
