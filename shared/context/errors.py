"""What the context store raises. ``ContextError`` is bad input (a ``ValueError``: JSON-RPC
-32602, HTTP 400); the others say which part of the input names nothing."""

from __future__ import annotations


class ContextError(ValueError):
    """Bad input to the context store (maps to JSON-RPC -32602 / HTTP 400)."""


class ContextNotFound(ContextError):
    """The context does not exist for this principal (or was evicted)."""


class VersionUnavailable(ContextNotFound):
    """The requested version is not retained (older than ``versions_retained``, or evicted)."""


class InvalidModality(ContextError):
    """A modality that is not configured in ``context.modalities``."""


class EntryTooLarge(ContextError):
    """An entry over ``context.max_entry_bytes``."""


class ContextExists(ContextError):
    """fork() target id is already used."""


# The script's error replies ("<kind> <message>", see fail() in context.lua) by kind.
SCRIPT_ERRORS: dict[str, type[ContextError]] = {
    "LM_NOTFOUND": ContextNotFound, "LM_VERSION": VersionUnavailable, "LM_BADLINK": ContextError,
    "LM_EXISTS": ContextExists,
}
