"""What the context store raises. ``ContextError`` is bad input (a ``ValueError``: JSON-RPC
-32602, HTTP 400); the others say which part of the input names nothing."""

from __future__ import annotations

from typing import Self


class ContextError(ValueError):
    """Bad input to the context store (maps to JSON-RPC -32602 / HTTP 400)."""


class ContextNotFound(ContextError):
    """The context does not exist for this principal (or was evicted). ``context_id``: the
    context named, when known."""

    kind = "context_not_found"

    def __init__(self, message: str, context_id: str | None = None, version: int | None = None) -> None:
        super().__init__(message)
        self.context_id = context_id
        self.version = version

    @classmethod
    def from_script(cls, message: str) -> Self:
        """From the script's "context <cid>[ version <v> ...]" (ids hold no spaces)."""
        words = message.split(" ")
        cid = words[1] if len(words) > 1 and words[0] == "context" else None
        version = int(words[3]) if len(words) > 3 and words[2] == "version" and words[3].isdecimal() else None
        return cls(message, cid, version)

    def data(self) -> dict[str, object]:
        """What a program acts on: ``kind``, and the context (and version) named, when known."""
        out: dict[str, object] = {"kind": self.kind}
        if self.context_id is not None:
            out["context_id"] = self.context_id
        if self.version is not None:
            out["version"] = self.version
        return out


class VersionUnavailable(ContextNotFound):
    """The requested version is not retained (older than ``versions_retained``, or evicted)."""

    kind = "version_unavailable"


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
