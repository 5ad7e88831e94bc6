"""Workers announce themselves in Redis; gateways read the announcements (worker discovery).

A worker renews its registration every ``worker.register_interval_ms``: one hash
(:func:`shared.keys.worker_registration`) with its advertised endpoint, capacity (its
largest batch), model id, model version and the time of the renewal, expiring after
``worker.registration_ttl_ms``; and its id in :data:`shared.keys.WORKERS_INDEX` scored by
that time. A worker that stops cleanly deletes its hash; one that dies stops renewing it and
Redis expires it. Readers take the index as the list of candidates and a hash as the proof
of life, so no clock but Redis's decides who is gone; index members whose hash is long gone
are trimmed by whoever reads.

An announcement only names an address: with CurveZMQ on, a gateway completes a connection
only with a process holding the workers' secret key, so a forged announcement cannot draw
requests to someone else's process.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from shared import keys
from shared.text import as_str

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]", "")  # noqa: S104 - names of wildcard binds, bound nowhere here
INDEX_TRIM_AFTER_MS = 600_000
"""Index members not renewed for this long (the worker's clock) are dropped from the index."""
_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}$")


class RegistrationError(ValueError):
    """A worker's advertised endpoint cannot be announced (wildcard, malformed)."""


@dataclass(frozen=True)
class Registration:
    """One worker's announcement."""

    worker_id: str
    endpoint: str
    capacity: int = 1
    model_id: str = ""
    version: int = 0
    heartbeat_ms: int = 0

    def fields(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "capacity": str(self.capacity), "model_id": self.model_id,
                "version": str(self.version), "heartbeat_ms": str(self.heartbeat_ms)}

    @classmethod
    def from_fields(cls, worker_id: str, raw: dict[Any, Any]) -> Registration | None:
        """The registration a hash holds, or None when it is incomplete or names no usable endpoint."""
        f = {as_str(k): as_str(v) for k, v in raw.items()}
        endpoint = f.get("endpoint", "")
        if not announceable(endpoint):
            return None
        try:
            return cls(worker_id, endpoint, max(1, int(f.get("capacity") or 1)), f.get("model_id", ""),
                       int(f.get("version") or 0), int(f.get("heartbeat_ms") or 0))
        except ValueError:
            return None


def announceable(endpoint: str) -> bool:
    """A TCP endpoint another host can connect to: a concrete host and port, no wildcard."""
    m = _ENDPOINT.match(endpoint)
    return m is not None and m.group(1) not in WILDCARD_HOSTS and 0 < int(endpoint.rsplit(":", 1)[1]) < 65536


def local_ip(toward: str) -> str:
    """This host's address on the route to ``toward`` (a host name or address): the one a peer
    that reaches the same network can use. No packet is sent (a UDP socket only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 9))
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


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


def register(redis: Any, reg: Registration, ttl_ms: int) -> None:
    """Write or renew ``reg`` (synchronous redis-py client; two keys, one round trip)."""
    key = keys.worker_registration(reg.worker_id)
    pipe = redis.pipeline(transaction=False)
    pipe.hset(key, mapping=reg.fields())
    pipe.pexpire(key, ttl_ms)
    pipe.zadd(keys.WORKERS_INDEX, {reg.worker_id: reg.heartbeat_ms})
    pipe.execute()


def withdraw(redis: Any, worker_id: str) -> None:
    """Remove a worker's announcement (it stops serving): gateways drop it at their next read."""
    pipe = redis.pipeline(transaction=False)
    pipe.delete(keys.worker_registration(worker_id))
    pipe.zrem(keys.WORKERS_INDEX, worker_id)
    pipe.execute()


async def registered(redis: Any, now_ms: int | None = None) -> list[Registration]:
    """Every live announcement (asyncio redis-py client; two round trips). Raises what redis-py
    raises when Redis is away: the caller keeps what it knew."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    ids = [as_str(m) for m in await redis.zrange(keys.WORKERS_INDEX, 0, -1)]
    if not ids:
        return []
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(keys.worker_registration(worker_id))
    found = []
    for worker_id, raw in zip(ids, await pipe.execute(), strict=True):
        reg = Registration.from_fields(worker_id, raw) if raw else None
        if reg is not None:
            found.append(reg)
    if len(found) < len(ids):
        await redis.zremrangebyscore(keys.WORKERS_INDEX, "-inf", f"({now_ms - INDEX_TRIM_AFTER_MS}")
    return found
