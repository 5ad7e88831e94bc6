"""The context store: per-principal, per-modality conversation context in Redis.

A principal owns contexts; a context has one channel per modality (text, image, audio —
``context.modalities``), each an ordered list of entries. Every operation is ONE call of the
Lua script ``context.lua`` (scripts.py): it reads or writes, bumps the context's version,
updates recency and enforces the per-channel window, the per-principal byte budget (exact
LRU over the principal's contexts) and the idle TTL atomically. The global budget (LRU over
principals) is checked in the same call; evicting another principal's keys is a follow-up
call on that principal's keys, needed only when the global budget is exceeded. See
docs/context.md for the data model and the rules.

- ``store``: ``ContextStore``, the API;
- ``validation``: what callers may send, checked before any call;
- ``scripts``: the script's calls (FCALL of a Redis Function; EVALSHA on Redis < 7);
- ``replies``: the script's replies decoded into windows;
- ``read_cache``: the entries a store keeps between reads of a context;
- ``entries``: the stored form of an entry (MessagePack, decoded in one C call per run);
- ``errors``: what the store raises.
"""

from shared.context.entries import pack_entry, stored_entry
from shared.context.errors import (
    ContextError,
    ContextExists,
    ContextNotFound,
    EntryTooLarge,
    InvalidModality,
    VersionUnavailable,
)
from shared.context.store import AppendResult, ContextInfo, ContextStore

__all__ = [
    "AppendResult",
    "ContextError",
    "ContextExists",
    "ContextInfo",
    "ContextNotFound",
    "ContextStore",
    "EntryTooLarge",
    "InvalidModality",
    "VersionUnavailable",
    "pack_entry",
    "stored_entry",
]
