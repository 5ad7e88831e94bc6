"""Rates and latency quantiles of this gateway replica, for the dashboard, and the mesh-wide
gauges its /metrics serves.

Prometheus counters are cumulative; the dashboard wants "requests per second now"
and "p99 over the last few seconds". A background task (:func:`run_stats_publisher`)
samples this process's registry once per interval, keeps a short ring of samples and
derives windowed rates and histogram quantiles from differences, then publishes the
snapshot to Redis (``keys.GATEWAY_STATS``) so any replica's /admin/summary shows all
replicas. The same task refreshes the per-worker version and lag gauges and the
context store's byte count, and republishes the proxy's breaker states
(gateway/proxy/health.py), whose TTL it keeps alive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from redis.exceptions import RedisError

from gateway.admin.workers import mesh_workers
from shared import control, keys, metrics
from shared.aio import pause

if TYPE_CHECKING:  # gateway.state names LocalStats as the type of one of its fields
    from gateway.state import Gateway

log = logging.getLogger(__name__)

WINDOW_S = 5.0


@dataclass
class _Sample:
    t: float
    requests: float
    errors: float
    buckets: list[tuple[float, float]]  # (le, cumulative count) summed over labels


def _counter_total(counter: Counter) -> float:
    total = 0.0
    for fam in counter.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                total += s.value
    return total


def _hist_buckets(hist: Histogram) -> list[tuple[float, float]]:
    by_le: dict[float, float] = {}
    for fam in hist.collect():
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + s.value
    return sorted(by_le.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Histogram quantile with linear interpolation inside the bucket (as PromQL does)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


class LocalStats:
    """A short ring of samples of this process's MCP counters and latency histogram."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.ring: deque[_Sample] = deque(maxlen=120)

    def tick(self) -> None:
        self.ring.append(_Sample(time.monotonic(), _counter_total(metrics.MCP_REQUESTS),
                                 _counter_total(metrics.MCP_ERRORS), _hist_buckets(metrics.MCP_LATENCY)))

    def snapshot(self) -> dict[str, float | None]:
        if not self.ring:
            self.tick()
        new = self.ring[-1]
        old = next((s for s in self.ring if new.t - s.t <= self.window_s), new)
        dt = new.t - old.t
        rps = (new.requests - old.requests) / dt if dt > 0 else 0.0
        eps = (new.errors - old.errors) / dt if dt > 0 else 0.0
        old_b = dict(old.buckets) if old is not new else {}
        window = [(le, c - old_b.get(le, 0.0)) for le, c in new.buckets]
        p50, p99 = quantile(window, 0.5), quantile(window, 0.99)
        return {
            "requests_total": new.requests,
            "errors_total": new.errors,
            "rps": round(rps, 3),
            "errors_per_s": round(eps, 3),
            "p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "p99_ms": None if p99 is None else round(p99 * 1000, 3),
        }


async def publish_stats(gateway: Gateway) -> None:
    """Sample now and publish this replica's snapshot for every replica's /admin/summary."""
    stats = gateway.admin_stats
    stats.tick()
    snap = {**stats.snapshot(), "ts_ms": control.now_ms()}
    await gateway.redis.hset(keys.GATEWAY_STATS, gateway.replica_id, json.dumps(snap))


async def withdraw_stats(gateway: Gateway) -> None:
    """Take this replica's snapshot out of the dashboard (the replica is stopping). With Redis
    away it stays until any replica's /admin/summary finds it stale."""
    try:
        await gateway.redis.hdel(keys.GATEWAY_STATS, gateway.replica_id)
    except (RedisError, OSError) as exc:
        log.debug("could not withdraw the dashboard snapshot: %s", type(exc).__name__)


async def _refresh_gauges(gateway: Gateway, labelled: set[str]) -> None:
    """Per-worker version and lag, and the context store's bytes; ``labelled`` holds the worker
    ids this replica exports, so that workers gone from the mesh leave the gauges too."""
    seen = set()
    for w in await mesh_workers(gateway):
        if isinstance(w.get("version"), (int, float)):
            metrics.WORKER_VERSION.labels(w["id"]).set(w["version"])
        if isinstance(w.get("lag"), (int, float)):
            metrics.WORKER_VERSION_LAG.labels(w["id"]).set(w["lag"])
        seen.add(w["id"])
    for gone in labelled - seen:
        for gauge in (metrics.WORKER_VERSION, metrics.WORKER_VERSION_LAG):
            with contextlib.suppress(KeyError):
                gauge.remove(gone)
    labelled.clear()
    labelled.update(seen)
    metrics.CONTEXT_STORED_BYTES.set(await gateway.store.global_bytes())


async def run_stats_publisher(gateway: Gateway, interval_s: float) -> None:
    """Publish the snapshot and the breakers' states and refresh the gauges every ``interval_s``
    until cancelled."""
    labelled: set[str] = set()
    while True:
        try:
            await publish_stats(gateway)
            await gateway.proxy.breakers.publish()
            await _refresh_gauges(gateway, labelled)
        except Exception as exc:  # noqa: BLE001 - Redis down: the gateway reports 503 elsewhere; keep sampling
            log.debug("admin stats publish failed: %s", exc)
        await pause(interval_s)
