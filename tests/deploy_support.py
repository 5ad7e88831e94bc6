"""What the compose and Kubernetes checks share: Redis's memory units and the headroom Redis
needs above learnmesh's context budget."""

from __future__ import annotations

import re

_UNITS = {None: 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def redis_bytes(size: str) -> int:
    """A redis.conf memory size in bytes (1k = 1000, 1kb = 1024; m/mb, g/gb alike)."""
    m = re.fullmatch(r"(\d+)(k|kb|m|mb|g|gb)?", size.lower())
    if m is None:
        raise ValueError(f"not a redis.conf memory size: {size!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def headroom_bytes(global_budget_bytes: int) -> int:
    """The least maxmemory that lets learnmesh's own eviction act before Redis refuses writes:
    the budget, a quarter more, and 512 MiB for sessions, the sample log, audit and the AOF
    rewrite buffer."""
    return global_budget_bytes * 5 // 4 + 512 * 1024**2
