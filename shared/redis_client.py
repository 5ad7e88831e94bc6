"""Every Redis client a learnmesh process opens is made here, from ``redis.*`` config.

Redis holds the mesh's trust root (admin key hashes, the sample log every model learns
from), so whoever reaches it must authenticate: ``redis.url`` may carry
``redis://user:password@host`` (``rediss://`` for TLS), or ``redis.username`` with
``redis.password`` / ``redis.password_file``; ``redis.tls_*`` name the CA, client
certificate and key. One function turns them into redis-py arguments so the gateway,
workers, trainer and supervisor connect alike. Passwords never reach a log line:
:func:`redact_url` is what prints a URL.

Redis Cluster (``redis.cluster: true`` or a ``redis+cluster://`` / ``rediss+cluster://`` URL
naming any node): the same functions return redis-py's ``RedisCluster`` (blocking or asyncio)
with the same credentials and TLS; :func:`for_each_primary` runs something on every master
(loading the function library, listing keys), on a single server on that one server;
:class:`Reach` lets a listing over every master answer with what the masters that answer hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import redis as redis_sync
import redis.asyncio as aioredis
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import NodesManager as AsyncNodesManager
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import NodesManager as SyncNodesManager
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.config import DEFAULT_REDIS_URL, ConfigError, RedisConfig
from shared.secret_files import check_private, read_private_text


class RedisAccessError(ConfigError):
    """Redis refused this process's credentials or TLS identity: a setting to fix, not an outage
    to wait out, so processes stop at start with this message."""


SyncRedis = redis_sync.Redis | redis_sync.RedisCluster
AsyncRedis = aioredis.Redis | aioredis.RedisCluster
T = TypeVar("T")
N = TypeVar("N")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def url_of(cfg: RedisConfig) -> str:
    """The configured URL as written (``+cluster`` scheme included)."""
    return cfg.url or DEFAULT_REDIS_URL


def is_cluster(cfg: RedisConfig) -> bool:
    """Whether ``cfg`` names a Redis Cluster (``redis.cluster`` or a ``+cluster`` URL scheme)."""
    return cfg.cluster or urlsplit(url_of(cfg)).scheme in _CLUSTER_SCHEMES


def server_url(cfg: RedisConfig) -> str:
    """The URL redis-py is given: ``redis://`` / ``rediss://`` (a cluster's seed node)."""
    url = url_of(cfg)
    scheme = urlsplit(url).scheme
    if scheme in _CLUSTER_SCHEMES:
        return _CLUSTER_SCHEMES[scheme] + url[len(scheme):]
    return url


def client_kwargs(cfg: RedisConfig) -> dict[str, Any]:
    """redis-py keyword arguments for the credentials and TLS settings the URL does not carry
    (the URL's own user and password win where it has them)."""
    kwargs: dict[str, Any] = {}
    if cfg.username:
        kwargs["username"] = cfg.username
    if cfg.password_file:
        kwargs["password"] = read_private_text(cfg.password_file, "redis.password_file")
    elif cfg.password:
        kwargs["password"] = cfg.password
    if server_url(cfg).startswith("rediss://"):
        kwargs["ssl_cert_reqs"], kwargs["ssl_check_hostname"] = "required", True  # older redis-py: off
        if cfg.tls_ca_file:
            kwargs["ssl_ca_certs"] = cfg.tls_ca_file
        if cfg.tls_cert_file and cfg.tls_key_file:
            check_private(cfg.tls_key_file, "redis.tls_key_file")
            kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = cfg.tls_cert_file, cfg.tls_key_file
    return kwargs


def _seeds(cfg: RedisConfig, node: Callable[[str, int], N]) -> list[N]:
    """``redis.cluster_nodes`` as redis-py cluster nodes, beside the url's node: a process
    starting while that one node is down (a failed-over master) reaches the cluster through them."""
    return [node(host, int(port)) for host, _, port in (n.rpartition(":") for n in cfg.cluster_nodes)]


class ClusterUnreachable(RedisClusterException, RedisConnectionError):
    """No node of a cluster answered while its slot map was read (the whole cluster stopped, a
    network cut), or the nodes that answered leave slots without a master (nodes started but not
    joined yet, a master lost with its replicas): redis-py's ``RedisClusterException`` for it, made
    a ``ConnectionError`` as well, so that whatever waits out a lost connection waits this out too."""


_NOT_COVERED = "All slots are not covered"  # how redis-py's map reading says the nodes left slots out


def _unreachable(exc: RedisClusterException) -> ClusterUnreachable | None:
    """``exc`` as :class:`ClusterUnreachable` when it is one of the outages above, else None."""
    if isinstance(exc, ClusterUnreachable):
        return None
    if isinstance(exc.__cause__, (RedisConnectionError, OSError)) or str(exc).startswith(_NOT_COVERED):
        return ClusterUnreachable(str(exc))
    return None


class _SyncNodes(SyncNodesManager):
    """A blocking cluster client's slot map, reporting :class:`ClusterUnreachable`."""

    __slots__ = ()

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise (_unreachable(exc) or exc) from exc.__cause__


class _AsyncNodes(AsyncNodesManager):
    """An asyncio cluster client's slot map, reporting :class:`ClusterUnreachable`."""

    __slots__ = ()

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise (_unreachable(exc) or exc) from exc.__cause__


class _AsyncCommands(AsyncCommandsParser):
    """An asyncio cluster client's command table, read once. redis-py reads it again at every
    re-initialisation of the slot map (after any lost connection), from the default node: the
    first master of the client's map, which may be the master that is down. That read failing
    fails the re-initialisation, and then every command of the client, the live masters' slots
    too, until that one master is back (a gateway unready, principals on live masters refused)."""

    async def initialize(self, node: Any = None) -> None:
        if node is not None:
            self.node = node
        if getattr(self, "commands", None):  # the table of the servers this client talks to
            return
        await super().initialize(node)


class _AsyncCluster(aioredis.RedisCluster):
    """A closed cluster client stays closed. redis-py's reads the slot map again for a command
    sent after ``aclose()`` and opens connections to the nodes, which nothing closes then: a
    task that still runs as its process stops would leave them to the garbage collector."""

    _closed = False

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RedisConnectionError("this Redis Cluster client is closed")
        return await super().initialize(*args, **kwargs)

    async def aclose(self) -> None:
        self._closed = True
        await super().aclose()


def sync_client(cfg: RedisConfig, **options: Any) -> SyncRedis:
    """A blocking client (trainer, workers, supervisor); ``options``: timeouts, pool size, ...
    A cluster client reaches the seed node as it is made (redis-py reads the slot map then)."""
    if is_cluster(cfg):
        try:
            cluster = redis_sync.RedisCluster.from_url(server_url(cfg), startup_nodes=_seeds(cfg, SyncClusterNode),
                                                       **client_kwargs(cfg), **options)
        except RedisClusterException as exc:
            raise (_unreachable(exc) or exc) from exc.__cause__
        cluster.nodes_manager.__class__ = _SyncNodes
        return cluster
    return redis_sync.Redis.from_url(server_url(cfg), **client_kwargs(cfg), **options)


def async_client(cfg: RedisConfig, **options: Any) -> AsyncRedis:
    """An asyncio client (gateway, the trainer's context reader)."""
    if is_cluster(cfg):
        # reinitialize_steps 0: a MOVED (a resharding: redis-cli --cluster reshard / rebalance) moves
        # that slot in the client's map. redis-py's default answers every fifth MOVED by closing the
        # client, every connection to every node with the commands on them, the context store's
        # pipeline batches to masters whose slots never moved too (503s with no master down).
        options = {"reinitialize_steps": 0, **options}
        cluster = aioredis.RedisCluster.from_url(server_url(cfg), startup_nodes=_seeds(cfg, AsyncClusterNode),
                                                 **client_kwargs(cfg), **options)
        # RedisCluster picks its connection class itself; the nodes it makes later copy these
        # kwargs, the seed nodes it made already are told directly.
        kinds = cluster.nodes_manager.connection_kwargs
        kinds["connection_class"] = _reporting(kinds.get("connection_class", aioredis.Connection))
        for node in cluster.nodes_manager.startup_nodes.values():
            node.connection_class = _reporting(node.connection_class)
        cluster.nodes_manager.__class__ = _AsyncNodes
        cluster.commands_parser.__class__ = _AsyncCommands
        cluster.__class__ = _AsyncCluster
        return cluster
    client = aioredis.Redis.from_url(server_url(cfg), **client_kwargs(cfg), **options)
    client.connection_pool.connection_class = _reporting(client.connection_pool.connection_class)
    return client


class _ClosedTransportIsConnectionError:
    """Two ways a write on a lost connection escapes redis-py as something other than its
    ``ConnectionError`` (retried, and answered 503 where it is not), given that path here:

    - uvloop's transport raises ``RuntimeError`` for a write once the peer closed the socket
      (a Redis node restarting, a connection killed), where asyncio's raises ``OSError``;
    - a connection disconnected by another task while this one writes (a cluster client
      drops every connection of a node it finds failing, also one still in its handshake):
      redis-py checks the connection, then writes on a later loop turn through a stream
      writer that is gone by then, an ``AttributeError``."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as exc:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise RedisConnectionError(f"redis closed the connection: {exc}") from None
        except AttributeError:
            if getattr(self, "_writer", None) is not None:
                raise
            raise RedisConnectionError("redis connection closed by another task while writing") from None


_REPORTING: dict[type, type] = {}


def _reporting(cls: type) -> type:
    """``cls`` (a redis-py asyncio connection class) with closed transports reported as
    connection errors (one subclass per class, made once)."""
    if issubclass(cls, _ClosedTransportIsConnectionError):
        return cls
    if cls not in _REPORTING:
        _REPORTING[cls] = type(cls.__name__, (_ClosedTransportIsConnectionError, cls), {})
    return _REPORTING[cls]


def node_client(client: aioredis.RedisCluster, node: Any) -> aioredis.Redis:
    """A plain asyncio client of one node of ``client``'s cluster (its own pool, closed by the
    caller): same credentials, TLS and timeouts as the cluster client's connections."""
    pool = aioredis.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
    return aioredis.Redis.from_pool(pool)


async def for_each_primary(client: AsyncRedis, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> list[T]:
    """``fn`` run with a client of every master, in turn (one server: just that one). The
    cluster's slot map is read first if the client has not read it yet."""
    if not isinstance(client, aioredis.RedisCluster):
        return [await fn(client)]
    await client.initialize()
    out: list[T] = []
    for node in client.get_primaries():
        node_redis = node_client(client, node)
        try:
            out.append(await fn(node_redis))
        finally:
            await node_redis.aclose()
    return out


# What a master that is down looks like to a reader: refused or silent (within the client's
# socket timeouts), a cluster that stopped serving, a slot whose master the map lost.
MASTER_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError, RedisClusterException, OSError)


@dataclass
class Reach:
    """What a listing over every master could read: the masters that did not answer (down, in
    a failover) and the slots they serve. A listing answers with what the other masters hold
    and says it is partial; when no master answered, :meth:`check` raises what the first
    failure raised (the one error map answers 503). On one server nothing is partial: a
    failure is raised where it happens."""

    client: AsyncRedis
    unreachable: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # node address -> slot ranges
    answered: int = 0
    _first: BaseException | None = None

    @property
    def partial(self) -> bool:
        return bool(self.unreachable)

    def as_json(self) -> dict[str, Any]:
        """``partial`` and ``unreachable`` (each master that did not answer and its slot ranges),
        as every listing over the masters carries them."""
        return {"partial": self.partial,
                "unreachable": [{"node": node, "slots": [list(r) for r in ranges]}
                                for node, ranges in sorted(self.unreachable.items())]}

    async def read(self, key: str, fn: Callable[[], Awaitable[T]], default: T) -> T:
        """``fn()`` (a read of ``key``), or ``default`` when the master of ``key``'s slot is down:
        found so by this read, or by an earlier one of the listing (not asked again: a master that
        is silent rather than refusing costs the listing one socket timeout, not one per key)."""
        node = _node_of_key(self.client, key)  # before the client's map drops a node it found down
        if node is not None and node in self.unreachable:
            return default
        try:
            try:
                got = await self._bounded(fn())
            except MASTER_DOWN as exc:
                # Once more unless it timed out: a command the cluster refuses while down makes
                # redis-py close every connection, and a read of a master that answers, in flight
                # on one of them then, fails without a word from that master.
                if isinstance(exc, (RedisTimeoutError, TimeoutError)) or not isinstance(self.client, aioredis.RedisCluster):
                    raise
                got = await self._bounded(fn())
        except MASTER_DOWN as exc:
            self._lost(exc, node or _node_of_key(self.client, key))
            return default
        self.answered += 1
        return got

    async def _bounded(self, call: Awaitable[T]) -> T:
        """``call`` within two socket timeouts on a cluster: redis-py retries a command that timed
        out, re-reading the slot map between tries, so a silent master would cost a listing
        several timeouts per read; the second leaves a read of a master that answers time for
        the retry it may need after redis-py closed its connection. ``asyncio.timeout`` raises
        TimeoutError, an OSError."""
        limit = socket_timeout_s(self.client)
        if limit is None:
            return await call
        async with asyncio.timeout(2 * limit):
            return await call

    async def each_primary(self, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> list[T]:
        """:func:`for_each_primary`, every master at once, with the answers of those that answered."""
        if not isinstance(self.client, aioredis.RedisCluster):
            out = [await fn(self.client)]
            self.answered += 1
            return out
        with contextlib.suppress(*MASTER_DOWN):
            # The map could not be read again now (a node asked timed out): the masters of the map
            # held are asked below all the same, and one that is down is reported as missed.
            await self.client.initialize()

        async def one(node: Any) -> tuple[bool, Any]:
            node_redis = node_client(self.client, node)  # type: ignore[arg-type]
            try:
                return True, await fn(node_redis)
            except MASTER_DOWN as exc:
                self._lost(exc, node.name)
                return False, None
            finally:
                await node_redis.aclose()

        got = await asyncio.gather(*[one(node) for node in self.client.get_primaries()])
        self.answered += sum(ok for ok, _ in got)
        return [value for ok, value in got if ok]

    def check(self) -> None:
        """Raise the first failure when nothing answered (no master to list from)."""
        if self._first is not None and not self.answered:
            raise self._first

    def require_all(self) -> None:
        """Raise the first failure when any master did not answer (an answer that needs them all)."""
        if self._first is not None:
            raise self._first

    def lost(self, exc: BaseException, key: str) -> None:
        """A command on ``key`` outside this listing's reads found its master down: that master
        is reported as missed with the others (raised on one server, as everywhere there)."""
        self._lost(exc, _node_of_key(self.client, key))

    def _lost(self, exc: BaseException, node: str | None) -> None:
        if not isinstance(self.client, aioredis.RedisCluster):
            raise exc
        self._first = self._first or exc
        name = node or "unknown"
        if name not in self.unreachable:
            self.unreachable[name] = _slot_ranges(self.client, name)


async def read_within(reach: Reach | None, key: str, fn: Callable[[], Awaitable[T]], default: T) -> T:
    """``fn()``, through ``reach`` where a listing gives one (:meth:`Reach.read`)."""
    return await fn() if reach is None else await reach.read(key, fn, default)


def socket_timeout_s(client: AsyncRedis) -> float | None:
    """A cluster client's socket timeout (None on one server, or where it has none)."""
    if not isinstance(client, aioredis.RedisCluster):
        return None
    limit = client.nodes_manager.connection_kwargs.get("socket_timeout")
    return float(limit) if limit else None


def _node_of_key(client: AsyncRedis, key: str) -> str | None:
    if not isinstance(client, aioredis.RedisCluster):
        return None
    nodes = client.nodes_manager.slots_cache.get(client.keyslot(key)) or []
    return nodes[0].name if nodes else None


def _slot_ranges(client: aioredis.RedisCluster, node: str) -> list[tuple[int, int]]:
    """The slot ranges ``node`` serves as master in ``client``'s slot map."""
    slots = sorted(s for s, nodes in client.nodes_manager.slots_cache.items() if nodes and nodes[0].name == node)
    ranges: list[tuple[int, int]] = []
    for s in slots:
        if ranges and ranges[-1][1] == s - 1:
            ranges[-1] = (ranges[-1][0], s)
        else:
            ranges.append((s, s))
    return ranges


def close_sync(client: SyncRedis) -> None:
    """Close a blocking client and every connection it opened: redis-py's cluster client
    leaves its nodes' connection pools open on ``close()``."""
    client.close()
    if isinstance(client, redis_sync.RedisCluster):
        for node in [*client.get_nodes(), *client.nodes_manager.startup_nodes.values()]:
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()


def for_each_primary_sync(client: SyncRedis, fn: Callable[[redis_sync.Redis], T]) -> list[T]:
    """:func:`for_each_primary` for a blocking client (redis-py keeps one client per node)."""
    if not isinstance(client, redis_sync.RedisCluster):
        return [fn(client)]
    return [fn(client.get_redis_connection(node)) for node in client.get_primaries()]


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (the user name stays: it is not secret),
    in the user info and in the query (redis-py takes ``?password=`` too)."""
    parts = urlsplit(url)
    query = parts.query
    fields = parse_qsl(query, keep_blank_values=True)
    if any("password" in name.lower() for name, _ in fields):
        query = "&".join(f"{name}={'***' if 'password' in name.lower() else value}" for name, value in fields)
    if parts.password is None:
        return urlunsplit(parts._replace(query=query))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def without_password(url: str) -> tuple[str, str | None]:
    """(``url`` without its password, the password or None)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    user = f"{parts.username}@" if parts.username else ""
    netloc = user + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc)), parts.password


def access_problem(exc: BaseException, has_password: bool) -> str | None:
    """What is wrong when ``exc`` means Redis refused who we are (credentials, ACL, TLS
    identity) rather than being away; None for an outage. The refusal may sit in ``exc``'s
    causes: a cluster client wraps what its seed nodes answered in a ``RedisClusterException``."""
    cause: BaseException | None = exc
    while cause is not None:
        problem = _refusal(cause, has_password)
        if problem is not None:
            return problem
        cause = cause.__cause__ or cause.__context__
    return None


def _refusal(exc: BaseException, has_password: bool) -> str | None:
    if isinstance(exc, AuthenticationError):
        return "wrong user name or password" if has_password else "it requires a password and none is configured"
    if isinstance(exc, NoPermissionError):
        return f"the ACL user lacks a permission learnmesh needs ({exc})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its TLS certificate did not verify ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"the TLS handshake failed ({exc.reason or exc})"
    return None


def check_access(cfg: RedisConfig, timeout_s: float = 5.0) -> bool:
    """Connect once at start: raise :class:`RedisAccessError` naming the settings to fix when
    Redis refuses our credentials or TLS identity; False when it cannot be reached (processes
    start anyway and wait for it), True when it answers."""
    has_password = bool(client_kwargs(cfg).get("password") or urlsplit(server_url(cfg)).password)
    try:
        client = sync_client(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    except (RedisError, RedisClusterException, OSError) as exc:  # a cluster client connects as it is made
        answered = _refused(cfg, exc, has_password)
        if _is_single_server(cfg, timeout_s):
            raise ConfigError(f"Redis at {redact_url(url_of(cfg))} is a single server, not a node of a Redis "
                              "Cluster: drop redis.cluster or the +cluster URL scheme (LEARNMESH_REDIS__CLUSTER, "
                              "REDIS_URL)") from None
        return answered
    try:
        answered = bool(for_each_primary_sync(client, lambda node: node.ping()))
        if not is_cluster(cfg) and _is_cluster_node(client):
            raise ConfigError(f"Redis at {redact_url(url_of(cfg))} is a node of a Redis Cluster: set "
                              "redis.cluster: true or a redis+cluster:// URL (LEARNMESH_REDIS__CLUSTER, REDIS_URL)")
        return answered
    except (RedisError, RedisClusterException, OSError) as exc:
        return _refused(cfg, exc, has_password)
    finally:
        close_sync(client)


def cluster_addresses(cfg: RedisConfig, timeout_s: float = 5.0) -> list[str]:
    """Every node of the cluster ``cfg`` names, masters and replicas, as ``host:port`` (its slot
    map as read now); empty when no node answers."""
    try:
        client = sync_client(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    except (RedisError, RedisClusterException, OSError):
        return []
    try:
        nodes = client.get_nodes() if isinstance(client, redis_sync.RedisCluster) else []
        return sorted({f"{node.host}:{node.port}" for node in nodes})
    finally:
        close_sync(client)


def _is_single_server(cfg: RedisConfig, timeout_s: float) -> bool:
    """Whether the node ``redis.url`` names answers as a server without cluster mode (a cluster
    client made for it fails as if the cluster were away)."""
    try:
        with redis_sync.Redis.from_url(server_url(cfg), socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                       **client_kwargs(cfg)) as node:
            return int(node.info("cluster").get("cluster_enabled", 1)) == 0
    except (RedisError, OSError):
        return False


def _is_cluster_node(client: SyncRedis) -> bool:
    """Whether a server reached as a single one belongs to a cluster: its first command on a slot
    of another node would fail with MOVED. A server that refuses to say counts as a single one."""
    try:
        client.execute_command("CLUSTER", "SLOTS")
    except (RedisError, OSError):
        return False
    return True


def _refused(cfg: RedisConfig, exc: BaseException, has_password: bool) -> bool:
    """False for an outage; raises RedisAccessError where Redis refused who we are."""
    problem = access_problem(exc, has_password)
    if problem is None:
        return False
    if problem.startswith("its TLS certificate") and not cfg.tls_ca_file:
        problem += " and no redis.tls_ca_file is set (the system's CAs were tried)"
    raise RedisAccessError(
        f"Redis at {redact_url(url_of(cfg))} refused this process: {problem}; check redis.url, "
        "redis.username, redis.password / redis.password_file and redis.tls_* (REDIS_URL, "
        "LEARNMESH_REDIS__*)") from None


class ReplicasBehind(TryAgainError):
    """A write reached its master but fewer replicas than ``redis.wait_replicas`` confirmed it
    within ``redis.wait_timeout_ms``: not acknowledged (the client retries; the write may stay)."""


def check_replicas(cfg: RedisConfig, acked: int) -> None:
    """Raise :class:`ReplicasBehind` when WAIT's reply ``acked`` is short of ``redis.wait_replicas``."""
    if acked < cfg.wait_replicas:
        raise ReplicasBehind(f"{acked} of {cfg.wait_replicas} replica(s) confirmed the write "
                             f"within {cfg.wait_timeout_ms} ms")
