"""The operator's control plane as seen by the processes it steers.

The admin API (gateway/admin/) writes commands and settings into Redis; the
trainer, the delta key ring, workers and gateway replicas pick them up by polling
with the small helpers here (synchronous redis-py, cheap enough to call every
optimizer step). The protocol is documented in docs/operations.md; key names live in
shared/keys.py.

- pause / resume: ``keys.TRAINER_PAUSED`` exists while paused (durable, survives restarts).
- one-shot commands (checkpoint now, roll back): ``keys.TRAINER_CONTROL`` stream;
  the trainer acknowledges each in ``keys.TRAINER_CONTROL_ACK``.
- runtime config (compression, consistency, scheduling): ``keys.RUNTIME_CONFIG`` hash
  of JSON overrides plus ``keys.RUNTIME_CONFIG_REV`` revision counter.
- delta key rotation: ``keys.DELTA_KEY_ROTATE`` stream; the key ring reports in
  ``keys.DELTA_KEY_STATUS``.
- drained workers: ``keys.WORKERS_DRAINED`` set.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from shared import keys
from shared.config import (
    CompressionConfig,
    Config,
    ConfigError,
    ConsistencyConfig,
    SchedulingConfig,
    apply_overrides,
)
from shared.text import as_str

log = logging.getLogger(__name__)

RUNTIME_SECTIONS: dict[str, type] = {
    "compression": CompressionConfig,
    "consistency": ConsistencyConfig,
    "scheduling": SchedulingConfig,
}
COMMANDS = ("checkpoint", "rollback")
VERSION_LOG_MAXLEN = 10_000


def now_ms() -> int:
    return int(time.time() * 1000)


# ---------------------------------------------------------------- runtime configuration
def validate_runtime_patch(cfg: Config, current: dict[str, dict[str, Any]],
                           patch: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Merge ``patch`` into the stored overrides and validate the result.

    Returns the new overrides per section. Raises :class:`ConfigError` naming the bad
    key for unknown sections or fields and for values the section's dataclass rejects.
    """
    if not isinstance(patch, dict) or not patch:
        raise ConfigError("expected a non-empty mapping of section -> fields")
    merged = {name: dict(fields) for name, fields in current.items()}
    for section, fields in patch.items():
        if section not in RUNTIME_SECTIONS:
            raise ConfigError(f"section {section!r} cannot be changed at runtime "
                              f"(allowed: {', '.join(RUNTIME_SECTIONS)})")
        if not isinstance(fields, dict) or not fields:
            raise ConfigError(f"{section}: expected a non-empty mapping of fields")
        for name, value in fields.items():
            check_storable(f"{section}.{name}", value)
        merged.setdefault(section, {}).update(fields)
    apply_overrides(cfg, merged)
    return merged


_INT64 = 2**63


def check_storable(where: str, value: Any) -> None:
    """Refuse what every process could not read back as it was written: JSON has no NaN or
    infinity, and the gateways' reader holds integers in 64 bits. Stored, such a value would make
    them ignore every runtime override."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number")
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        raise ConfigError(f"{where}: must fit in a signed 64-bit integer")


def effective_config(cfg: Config, overrides: dict[str, dict[str, Any]]) -> Config:
    """``cfg`` with the runtime overrides applied (validated; a copy)."""
    return apply_overrides(cfg, overrides)


def read_overrides(redis: Any) -> dict[str, dict[str, Any]]:
    raw = redis.hgetall(keys.RUNTIME_CONFIG) or {}
    return {as_str(k): json.loads(v) for k, v in raw.items()}


class RuntimeConfigWatcher:
    """Poll the runtime config revision; ``poll()`` returns a new Config when it changed.

    >>> watcher = RuntimeConfigWatcher(redis, cfg)
    >>> if (new := watcher.poll()) is not None: encoder.reconfigure(new.compression, new.scheduling.priority_mode)
    """

    def __init__(self, redis: Any, cfg: Config) -> None:
        self.redis = redis
        self.base = cfg
        self.rev = -1
        self.current = cfg

    def poll(self) -> Config | None:
        rev = int(self.redis.get(keys.RUNTIME_CONFIG_REV) or 0)
        if rev == self.rev:
            return None
        self.rev = rev
        try:
            new = effective_config(self.base, read_overrides(self.redis))
        except (ConfigError, ValueError) as exc:  # written by a validating API; defensive
            log.error("ignoring invalid runtime config rev %s: %s", rev, exc)
            return None
        changed = new != self.current
        self.current = new
        return new if changed else None


# ---------------------------------------------------------------- trainer control
@dataclass
class Command:
    id: str
    cmd: str
    by: str
    args: dict[str, str] = field(default_factory=dict)


class TrainerControl:
    """What the trainer checks every step: ``paused()`` and new one-shot ``commands()``.

    Commands are read from the stream after a cursor kept in Redis, so a restarted
    trainer neither repeats handled commands nor misses ones sent while it was down.
    Call ``ack(cmd, ok=True, **result)`` once a command is handled.
    """

    CURSOR_FIELD = "_cursor"

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.cursor = as_str(redis.hget(keys.TRAINER_CONTROL_ACK, self.CURSOR_FIELD) or "0-0")

    def paused(self) -> bool:
        return bool(self.redis.exists(keys.TRAINER_PAUSED))

    def commands(self, count: int = 16) -> list[Command]:
        got = self.redis.xread({keys.TRAINER_CONTROL: self.cursor}, count=count) or []
        out = []
        for _stream, entries in got:
            for entry_id, fields in entries:
                f = {as_str(k): as_str(v) for k, v in fields.items()}
                self.cursor = as_str(entry_id)
                out.append(Command(id=f.pop("id", self.cursor), cmd=f.pop("cmd", ""),
                                   by=f.pop("by", ""), args=f))
        return out

    def ack(self, command: Command, ok: bool = True, **result: Any) -> None:
        body = json.dumps({"ok": ok, "ts_ms": now_ms(), **result}, default=str)
        self.redis.hset(keys.TRAINER_CONTROL_ACK, mapping={command.id: body, self.CURSOR_FIELD: self.cursor})


def record_version(redis: Any, version: int, *, step: int | None = None, loss: float | None = None,
                   anchor: bool = False, checkpoint: str | None = None, **extra: Any) -> None:
    """Append one published model version to the version log the admin API lists."""
    fields = {"version": version, "anchor": int(anchor), "ts_ms": now_ms(), **extra}
    if step is not None:
        fields["step"] = step
    if loss is not None:
        fields["loss"] = loss
    if checkpoint:
        fields["checkpoint"] = checkpoint
    redis.xadd(keys.MODEL_VERSION_LOG, {k: str(v) for k, v in fields.items()},
               maxlen=VERSION_LOG_MAXLEN, approximate=True)


# ---------------------------------------------------------------- delta key rotation
ROTATION_KINDS = ("encryption", "signing", "both")
"""What a delta key rotation request replaces: the AES key, the Ed25519 signing key, or both."""


class KeyRotationWatcher:
    """The delta key ring calls ``pending()``; every returned (request id, kind) means: rotate
    once, then ``done(request_id, key_id=..., epoch=...)`` so operators see it happened."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.cursor = as_str(redis.hget(keys.DELTA_KEY_STATUS, "last_request") or "0-0")

    def pending(self) -> list[tuple[str, str]]:
        got = self.redis.xread({keys.DELTA_KEY_ROTATE: self.cursor}, count=16) or []
        out = []
        for _stream, entries in got:
            for entry_id, fields in entries:
                kind = as_str(fields.get(b"kind", fields.get("kind")) or "encryption")
                out.append((as_str(entry_id), kind if kind in ROTATION_KINDS else "encryption"))
        return out

    def done(self, request_id: str, **report: Any) -> None:
        self.cursor = request_id
        mapping = {"last_request": request_id, "rotated_ms": now_ms(), **report}
        self.redis.hset(keys.DELTA_KEY_STATUS, mapping={k: str(v) for k, v in mapping.items()})


# ---------------------------------------------------------------- workers and self-reports
def drained_workers(redis: Any) -> set[str]:
    return {as_str(m) for m in redis.smembers(keys.WORKERS_DRAINED)}


def report_status(redis: Any, component: str, ttl_s: float = 10.0, **fields: Any) -> None:
    """Publish a process's self-report (read by /admin/summary and the dashboard).

    Numbers only where possible: ``loss``, ``step``, ``samples_per_s``, ``version``,
    ``compression_ratio``, ``sync_latency_ms``, ``encode_ms``, ``bytes_per_s`` ...
    """
    key = keys.component_status(component)
    mapping = {k: str(v) for k, v in fields.items() if v is not None}
    mapping["ts_ms"] = str(now_ms())
    pipe = redis.pipeline(transaction=False)
    pipe.hset(key, mapping=mapping)
    pipe.pexpire(key, int(ttl_s * 1000))
    pipe.sadd(keys.STATUS_INDEX, component)
    pipe.execute()


def withdraw_status(redis: Any, component: str) -> None:
    """Remove a process's self-report as it stops cleanly, so listings drop it at once rather
    than when the report's TTL lapses."""
    pipe = redis.pipeline(transaction=False)
    pipe.delete(keys.component_status(component))
    pipe.srem(keys.STATUS_INDEX, component)
    pipe.execute()


def status_ttl_s(cfg: Config) -> float:
    """How long a self-report outlives its last refresh: a few ``metrics.status_interval_s``."""
    return max(10.0, 5 * cfg.metrics.status_interval_s)


def start_metrics_server(cfg: Config, kind: str, index: int = 0) -> int | None:
    """Expose this process's Prometheus registry over HTTP (workers and trainer ranks).

    ``kind`` is ``"worker"`` (port ``metrics.worker_port + index``) or ``"trainer"``
    (``metrics.trainer_port + local rank``: ports count per host). Returns the port, or None when disabled or taken.
    """
    from prometheus_client import start_http_server

    base = {"worker": cfg.metrics.worker_port, "trainer": cfg.metrics.trainer_port}[kind]
    if base == 0:
        return None
    port = base + index
    try:
        start_http_server(port, addr=cfg.metrics.bind_host)
    except OSError as exc:
        log.warning("metrics exporter for %s %d not started on port %d: %s", kind, index, port, exc)
        return None
    return port
