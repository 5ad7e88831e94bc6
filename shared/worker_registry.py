"""Workers announce themselves in Redis; gateways read the announcements (worker discovery).

A worker renews its registration every ``worker.register_interval_ms``: one hash
(:func:`shared.keys.worker_registration`) with its advertised endpoint, capacity (its
largest batch), model id, model version and the time of the renewal, expiring after
``worker.registration_ttl_ms``; and its id in :data:`shared.keys.WORKERS_INDEX` scored by
that time. A worker that stops cleanly deletes its hash; one that dies stops renewing it and
Redis expires it. Readers take the index as the list of candidates and a hash as the proof
of life, so no clock but Redis's decides who is gone; index members whose hash is gone are
trimmed by whoever reads.

An announcement only names an address: with CurveZMQ on, a gateway completes a connection
only with a process holding the workers' secret key, so a forged announcement cannot draw
requests to someone else's process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import (
    AskError,
    ClusterError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.text import as_str

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]", "")  # noqa: S104 - names of wildcard binds, bound nowhere here
MAX_CAPACITY = 65_536
"""The largest capacity (batch) an announcement may claim: more is taken for a hostile value that
would draw every request to one endpoint."""
_WORKER_ID = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}$")


class RegistrationError(ValueError):
    """A worker's advertised endpoint cannot be announced (wildcard, malformed)."""


class DuplicateWorker(RuntimeError):
    """Another live process holds the announcement of this worker id."""

    def __init__(self, worker_id: str, endpoint: str) -> None:
        super().__init__(f"worker id {worker_id!r} is announced by another process at {endpoint or '?'}: "
                         "give each worker its own worker.id (this one is announced once that announcement "
                         "expires or is withdrawn)")
        self.endpoint = endpoint


@dataclass(frozen=True)
class Registration:
    """One worker's announcement."""

    worker_id: str
    endpoint: str
    capacity: int = 1
    model_id: str = ""
    version: int = 0
    heartbeat_ms: int = 0
    instance: str = ""  # the announcing process (random per start): tells two holders of one id apart

    def fields(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "capacity": str(self.capacity), "model_id": self.model_id,
                "version": str(self.version), "heartbeat_ms": str(self.heartbeat_ms), "instance": self.instance}

    @classmethod
    def from_fields(cls, worker_id: str, raw: dict[Any, Any]) -> Registration:
        """The registration a hash holds. Raises :class:`RegistrationError` saying what is wrong
        when it is incomplete, not text, or names no usable endpoint or capacity."""
        try:
            f = {as_str(k): as_str(v) for k, v in raw.items()}
        except UnicodeDecodeError:
            raise RegistrationError("a field is not UTF-8 text") from None
        endpoint = f.get("endpoint", "")
        if not announceable(endpoint):
            raise RegistrationError(f"endpoint {endpoint[:80]!r} is not tcp://<host>:<port> with a concrete host")
        try:
            capacity, version, heartbeat = (int(f.get(name) or default) for name, default in
                                            (("capacity", 1), ("version", 0), ("heartbeat_ms", 0)))
        except ValueError:
            raise RegistrationError("capacity, version and heartbeat_ms must be integers") from None
        if not 1 <= capacity <= MAX_CAPACITY:
            raise RegistrationError(f"capacity {capacity} is outside 1..{MAX_CAPACITY}")
        return cls(worker_id, endpoint, capacity, f.get("model_id", "")[:256], version, heartbeat,
                   f.get("instance", "")[:64])


def announceable(endpoint: str) -> bool:
    """A TCP endpoint another host can connect to: a concrete host and port, no wildcard."""
    m = _ENDPOINT.match(endpoint)
    return m is not None and m.group(1) not in WILDCARD_HOSTS and 0 < int(endpoint.rsplit(":", 1)[1]) < 65536


def is_loopback(host: str | None) -> bool:
    """``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host is None:
        return False
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_ip(toward: str) -> str:
    """The machine's address on the route to ``toward`` (a host name or address): the one a peer
    that reaches the same network can use. No packet is sent (a UDP socket only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 9))
            return str(s.getsockname()[0])
        except OSError as route:
            try:
                return socket.gethostbyname(socket.gethostname())
            except OSError as own:
                raise RegistrationError(
                    f"cannot tell the worker's address (no route toward {toward!r}: {route.strerror or route}; "
                    f"its own name {socket.gethostname()!r} does not resolve: {own.strerror or own}); "
                    "set worker.advertise to the address gateways reach it at") from None


def advertised_endpoint(bound: str, template: str, redis_host: str) -> str:
    """The endpoint to announce for a socket bound at ``bound`` (its actual address, port
    filled in): ``template`` with ``{host}``, ``{ip}`` and ``{port}`` filled in, or when it is
    empty, ``bound`` itself, with the worker's own address in place of a wildcard host."""
    parts = urlsplit(bound)
    if parts.scheme != "tcp" or parts.port is None:
        raise RegistrationError(f"worker endpoint {bound!r}: only tcp:// endpoints can be announced")
    if not template:
        template = "tcp://{ip}:{port}" if (parts.hostname or "") in WILDCARD_HOSTS else bound
    values = {"port": parts.port, "host": socket.gethostname()}
    if "{ip}" in template:
        values["ip"] = local_ip(redis_host)
    endpoint = template.format(**values)
    if not announceable(endpoint):
        raise RegistrationError(f"worker.advertise gives {endpoint!r}: announce a host and port other "
                                "workers' gateways can connect to (not a wildcard)")
    return endpoint


_REGISTER = """
local holder = redis.call('HGET', KEYS[1], 'instance')
local endpoint = redis.call('HGET', KEYS[1], 'endpoint')
if holder and holder ~= ARGV[1] and endpoint ~= ARGV[3] then
  return endpoint or ''
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return false
"""
_WITHDRAW = """
if redis.call('HGET', KEYS[1], 'instance') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def register(redis: Any, reg: Registration, ttl_ms: int) -> None:
    """Write or renew ``reg`` (synchronous redis-py client; two round trips). Raises
    :class:`DuplicateWorker` while another process (``reg.instance``) holds a live
    announcement of the same worker id at another endpoint: the first one keeps it until it
    expires or is withdrawn, so two workers given one id never take turns at it. A process at
    the same endpoint takes it over at once: it is that worker restarted (the port is its)."""
    key = keys.worker_registration(reg.worker_id)
    fields = [part for pair in reg.fields().items() for part in pair]
    holder = redis.register_script(_REGISTER)(keys=[key], args=[reg.instance, ttl_ms, reg.endpoint, *fields])
    if holder is not None:
        raise DuplicateWorker(reg.worker_id, as_str(holder))
    redis.zadd(keys.WORKERS_INDEX, {reg.worker_id: reg.heartbeat_ms})


def withdraw(redis: Any, worker_id: str, instance: str | None = None) -> None:
    """Remove a worker's announcement (it stops serving): gateways drop it at their next read.
    With ``instance``, only when that process holds it (not another one given the same id)."""
    key = keys.worker_registration(worker_id)
    if instance is None:
        redis.delete(key)
    elif not redis.register_script(_WITHDRAW)(keys=[key], args=[instance]):
        return
    redis.zrem(keys.WORKERS_INDEX, worker_id)


# A registration that cannot be read now (its cluster master down or failing over; MOVED and
# ASK are redirections redis-py gave up on meanwhile): it may well be there.
_UNREADABLE_NOW = (RedisConnectionError, RedisTimeoutError, ClusterError, TryAgainError, AskError,
                   RedisClusterException, OSError)


async def registered(redis: Any, skipped: Callable[[str, str], None] | None = None,
                     unreadable: Callable[[str], None] | None = None) -> list[Registration]:
    """Every live announcement (asyncio redis-py client; two round trips, a third to trim the
    index). An announcement that cannot be used (an id or field that is not text, a malformed
    endpoint or capacity: written by hand or by something other than a worker) is left out and
    passed to ``skipped(worker id, why)``. Index members whose registration is gone (expired,
    withdrawn) are dropped from the index, whatever their scores say: the clocks of the workers
    that wrote them decide nothing. Raises what redis-py raises when Redis is away: the caller
    keeps what it knew. On a cluster one master may be away while the others answer: a
    registration on it is passed to ``unreadable(worker id)`` (without it, the read raises), and
    the caller keeps what it knew of that worker alone."""
    members = await redis.zrange(keys.WORKERS_INDEX, 0, -1)
    ids: list[str] = []
    gone: list[Any] = []
    for member in members:
        try:
            worker_id = member.decode() if isinstance(member, bytes) else str(member)
        except UnicodeDecodeError:
            worker_id = ""
        if _WORKER_ID.match(worker_id):
            ids.append(worker_id)
        else:  # no worker announces such an id (shared.config.WorkerConfig.id)
            gone.append(member)
            if skipped is not None:
                skipped(repr(member)[:80], "not a worker id")
    found = []
    if ids:
        pipe = redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(keys.worker_registration(worker_id))
        try:
            raws = await pipe.execute(raise_on_error=False)
        except _UNREADABLE_NOW:
            if unreadable is None:
                raise
            # a cluster pipeline fails as a whole when one of its masters is away: each on its own
            raws = await asyncio.gather(*(redis.hgetall(keys.worker_registration(w)) for w in ids),
                                        return_exceptions=True)
        for worker_id, raw in zip(ids, raws, strict=True):
            if isinstance(raw, _UNREADABLE_NOW):
                if unreadable is None:
                    raise raw
                unreadable(worker_id)
                continue
            if not raw:
                gone.append(worker_id)
                continue
            try:
                if isinstance(raw, ResponseError):  # WRONGTYPE: its key holds something else than a hash
                    raise RegistrationError(f"its key cannot be read as a registration ({raw})")
                if isinstance(raw, Exception):  # anything else: the whole read fails
                    raise raw
                found.append(Registration.from_fields(worker_id, raw))
            except RegistrationError as exc:
                if skipped is not None:
                    skipped(worker_id, str(exc))
    if gone:  # a worker registering meanwhile is back in the index at its next renewal
        await redis.zrem(keys.WORKERS_INDEX, *gone)
    return found
