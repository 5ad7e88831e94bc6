"""Domain types shared by the gateway, the context store, workers and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Entry(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One entry of a context channel. ``content`` is raw bytes (UTF-8 for text; the
    decoded image/audio bytes for binary modalities — never base64 inside learnmesh).

    Immutable (readers of one context share entries: the context store's read cache).
    A msgspec Struct without garbage-collector tracking (its fields are strings, bytes,
    ints and a tuple of strings: no cycles possible): built ~3x faster than a dataclass,
    and a process holding 10^5 of them (the context store's read cache) does not make every
    full collection a pause of tens of milliseconds, as 10^5 dataclass entries did.

    ``array_like``: its MessagePack form is the array of its fields in this order — the
    context store's stored form (see shared/context/entries.py), decoded straight into
    entries. Do not reorder the fields: stored entries would decode wrongly."""

    id: str
    modality: str
    role: str
    content: bytes
    mime: str | None = None
    tokens: int = 0
    size_bytes: int = 0
    ts_ms: int = 0
    links: tuple[str, ...] = ()  # ids of entries in other channels

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
