"""Which list changes a legacy (2025-11-25) session has been told about, so that a session whose
event stream was closed when a list changed is told as soon as it opens one again, on any replica.

- Every announced change bumps a counter in Redis before it is delivered, and the delivery
  carries the new value: ``keys.LIST_REVISIONS`` holds the lists everyone may see (the gateway's
  own ``<kind>``, an upstream's ``<kind>@<upstream>``), ``keys.principal_list_revisions`` those
  announced to one principal alone (``~`` in front of the name in a session's record). A new
  revision is never below the Redis server's clock in ms, so a hash that expired or was lost
  starts above every revision a session recorded.
- A session keeps the revisions it was told about in its hash (field ``lists``): read at
  initialize; when an event stream opens, after each list whose revision differs has been
  logged for it; when the stream closes, with what the stream delivered meanwhile.
- A stream is registered on its replica before it reads the revisions, and a change is bumped
  before it is delivered: a change either finds the stream open (the note goes to the session's
  log) or is in the revisions the next stream reads. A session may be told twice (each replica
  bumps an upstream's change it learns of on its own; a replica that stops records nothing),
  never not at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys

log = logging.getLogger(__name__)

Revisions = dict[str, int]  # list name -> revision counter
MINE = "~"  # a list announced to the session's principal alone

# KEYS: a revision hash. ARGV: list name, TTL s (0: none). The new revision: above the last one and
# no lower than the server's clock in ms, so a counter that expired (or was lost) and starts again
# never comes back to a value a session recorded before.
_BUMP_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) or 0
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HINCRBY', KEYS[1], ARGV[1], math.max(1, ms - cur))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return v
"""

# KEYS: the session's hash. ARGV: the revisions as JSON. A session that has ended stays ended.
_RECORD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'lists', ARGV[1]) end
return 0
"""


def list_name(kind: str, upstream: str | None = None, mine: bool = False) -> str:
    """``kind`` (tools | resources | prompts) of the gateway itself or of ``upstream``."""
    return (MINE if mine else "") + (kind if upstream is None else f"{kind}@{upstream}")


def parse_name(name: str) -> tuple[str, str | None]:
    """(kind, upstream or None) of a list name."""
    kind, _, upstream = name.removeprefix(MINE).partition("@")
    return kind, upstream or None


@dataclass(eq=False)
class OpenStream:
    """A legacy session's event stream open on this replica and the revisions it has told about."""

    principal: str
    sid: str
    told: Revisions = field(default_factory=dict)
    recorded: Revisions | None = None  # the session's record as this stream last read or wrote it

    def tell(self, name: str, revision: int | None) -> None:
        if revision is not None and revision > self.told.get(name, 0):
            self.told[name] = revision


def _merge(everyone: dict[Any, Any], mine: dict[Any, Any]) -> Revisions:
    out = {k.decode(): int(v) for k, v in everyone.items()}
    out.update({MINE + k.decode(): int(v) for k, v in mine.items()})
    return out


class ListRevisions:
    """The revision counters and each session's record of them."""

    def __init__(self, redis: aioredis.Redis, ttl_s: int) -> None:
        self._redis = redis
        self.ttl_s = ttl_s  # a principal's counters expire like an idle session
        self._bump = redis.register_script(_BUMP_LUA)
        self._record = redis.register_script(_RECORD_LUA)

    async def bump(self, principal: str | None, kind: str, upstream: str | None) -> int | None:
        """Count a change of a list (``principal``: announced to that principal alone); its new
        revision, or None when Redis could not be reached (the change is still delivered)."""
        name = list_name(kind, upstream)
        if principal is None:
            key, ttl_s = keys.LIST_REVISIONS, 0
        else:
            key, ttl_s = keys.principal_list_revisions(principal), self.ttl_s
        try:
            return int(await self._bump(keys=[key], args=[name, ttl_s]))
        except (RedisError, OSError):
            log.warning("could not count a change of the %s list; sessions without an open stream may miss it", name)
            return None

    def _read_current(self, principal: str) -> Any:
        """A pipeline that starts with the two reads of :meth:`current` (everyone's, then the
        principal's own counters)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(keys.LIST_REVISIONS)
        pipe.hgetall(keys.principal_list_revisions(principal))
        return pipe

    async def current(self, principal: str) -> Revisions:
        """The revisions of every list ``principal`` could be told about."""
        everyone, mine = await self._read_current(principal).execute()
        return _merge(everyone, mine)

    async def open(self, stream: OpenStream) -> list[str]:
        """Start ``stream`` at the current revisions; the names of the lists that changed since
        the session's record (a session without one is told of every list ever changed)."""
        pipe = self._read_current(stream.principal)
        pipe.hget(keys.session(stream.principal, stream.sid), "lists")
        everyone, mine, raw = await pipe.execute()
        now = _merge(everyone, mine)
        seen: Revisions = orjson.loads(raw) if raw else {}
        stream.recorded = seen
        for name, revision in now.items():
            stream.tell(name, revision)
        return sorted(n for n in now.keys() | seen.keys() if now.get(n, 0) != seen.get(n, 0))

    async def record(self, stream: OpenStream) -> None:
        """Write what ``stream`` has told about into the session's record (once it has read it)."""
        if stream.recorded is None or stream.told == stream.recorded:
            return
        told = dict(stream.told)
        await self._record(keys=[keys.session(stream.principal, stream.sid)], args=[orjson.dumps(told)])
        stream.recorded = told
