"""Test fixtures shared by every test module.

Tests run against a real Redis server: a private ``redis-server`` started for the test
session on a free port (so parallel runs never share state: ``make test`` runs two test
processes, each with its own), or — when no binary is on PATH — the one answering on
127.0.0.1:6379 (database 15), which only one test process may use. Each test gets a flushed
database. ``wait_for`` replaces sleeps: poll a condition until it holds or time runs out
(tests/waiting.py, re-exported here).

Redis Cluster: a test that takes the ``redis_target`` fixture runs twice, ``[single]`` against
the private server and ``[cluster]`` against a real cluster of 3 masters + 3 replicas started
once per session from redis-server (``shared.redis_local_cluster``; or the cluster at
``LEARNMESH_TEST_REDIS_CLUSTER_URL``, any node, which is FLUSHED). ``redis_target`` is a
:class:`RedisTarget`: ``.config`` (a ``RedisConfig`` for anything built from config),
``.url``, ``.async_client()`` / ``.sync_client()`` (shared.redis_client's, so ``RedisCluster``
in cluster mode), ``.flush()`` (every master), ``.cluster`` (the ``LocalCluster``, to kill or
reshard nodes; None for single or an external cluster). Every master is flushed before each
test. ``LEARNMESH_TEST_REDIS_MODES=single`` (or ``cluster``) runs one side only. ``redis_url``
stays the single-server fixture for files that have not opted in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis as redis_sync

from shared.config import RedisConfig
from shared.net import free_port, share_ports
from shared.redis_client import (
    AsyncRedis,
    SyncRedis,
    async_client,
    close_sync,
    for_each_primary_sync,
    sync_client,
)
from shared.redis_local_cluster import LocalCluster
from tests.waiting import wait_for as wait_for
from tests.waiting import wait_for_sync as wait_for_sync


def pytest_configure(config: pytest.Config) -> None:
    """Several test processes (pytest-xdist ``-n``) each start their own Redis; a shared one, which
    every test flushes, would have them empty each other's data mid-test. Each picks its ports from
    a slice of its own, and the processes it starts (gateways, embedded Redis, torch ranks) pick
    from another of its own: a port one picked and has not bound yet is never another's pick."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    index, runners = (int(worker[2:]), int(count)) if worker.startswith("gw") and worker[2:].isdigit() \
        and count.isdigit() else (0, 1)
    share_ports(2 * index, 2 * runners, children=2 * index + 1)
    jobs = getattr(config.option, "numprocesses", None)
    if not jobs or jobs == 1:
        return
    shared = [name for name in ("LEARNMESH_TEST_REDIS_URL", "LEARNMESH_TEST_REDIS_CLUSTER_URL") if os.environ.get(name)]
    if shutil.which("redis-server") is None:
        shared.append("no redis-server on PATH (127.0.0.1:6379 is used)")
    if shared:
        raise pytest.UsageError(f"tests flush a shared Redis ({', '.join(shared)}): run them in one process "
                                "(make test TEST_JOBS=1, or pytest without -n)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    binary = shutil.which("redis-server")
    if binary is None or os.environ.get("LEARNMESH_TEST_REDIS_URL"):
        yield os.environ.get("LEARNMESH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
        return
    with private_redis(binary) as url:
        yield url


@contextlib.contextmanager
def private_redis(binary: str) -> Iterator[str]:
    """A redis-server of the caller alone, on a free port, without persistence: its URL."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="lm-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--maxmemory-policy", "noeviction",
                             "--notify-keyspace-events", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis_sync.Redis.from_url(url) as client:
            wait_for_sync(lambda: _ping(client), timeout_s=10, what="redis-server to answer")
        yield url
    finally:  # also when it never answered: no server left running, no process left unreaped
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _ping(client: redis_sync.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis_sync.ConnectionError:
        return False


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A flushed database on the session's Redis server."""
    client = redis_sync.Redis.from_url(redis_server)
    client.flushdb()
    client.close()
    yield redis_server


@dataclass
class RedisTarget:
    """One Redis a test runs against: a single server or a cluster (see the module docstring)."""

    kind: str  # "single" | "cluster"
    url: str  # learnmesh's form: redis+cluster://... for a cluster
    cluster: LocalCluster | None = None

    @property
    def config(self) -> RedisConfig:
        return RedisConfig(url=self.url)

    @property
    def is_cluster(self) -> bool:
        return self.kind == "cluster"

    def async_client(self, **options: Any) -> AsyncRedis:
        return async_client(self.config, **options)

    def sync_client(self, **options: Any) -> SyncRedis:
        """Close it with shared.redis_client.close_sync (a cluster client's ``close()`` leaves
        its nodes' connections open)."""
        return sync_client(self.config, **options)

    @contextlib.contextmanager
    def flushed(self) -> Iterator[SyncRedis]:
        """Every master emptied, and a sync client to read what a test wrote (closed after)."""
        self.flush()
        client = self.sync_client()
        try:
            yield client
        finally:
            close_sync(client)

    def flush(self) -> None:
        """Empty every master (replicas follow)."""
        client = self.sync_client()
        try:
            for_each_primary_sync(client, lambda node: node.flushall())
        finally:
            close_sync(client)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisTarget]:
    """A real Redis Cluster for this test session (3 masters + 3 replicas), started only when
    a test asks for it."""
    external = os.environ.get("LEARNMESH_TEST_REDIS_CLUSTER_URL")
    if external:
        yield RedisTarget("cluster", external if "+cluster://" in external else
                          external.replace("://", "+cluster://", 1))
        return
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("no redis-server/redis-cli to start a Redis Cluster")
    cluster = LocalCluster(masters=3, replicas=1).start()
    try:
        yield RedisTarget("cluster", cluster.url, cluster)
    finally:
        cluster.stop()


def redis_modes() -> list[str]:
    """The Redis kinds two-mode tests run on (``LEARNMESH_TEST_REDIS_MODES``): for a test that
    parametrizes ``redis_target`` itself (indirectly) to pair kinds with its own cases."""
    wanted = os.environ.get("LEARNMESH_TEST_REDIS_MODES", "single,cluster")
    return [m for m in ("single", "cluster") if m in wanted.split(",")]


def _flushed_target(request: pytest.FixtureRequest) -> RedisTarget:
    """The Redis of ``request.param`` (``single`` or ``cluster``), every master flushed."""
    if request.param == "single":
        target = RedisTarget("single", request.getfixturevalue("redis_server"))
    else:
        target = request.getfixturevalue("redis_cluster")
    target.flush()
    return target


@pytest.fixture(params=redis_modes())
def redis_target(request: pytest.FixtureRequest) -> Iterator[RedisTarget]:
    """The test runs once per Redis kind (single server, cluster), each flushed first."""
    yield _flushed_target(request)


@pytest.fixture(scope="module", params=redis_modes())
def redis_target_module(request: pytest.FixtureRequest) -> Iterator[RedisTarget]:
    """``redis_target`` for a module that starts long-lived processes (gateway replicas) once per
    Redis kind: flushed when the module's run on that kind begins; flush it per test yourself."""
    yield _flushed_target(request)
