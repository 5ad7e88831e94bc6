"""The set of upstreams every replica serves, kept in one Redis hash (``keys.PROXY_UPSTREAMS``).

``proxy.upstreams`` of the config file is the initial set: at start each is written unless the
hash already has that name (an admin change, or a removal marker, survives restarts). The admin
API writes here and publishes ``{"t": "proxy"}`` on the gateway control channel; every replica
then reloads (and reloads again whenever it reconnects to the channel, in case it missed one).
Stored: the configuration as given, with credential *sources* (environment variable names,
file paths) and never a credential's value.
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


def to_json(cfg: UpstreamConfig) -> bytes:
    return orjson.dumps(dataclasses.asdict(cfg))


def from_json(raw: bytes | str) -> UpstreamConfig | None:
    """The stored upstream; None for a removal marker."""
    data = orjson.loads(raw)
    if data.get("removed"):
        return None
    return UpstreamConfig(**data)


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
                        "removed at runtime" if stored is None else "changed at runtime or by an earlier config")


async def load(redis: aioredis.Redis) -> list[UpstreamConfig]:
    """Every upstream in the hash (sorted by name); an entry that no longer validates is skipped."""
    raw: dict[Any, Any] = await redis.hgetall(keys.PROXY_UPSTREAMS)
    out: list[UpstreamConfig] = []
    for name in sorted(raw, key=as_str):
        try:
            cfg = from_json(raw[name])
        except (ConfigError, orjson.JSONDecodeError, TypeError):
            continue
        if cfg is not None:
            out.append(cfg)
    return out


async def get(redis: aioredis.Redis, name: str) -> UpstreamConfig | None:
    raw = await redis.hget(keys.PROXY_UPSTREAMS, name)
    return from_json(raw) if raw is not None else None


async def put(redis: aioredis.Redis, cfg: UpstreamConfig) -> None:
    await redis.hset(keys.PROXY_UPSTREAMS, cfg.name, to_json(cfg))


async def remove(redis: aioredis.Redis, name: str) -> bool:
    """Mark ``name`` removed (a config-file upstream stays removed after a restart)."""
    if await get(redis, name) is None:
        return False
    await redis.hset(keys.PROXY_UPSTREAMS, name, REMOVED)
    return True
