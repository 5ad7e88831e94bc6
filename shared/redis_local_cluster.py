"""A real Redis Cluster on this machine, made of ``redis-server`` processes (``--cluster-enabled
yes``) joined by ``redis-cli --cluster create``: what the tests, the benchmarks and the failover
drills run against when no cluster is given. Never a fake: each node is a process of its own,
so a drill can kill one with SIGKILL and watch the cluster fail over.

Each node needs two free ports: its client port and its cluster bus port (client port +
10000); both are picked below the kernel's ephemeral range (see shared.net.free_port)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis as redis_sync

from shared.net import free_port_pair

BUS_OFFSET = 10000  # Redis's cluster bus listens on the client port + 10000


@dataclass
class Node:
    port: int
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **options: object) -> redis_sync.Redis:
        return redis_sync.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, under a temporary directory."""

    masters: int = 3
    replicas: int = 1
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lm-redis-cluster-")))
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed URL (any node) in learnmesh's cluster scheme."""
        return f"redis+cluster://{self.nodes[0].address}/0"

    @property
    def seed_url(self) -> str:
        """The same seed as a plain ``redis://`` URL (redis-py's RedisCluster.from_url)."""
        return f"redis://{self.nodes[0].address}/0"

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        """Start every node, join them, and wait until every node reports ``cluster_state:ok``
        and every replica is in sync; stops what it started if that fails."""
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                self.nodes.append(self._spawn())
            for node in self.nodes:
                _wait(lambda n=node: _answers(n), timeout_s, f"redis-server on port {node.port}")
            binary = shutil.which("redis-cli") or "redis-cli"
            subprocess.run([binary, "--cluster", "create", *[n.address for n in self.nodes],  # noqa: S603
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s)
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every running node says the cluster is ok and knows every slot's master, every
        replica's link to its master is up and every master has an acknowledgement from each of
        its replicas (so WAIT counts them)."""
        for node in self.running():
            _wait(lambda n=node: _cluster_ok(n), timeout_s, f"cluster_state:ok on port {node.port}")

    def running(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def primaries(self) -> list[Node]:
        """Running nodes that are masters now (failovers move the role)."""
        out = []
        for node in self.running():
            with node.client(socket_timeout=2) as c:
                if c.info("replication").get("role") == "master":
                    out.append(node)
        return out

    def kill(self, node: Node) -> None:
        """SIGKILL ``node``: what a crashed host looks like to the rest of the cluster."""
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(10)

    def restart(self, node: Node) -> None:
        """Start a killed ``node`` again, same port and directory (what a host brought back
        looks like): it rejoins from its cluster config, as a replica of whoever took its slots."""
        node.proc = self._spawn(node.port).proc

    def flush(self) -> None:
        """Empty every master (replicas follow)."""
        for node in self.primaries():
            with node.client(socket_timeout=5) as c:
                c.flushall()

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and remove the directory."""
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            try:
                node.proc.wait(5)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
        self.nodes = []
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _spawn(self, port: int | None = None) -> Node:
        port = port or free_port_pair(BUS_OFFSET)
        nodedir = self.workdir / str(port)
        nodedir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server") or "redis-server"
        # S603: redis-server from PATH, arguments built here, no shell.
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(nodedir),  # noqa: S603
                                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                 "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no",
                                 "--maxmemory-policy", "noeviction", "--notify-keyspace-events", ""],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return Node(port, proc)


def _answers(node: Node) -> bool:
    if node.proc.poll() is not None:
        raise RuntimeError(f"redis-server on port {node.port} exited with {node.proc.returncode}")
    try:
        with node.client(socket_timeout=1, socket_connect_timeout=1) as c:
            return bool(c.ping())
    except redis_sync.RedisError:
        return False


def _cluster_ok(node: Node) -> bool:
    try:
        with node.client(socket_timeout=1, socket_connect_timeout=1) as c:
            info = c.cluster("info")
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
            repl = c.info("replication")
            if repl.get("role") == "master":
                # a replica counts for WAIT once it acknowledged an offset (about a second after its sync)
                return all(v.get("offset", 0) > 0 for k, v in repl.items() if k.startswith("slave") and
                           isinstance(v, dict))
            return repl.get("master_link_status") == "up"
    except redis_sync.RedisError:
        return False


def _wait(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
