"""The set of upstreams every replica serves, kept in one Redis hash (``keys.PROXY_UPSTREAMS``).

``proxy.upstreams`` of the config file is the initial set: at start each is written unless the
hash already has that name (an admin change, or a removal marker, survives restarts). The admin
API writes here and publishes ``{"t": "proxy"}`` on the gateway control channel; every replica
then reloads (and reloads again whenever it reconnects to the channel, in case it missed one).
Stored: the configuration as given, with credential *sources* (environment variable names,
file paths) and never a credential's value.

An admin add or change is one Lua script on the hash (one key, so one Redis Cluster slot): it
checks that the name is free (add) or unchanged since read (change) and that no other entry
mounts under the same namespace, and writes only then; so of concurrent adds under one name or
namespace exactly one wins, on every replica.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import orjson
import redis.asyncio as aioredis

from shared import keys
from shared.config import ConfigError, UpstreamConfig
from shared.text import as_str

log = logging.getLogger(__name__)

REMOVED = b'{"removed":true}'

# KEYS[1]: the hash. ARGV: name, JSON, namespace, and the entry the change was made from ('' for an
# add: the name must be free). Returns 'ok', 'name' (taken), 'gone' (a change of an entry removed
# since), 'changed' (changed since it was read) or {'namespace', other upstream's name}.
# An entry that is not JSON cannot be told apart from a namespace's owner and is passed over, as
# reading the set skips it; one that is JSON but no longer validates still holds its namespace.
_PUT_LUA = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
local live = current and current ~= '{"removed":true}'
if ARGV[4] == '' then
  if live then return 'name' end
elseif not live then
  return 'gone'
elseif current ~= ARGV[4] then
  return 'changed'
end
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local field = entries[i]
  if field ~= ARGV[1] then
    local ok, data = pcall(cjson.decode, entries[i + 1])
    if ok and type(data) == 'table' and not data['removed'] then
      local ns = data['namespace']
      if type(ns) ~= 'string' then ns = field end
      if ns == ARGV[3] then return {'namespace', field} end
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 'ok'
"""


class Conflict(Exception):
    """The add or change would break the set: ``what`` is ``name`` (taken), ``namespace`` (another
    upstream, ``other``, mounts there), ``gone`` (removed meanwhile) or ``changed`` (changed
    meanwhile: read it again)."""

    def __init__(self, what: str, other: str = "") -> None:
        super().__init__(what, other)
        self.what = what
        self.other = other


def to_json(cfg: UpstreamConfig) -> bytes:
    return orjson.dumps(dataclasses.asdict(cfg))


@dataclasses.dataclass(frozen=True, slots=True)
class Unreadable:
    """A stored entry that is no upstream configuration (written by hand, by another version, or
    damaged): served by no replica, shown by the admin API with ``reason``, and removable."""

    name: str
    reason: str


def read(name: str, raw: bytes | str) -> UpstreamConfig | Unreadable | None:
    """The entry stored as ``name``: its configuration, None for a removal marker, or Unreadable."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Unreadable(name, "not JSON")
    if not isinstance(data, dict):
        return Unreadable(name, "not a JSON object")
    if data.get("removed"):
        return None
    try:
        cfg = UpstreamConfig(**data)
    except (ConfigError, TypeError) as exc:
        return Unreadable(name, f"not a valid upstream: {exc}")
    if cfg.name != name:
        return Unreadable(name, f"holds the configuration of upstream {cfg.name!r}")
    return cfg


async def seed(redis: aioredis.Redis, initial: list[UpstreamConfig]) -> None:
    """Write the config file's upstreams whose names Redis does not have; one that Redis holds
    differently (changed or removed at runtime, or by an earlier configuration) is kept as stored,
    with a warning naming it."""
    for cfg in initial:
        if await redis.hsetnx(keys.PROXY_UPSTREAMS, cfg.name, to_json(cfg)):
            continue
        stored = await get(redis, cfg.name)
        if stored != cfg:
            log.warning("proxy upstream %s: the configuration file differs from the set in Redis (%s), which is "
                        "what is served; change it through /admin/upstreams", cfg.name,
                        "removed at runtime" if stored is None else
                        f"unreadable: {stored.reason}" if isinstance(stored, Unreadable) else
                        "changed at runtime or by an earlier config")


async def entries(redis: aioredis.Redis) -> list[UpstreamConfig | Unreadable]:
    """Every entry in the hash but removal markers, sorted by name."""
    raw: dict[Any, Any] = await redis.hgetall(keys.PROXY_UPSTREAMS)
    found = (read(as_str(name), raw[name]) for name in sorted(raw, key=as_str))
    return [e for e in found if e is not None]


async def load(redis: aioredis.Redis) -> list[UpstreamConfig]:
    """Every upstream in the hash (sorted by name); an entry that cannot be read is skipped."""
    out: list[UpstreamConfig] = []
    for entry in await entries(redis):
        if isinstance(entry, Unreadable):
            log.warning("proxy upstream %s: the stored entry is not served (%s); remove it with DELETE "
                        "/admin/upstreams/%s", entry.name, entry.reason, entry.name)
        else:
            out.append(entry)
    return out


async def get(redis: aioredis.Redis, name: str) -> UpstreamConfig | Unreadable | None:
    raw = await get_raw(redis, name)
    return read(name, raw) if raw is not None else None


async def get_raw(redis: aioredis.Redis, name: str) -> bytes | None:
    """The stored entry as it is (a removal marker included), for :func:`put`'s ``read``."""
    raw = await redis.hget(keys.PROXY_UPSTREAMS, name)
    return raw.encode() if isinstance(raw, str) else raw


async def put(redis: aioredis.Redis, cfg: UpstreamConfig, read: bytes | None = None) -> None:
    """Add ``cfg`` (``read`` None: its name must be free), or change the entry that read as ``read``;
    raises :class:`Conflict` and writes nothing when that no longer holds or another upstream
    mounts under ``cfg``'s namespace."""
    script = redis.register_script(_PUT_LUA)
    answer = await script(keys=[keys.PROXY_UPSTREAMS], args=[cfg.name, to_json(cfg), cfg.prefix, read or b""])
    if isinstance(answer, list):
        raise Conflict("namespace", as_str(answer[1]))
    if as_str(answer) != "ok":
        raise Conflict(as_str(answer))


async def remove(redis: aioredis.Redis, name: str) -> bool:
    """Mark ``name`` removed (a config-file upstream stays removed after a restart)."""
    raw = await get_raw(redis, name)
    if raw is None or raw == REMOVED:
        return False
    await redis.hset(keys.PROXY_UPSTREAMS, name, REMOVED)
    return True
