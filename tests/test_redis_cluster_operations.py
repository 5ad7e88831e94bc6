"""What an operator meets running learnmesh on a real Redis Cluster (3 masters + 3 replicas,
redis-server processes of this file's own), beside the failover drill
(tests/test_redis_cluster_failover.py): the whole cluster stopped and started again, a gateway
(re)started while Redis is away. Each scenario runs against a private single server too, where
it applies there as well.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from shared.net import free_port
from shared.redis_local_cluster import LocalCluster
from tests.conftest import wait_for_sync
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
        if kind == "cluster":
            self.cluster = LocalCluster(masters=3, replicas=1).start()
            self.url = self.cluster.url
        else:
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"

    def down(self) -> None:
        """Every node stopped (SIGTERM), as for a maintenance or a power cut."""
        if self.cluster is not None:
            for node in self.cluster.running():
                node.proc.terminate()
            for node in self.cluster.nodes:
                node.proc.wait(10)
        elif self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def up(self) -> None:
        """Every node started again (a cluster re-forms from its nodes.conf files)."""
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


@pytest.fixture(params=["single", "cluster"])
def outage(request: pytest.FixtureRequest) -> Iterator[Outage]:
    o = Outage(request.param)
    try:
        yield o
    finally:
        o.close()


def _append(base: str, text: str) -> httpx.Response:
    params = {"name": "context_append", "arguments": {"context_id": "ops", "modality": "text", "text": text},
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    return httpx.post(f"{base}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params},
                      headers={"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
                               "mcp-method": "tools/call", "mcp-name": "context_append",
                               "authorization": f"Bearer {KEY}"}, timeout=15)


def _appended(base: str, text: str) -> bool:
    resp = _append(base, text)
    if resp.status_code == 503:
        assert resp.headers.get("retry-after") == "1", resp.text
        return False
    assert resp.status_code == 200, resp.text
    return not orjson.loads(resp.text)["result"].get("isError")


def test_a_gateway_started_while_redis_is_down_serves_503_then_recovers(outage: Outage, tmp_path: Path) -> None:
    """A gateway (re)started during an outage (a pod rescheduled while the cluster is stopped)
    comes up, answers 503 with Retry-After and is not ready; once Redis is back it finishes
    its start and serves, with no restart and no traceback in its log."""
    outage.down()
    port, log = free_port(), tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        gw = start_gateway(port, outage.url, api_keys=f"ops:{KEY}", output=out,
                           overrides={"redis": {"retry_after_s": 1, "socket_timeout_s": 1.0}})
    try:
        assert not _appended(base, "while down")
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
