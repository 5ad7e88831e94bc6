"""The legacy-session cache on the hot path (gateway/mcp/sessions.py): concurrent requests that find
a cached session due for its re-check send ONE round trip between them, and a re-check that
fails leaves the session due, so the next request tries again (and sees the outage)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.mcp.sessions import Session, SessionNotFound, SessionRegistry, new_session_id
from shared.config import load_config
from shared.redis_client import AsyncRedis, for_each_primary
from tests.conftest import RedisTarget, free_port


async def _hgetall_calls(r: AsyncRedis) -> int:
    stats = await for_each_primary(r, lambda node: node.info("commandstats"))
    return sum(s.get("cmdstat_hgetall", {}).get("calls", 0) for s in stats)


async def test_concurrent_rechecks_share_one_round_trip(redis_target: RedisTarget) -> None:
    r = redis_target.async_client()
    try:
        reg = SessionRegistry(r, r, load_config(env={}, overrides={}).gateway)  # type: ignore[arg-type]
        s = await reg.create("alice", "2025-11-25", {})
        s.checked_at -= reg.recheck_s + 1  # due for a re-check
        before = await _hgetall_calls(r)
        got = await asyncio.gather(*(reg.get("alice", s.id) for _ in range(20)))
        assert all(g.id == s.id for g in got)
        assert await _hgetall_calls(r) - before == 1
        await reg.delete("alice", s.id)
        with pytest.raises(SessionNotFound):
            await reg.get("alice", s.id)
    finally:
        await r.aclose()


async def test_failed_recheck_leaves_the_session_due() -> None:
    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    try:
        reg = SessionRegistry(dead, dead, load_config(env={}, overrides={}).gateway)
        s = Session(new_session_id(), "alice", "2025-11-25", checked_at=0.0)
        reg._remember(s)
        for _ in range(2):  # both attempts go to Redis: the failed one did not count as a check
            with pytest.raises((RedisError, OSError)):
                await reg.get("alice", s.id)
            assert s.checked_at == 0.0
    finally:
        await dead.aclose()
