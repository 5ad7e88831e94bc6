"""The context store's global byte budget on a real Redis Cluster whose masters die (SIGKILL),
each test on a cluster of its own: the global accounting comes back to what the principals
hold after a failover, and the evictor goes on evicting what it can reach while a master is
down (shared/context/budget.py, docs/context.md "Global budget").
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.exceptions import RedisClusterException, RedisError

from shared import keys
from shared.config import ContextConfig, RedisConfig
from shared.context import ContextStore
from shared.redis_client import AsyncRedis, async_client
from shared.redis_local_cluster import LocalCluster
from tests.failover_drill import _master_of
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                reason="needs redis-server and redis-cli to start Redis Cluster nodes")

PRINCIPALS = [f"p{i}" for i in range(24)]


async def _client(cluster: LocalCluster) -> AsyncRedis:
    return async_client(RedisConfig(url=cluster.url), socket_timeout=1.0, socket_connect_timeout=1.0)


async def _held(store: ContextStore) -> int:
    """What the principals hold, from their own state (the truth the reports follow)."""
    return sum([await store.principal_bytes(p) for p in PRINCIPALS])


class Appender:
    """Appends to every principal in turn from a few tasks, counting what was acknowledged and
    what failed (while a master is down or failing over)."""

    def __init__(self, store: ContextStore) -> None:
        self.store = store
        self.acked = self.failed = 0
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, callers: int = 4) -> None:
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(callers)]

    async def _run(self, i: int) -> None:
        n = i
        while True:
            try:
                await self.store.append(PRINCIPALS[n % len(PRINCIPALS)], "c", "text", "user", b"x" * 64)
                self.acked += 1
            except (RedisError, RedisClusterException, OSError):
                self.failed += 1
                await asyncio.sleep(0.01)  # a refused call comes back at once: no busy loop meanwhile
            n += 1

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def more(self, n: int, what: str) -> None:
        """Until ``n`` more appends were acknowledged."""
        target = self.acked + n
        await wait_for(lambda: self.acked >= target, timeout_s=30, what=what)


@pytest.fixture
async def failing_cluster() -> AsyncIterator[LocalCluster]:
    cluster = LocalCluster(masters=3, replicas=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def test_the_global_accounting_comes_back_to_what_is_held_after_a_master_with_shards_fails_over(
        failing_cluster: LocalCluster) -> None:
    """A master serving accounting shards is killed under appends: the reports posted to it
    while it is down (and those in flight, or taken but not yet on its replica) are lost, so the
    shards' totals run below what the principals hold. The evictor sets every report right from
    the principals' own byte counts once they have settled, and every principal that holds bytes
    is in the global LRU again."""
    cluster = failing_cluster
    redis = await _client(cluster)
    store = ContextStore(redis, ContextConfig(global_lru_resolution_ms=0))
    appender = Appender(store)
    try:
        victim = _master_of(cluster, keys.ctx_global_bytes(keys.ctx_global_shard(PRINCIPALS[0])))
        appender.start()
        await appender.more(100, "appends before the kill")
        cluster.kill(victim)
        await asyncio.to_thread(cluster.wait_ok, 60)
        await appender.more(100, "appends after the failover")
        await appender.stop()
        assert appender.failed, "appends failed while the master was down"
        held = await _held(store)
        assert await store.global_bytes() < held  # reports lost with the master

        evictor = store.evictor(owner="a", report_settle_s=0.5)

        async def converged() -> bool:
            await evictor.sweep_once()
            holding = {p for p in PRINCIPALS if await store.principal_bytes(p)}
            return await store.global_bytes() == held and holding <= set(await store.principals())
        await wait_for(converged, timeout_s=30, interval_s=0.2, what="the global reports to match what is held")
        assert evictor.accounts.corrected > 0
        assert await store.evictor(owner="a", report_settle_s=0.5).sweep_once() == []  # well within the budget
    finally:
        await appender.stop()
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()


async def test_the_evictor_evicts_what_it_can_reach_while_a_master_is_down(caplog: pytest.LogCaptureFixture) -> None:
    """A master killed with no replica to take over (`cluster-require-full-coverage no`), the
    lease's among others: the replica that held the lease sweeps on, leaves out the shards of the
    lost master and the principals whose keys it held, and evicts the least recently used of the
    rest down to the budget; another replica waits. One log line says what is skipped, however
    many sweeps meet the lost master within the log's interval."""
    cluster = LocalCluster(masters=3, replicas=0, options=("--cluster-require-full-coverage", "no")).start()
    redis = await _client(cluster)
    now = [1_000_000]
    clock: Callable[[], int] = lambda: now[0]  # noqa: E731
    store = ContextStore(redis, ContextConfig(global_lru_resolution_ms=0, max_entry_bytes=100,
                                              channel_max_bytes=1000, principal_budget_bytes=1000,
                                              global_budget_bytes=1000), clock_ms=clock)
    try:
        for p in PRINCIPALS:  # p0 is the least recently used
            await store.append(p, "c", "text", "user", b"x" * 100)
            now[0] += 1
        one = await store.principal_bytes(PRINCIPALS[0])
        assert (await store.principals())[::-1] == PRINCIPALS
        evictor, other = store.evictor(owner="a"), store.evictor(owner="b")
        evictor.budget_bytes = other.budget_bytes = 10 * len(PRINCIPALS) * one
        assert await evictor.sweep_once() == []  # within the budget; "a" holds the lease
        victim = _master_of(cluster, keys.CTX_EVICTOR_LEASE)
        lost = {p: (_master_of(cluster, keys.ctx_global_bytes(keys.ctx_global_shard(p))).port == victim.port,
                    _master_of(cluster, keys.ctx_meta(p)).port == victim.port) for p in PRINCIPALS}
        counted = [p for p in PRINCIPALS if not lost[p][0]]  # reports on a live master
        reachable = [p for p in counted if not lost[p][1]]  # and keys on a live master
        assert any(lost[p][0] for p in PRINCIPALS) and len(reachable) < len(counted)
        cluster.kill(victim)

        evict = len(reachable) // 2
        assert evict and any(lost[p][1] for p in counted[:counted.index(reachable[evict - 1])])  # one is skipped
        evictor.budget_bytes = other.budget_bytes = (len(counted) - evict) * one
        caplog.set_level(logging.WARNING, logger="shared.context.budget")
        began = time.monotonic()
        assert await evictor.sweep_once() == reachable[:evict]
        assert await other.sweep_once() == [] and other.sweeps == 0  # "b" never held the lease: it waits
        assert await evictor.sweep_once() == []  # at the budget now
        for p in reachable[:evict]:
            assert await store.list_contexts(p) == []
        for p in reachable[evict:] + [p for p in PRINCIPALS if lost[p][0] and not lost[p][1]]:
            assert [c.id for c in await store.list_contexts(p)] == ["c"], p
        skipping = [r.getMessage() for r in caplog.records if "skips what the master(s)" in r.getMessage()]
        # once per interval of the log: sweeps slowed by a loaded machine may span a second one
        intervals = 1 + int((time.monotonic() - began) // evictor._skipping.interval_s)
        assert 1 <= len(skipping) <= intervals and victim.address in skipping[0], skipping
        leases = [r.getMessage() for r in caplog.records if "lease does not answer" in r.getMessage()]
        held = [m for m in leases if "held it and sweeps on" in m]  # a later line adds a count
        waits = [m for m in leases if "does not hold it and waits" in m]
        assert 1 <= len(held) <= intervals and 1 <= len(waits) <= intervals and len(held) + len(waits) == len(leases), leases
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()
        cluster.stop()
