"""What an operator meets running learnmesh on a real Redis Cluster (3 masters + 3 replicas,
redis-server processes of this file's own), beside the failover drill
(tests/test_redis_cluster_failover.py): the whole cluster stopped and started again, a gateway
(re)started while Redis is away. Each scenario runs against a private single server too, where
it applies there as well.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import zmq

from shared import keys
from shared.net import free_port
from shared.redis_local_cluster import LocalCluster
from tests.conftest import wait_for_sync
from tests.failover_drill import _master_of
from tests.gateway_support import start_gateway, stop

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                reason="needs redis-server and redis-cli to start and stop Redis")

MODERN = "2026-07-28"
KEY = "ops-key-0123456789"


class Outage:
    """A Redis that is down, then brought back on the same port(s): one server or a whole cluster."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.cluster: LocalCluster | None = None
        self.proc: subprocess.Popen | None = None
        self.workdir = tempfile.mkdtemp(prefix="lm-ops-")
        if kind != "single":  # "unjoined": nodes started, the cluster not created yet
            self.cluster = LocalCluster(masters=3, replicas=1).start(join=kind == "cluster")
            self.url = self.cluster.url
        else:
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"

    def down(self) -> None:
        """Every node stopped (SIGTERM), as for a maintenance or a power cut; nodes not joined yet
        stay as they are."""
        if self.kind == "unjoined":
            return
        if self.cluster is not None:
            for node in self.cluster.running():
                node.proc.terminate()
            for node in self.cluster.nodes:
                node.proc.wait(10)
        elif self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def up(self) -> None:
        """Every node started again (a cluster re-forms from its nodes.conf files), or the nodes
        joined (``redis-cli --cluster create``)."""
        if self.kind == "unjoined" and self.cluster is not None:
            self.cluster.join()
            return
        if self.cluster is not None:
            for node in self.cluster.nodes:
                self.cluster.restart(node)
            self.cluster.wait_ok(60)
            return
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(self.port),  # noqa: S603
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        elif self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(params=["single", "cluster", "unjoined"])
def outage(request: pytest.FixtureRequest) -> Iterator[Outage]:
    o = Outage(request.param)
    try:
        yield o
    finally:
        o.close()


def _tool(base: str, name: str, arguments: dict[str, Any]) -> httpx.Response:
    params = {"name": name, "arguments": arguments,
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    return httpx.post(f"{base}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params},
                      headers={"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
                               "mcp-method": "tools/call", "mcp-name": name, "authorization": f"Bearer {KEY}"},
                      timeout=15)


def _answered(base: str, name: str, arguments: dict[str, Any]) -> bool:
    """True for a result, False for 503 with Retry-After (the client retries); anything else fails."""
    resp = _tool(base, name, arguments)
    if resp.status_code == 503:
        assert resp.headers.get("retry-after") == "1", resp.text
        return False
    assert resp.status_code == 200, resp.text
    body = orjson.loads(resp.text)
    assert "result" in body and not body["result"].get("isError"), body
    return True


def _appended(base: str, text: str) -> bool:
    return _answered(base, "context_append", {"context_id": "ops", "modality": "text", "text": text})


def test_a_gateway_started_while_redis_is_down_serves_503_then_recovers(outage: Outage, tmp_path: Path) -> None:
    """A gateway (re)started during an outage (a pod rescheduled while the cluster is stopped, or
    started beside cluster nodes that the operator has not joined yet) comes up, answers 503 with
    Retry-After and is not ready; once Redis is back it finishes its start and serves, with no
    restart and no traceback in its log."""
    outage.down()
    port, log = free_port(), tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        gw = start_gateway(port, outage.url, api_keys=f"ops:{KEY}", output=out,
                           overrides={"redis": {"retry_after_s": 1, "socket_timeout_s": 1.0}})
    try:
        for i in range(20):  # a client retrying: answered 503 every time, logged once in a while
            assert not _appended(base, f"while down {i}")
        ready = httpx.get(f"{base}/readyz", timeout=15)
        assert ready.status_code == 503 and ready.headers.get("retry-after") == "1"
        outage.up()
        wait_for_sync(lambda: httpx.get(f"{base}/readyz", timeout=15).status_code == 200, timeout_s=30,
                      what="readyz once Redis is back")
        wait_for_sync(lambda: _appended(base, "back"), timeout_s=30, what="an append once Redis is back")
        assert gw.poll() is None
    finally:
        stop(gw)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "redis unreachable at start" in text
    assert text.count("redis unavailable while serving") <= 3, text[-3000:]


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_a_graceful_failover_answers_every_call(wait_replicas: int, tmp_path: Path) -> None:
    """`CLUSTER FAILOVER` on a replica (maintenance of a master's host): the old master answers
    MOVED and the promoted one lacks the scripts the gateway loaded (a script cache is not
    replicated). Every call after it is answered, none with an internal error: the request and
    learn limits, learn and the context store load what the new master lacks, also where writes
    wait for a replica (the old master is the new one's replica at once)."""
    cluster = LocalCluster(masters=3, replicas=1).start()
    port, log = free_port(), tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    try:
        with log.open("wb") as out:
            gw = start_gateway(port, cluster.url, api_keys=f"ops:{KEY}", output=out,
                               overrides={"redis": {"retry_after_s": 1, "wait_replicas": wait_replicas},
                                          "learning": {"teachers": ["ops"]}})
        try:
            calls = [("learn", {"input": "q", "target": "a"}),
                     ("context_append", {"context_id": "ops", "modality": "text", "text": "t"})]
            for name, args in calls:
                assert _answered(base, name, args)
            for key in (keys.ctx_meta("ops"), keys.sample_log(0)):  # the principal's master, the log's
                master = _master_of(cluster, key)
                with cluster.replica_of(master).client(socket_timeout=5) as replica:
                    replica.execute_command("CLUSTER", "FAILOVER")
                wait_for_sync(lambda m=master: m.port not in {n.port for n in cluster.primaries()}, timeout_s=30,
                              what="the replica to take over")
                cluster.wait_ok(30)
                for name, args in calls:
                    wait_for_sync(lambda n=name, a=args: _answered(base, n, a), timeout_s=30,
                                  what=f"{name} after the failover")
            assert gw.poll() is None
        finally:
            stop(gw)
    finally:
        cluster.stop()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]


def _learned_seqs(base: str, text: str) -> list[int] | None:
    """The seqs a `learn` was logged under; None for 503 (the client retries)."""
    resp = _tool(base, "learn", {"input": text, "target": text})
    if resp.status_code == 503:
        return None
    assert resp.status_code == 200, resp.text
    return list(orjson.loads(resp.text)["result"]["structuredContent"]["seqs"])


def test_a_failover_that_loses_trained_samples_never_reuses_their_seqs(tmp_path: Path) -> None:
    """A master killed before its replica got its newest sample-log entry (a lagging replica;
    `redis.wait_replicas: 0`, the default, acknowledges on the master alone): the trainer had
    read and committed that entry, the promoted replica never had it, and its seq counter is
    one behind. The next `learn` must not be given the trained seq again: the trainer skips
    seqs at or below its position, so that sample (acknowledged after the failover) would
    never be trained, and its `learned` token would count as trained at once."""
    from services.trainer.data import SampleSource
    from services.trainer.ledger import Ledger, Offset, read_offset
    from shared.config import load_config
    from shared.redis_client import close_sync, sync_client
    from shared.samples import CLUSTER_SAMPLE_PARTITIONS, partition_of

    cluster = LocalCluster(masters=3, replicas=1).start()
    port, log = free_port(), tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    cfg = load_config(env={}, overrides={"redis": {"url": cluster.url},
                                         "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}"}})
    redis = sync_client(cfg.redis, socket_timeout=2)
    zmq_ctx = zmq.Context()
    source: SampleSource | None = None
    try:
        part = partition_of("ops", CLUSTER_SAMPLE_PARTITIONS)
        victim = _master_of(cluster, keys.sample_log(part))
        assert victim is not _master_of(cluster, keys.TRAINER_OFFSET), "the commit record must survive the kill"
        lagging = cluster.replica_of(victim)
        with log.open("wb") as out:
            gw = start_gateway(port, cluster.url, api_keys=f"ops:{KEY}", output=out,
                               overrides={"redis": {"retry_after_s": 1, "socket_timeout_s": 1.0},
                                          "learning": {"teachers": ["ops"]}})
        try:
            source = SampleSource(cfg, redis, zmq_ctx, {}, partitions=CLUSTER_SAMPLE_PARTITIONS)
            ledger = Ledger(redis, CLUSTER_SAMPLE_PARTITIONS)

            def train(expected: int) -> list[int]:
                """Take the samples the log holds, as the trainer's rank 0 does, and commit them."""
                batch = source.next_batch(10, 0, lambda: True)
                assert len(batch) == expected, [(s.seq, s.id) for s in batch]
                off = read_offset(redis)
                ledger.commit(Offset(off.step + 1, off.version + 1, off.epoch, source.positions()), [s.id for s in batch])
                return [s.seq for s in batch]

            assert _learned_seqs(base, "replicated") == [1]
            with victim.client() as master:
                assert master.wait(1, 5000) == 1
            assert train(1) == [1]
            # the replica falls behind: stopped, its link cut (it cannot reconnect while stopped)
            lagging.proc.send_signal(signal.SIGSTOP)
            try:
                with victim.client() as master:
                    master.client_kill_filter(_type="replica")
                assert _learned_seqs(base, "lost in the failover") == [2]
                assert train(1) == [2]  # trained and committed: the commit record is on another master
                cluster.kill(victim)
            finally:
                lagging.proc.send_signal(signal.SIGCONT)
            wait_for_sync(lambda: lagging.port in {n.port for n in cluster.primaries()}, timeout_s=60,
                          what="the lagging replica to take over")
            cluster.wait_ok(60)
            seqs = wait_for_sync(lambda: _learned_seqs(base, "after the failover"), timeout_s=30,
                                 what="a learn after the failover")
            assert seqs == [3], seqs
            assert train(1) == [3]
        finally:
            stop(gw)
    finally:
        if source is not None:
            source.close()
        zmq_ctx.term()
        close_sync(redis)
        cluster.stop()
