"""``redis.wait_replicas``: a learn sample is acknowledged only once that many replicas hold it
(WAIT in the same round trip); with too few replicas the call fails as an outage (503), never
silently. Runs on one server (no replica: refused) and on the cluster (one replica per master)."""

from __future__ import annotations

import dataclasses

import pytest
import redis as redis_sync
from trainer_support import trainer_config

from gateway.errors import SERVICE_UNAVAILABLE, wire_error
from gateway.tools.learning import SampleIngest
from shared import keys
from shared.config import Config, ContextConfig
from shared.context import ContextStore
from shared.redis_client import ReplicasBehind
from shared.samples import Example, partition_of
from tests.conftest import RedisTarget, free_port


def _ingest(redis_target: RedisTarget, tmp_path, wait_replicas: int):
    cfg = trainer_config(redis_target.url, tmp_path, free_port())
    cfg = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, wait_replicas=wait_replicas,
                                                             wait_timeout_ms=300))
    redis = redis_target.async_client()
    return SampleIngest(redis, cfg), redis  # type: ignore[arg-type]


@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_a_sample_waits_for_its_replica(redis_target: RedisTarget, tmp_path, wait_replicas: int) -> None:
    ingest, redis = _ingest(redis_target, tmp_path, wait_replicas)
    try:
        sample = Example(input="q", target="a")
        if wait_replicas and not redis_target.is_cluster:  # a lone server has no replica to wait for
            with pytest.raises(ReplicasBehind) as err:
                await ingest.submit("alice", [sample])
            wire = wire_error(err.value, ingest.cfg)
            assert wire.code == SERVICE_UNAVAILABLE and wire.http_status == 503
            return
        for _ in range(2):  # the second append finds the script loaded
            got = await ingest.submit("alice", [sample])
        log_key = keys.sample_log(partition_of("alice", ingest.partitions))
        assert got["seqs"] == [2] and await redis.xlen(log_key) == 2
        if wait_replicas:
            assert _on_replica(redis_target, log_key) == 2  # confirmed by WAIT: read at once
    finally:
        ingest.close()
        await redis.aclose()


def _on_replica(redis_target: RedisTarget, key: str) -> int:
    """XLEN of ``key`` read from the replica of its master (the one that does not redirect)."""
    assert redis_target.cluster is not None
    for node in redis_target.cluster.running():
        with node.client(socket_timeout=2) as c:
            if c.info("replication")["role"] != "slave":
                continue
            c.execute_command("READONLY")
            try:
                return int(c.xlen(key))
            except redis_sync.exceptions.MovedError:  # a replica of another master
                continue
    raise AssertionError(f"no replica serves {key}")


async def _waits(redis, node_of: str | None = None) -> int:
    """WAIT calls answered so far: by the master of key ``node_of``'s slot (cluster), or by all."""
    from shared.redis_client import for_each_primary, node_client

    if node_of is not None:
        node = node_client(redis, redis.get_node_from_key(node_of))
        try:
            return int((await node.info("commandstats")).get("cmdstat_wait", {}).get("calls", 0))
        finally:
            await node.aclose()
    stats = await for_each_primary(redis, lambda node: node.info("commandstats"))
    return sum(int(s.get("cmdstat_wait", {}).get("calls", 0)) for s in stats)


@pytest.mark.parametrize("functions", [True, False], ids=["fcall", "evalsha"])
async def test_a_context_write_waits_for_its_replica(redis_target: RedisTarget, functions: bool) -> None:
    """Appends, clears, forks and evictions are acknowledged once a replica holds them (WAIT
    right after the script call, on its connection); a lone server has none: refused (503)."""
    redis = redis_target.async_client()
    rcfg = dataclasses.replace(redis_target.config, wait_replicas=1, wait_timeout_ms=300)
    store = ContextStore(redis, ContextConfig(), redis_cfg=rcfg)
    store._script.use_functions = None if functions else False
    try:
        if not redis_target.is_cluster:  # no replica to wait for
            with pytest.raises(ReplicasBehind) as err:
                await store.append("alice", "c", "text", "user", b"one")
            assert wire_error(err.value, dataclasses.replace(Config(), redis=rcfg)).http_status == 503
            return
        await redis.cluster_nodes()  # the slot map, for _waits
        meta = keys.ctx_meta("alice")
        before = await _waits(redis, meta)
        assert (await store.append("alice", "c", "text", "user", b"one")).version == 1
        assert await store.fork("alice", "c", "d") == "d"
        assert await store.clear("alice", "d") == 2
        assert await store.evict("alice", "d") is True
        assert await _waits(redis, meta) >= before + 4  # one WAIT per write, on the principal's master
        waits = await _waits(redis)
        assert [e.content for e in (await store.get_window("alice", "c")).channels["text"]] == [b"one"]
        assert await _waits(redis) == waits  # reads wait for nothing
    finally:
        await redis.aclose()


async def test_context_writes_send_no_wait_by_default(redis_target: RedisTarget) -> None:
    redis = redis_target.async_client()
    store = ContextStore(redis, ContextConfig(), redis_cfg=redis_target.config)  # wait_replicas: 0
    try:
        before = await _waits(redis)
        await store.append("bob", "c", "text", "user", b"one")
        await store.evict("bob", "c")
        assert await _waits(redis) == before
    finally:
        await redis.aclose()

