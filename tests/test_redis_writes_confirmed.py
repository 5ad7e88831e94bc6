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
