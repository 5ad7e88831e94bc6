"""Decoding of Redis replies: clients run with ``decode_responses=False`` (context entries
are bytes), so names and numbers come back as bytes and are decoded where they are read."""

from __future__ import annotations

from typing import Any


def as_str(value: Any) -> str:
    """``value`` as text: bytes decoded as UTF-8, anything else through ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)
