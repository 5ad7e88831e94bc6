"""Domain types shared by the gateway, the context store, workers and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Entry:
    """One entry of a context channel. ``content`` is raw bytes (UTF-8 for text; the
    decoded image/audio bytes for binary modalities — never base64 inside learnmesh).

    Read-only by contract: the context store hands the same Entry objects to every reader
    of a context (its read cache), so change a copy (``dataclasses.replace``), never one
    you were given."""

    id: str
    modality: str
    role: str
    content: bytes
    mime: str | None = None
    tokens: int = 0
    size_bytes: int = 0
    ts_ms: int = 0
    links: list[str] = field(default_factory=list)  # ids of entries in other channels

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


@dataclass
class ContextWindow:
    """What a caller reads of a context: entries per modality, oldest first, at a version."""

    principal: str
    context_id: str
    version: int
    channels: dict[str, list[Entry]] = field(default_factory=dict)

    def entries(self) -> list[Entry]:
        """All entries of all channels ordered by time (ties keep channel order)."""
        out = [e for ch in self.channels.values() for e in ch]
        out.sort(key=lambda e: e.ts_ms)
        return out
