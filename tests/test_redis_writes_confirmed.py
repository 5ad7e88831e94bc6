"""``redis.wait_replicas``: a learn sample is acknowledged only once that many replicas hold it
(WAIT in the same round trip); with too few replicas the call fails as an outage (503), never
silently. Runs on one server (no replica: refused) and on the cluster (one replica per master)."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest
import redis as redis_sync
from trainer_support import TrainerProc, committed, trained_total, trainer_config

from gateway.errors import SERVICE_UNAVAILABLE, wire_error
from gateway.tools.learning import SampleIngest
from shared import keys
from shared.config import Config, ContextConfig
from shared.context import ContextStore
from shared.redis_client import ReplicasBehind, async_client
from shared.samples import Example, partition_of
from tests.conftest import RedisTarget, free_port, wait_for, wait_for_sync


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
        await store.aclose()  # its batches before the client (ContextStore.aclose)
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
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()



@pytest.fixture
def master_and_replica(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A redis-server and its replica, the replica in sync: (the master's URL, the replica's process)."""
    server = shutil.which("redis-server") or "redis-server"
    ports, procs = [free_port(), free_port()], []
    for i, port in enumerate(ports):
        (tmp_path / f"redis-{i}").mkdir()
        extra = ["--replicaof", "127.0.0.1", str(ports[0])] if i else []
        procs.append(subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",  # noqa: S603
                                       "--appendonly", "no", "--dir", str(tmp_path / f"redis-{i}"), *extra],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        with redis_sync.Redis(port=ports[0], socket_timeout=5) as master:
            wait_for_sync(lambda: _answers(master) and master.set("lm:test:linked", 1) and master.wait(1, 100) == 1,
                          timeout_s=30, what="the replica in sync")
        yield f"redis://127.0.0.1:{ports[0]}/0", procs[1]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(10)


def _answers(client: redis_sync.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis_sync.RedisError:
        return False


def _wait_calls(url: str) -> int:
    with redis_sync.Redis.from_url(url, socket_timeout=5) as r:
        return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


async def test_the_trainer_holds_a_commit_until_its_replica_confirms_it(master_and_replica, tmp_path) -> None:
    """`redis.wait_replicas: 1` with the replica stopped: the trainer's first commit reaches the
    master only; the trainer takes no further step (and publishes nothing past it) while it
    commits that step again, logs it once, and goes on once the replica confirms it; every
    sample is trained exactly once."""
    from services.trainer import ledger

    url, replica = master_and_replica
    cfg = trainer_config(url, tmp_path, free_port(), batch_size=4, checkpoint_every=100, batch_wait_ms=20)
    held = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, wait_replicas=1, wait_timeout_ms=200))
    ingest = SampleIngest(async_client(cfg.redis), cfg)  # the samples themselves wait for nothing
    replica.send_signal(signal.SIGSTOP)
    acked: list[str] = []
    trainer = None
    try:
        for i in range(0, 8, 4):  # two steps' worth, logged before the trainer starts
            acked += (await ingest.submit("alice", [Example(input=f"q{j}", target="a") for j in range(i, i + 4)]))["ids"]
        before = _wait_calls(url)
        trainer = TrainerProc(held, tmp_path)
        await wait_for(lambda: _wait_calls(url) >= before + 3, timeout_s=60, what="the commit tried again")
        record = committed(url)
        assert record["step"] == "1" and trained_total(record) == 4, record  # no step past the held one
        assert "commit is not confirmed" in trainer.output()
        replica.send_signal(signal.SIGCONT)
        await wait_for(lambda: trained_total(committed(url)) == 8, timeout_s=60, what="training to go on")
        assert trainer.term() == 0, trainer.output()
    finally:
        replica.send_signal(signal.SIGCONT)
        if trainer is not None:
            trainer.close()
        ingest.close()
        await ingest.redis.aclose()
    out = trainer.output()
    assert out.count("commit is not confirmed") == 1 and "commit confirmed after" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    with redis_sync.Redis.from_url(url) as r:
        assert sorted(ledger.trained_ids(r)) == sorted(acked)


async def test_a_write_its_replica_did_not_confirm_is_stored_once_when_sent_again(master_and_replica, tmp_path) -> None:
    """The ambiguous failure a retry exists for: with `redis.wait_replicas: 1` and the replica
    stopped, an append and a learn reach the master, yet are answered "not confirmed" (503).
    The replica comes back and the client sends both calls again with their request ids: each
    is answered as the first (repeated), confirmed, and stored once."""
    url, replica = master_and_replica
    cfg = trainer_config(url, tmp_path, free_port())
    cfg = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, wait_replicas=1, wait_timeout_ms=200))
    redis = async_client(cfg.redis)
    store = ContextStore(redis, ContextConfig(), redis_cfg=cfg.redis)
    ingest = SampleIngest(redis, cfg)
    sample = Example(input="The capital of Zorbland is", target=" Quixville.")
    try:
        replica.send_signal(signal.SIGSTOP)
        with pytest.raises(ReplicasBehind):
            await store.append("alice", "c", "text", "user", b"pay the invoice", request_id="a-1")
        with pytest.raises(ReplicasBehind):
            await ingest.submit("alice", [sample], request_id="l-1")
        replica.send_signal(signal.SIGCONT)
        again = await wait_for(lambda: _when_confirmed(store.append(
            "alice", "c", "text", "user", b"pay the invoice", request_id="a-1")), timeout_s=30,
            what="the append confirmed")
        assert (again.entry_id, again.version, again.repeated) == ("text:1", 1, True)
        taught = await ingest.submit("alice", [sample], request_id="l-1")
        assert taught["repeated"] is True and taught["seqs"] == [1]
        assert [e.content for e in (await store.get_window("alice", "c")).channels["text"]] == [b"pay the invoice"]
        assert await redis.xlen(keys.sample_log(partition_of("alice", ingest.partitions))) == 1
    finally:
        replica.send_signal(signal.SIGCONT)
        ingest.close()
        await store.aclose()
        await redis.aclose()


async def _when_confirmed(call):
    """The call's answer, or None while its replica has not confirmed it."""
    try:
        return await call
    except ReplicasBehind:
        return None


def test_a_trainer_commit_waits_for_its_replica(redis_target: RedisTarget) -> None:
    """The commit record with `redis.wait_replicas: 1`: WAIT on the connection that wrote it, on
    the master of the {trainer} slot; a lone server has no replica: refused with ReplicasBehind."""
    from services.trainer.ledger import Ledger, Offset, Position, read_offset, skipped_ids, trained_ids
    from shared.redis_client import close_sync

    rcfg = dataclasses.replace(redis_target.config, wait_replicas=1, wait_timeout_ms=300)
    redis = redis_target.sync_client()
    try:
        ledger = Ledger(redis, 1, rcfg)
        off = Offset(1, 2, 0, {0: Position(4, "1-3", "log")})
        if not redis_target.is_cluster:
            with pytest.raises(ReplicasBehind):
                ledger.commit(off, ["a", "b"], {"c": "empty"})
        else:
            node = redis.get_redis_connection(redis.get_node_from_key(keys.TRAINER_OFFSET))
            waits = lambda: int(node.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))  # noqa: E731
            before = waits()
            ledger.commit(off, ["a", "b"], {"c": "empty"})
            assert waits() == before + 1
        assert read_offset(redis) == off  # written either way; confirmed only on the cluster
        assert trained_ids(redis) == ["a", "b"] and skipped_ids(redis) == {"c": "empty"}
    finally:
        close_sync(redis)
