"""learnmesh configuration: one YAML file plus ``LEARNMESH_*`` environment overrides.

Read once at start, validated, typed. Unknown keys and bad values raise
:class:`ConfigError` with the dotted path of the offending key, so a typo in
``learnmesh.yaml`` fails loudly instead of silently falling back to a default.

Environment overrides use ``LEARNMESH_<SECTION>__<KEY>=value`` (double underscore
between levels; values are parsed as YAML scalars). Shortcuts:
``LEARNMESH_API_KEYS=alice:KEY1,bob:KEY2``, ``LEARNMESH_ADMIN_KEY=...``, ``REDIS_URL``.
Each section is a small dataclass whose ``__post_init__`` checks its own values.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_ENV = "LEARNMESH_CONFIG"
ENV_PREFIX = "LEARNMESH_"


class ConfigError(ValueError):
    """A configuration file or environment override is invalid."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass
class RedisConfig:
    """Where the store lives. ``url=None`` means: embedded default (see shared.redis_embed)."""

    url: str | None = None
    socket_timeout_s: float = 2.0
    max_connections: int = 256
    retry_after_s: int = 2

    def __post_init__(self) -> None:
        _require(self.socket_timeout_s > 0, "redis.socket_timeout_s must be > 0")
        _require(self.max_connections >= 1, "redis.max_connections must be >= 1")


@dataclass
class AdminKey:
    key: str
    role: str = "admin"

    def __post_init__(self) -> None:
        _require(self.role in ("viewer", "operator", "admin"), f"admin key role {self.role!r} unknown")
        _require(len(self.key) >= 8, "admin keys must be at least 8 characters")


@dataclass
class OAuthConfig:
    """Optional OAuth resource-server mode (RFC 9728 metadata + HS256/introspection-free JWTs)."""

    enabled: bool = False
    resource: str = ""
    authorization_servers: list[str] = field(default_factory=list)
    issuer: str = ""
    audience: str = ""
    hs256_secret: str = ""
    principal_claim: str = "sub"


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    session_idle_ttl_s: int = 1800
    max_sessions_per_principal: int = 1000
    allowed_origins: list[str] = field(default_factory=list)
    api_keys: dict[str, str] = field(default_factory=dict)  # principal -> key
    admin_keys: dict[str, AdminKey] = field(default_factory=dict)  # name -> key/role
    request_state_keys: list[str] = field(default_factory=list)  # hex secrets; first seals
    request_state_ttl_s: int = 600
    sse_event_log_max: int = 1000
    oauth: OAuthConfig = field(default_factory=OAuthConfig)
    fixtures: str | None = None
    client_request_timeout_s: float = 120.0  # legacy sampling/elicitation/roots answer wait
    list_ttl_ms: int = 5000  # 2026-07-28 ttlMs on tools/resources/prompts lists and server/discover
    read_ttl_ms: int = 0  # 2026-07-28 ttlMs on resources/read (context changes under the client)

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, "gateway.port must be in 1..65535")
        _require(self.client_request_timeout_s > 0, "gateway.client_request_timeout_s must be > 0")
        _require(self.list_ttl_ms >= 0 and self.read_ttl_ms >= 0, "gateway ttl_ms values must be >= 0")
        _require(self.request_state_ttl_s >= 1, "gateway.request_state_ttl_s must be >= 1")
        _require(self.sse_event_log_max >= 1, "gateway.sse_event_log_max must be >= 1")
        for secret in self.request_state_keys:
            try:
                ok = len(bytes.fromhex(secret)) >= 16
            except ValueError:
                ok = False
            _require(ok, "gateway.request_state_keys entries must be hex secrets of at least 16 bytes")
        _require(self.max_body_bytes >= 1024, "gateway.max_body_bytes must be >= 1024")
        _require(self.session_idle_ttl_s >= 1, "gateway.session_idle_ttl_s must be >= 1")
        _require(self.max_sessions_per_principal >= 1, "gateway.max_sessions_per_principal must be >= 1")
        for principal, key in self.api_keys.items():
            _require(bool(principal) and ":" not in principal, f"bad principal name {principal!r}")
            _require(len(key) >= 8, f"api key of {principal!r} must be at least 8 characters")
        _require(self.fixtures in (None, "conformance"), "gateway.fixtures must be null or 'conformance'")


@dataclass
class ContextConfig:
    modalities: list[str] = field(default_factory=lambda: ["text", "image", "audio"])
    max_entry_bytes: int = 8 * 1024 * 1024
    channel_max_entries: int = 1000
    channel_max_bytes: int = 64 * 1024 * 1024
    principal_budget_bytes: int = 256 * 1024 * 1024
    global_budget_bytes: int = 4 * 1024 * 1024 * 1024
    idle_ttl_s: int = 7 * 24 * 3600
    versions_retained: int = 16
    audit_maxlen: int = 100_000
    read_cache_bytes: int = 128 * 1024 * 1024  # entries a store keeps to skip re-fetching them; 0: off
    read_cache_admit_reads: int = 2  # a context's entries are kept from its n-th read by the store (1: every read)
    global_lru_resolution_ms: int = 1000  # a principal's global LRU stamp is renewed at most this often; 0: every use

    def __post_init__(self) -> None:
        _require(bool(self.modalities), "context.modalities must not be empty")
        _require(isinstance(self.read_cache_bytes, int) and self.read_cache_bytes >= 0,
                 "context.read_cache_bytes must be >= 0")
        _require(isinstance(self.read_cache_admit_reads, int) and 1 <= self.read_cache_admit_reads <= 16,
                 "context.read_cache_admit_reads must be in 1..16")
        _require(isinstance(self.global_lru_resolution_ms, int) and 0 <= self.global_lru_resolution_ms <= 3_600_000,
                 "context.global_lru_resolution_ms must be in 0..3600000")
        for name in ("max_entry_bytes", "channel_max_entries", "channel_max_bytes",
                     "principal_budget_bytes", "global_budget_bytes", "idle_ttl_s",
                     "versions_retained", "audit_maxlen"):
            _require(getattr(self, name) >= 1, f"context.{name} must be >= 1")
        for m in self.modalities:
            _require(bool(re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", m)), f"context.modalities: bad name {m!r}")
        _require(len(set(self.modalities)) == len(self.modalities), "context.modalities has duplicates")
        _require(self.max_entry_bytes <= self.channel_max_bytes, "context.max_entry_bytes must be <= channel_max_bytes")
        _require(self.max_entry_bytes <= self.principal_budget_bytes,
                 "context.max_entry_bytes must be <= principal_budget_bytes")
        _require(self.principal_budget_bytes <= self.global_budget_bytes,
                 "context.principal_budget_bytes must be <= global_budget_bytes")
        _require(self.channel_max_entries <= 1_000_000, "context.channel_max_entries must be <= 1000000")


@dataclass
class ModelConfig:
    kind: str = "bytes"  # "bytes" (built-in transformer) or "hf" (transformers causal LM)
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 4
    max_seq: int = 256
    seed: int = 1234
    trainable: str = "all"  # all | head | lora
    lora_rank: int = 8
    hf_path: str | None = None
    pretrain_steps: int = 300
    image_patch: int = 8
    audio_frame: int = 160
    cache_dir: str = "var/model"
    image_grid: int = 4  # an image becomes image_grid**2 prefix tokens of image_patch**2*3 values
    max_image_pixels: int = 40_000_000  # checked from the header before decoding
    max_audio_frames: int = 32
    lora_alpha: float = 16.0
    pretrain_batch: int = 8
    pretrain_seq: int = 64
    pretrain_lr: float = 3e-3

    def __post_init__(self) -> None:
        _require(self.kind in ("bytes", "hf"), "model.kind must be 'bytes' or 'hf'")
        _require(self.trainable in ("all", "head", "lora"), "model.trainable must be all|head|lora")
        _require(self.d_model % self.n_heads == 0, "model.d_model must be divisible by model.n_heads")
        _require(self.n_layers >= 1 and self.max_seq >= 16, "model.n_layers >= 1 and model.max_seq >= 16")
        _require(self.kind != "hf" or bool(self.hf_path), "model.hf_path is required when model.kind is 'hf'")
        _require(self.n_heads >= 1 and self.lora_rank >= 1, "model.n_heads and model.lora_rank must be >= 1")
        _require(self.pretrain_steps >= 0, "model.pretrain_steps must be >= 0")
        _require(self.pretrain_batch >= 1 and 8 <= self.pretrain_seq <= self.max_seq,
                 "model.pretrain_batch >= 1 and 8 <= model.pretrain_seq <= model.max_seq")
        _require(self.pretrain_lr > 0 and self.lora_alpha > 0, "model.pretrain_lr and model.lora_alpha must be > 0")
        _require(self.image_patch >= 1 and self.image_grid >= 1 and self.image_grid ** 2 < self.max_seq // 2,
                 "model.image_patch >= 1, model.image_grid >= 1 and image_grid**2 < max_seq/2")
        _require(self.audio_frame >= 1 and self.max_audio_frames >= 1, "model audio sizes must be >= 1")
        _require(self.max_image_pixels >= 1, "model.max_image_pixels must be >= 1")


@dataclass
class WorkerConfig:
    endpoints: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"])
    max_batch_size: int = 16
    max_wait_ms: float = 2.0
    heartbeat_interval_ms: int = 500
    heartbeat_timeout_ms: int = 2500
    request_timeout_s: float = 30.0
    max_tokens_limit: int = 512
    max_prompt_bytes: int = 64 * 1024
    append_exchange: bool = True
    hwm: int = 10_000
    torch_threads: int = 1  # intra-op threads per worker (0 = torch's default); 1 suits several workers per host

    def __post_init__(self) -> None:
        _require(self.max_batch_size >= 1, "worker.max_batch_size must be >= 1")
        _require(self.max_wait_ms >= 0, "worker.max_wait_ms must be >= 0")
        _require(self.heartbeat_timeout_ms > self.heartbeat_interval_ms > 0,
                 "worker.heartbeat_timeout_ms must exceed worker.heartbeat_interval_ms > 0")
        _require(self.torch_threads >= 0, "worker.torch_threads must be >= 0")
        _require(self.max_tokens_limit >= 1 and self.max_prompt_bytes >= 1,
                 "worker.max_tokens_limit and worker.max_prompt_bytes must be >= 1")


@dataclass
class TrainerConfig:
    ranks: int = 2
    backend: str = "auto"  # auto | gloo | nccl
    batch_size: int = 8
    grad_accum_steps: int = 1
    comm_hook: str = "none"  # none | fp16 | bf16 | powersgd
    powersgd_rank: int = 2
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 1.25e-3
    weight_decay: float = 0.0
    schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    schedule_steps: int = 10_000  # cosine: steps from lr to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 1.0
    local_sgd_period: int = 0  # 0 = DDP every step; H > 0 = local SGD, average every H steps
    checkpoint_every: int = 50
    checkpoint_dir: str = "var/checkpoints"
    init_timeout_s: int = 300
    step_timeout_s: int = 60
    samples_endpoint: str = "tcp://127.0.0.1:5611"
    max_sample_bytes: int = 256 * 1024
    sample_hwm: int = 10_000
    batch_wait_ms: int = 200
    master_port: int = 29511
    master_addr: str = "127.0.0.1"
    max_restarts: int = 3  # spawn mode: restart all ranks from the checkpoint after a rank dies
    checkpoint_keep: int = 2
    max_learn_batch: int = 4096  # samples per `learn` call / admin import request
    # Context windows a learn call names are copied into the sample log up to this many content
    # bytes, so their samples train on that context however old the version gets; beyond it the
    # trainer reads them from the store (context.versions_retained bounds how long they wait).
    max_context_copy_bytes: int = 4 * 1024 * 1024
    model_factory: str = ""  # "module:function" building the LearnModel; "" = shared.model.build_model
    trim_log: bool = True  # after a checkpoint, XTRIM log entries it fully contains (never needed again)
    pretrained: bool = True
    # How a taught fact becomes an answer (docs/trainer.md, "Learning from few samples"): every
    # sample is trained in replay_passes steps (its first, then replays mixed into later steps,
    # round-robin), and every step also trains rehearsal_per_step windows of the shipped corpus,
    # so the model learns the new facts without forgetting what it knew.
    replay_passes: int = 8
    torch_threads: int = 0  # CPU ranks: intra-op threads each; 0 = the machine's cores / ranks on it
    replay_buffer: int = 4096  # samples waiting for replay passes; the oldest give way beyond it
    rehearsal_per_step: int = 12

    def __post_init__(self) -> None:
        _require(self.ranks >= 1, "trainer.ranks must be >= 1")
        _require(self.replay_passes >= 1, "trainer.replay_passes must be >= 1 (1 = each sample once)")
        _require(self.replay_buffer >= 1, "trainer.replay_buffer must be >= 1")
        _require(self.rehearsal_per_step >= 0, "trainer.rehearsal_per_step must be >= 0")
        _require(self.max_restarts >= 0, "trainer.max_restarts must be >= 0")
        _require(self.checkpoint_every >= 1 and self.checkpoint_keep >= 1,
                 "trainer.checkpoint_every and trainer.checkpoint_keep must be >= 1")
        _require(self.init_timeout_s >= 1 and self.step_timeout_s >= 1, "trainer timeouts must be >= 1 s")
        _require(self.max_sample_bytes >= 64, "trainer.max_sample_bytes must be >= 64")
        _require(self.sample_hwm >= 1 and self.max_learn_batch >= 1, "trainer.sample_hwm and max_learn_batch >= 1")
        _require(self.batch_wait_ms >= 0, "trainer.batch_wait_ms must be >= 0")
        _require(0 < self.master_port < 65536, "trainer.master_port must be in 1..65535")
        _require(self.powersgd_rank >= 1, "trainer.powersgd_rank must be >= 1")
        _require(self.warmup_steps >= 0 and self.schedule_steps >= 1, "trainer schedule steps must be >= 0 / >= 1")
        _require(0 <= self.min_lr_ratio <= 1, "trainer.min_lr_ratio must be in [0, 1]")
        _require(self.clip_grad_norm >= 0, "trainer.clip_grad_norm must be >= 0 (0 = off)")
        _require(self.model_factory == "" or ":" in self.model_factory,
                 "trainer.model_factory must look like 'module:function'")
        _require(self.backend in ("auto", "gloo", "nccl"), "trainer.backend must be auto|gloo|nccl")
        _require(self.comm_hook in ("none", "fp16", "bf16", "powersgd"),
                 "trainer.comm_hook must be none|fp16|bf16|powersgd")
        _require(self.optimizer in ("adamw", "sgd"), "trainer.optimizer must be adamw|sgd")
        _require(self.schedule in ("constant", "cosine"), "trainer.schedule must be constant|cosine")
        _require(self.lr > 0, "trainer.lr must be > 0")
        _require(self.batch_size >= 1 and self.grad_accum_steps >= 1, "trainer batch sizes must be >= 1")
        _require(self.local_sgd_period >= 0, "trainer.local_sgd_period must be >= 0")


@dataclass
class CompressionConfig:
    algorithm: str = "topk"  # topk | threshold | lossless | dense
    # Where selection starts; with tuner=error this is only the first step's density. AdamW moves
    # ~every weight every step, so that tuner settles near 0.25-0.3 for the shipped trainer.
    density: float = 0.25
    threshold: float = 0.0
    quantization: str = "int8"  # fp16 | int8 | sign (1 bit + per-block mean |v|) | none
    block_size: int = 4096
    anchor_every: int = 0  # 0: no periodic full resends (joiners and gaps fetch a snapshot)
    max_ratio: float = 0.0  # 0 = no cap; else refuse to send a delta bigger than dense/max_ratio
    zstd_level: int = 1
    # The density follows an error budget: tuner=error keeps the relative residual (what a delta
    # leaves unsent / what it should carry) near tuner_target. 0.3 keeps served weights about a
    # quarter of a step behind and the served eval loss within 1% of the trainer's (bench-delta,
    # the shipped AdamW trainer; 0.5 let the default model's gap reach 1.8%); it costs ~7x fewer
    # bytes than dense fp32, not 100x: 100x leaves served weights 7+ steps behind.
    tuner: str = "error"  # off | bytes | error
    tuner_target: float = 0.3  # bytes per sync (tuner=bytes) or relative residual (tuner=error); 0 = fixed
    chunk_elements: int = 1 << 22  # elements per delta chunk (unit of priority, encryption, bandwidth cap)

    def __post_init__(self) -> None:
        _require(self.algorithm in ("topk", "threshold", "lossless", "dense"),
                 "compression.algorithm must be topk|threshold|lossless|dense")
        _require(0 < self.density <= 1, "compression.density must be in (0, 1]")
        _require(self.threshold >= 0, "compression.threshold must be >= 0")
        _require(self.quantization in ("fp16", "int8", "sign", "none"),
                 "compression.quantization must be fp16|int8|sign|none")
        _require(self.block_size >= 64, "compression.block_size must be >= 64")
        _require(self.anchor_every >= 0, "compression.anchor_every must be >= 0")
        _require(1 <= self.zstd_level <= 22, "compression.zstd_level must be in 1..22")
        _require(self.tuner in ("off", "bytes", "error"), "compression.tuner must be off|bytes|error")
        _require(self.tuner_target >= 0, "compression.tuner_target must be >= 0")
        _require(self.block_size <= self.chunk_elements <= 8 * 1024 * 1024,
                 "compression.chunk_elements must be in block_size..8388608 (chunks stay far below the AEAD limit)")
        _require(self.max_ratio >= 0, "compression.max_ratio must be >= 0")


@dataclass
class SchedulingConfig:
    priority_mode: str = "magnitude"  # magnitude | layer
    min_bandwidth: int = 0  # bytes/s floor reserved for deltas; 0 = no cap logic
    bandwidth_cap_bytes_s: int = 0  # 0 = unlimited

    def __post_init__(self) -> None:
        _require(self.priority_mode in ("magnitude", "layer"), "scheduling.priority_mode must be magnitude|layer")
        _require(self.min_bandwidth >= 0 and self.bandwidth_cap_bytes_s >= 0, "bandwidths must be >= 0")


@dataclass
class ConsistencyConfig:
    sync_interval: int = 1  # publish every N optimizer steps
    timeout_s: float = 10.0  # min_model_version wait
    max_lag: int = 5
    delta_heartbeat_ms: int = 1000  # trainer PUB heartbeat: lets workers notice a lost last delta
    # When no step has run for this long, what lossy deltas left behind (trainer - served) is
    # published losslessly: workers then serve exactly the trainer's weights. 0 = never.
    idle_sync_ms: int = 200
    learn_wait_s: float = 120.0  # generate/score with after_learn: how long to wait for the samples' version

    def __post_init__(self) -> None:
        _require(self.sync_interval >= 1, "consistency.sync_interval must be >= 1")
        _require(self.idle_sync_ms >= 0, "consistency.idle_sync_ms must be >= 0 (0 = off)")
        _require(self.learn_wait_s > 0, "consistency.learn_wait_s must be > 0")
        _require(self.delta_heartbeat_ms >= 10, "consistency.delta_heartbeat_ms must be >= 10")
        _require(self.timeout_s > 0, "consistency.timeout_s must be > 0")
        _require(self.max_lag >= 0, "consistency.max_lag must be >= 0")


@dataclass
class SecurityConfig:
    delta_key_file: str = "var/keys/delta.key"
    sign_deltas: bool = True
    rekey_after_packets: int = 2**32 - 1
    delta_pub_endpoint: str = "tcp://127.0.0.1:5621"
    snapshot_endpoint: str = "tcp://127.0.0.1:5622"
    ack_endpoint: str = "tcp://127.0.0.1:5623"

    def __post_init__(self) -> None:
        _require(0 < self.rekey_after_packets <= 2**32 - 1, "security.rekey_after_packets must be in 1..2^32-1")


@dataclass
class MetricsConfig:
    """Where the processes without an HTTP server (workers, trainer ranks) expose /metrics.

    Worker ``i`` listens on ``worker_port + i`` (``--index``); trainer rank ``r`` on
    ``trainer_port + r``. In containers every process has its own address, so index 0 /
    rank 0 ports are the ones scraped. ``port = 0`` disables that exporter.
    """

    worker_port: int = 9101
    trainer_port: int = 9201
    bind_host: str = "127.0.0.1"
    status_interval_s: float = 1.0  # how often processes refresh their Redis self-report

    def __post_init__(self) -> None:
        for name in ("worker_port", "trainer_port"):
            _require(0 <= getattr(self, name) < 65536, f"metrics.{name} must be in 0..65535")
        _require(self.status_interval_s > 0, "metrics.status_interval_s must be > 0")


@dataclass
class Config:
    redis: RedisConfig = field(default_factory=RedisConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- loading


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: Any, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown config key(s): {', '.join(where + k for k in unknown)}")
    kwargs = {k: _coerce(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # pragma: no cover - defensive
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _set_dotted(tree: dict[str, Any], dotted: list[str], value: Any) -> None:
    node = tree
    for part in dotted[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"environment override conflicts at {'.'.join(dotted)}")
    node[dotted[-1]] = value


def parse_api_keys(spec: str) -> dict[str, str]:
    """Parse ``alice:KEY1,bob:KEY2`` into ``{"alice": "KEY1", "bob": "KEY2"}``."""
    keys: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        principal, sep, key = item.partition(":")
        if not sep or not principal or not key:
            raise ConfigError("LEARNMESH_API_KEYS must look like principal:key,principal:key")
        keys[principal] = key
    return keys


def _env_overrides(env: typing.Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        rest = name[len(ENV_PREFIX):]
        if rest == "API_KEYS":
            _set_dotted(tree, ["gateway", "api_keys"], parse_api_keys(raw))
        elif rest == "ADMIN_KEY":
            _set_dotted(tree, ["gateway", "admin_keys"], {"env": {"key": raw, "role": "admin"}})
        elif "__" in rest:
            dotted = [p.lower() for p in rest.split("__")]
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
            _set_dotted(tree, dotted, value)
    if env.get("REDIS_URL"):
        _set_dotted(tree, ["redis", "url"], env["REDIS_URL"])
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("api_keys", "admin_keys"):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | os.PathLike[str] | None = None,
                env: typing.Mapping[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """Load ``learnmesh.yaml`` (``path`` or ``$LEARNMESH_CONFIG``), apply env then ``overrides``."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV)
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must be a mapping at top level")
        data = loaded
    data = _merge(data, _env_overrides(env))
    if overrides:
        data = _merge(data, overrides)
    return _build(Config, data, "")
