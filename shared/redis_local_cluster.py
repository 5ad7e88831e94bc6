"""A real Redis Cluster on this machine, made of ``redis-server`` processes (``--cluster-enabled
yes``) joined by ``redis-cli --cluster create``: what the tests, the benchmarks and the failover
drills run against when no cluster is given. Never a fake: each node is a process of its own,
so a drill can kill one with SIGKILL and watch the cluster fail over.

Each node needs two free ports: its client port and its cluster bus port (client port +
10000); both are picked below the kernel's ephemeral range (see shared.net.free_port).

With a :class:`NodeSecurity` the cluster is one as production runs it: TLS on every port a
node opens (clients, cluster bus, replication; no plain port) and ACL users instead of the
open default user. The harness then speaks to the nodes as the security's admin user."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_sync

from shared.net import free_port_pair

BUS_OFFSET = 10000  # Redis's cluster bus listens on the client port + 10000


@dataclass(frozen=True)
class NodeSecurity:
    """TLS files and ACL users of every node of a cluster. ``cert_file`` / ``key_file``: what a
    node shows to whoever connects to it; ``client_cert_file`` / ``client_key_file``: what it
    shows when it connects to another node (cluster bus, replication) and what the harness
    shows, since clients must present a certificate the CA signed. ``acl``: redis.conf
    ``user`` lines, handed to each node on stdin so no password is on a command line;
    ``admin_user`` / ``admin_password``: one of them with every permission (joining the nodes,
    health checks, flushing). ``replication_user`` / ``replication_password``: the user replicas
    authenticate to their master as; one of the ``acl`` lines should give it only what
    replication needs (``+psync +replconf +ping``); empty: the admin user."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_file: str
    client_key_file: str
    acl: tuple[str, ...]
    admin_user: str
    admin_password: str
    replication_user: str = ""
    replication_password: str = ""

    def args(self, port: int) -> list[str]:
        """redis-server arguments: TLS only, on ``port``, for clients, the bus and replication."""
        return ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file,
                "--tls-client-cert-file", self.client_cert_file, "--tls-client-key-file", self.client_key_file,
                "--tls-ca-cert-file", self.ca_file, "--tls-auth-clients", "yes"]

    def config(self) -> str:
        """redis.conf text with the secrets: the ACL users and the replicas' credentials."""
        user = self.replication_user or self.admin_user
        password = self.replication_password if self.replication_user else self.admin_password
        return "".join(f"{line}\n" for line in (*self.acl, f"masteruser {user}", f"masterauth {password}"))

    def client_options(self) -> dict[str, Any]:
        """redis-py keyword arguments of the admin user over TLS."""
        return {"ssl": True, "ssl_ca_certs": self.ca_file, "ssl_certfile": self.client_cert_file,
                "ssl_keyfile": self.client_key_file, "username": self.admin_user, "password": self.admin_password}

    def cli_args(self) -> list[str]:
        """redis-cli arguments (the password goes in REDISCLI_AUTH, see :meth:`cli_env`)."""
        return ["--tls", "--cacert", self.ca_file, "--cert", self.client_cert_file, "--key", self.client_key_file,
                "--user", self.admin_user]

    def cli_env(self) -> dict[str, str]:
        return {**os.environ, "REDISCLI_AUTH": self.admin_password}


@dataclass
class Node:
    port: int
    proc: subprocess.Popen
    security: NodeSecurity | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **options: object) -> redis_sync.Redis:
        """A client of this node (as the admin user over TLS on a secured cluster)."""
        if self.security is not None:
            options = {**self.security.client_options(), **options}
        return redis_sync.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, under a temporary directory.
    ``server``: the redis-server binary to run (another version than the one on PATH);
    ``options``: more redis-server arguments for every node (``--cluster-allow-reads-when-down yes``)."""

    masters: int = 3
    replicas: int = 1
    security: NodeSecurity | None = None
    server: str | None = None
    options: tuple[str, ...] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lm-redis-cluster-")))
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed URL (any node) in learnmesh's cluster scheme (``rediss+cluster://`` over TLS)."""
        return f"{self._scheme()}+cluster://{self.nodes[0].address}/0"

    @property
    def seed_url(self) -> str:
        """The same seed as a plain ``redis://`` (``rediss://``) URL (redis-py's RedisCluster.from_url)."""
        return f"{self._scheme()}://{self.nodes[0].address}/0"

    def _scheme(self) -> str:
        return "redis" if self.security is None else "rediss"

    def start(self, timeout_s: float = 60.0, join: bool = True) -> LocalCluster:
        """Start every node, join them, and wait until every node reports ``cluster_state:ok``
        and every replica is in sync; stops what it started if that fails. ``join=False``: the
        nodes only, each alone and without slots, as before an operator's ``--cluster create``
        (:meth:`join` then)."""
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                self.nodes.append(self._spawn())
            for node in self.nodes:
                _wait(lambda n=node: _answers(n), timeout_s, f"redis-server on port {node.port}")
            if join:
                self.join(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def join(self, timeout_s: float = 60.0) -> None:
        """``redis-cli --cluster create`` over the started nodes; waits until the cluster is ok."""
        self._cli("--cluster", "create", *[n.address for n in self.nodes], "--cluster-replicas",
                  str(self.replicas), "--cluster-yes", timeout_s=timeout_s)
        self.wait_ok(timeout_s)

    def add_master(self, timeout_s: float = 60.0) -> Node:
        """Start one more node and join it as a master without slots (``redis-cli --cluster
        add-node``); :meth:`move_slot` gives it some. Clients learn of it only from the cluster."""
        node = self._spawn()
        self.nodes.append(node)
        _wait(lambda: _answers(node), timeout_s, f"redis-server on port {node.port}")
        self._cli("--cluster", "add-node", node.address, self.nodes[0].address, timeout_s=timeout_s)
        _wait(lambda: all(_knows(n, node) for n in self.running()), timeout_s, f"every node to know {node.address}")
        self.wait_ok(timeout_s)
        return node

    def move_slot(self, slot: int, target: Node, timeout_s: float = 30.0) -> None:
        """Move ``slot`` and its keys to the master ``target`` as a resharding does: IMPORTING on
        the target, MIGRATING on the source, MIGRATE of the keys, then SETSLOT NODE on every master."""
        with target.client(socket_timeout=timeout_s) as dst:
            owner = next(int(master[1]) for first, last, master, *_ in dst.execute_command("CLUSTER SLOTS")
                         if first <= slot <= last)
            source = next(n for n in self.nodes if n.port == owner)
            with source.client(socket_timeout=timeout_s) as src:
                src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
                dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
                src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
                auth = [] if self.security is None else ["AUTH2", self.security.admin_user,
                                                         self.security.admin_password]
                while names := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
                    src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, int(timeout_s * 1000),
                                        *auth, "KEYS", *names)
        for node in [target, source, *self.primaries()]:
            with node.client(socket_timeout=timeout_s) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok(timeout_s)

    def _cli(self, *args: str, timeout_s: float) -> None:
        binary = shutil.which("redis-cli") or "redis-cli"
        tls = self.security.cli_args() if self.security else []
        subprocess.run([binary, *tls, *args], check=True, stdout=subprocess.DEVNULL,  # noqa: S603
                       stderr=subprocess.PIPE, timeout=timeout_s,
                       env=self.security.cli_env() if self.security else None)

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

    def replica_of(self, master: Node) -> Node:
        """A running replica of ``master`` (what ``CLUSTER FAILOVER`` is sent to)."""
        for node in self.running():
            with node.client(socket_timeout=2) as c:
                info = c.info("replication")
            if info.get("role") == "slave" and int(info["master_port"]) == master.port:
                return node
        raise RuntimeError(f"no running replica of the master on port {master.port}")

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
        binary = self.server or shutil.which("redis-server") or "redis-server"
        ports = ["--port", str(port)] if self.security is None else ["-", *self.security.args(port)]
        # S603: redis-server from PATH (or the caller's), arguments built here, no shell.
        proc = subprocess.Popen([binary, *ports, "--bind", "127.0.0.1", "--dir", str(nodedir),  # noqa: S603
                                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                 "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no",
                                 "--maxmemory-policy", "noeviction", "--notify-keyspace-events", "",
                                 *self.options],
                                stdin=subprocess.PIPE if self.security else subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.security is not None and proc.stdin is not None:  # "-" above: the secrets come from stdin
            with proc.stdin:
                proc.stdin.write(self.security.config().encode())
        return Node(port, proc, self.security)


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


def _knows(node: Node, other: Node) -> bool:
    """Whether ``node`` lists ``other`` as a connected member of its cluster."""
    try:
        with node.client(socket_timeout=1, socket_connect_timeout=1) as c:
            members = c.execute_command("CLUSTER NODES")  # redis-py: {address: {"connected": ...}}
    except redis_sync.RedisError:
        return False
    return bool(members.get(other.address, {}).get("connected"))


def _wait(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
