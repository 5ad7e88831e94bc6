"""learnmesh configuration: one YAML file plus ``LEARNMESH_*`` environment overrides.

Read once at start, validated, typed. Each section is a pydantic dataclass: bounds and
choices are declared on its fields, rules that tie fields together live in its
``__post_init__``, unknown keys are refused. Every failure raises :class:`ConfigError`
naming the dotted key (``gateway.session_idle_ttl_s: ...``), so a typo in
``learnmesh.yaml`` fails loudly instead of silently falling back to a default.
:func:`config_schema` is the whole configuration as JSON Schema.

Environment overrides use ``LEARNMESH_<SECTION>__<KEY>=value`` (double underscore
between levels; values are parsed as YAML scalars). Shortcuts:
``LEARNMESH_API_KEYS=alice:KEY1,bob:KEY2``, ``LEARNMESH_ADMIN_KEY=...``,
``LEARNMESH_REQUEST_STATE_KEYS=HEX1,HEX2`` (``gateway.request_state_keys``), ``REDIS_URL``; the
first three also as ``LEARNMESH_API_KEYS_FILE`` / ``LEARNMESH_ADMIN_KEY_FILE`` /
``LEARNMESH_REQUEST_STATE_KEYS_FILE``, naming a 0600 file that holds the value (compose
secrets), so the keys stay out of the process environment. Any other
``LEARNMESH_*`` variable sets nothing: :func:`unknown_env_variables` names them for a warning.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import pydantic
import pydantic.dataclasses
import yaml
from pydantic import Field, JsonValue, StrictBool, StrictFloat, StrictInt

from shared import keys

CONFIG_ENV = "LEARNMESH_CONFIG"
ENV_PREFIX = "LEARNMESH_"
CONFIG_ERROR_EXIT = 2
"""The exit status of a learnmesh process stopped by a failure a restart would meet again (a
setting, a key or checkpoint file to mend): `learnmesh up` and the trainer's launcher do not
restart it."""
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""Where every process looks for Redis when neither ``redis.url`` nor ``REDIS_URL`` names one."""

_T = typing.TypeVar("_T")

# Integers, floats and booleans are taken as written (YAML ``port: "80"`` or ``true`` for a
# number is refused, not coerced); plain numbers are accepted where a string is expected.
# allow_inf_nan off: an endless timeout never fires and a NaN compares false to every bound.
_STRICT_SCALARS = pydantic.ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

Port = Annotated[StrictInt, Field(ge=1, le=65535)]
OptionalPort = Annotated[StrictInt, Field(ge=0, le=65535, description="0 disables")]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveFloat = Annotated[StrictFloat, Field(gt=0)]
NonNegativeFloat = Annotated[StrictFloat, Field(ge=0)]


class ConfigError(ValueError):
    """A configuration file or environment override is invalid."""


def _where(loc: tuple[int | str, ...], cls: type, positional: bool) -> str:
    parts = [str(p) for p in loc]
    if positional and loc and isinstance(loc[0], int):  # a positional argument of a direct construction
        parts[0] = dataclasses.fields(cls)[loc[0]].name
    return ".".join(parts)


def _describe(exc: pydantic.ValidationError, cls: type, positional: bool = False) -> str:
    """One clause per problem, each led by the dotted key (``positional``: a construction's
    positional arguments by field name; else a leading number is a key a file wrote as a number).
    Values are never echoed: some of them are secrets."""
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            msg = "unknown key"
        elif err["type"] == "value_error":
            msg = str(err["ctx"]["error"])
        elif err["type"] == "string_pattern_mismatch" and err["ctx"]["pattern"] in _PATTERN_WORDS:
            msg = f"must be {_PATTERN_WORDS[err['ctx']['pattern']]}"
        else:
            msg = err["msg"]
        where = _where(err["loc"], cls, positional)
        lines.append(f"{where}: {msg}" if where else msg)
    return "; ".join(lines)


@typing.dataclass_transform(field_specifiers=(Field,))
def _section(cls: type[_T]) -> type[_T]:
    """A pydantic dataclass whose construction raises :class:`ConfigError` (the one error
    callers catch), whether built by :func:`load_config`, directly or by ``dataclasses.replace``."""
    built: Any = pydantic.dataclasses.dataclass(config=_STRICT_SCALARS)(cls)
    validate: Callable[..., None] = built.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            validate(self, *args, **kwargs)
        except pydantic.ValidationError as exc:
            raise ConfigError(_describe(exc, built, positional=True)) from None

    built.__init__ = __init__
    return typing.cast(type[_T], built)


_HOST_PORT = re.compile(r"[A-Za-z0-9_.-]+:[0-9]{1,5}")
_ZMQ_HOST = r"(?:\[[0-9A-Fa-f:.]+\]|\*|[A-Za-z0-9_.-]{1,253})"
_ZMQ_TCP = re.compile(rf"tcp://{_ZMQ_HOST}:([0-9]{{1,5}}|\*)")
_ZMQ_LOCAL = re.compile(r"(?:ipc|inproc)://\S{1,255}")
_ZMQ_FORMS = "tcp://<host>:<port> (port 1-65535, or * for a free one), ipc://<path> or inproc://<name>"


def check_zmq_endpoint(value: str) -> str:
    """A ZeroMQ endpoint a socket can bind and its peers connect to, checked as the
    configuration loads: one libzmq refuses would crash its process at every restart."""
    tcp = _ZMQ_TCP.fullmatch(value)
    if tcp and (tcp.group(1) == "*" or 1 <= int(tcp.group(1)) <= 65535):
        return value
    if not tcp and _ZMQ_LOCAL.fullmatch(value):
        return value
    raise ValueError(f"not a ZeroMQ endpoint: {_ZMQ_FORMS}")


ZmqEndpoint = Annotated[str, pydantic.AfterValidator(check_zmq_endpoint)]


def _advertised(value: str) -> str:
    """``worker.advertise``: '' or a tcp:// endpoint with a concrete host and port once
    ``{host}``, ``{ip}`` and ``{port}`` are filled in (shared/worker_registry.py)."""
    filled = value.replace("{host}", "h").replace("{ip}", "192.0.2.1").replace("{port}", "1")
    tcp = _ZMQ_TCP.fullmatch(filled)
    if value and not (tcp and tcp.group(1) != "*" and not filled.startswith("tcp://*:")
                      and 1 <= int(tcp.group(1)) <= 65535):
        raise ValueError("must be tcp://<host>:<port> that gateways can connect to; {host}, {ip} and {port} "
                         "stand for the worker's hostname, address and bound port")
    return value


def _bind_host(value: str) -> str:
    """``zmq.bind_host``: '' (each endpoint's own host), a wildcard, an address or a name."""
    if value and not re.fullmatch(r"\*|\[?[0-9A-Fa-f:.]{2,45}\]?|[A-Za-z0-9_.-]{1,253}", value):
        raise ValueError("must be '', *, an IP address or a host name")
    return value
_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def _check(cond: bool, message: str) -> None:
    """A rule that ties fields together; ``message`` names the keys relative to the section."""
    if not cond:
        raise ValueError(message)


def _check_redis_url(url: str) -> None:
    """A URL redis-py takes, with a port and database it would not silently replace. The
    messages never repeat the URL (it may carry the password)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("url is not a URL (a bracketed IPv6 host not closed?)") from None
    _check(parts.scheme in _REDIS_SCHEMES, "url must start with " + ", ".join(f"{s}://" for s in _REDIS_SCHEMES))
    if parts.scheme == "unix":
        return
    try:
        port = parts.port
    except ValueError:
        raise ValueError("url's port must be a number in 1-65535") from None
    _check(port is None or port >= 1, "url's port must be a number in 1-65535")
    _check(parts.path.strip("/").isdigit() or not parts.path.strip("/"), "url's database (its path) must be a number")


@_section
class RedisConfig:
    """Where the store lives. ``url=None``: ``REDIS_URL``, else the embedded default (shared.redis_embed).

    Credentials and TLS apply to every client a learnmesh process opens (shared/redis_client.py):
    ``redis://user:password@host`` or the fields below; ``rediss://`` for TLS.

    Redis Cluster: ``cluster: true``, or a ``redis+cluster://`` (``rediss+cluster://``) URL naming
    any node as the seed; every process then discovers the other masters from it."""

    url: str | None = None
    socket_timeout_s: PositiveFloat = 2.0
    max_connections: PositiveInt = 256
    retry_after_s: StrictInt = Field(default=2, ge=1, le=3600, description="Retry-After (s) sent while Redis is unreachable")
    username: str | None = Field(default=None, description="ACL user (Redis 6+); None: 'default'")
    password: str | None = None
    password_file: str | None = Field(default=None, description="file holding the password (mode 0600)")
    tls_ca_file: str | None = Field(default=None, description="rediss://: CA bundle the server's certificate "
                                                              "must chain to (None: the system's)")
    tls_cert_file: str | None = Field(default=None, description="rediss://: client certificate (mutual TLS)")
    tls_key_file: str | None = Field(default=None, description="rediss://: its private key (mode 0600)")
    cluster: StrictBool = Field(default=False, description="the url names a node of a Redis Cluster (same as a "
                                                           "redis+cluster:// or rediss+cluster:// url)")
    cluster_nodes: list[str] = Field(default_factory=list, description="more nodes of the cluster (host:port), "
                                     "tried when the url's node does not answer as a process starts")
    wait_replicas: NonNegativeInt = Field(default=0, description="acknowledged context and sample writes, and the "
                                          "trainer's commit record, wait until this many replicas hold them "
                                          "(Redis WAIT); 0: off")
    wait_timeout_ms: PositiveInt = Field(default=200, description="the longest such a write waits for its replicas; "
                                         "fewer by then: the write is reported as failed (503)")

    def __post_init__(self) -> None:
        if self.url:
            _check_redis_url(self.url)
        if self.url and urlsplit(self.url).scheme in ("redis+cluster", "rediss+cluster"):
            self.cluster = True  # the mode in effect, as the configuration shows it (GET /admin/config)
        _check(not (self.password and self.password_file), "set password or password_file, not both")
        _check(not (self.url and urlsplit(self.url).password and (self.password or self.password_file)),
               "url already carries a password; drop password/password_file or the one in url")
        tls = self.tls_ca_file or self.tls_cert_file or self.tls_key_file
        _check(not (tls and self.url and not self.url.startswith(("rediss://", "rediss+cluster://"))),
               "tls_* files need a rediss:// url")
        _check(bool(self.tls_cert_file) == bool(self.tls_key_file), "tls_cert_file and tls_key_file go together")
        _check(all(_HOST_PORT.fullmatch(n) for n in self.cluster_nodes), "cluster_nodes: each is host:port")
        _check(not self.cluster_nodes or self.cluster or "+cluster://" in (self.url or ""),
               "cluster_nodes need a cluster: cluster: true or a redis+cluster:// url")


# What an ``Authorization: Bearer`` header can carry and the gateway reads back whole: printable
# ASCII (HTTP clients refuse to send more), with no space at either end (stripped on the way in).
_SENDABLE_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
_UNSENDABLE = "cannot be sent in an Authorization header: printable ASCII only, no space at either end"


@_section
class AdminKey:
    key: str = Field(min_length=8)
    role: Literal["viewer", "operator", "admin"] = "admin"

    def __post_init__(self) -> None:
        _check(_SENDABLE_KEY.fullmatch(self.key) is not None, f"key {_UNSENDABLE}")


@_section
class OAuthConfig:
    """Optional OAuth resource-server mode (RFC 9728 metadata + HS256/introspection-free JWTs)."""

    enabled: StrictBool = False
    resource: str = ""
    authorization_servers: list[str] = Field(default_factory=list)
    issuer: str = ""
    audience: str = ""
    hs256_secret: str = ""
    principal_claim: str = "sub"
    leeway_s: StrictInt = Field(
        default=30, ge=0, le=300, description="how far the issuer's clock may be off ours: a token is accepted "
                                              "this long before its nbf and iat and after its exp")

    def __post_init__(self) -> None:
        # RFC 7518 3.2: an HS256 key has at least the hash's 256 bits; an empty one (that some
        # PyJWT versions accept) would let anyone sign a token for any principal.
        _check(not self.enabled or len(self.hs256_secret.encode()) >= 32,
               "enabled needs hs256_secret: at least 32 bytes (the issuer's HS256 key)")
        # The resource is the audience a token must name when no other is set, and where the
        # 401 challenge points (RFC 9728): without it a token issued for any service would pass.
        parts = urlsplit(self.resource)
        _check(not self.enabled or (parts.scheme in ("http", "https") and bool(parts.hostname)),
               "enabled needs resource: the http(s) URL of this gateway's /mcp that tokens are issued for")
        # The key proves that a holder of it signed, not which one: without an issuer, any other
        # authorization server given the same key (a shared or a staging one) would issue our tokens.
        _check(not self.enabled or bool(self.issuer),
               "enabled needs issuer: the iss of the authorization server whose tokens are accepted")


@_section
class AuthThrottleConfig:
    """Failed authentication attempts (a bearer token, admin key or WebSocket ticket that is presented
    and not valid), counted in Redis over every replica for ``window_s`` seconds from the first.
    Past ``failures_per_source`` failures, the source's every request is refused (429 + Retry-After)
    until the window ends, valid credentials too: a guesser cannot learn that a guess was right.
    Past ``failures_per_credential``, one credential is refused likewise from every source. 0: off."""

    failures_per_source: NonNegativeInt = Field(
        default=30, description="failed attempts from one client address (IPv6: its /64) per window")
    failures_per_credential: NonNegativeInt = Field(
        default=10, description="failed attempts with one and the same credential, from anywhere, per window")
    window_s: StrictInt = Field(default=60, ge=1, le=86400, description="how long failures count (s)")
    trusted_proxies: list[str] = Field(
        default_factory=list, description="addresses or CIDR networks of proxies in front of the gateway whose "
                                          "X-Forwarded-For names the client; the peer address otherwise")

    def __post_init__(self) -> None:
        for net in self.trusted_proxies:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {net!r} is not an address or a CIDR network") from None


# The characters a token's principal may have (gateway/auth.py) but ':', which LEARNMESH_API_KEYS
# uses: every principal is then a name the context store and the Redis keys' hash tags take, and no
# two look alike.
_PRINCIPAL_PATTERN = r"^[A-Za-z0-9_.@\-]{1,128}$"
_HEX_KEY_PATTERN = r"^(?:[0-9a-fA-F]{2}){16,}$"
Principal = Annotated[str, Field(pattern=_PRINCIPAL_PATTERN, description="a principal name: 1-128 of A-Z a-z 0-9 _ . @ -")]
HexSecret = Annotated[str, Field(pattern=_HEX_KEY_PATTERN, description="a hex secret of at least 16 bytes")]
# What a pattern asks for, in words: pydantic's message would show the regular expression.
_PATTERN_WORDS = {_PRINCIPAL_PATTERN: "1-128 of A-Z a-z 0-9 _ . @ -",
                  _HEX_KEY_PATTERN: "hex digits, an even number of them and at least 32 (16 bytes)"}


@_section
class GatewayConfig:
    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_bytes: StrictInt = Field(
        default=4 * 1024 * 1024, ge=1024, description="largest request body on any route and largest WebSocket "
                                                      "message (413 / close 1009), checked before it is read")
    max_header_bytes: StrictInt = Field(
        default=64 * 1024, ge=4096, description="largest request line and headers of any request (431 and the "
                                                "connection closed, before more of them is read)")
    header_timeout_s: PositiveFloat = Field(
        default=10.0, description="a connection whose request headers are not complete this long after their "
                                  "first byte (or after it opened) is closed")
    body_timeout_s: PositiveFloat = Field(
        default=60.0, description="a request body not received in full this long after its headers is cut off (408)")
    ws_ticket_ttl_s: StrictInt = Field(
        default=30, ge=1, le=600, description="lifetime of a single-use WebSocket ticket (POST /mcp/ws-ticket)")
    ws_ping_interval_s: PositiveFloat = Field(
        default=20.0, description="a WebSocket connection is pinged after this long without a ping")
    ws_ping_timeout_s: PositiveFloat = Field(
        default=20.0, description="a WebSocket peer that has not answered a ping this long after it was sent is "
                                  "dropped, with whatever was queued for it")
    session_idle_ttl_s: PositiveInt = 1800
    max_sessions_per_principal: PositiveInt = 1000
    max_client_capabilities_bytes: StrictInt = Field(
        default=16 * 1024, ge=1024, description="largest client capabilities and client info a client may declare "
                                                "(each, as JSON): a 2025-11-25 session keeps them, a 2026-07-28 "
                                                "listen stream or task holds them while it lives (-32602 beyond)")
    allowed_origins: list[str] = Field(default_factory=list)
    api_keys: dict[Principal, Annotated[str, Field(min_length=8)]] = Field(
        default_factory=dict, description="principal -> MCP client key")
    admin_keys: dict[str, AdminKey] = Field(default_factory=dict, description="name -> admin key and role")
    request_state_keys: list[HexSecret] = Field(
        default_factory=list, description="secrets sealing 2026-07-28 requestState; the first seals")
    request_state_ttl_s: PositiveInt = 600
    sse_event_log_max: PositiveInt = 1000
    oauth: OAuthConfig = Field(default_factory=OAuthConfig)
    auth_throttle: AuthThrottleConfig = Field(default_factory=AuthThrottleConfig)
    fixtures: Literal["conformance"] | None = None
    client_request_timeout_s: PositiveFloat = Field(
        default=120.0, description="legacy sessions: how long a sampling/elicitation/roots answer waits")
    list_ttl_ms: NonNegativeInt = Field(
        default=5000, description="2026-07-28 ttlMs on tools/resources/prompts lists and server/discover")
    read_ttl_ms: NonNegativeInt = Field(
        default=0, description="2026-07-28 ttlMs on resources/read (context changes under the client)")

    def __post_init__(self) -> None:
        reserved = sorted(name for name in self.api_keys if name.startswith(keys.RESERVED_PRINCIPAL_PREFIX))
        _check(not reserved, f"api_keys: principal name(s) {', '.join(reserved)} are reserved: names starting "
                             f"{keys.RESERVED_PRINCIPAL_PREFIX!r} are the mesh's own context accounting keys")
        for name, key in self.api_keys.items():
            _check(_SENDABLE_KEY.fullmatch(key) is not None, f"api_keys: the key of {name} {_UNSENDABLE}")
        mcp = set(self.api_keys.values())
        clash = sorted(name for name, admin in self.admin_keys.items() if admin.key in mcp)
        _check(not clash, f"admin key(s) {', '.join(clash)} equal an MCP client key; admin and MCP keys must be "
                          "different")


Modality = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]


@_section
class ContextConfig:
    modalities: list[Modality] = Field(default_factory=lambda: ["text", "image", "audio"], min_length=1)
    max_entry_bytes: PositiveInt = 8 * 1024 * 1024
    channel_max_entries: StrictInt = Field(default=1000, ge=1, le=1_000_000)
    channel_max_bytes: PositiveInt = 64 * 1024 * 1024
    principal_budget_bytes: PositiveInt = 256 * 1024 * 1024
    global_budget_bytes: PositiveInt = Field(
        default=4 * 1024 * 1024 * 1024, description="bytes over all principals; the gateways' evictor evicts least "
                                                    "recently used principals every global_evict_interval_s "
                                                    "(see docs/context.md: how far over it can run)")
    idle_ttl_s: PositiveInt = 7 * 24 * 3600
    versions_retained: PositiveInt = 16
    audit_maxlen: PositiveInt = Field(default=100_000, description="cap of each audit stream: every principal's "
                                                                  "context records, and each shard of the others")
    read_cache_bytes: NonNegativeInt = Field(
        default=128 * 1024 * 1024, description="entries a store keeps to skip re-fetching them; 0: off")
    read_cache_admit_reads: StrictInt = Field(
        default=2, ge=1, le=16, description="a context's entries are kept from its n-th read by the store "
                                            "(1: every read)")
    global_lru_resolution_ms: StrictInt = Field(
        default=1000, ge=0, le=3_600_000, description="a principal's global LRU stamp is renewed at most "
                                                      "this often (per principal on one server, per "
                                                      "principal and gateway on a cluster); 0: every use")
    global_evict_interval_s: PositiveFloat = Field(
        default=1.0, le=3600, description="how often a gateway's evictor checks the global budget (one replica "
                                          "at a time holds the lease)")

    def __post_init__(self) -> None:
        _check(len(set(self.modalities)) == len(self.modalities), "modalities has duplicates")
        _check(self.max_entry_bytes <= self.channel_max_bytes, "max_entry_bytes must be <= channel_max_bytes")
        _check(self.max_entry_bytes <= self.principal_budget_bytes,
               "max_entry_bytes must be <= principal_budget_bytes")
        _check(self.principal_budget_bytes <= self.global_budget_bytes,
               "principal_budget_bytes must be <= global_budget_bytes")


@_section
class ModelConfig:
    kind: Literal["bytes", "hf"] = Field(
        default="bytes", description="bytes: the built-in transformer; hf: a transformers causal LM")
    d_model: PositiveInt = 192
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    max_seq: StrictInt = Field(default=256, ge=16)
    seed: StrictInt = 1234
    trainable: Literal["all", "head", "lora"] = "all"
    lora_rank: PositiveInt = 8
    hf_path: str | None = None
    pretrain_steps: NonNegativeInt = 300
    image_patch: PositiveInt = 8
    audio_frame: PositiveInt = 160
    cache_dir: str = "var/model"
    image_grid: PositiveInt = Field(
        default=4, description="an image becomes image_grid**2 prefix tokens of image_patch**2*3 values")
    max_image_pixels: PositiveInt = Field(
        default=40_000_000, description="checked from the header before decoding")
    max_audio_frames: PositiveInt = 32
    lora_alpha: PositiveFloat = 16.0
    pretrain_batch: PositiveInt = 8
    pretrain_seq: StrictInt = Field(default=64, ge=8)
    pretrain_lr: PositiveFloat = 3e-3

    def __post_init__(self) -> None:
        _check(self.d_model % self.n_heads == 0, "d_model must be divisible by n_heads")
        _check(self.kind != "hf" or bool(self.hf_path), "hf_path is required when kind is 'hf'")
        _check(self.pretrain_seq <= self.max_seq, "pretrain_seq must be <= max_seq")
        _check(self.image_grid ** 2 < self.max_seq // 2, "image_grid**2 must be < max_seq/2")


@_section
class WorkerConfig:
    endpoints: list[ZmqEndpoint] = Field(default_factory=lambda: ["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"])
    max_batch_size: PositiveInt = 16
    max_wait_ms: NonNegativeFloat = 2.0
    heartbeat_interval_ms: PositiveInt = 500
    heartbeat_timeout_ms: PositiveInt = 2500
    request_timeout_s: PositiveFloat = 30.0
    # A request in flight on a worker that dies goes to another; one that was on this many when
    # they died fails instead (it may be what kills them: it must not take the pool down).
    max_request_losses: PositiveInt = Field(
        default=2, description="workers a request may lose (dead under it) before it fails rather than move on")
    # A worker that answers heartbeats but lets requests time out (a wedged serving loop, a model
    # stuck in one forward pass) is benched: three in a row, because two can be one over-long
    # request and its caller's retry, while each one costs its caller request_timeout_s.
    max_consecutive_timeouts: NonNegativeInt = Field(
        default=3, description="requests in a row that time out on one worker, with no answer from it between, "
                               "before it is benched (0: never)")
    bench_cooloff_s: PositiveFloat = Field(
        default=30.0, description="how long a benched worker gets no request; then the gateway probes it: an "
                                  "answer brings it back, none within request_timeout_s benches it again")
    max_tokens_limit: PositiveInt = 512
    max_prompt_bytes: PositiveInt = 64 * 1024
    append_exchange: StrictBool = True
    hwm: NonNegativeInt = Field(default=10_000, description="ZeroMQ high-water mark (0: none)")
    torch_threads: NonNegativeInt = Field(
        default=1, description="intra-op threads per worker (0: torch's default); 1 suits several workers "
                               "per host")
    # Discovery (docs/operations.md, "Workers that join by themselves"): workers announce
    # themselves in Redis and every gateway connects to the announced ones as well as to
    # ``endpoints`` (static workers, which need no Redis and stay in the pool when silent).
    id: str = Field(default="", pattern=r"^[A-Za-z0-9_.{}-]{0,128}$",
                    description="this worker's id; '': worker-<index>; {host} and {index} are filled in "
                                "(replicas sharing one config: worker-{host})")
    advertise: Annotated[str, pydantic.AfterValidator(_advertised)] = Field(default="", description="the endpoint gateways connect to; '': the bound endpoint, or "
                                                   "tcp://{ip}:{port} when it binds a wildcard; {host} (hostname), "
                                                   "{ip} (the worker's address on its route to Redis), {port} (bound port)")
    register: StrictBool = Field(default=True, description="announce this worker in Redis (needs redis)")
    discovery: StrictBool = Field(default=True, description="gateways connect to every worker announced in Redis, "
                                                            "and drop one when its announcement expires")
    register_interval_ms: PositiveInt = Field(default=1000, description="how often a worker renews its announcement "
                                                                        "(and a gateway reads them)")
    registration_ttl_ms: PositiveInt = Field(default=5000, description="an announcement not renewed this long expires: "
                                                                       "gateways drop that worker")
    max_discovered: PositiveInt = Field(default=256, description="announced workers a gateway connects to at most; "
                                                                "further announcements are ignored (with a warning)")
    snapshot_wait_s: NonNegativeFloat = Field(
        default=15.0, description="a worker starting in a mesh whose trainer has published a version (its status "
                                  "in Redis) takes the trainer's snapshot before it serves, waiting this long at "
                                  "most; then it serves the base weights until one arrives (0: never waits)")
    await_snapshot: bool = Field(
        default=False, description="wait for the trainer's snapshot (up to snapshot_wait_s) even where Redis names no "
                                   "published version: a Redis that lost its data beside a trainer that restores a "
                                   "checkpoint. `learnmesh up` sets it when its trainer.checkpoint_dir holds one")

    def __post_init__(self) -> None:
        _check(len(set(self.endpoints)) == len(self.endpoints),
               "endpoints names one endpoint twice: a second worker cannot bind it")
        _check(self.heartbeat_timeout_ms > self.heartbeat_interval_ms,
               "heartbeat_timeout_ms must exceed heartbeat_interval_ms")
        _check(self.registration_ttl_ms >= 2 * self.register_interval_ms,
               "registration_ttl_ms must be at least twice register_interval_ms")
        _check("{" not in self.id.replace("{host}", "").replace("{index}", "")
               and "}" not in self.id.replace("{host}", "").replace("{index}", ""),
               "id may hold {host} and {index}, no other braces")


@_section
class TrainerConfig:
    ranks: PositiveInt = 2
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    batch_size: PositiveInt = 8
    grad_accum_steps: PositiveInt = 1
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: PositiveInt = 2
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: PositiveFloat = 1.25e-3
    weight_decay: NonNegativeFloat = 0.0
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: NonNegativeInt = 0
    schedule_steps: PositiveInt = Field(
        default=10_000, description="cosine: steps from lr to lr * min_lr_ratio")
    min_lr_ratio: StrictFloat = Field(default=0.1, ge=0, le=1)
    clip_grad_norm: NonNegativeFloat = Field(default=1.0, description="0: off")
    local_sgd_period: NonNegativeInt = Field(
        default=0, description="0: DDP every step; H > 0: local SGD, average every H steps")
    checkpoint_every: PositiveInt = 50
    checkpoint_dir: str = "var/checkpoints"
    init_timeout_s: PositiveInt = 300
    step_timeout_s: PositiveInt = 60
    samples_endpoint: ZmqEndpoint = "tcp://127.0.0.1:5611"
    max_sample_bytes: StrictInt = Field(default=256 * 1024, ge=64)
    sample_hwm: PositiveInt = 10_000
    batch_wait_ms: NonNegativeInt = 200
    master_port: Port = Field(
        default=29511, description="ignored: the rendezvous of `learnmesh trainer` takes a free port at "
                                   "master_addr; across machines torchrun's --rdzv-endpoint names the port")
    master_addr: str = "127.0.0.1"
    max_restarts: NonNegativeInt = Field(
        default=3, description="spawn mode: restart all ranks from the checkpoint after a rank dies, this many "
                                     "times in a row (counted afresh after 10 minutes without a failure)")
    checkpoint_keep: PositiveInt = 2
    max_learn_batch: PositiveInt = Field(
        default=4096, description="samples per `learn` call / admin import request")
    # Context windows a learn call names are copied into the sample log up to this many content
    # bytes, so their samples train on that context however old the version gets; beyond it the
    # trainer reads them from the store (context.versions_retained bounds how long they wait).
    max_context_copy_bytes: NonNegativeInt = 4 * 1024 * 1024
    model_factory: str = Field(
        default="", pattern=r"^$|:", description="'module:function' building the LearnModel; '': "
                                                 "shared.model.build_model")
    trim_log: StrictBool = Field(
        default=True, description="after a checkpoint, XTRIM log entries every kept checkpoint contains")
    pretrained: StrictBool = True
    # How a taught fact becomes an answer (docs/trainer.md, "Learning from few samples"): every
    # sample is trained in replay_passes steps (its first, then replays mixed into later steps,
    # round-robin), and every step also trains rehearsal_per_step windows of the shipped corpus,
    # so the model learns the new facts without forgetting what it knew.
    replay_passes: PositiveInt = Field(default=8, description="steps each sample is trained in (1: once)")
    # After its last pass a sample with a short target is checked against the model (does it give
    # that target greedily?); one that is not answered yet gets another pass, up to answer_passes
    # more (services/trainer/replay.py). 0: off.
    answer_passes: NonNegativeInt = Field(
        default=8, description="passes beyond replay_passes for a short target the model does not answer yet")
    answer_max_bytes: PositiveInt = Field(
        default=64, description="targets up to this many bytes are answers to give back (answer_passes)")
    # An answer only just given is lost again by the next steps on other facts; a lead of 1 nat
    # (the target e times likelier than the runner-up) keeps it through them.
    answer_margin: NonNegativeFloat = Field(
        default=1.0, description="logit lead each target token needs over the next likeliest to count as answered")
    torch_threads: NonNegativeInt = Field(
        default=0, description="CPU ranks: intra-op threads each; 0: the machine's cores / ranks on it")
    replay_buffer: PositiveInt = Field(
        default=4096, description="samples waiting for replay passes; the oldest give way beyond it")
    rehearsal_per_step: NonNegativeInt = 12
    # Facts answered are rehearsed too (services/trainer/replay.py): each step that trains
    # anything also trains recall_per_step of the last recall_facts answered facts.
    recall_per_step: NonNegativeInt = Field(
        default=4, description="answered facts trained again in every step that trains anything; 0: off")
    recall_facts: PositiveInt = Field(
        default=1024, description="answered facts kept for recall_per_step; the oldest give way beyond it")
    sample_partitions: PositiveInt | None = Field(
        default=None, le=1024, description="partitions of the sample log (each its own Redis Cluster slot; a "
        "principal's samples go to one); None: 1 on one server, 8 on a cluster. Raise it freely; lower it only "
        "once the trainer has trained every sample of the partitions dropped")


@_section
class CompressionConfig:
    algorithm: Literal["topk", "threshold", "lossless", "dense"] = "topk"
    # Where selection starts; with tuner=error this is only the first step's density. AdamW moves
    # ~every weight every step, so that tuner settles near 0.25-0.3 for the shipped trainer.
    density: StrictFloat = Field(default=0.25, gt=0, le=1)
    threshold: NonNegativeFloat = 0.0
    quantization: Literal["fp16", "int8", "sign", "none"] = Field(
        default="int8", description="sign: 1 bit + per-block mean |v|")
    block_size: StrictInt = Field(default=4096, ge=64)
    anchor_every: NonNegativeInt = Field(
        default=0, description="0: no periodic full resends (joiners and gaps fetch a snapshot)")
    max_ratio: NonNegativeFloat = Field(
        default=0.0, description="0: no cap; else refuse to send a delta bigger than dense/max_ratio")
    zstd_level: StrictInt = Field(default=1, ge=1, le=22)
    # The density follows an error budget: tuner=error keeps the relative residual (what a delta
    # leaves unsent / what it should carry) near tuner_target. 0.3 keeps served weights about a
    # quarter of a step behind and the served eval loss within 1% of the trainer's (bench-delta,
    # the shipped AdamW trainer; 0.5 let the default model's gap reach 1.8%); it costs ~7x fewer
    # bytes than dense fp32, not 100x: 100x leaves served weights 7+ steps behind.
    tuner: Literal["off", "bytes", "error"] = "error"
    tuner_target: NonNegativeFloat = Field(
        default=0.3, description="bytes per sync (tuner=bytes) or relative residual (tuner=error); 0: fixed")
    # Chunks stay far below the AEAD limit.
    chunk_elements: StrictInt = Field(
        default=1 << 22, le=8 * 1024 * 1024, description="elements per delta chunk (unit of priority, "
                                                         "encryption, bandwidth cap)")

    def __post_init__(self) -> None:
        _check(self.block_size <= self.chunk_elements, "chunk_elements must be >= block_size")


@_section
class SchedulingConfig:
    priority_mode: Literal["magnitude", "layer"] = "magnitude"
    min_bandwidth: NonNegativeInt = Field(
        default=0, description="bytes/s floor reserved for deltas; 0: no cap logic")
    bandwidth_cap_bytes_s: NonNegativeInt = Field(default=0, description="0: unlimited")


@_section
class ConsistencyConfig:
    sync_interval: PositiveInt = Field(default=1, description="publish every N optimizer steps")
    timeout_s: PositiveFloat = Field(default=10.0, description="min_model_version wait")
    max_lag: NonNegativeInt = 5
    delta_heartbeat_ms: StrictInt = Field(
        default=1000, ge=10, description="trainer PUB heartbeat: lets workers notice a lost last delta")
    # When no step has run for this long, what lossy deltas left behind (trainer - served) is
    # published losslessly: workers then serve exactly the trainer's weights.
    idle_sync_ms: NonNegativeInt = Field(default=200, description="0: never")
    learn_wait_s: PositiveFloat = Field(
        default=120.0, description="generate/score with after_learn: how long to wait for the samples' "
                                   "version")
    snapshot_interval_ms: NonNegativeInt = Field(
        default=1000, description="the trainer sends one worker connection at most one snapshot per interval; "
                                  "requests that arrive sooner wait for its end and are merged into one answer "
                                  "(keep it under timeout_s)")


@_section
class SecurityConfig:
    delta_key_file: str = Field(default="var/keys/delta.key", description="the delta key ring: AES keys and "
                                "verify keys; the trainer and every worker read it")
    delta_sign_key_file: str = Field(default="", description="the trainer's Ed25519 signing key; only the "
                                     "trainer reads it. '': delta-sign.key next to delta_key_file")
    delta_key_grace_s: NonNegativeInt = Field(
        default=300, description="after a rotation, packets under the previous AES or signing key are accepted "
                                 "this long, then refused")
    sign_deltas: StrictBool = True
    rekey_after_packets: StrictInt = Field(default=2**32 - 1, ge=1, le=2**32 - 1)
    delta_pub_endpoint: ZmqEndpoint = "tcp://127.0.0.1:5621"
    snapshot_endpoint: ZmqEndpoint = "tcp://127.0.0.1:5622"
    ack_endpoint: ZmqEndpoint = "tcp://127.0.0.1:5623"

    @property
    def signing_key_path(self) -> str:
        """Where the trainer's signing key lives (``delta_sign_key_file`` or its default)."""
        return self.delta_sign_key_file or str(Path(self.delta_key_file).with_name("delta-sign.key"))


@_section
class ZmqConfig:
    """CurveZMQ on every ZeroMQ link: each process holds its role's keypair under ``keys_dir``
    (``<role>.key_secret``, 0600) and the public keys of its peers (``<role>.key``); see
    shared/curve.py and docs/operations.md, "ZeroMQ links"."""

    curve: StrictBool = Field(default=True, description="encrypt and authenticate every ZeroMQ link; off: "
                                                        "any local process can read and inject messages")
    keys_dir: str = "var/keys/zmq"
    bind_host: Annotated[str, pydantic.AfterValidator(_bind_host)] = Field(default="", description="'': every ZeroMQ socket binds the host its endpoint names "
                                                   "(loopback by default); e.g. 0.0.0.0: bind that host on the "
                                                   "endpoint's port, while peers connect to the endpoint as written")


MAX_BUCKET_FILL_S = 1e12  # see PrincipalLimits.__post_init__


@_section
class PrincipalLimits:
    """What one principal may use (gateway/limits.py); 0 turns a limit off. The defaults leave
    room for any well-behaved client: they stop floods, not work."""

    requests_per_s: NonNegativeFloat = Field(
        default=1000.0, description="MCP messages per second, over every replica (token bucket in Redis)")
    requests_burst: PositiveInt = 2000
    learn_samples_per_s: NonNegativeFloat = 100.0
    learn_samples_burst: PositiveInt = 10_000
    learn_bytes_per_s: NonNegativeFloat = 1024.0 * 1024
    learn_bytes_burst: PositiveInt = 64 * 1024 * 1024
    subscriptions_per_session: NonNegativeInt = Field(
        default=1000, description="resources/subscribe URIs per legacy session (and URIs per listen stream)")
    listen_streams: NonNegativeInt = Field(default=64, description="open subscriptions/listen streams, all replicas")
    event_streams: NonNegativeInt = Field(
        default=64, description="open GET /mcp streams, WebSocket connections and server->client requests awaiting "
                                "a 2025-11-25 client's answer, all replicas")
    ws_concurrent_requests: NonNegativeInt = Field(default=256, description="requests in flight per WebSocket")
    running_tasks: NonNegativeInt = Field(
        default=64, description="tasks (MCP tasks extension) not yet completed, failed or cancelled, all replicas")
    inference_in_flight: NonNegativeInt = Field(
        default=16, description="generate and score calls not yet answered, per gateway replica (the mesh admits "
                                "replicas x this): one worker batch (worker.max_batch_size) from each replica")

    def __post_init__(self) -> None:
        # A bucket's wait is stored in Redis as a key's expiry in ms: one that would take longer than
        # this to fill overflows it, and every check of the principal fails instead of refusing.
        for rate, burst in (("requests_per_s", "requests_burst"), ("learn_samples_per_s", "learn_samples_burst"),
                            ("learn_bytes_per_s", "learn_bytes_burst")):
            per_s, most = getattr(self, rate), getattr(self, burst)
            _check(not per_s or most / per_s <= MAX_BUCKET_FILL_S,
                   f"{rate}: {per_s:g} per second fills a bucket of {most} ({burst}) in more than "
                   f"{MAX_BUCKET_FILL_S:g} s; raise it, or 0 turns the limit off")


@_section
class LimitsConfig:
    """Quotas and rate limits: ``default``, then ``roles.<role>`` for the principals that
    ``principal_roles`` puts in that role, then ``principals.<name>`` for one principal, each
    overriding some fields of what comes before; the admin API sets fields for one principal
    over all of them at runtime (``/admin/limits``, gateway/limits.py)."""

    default: PrincipalLimits = Field(default_factory=PrincipalLimits)
    roles: dict[Principal, dict[str, JsonValue]] = Field(default_factory=dict)
    principal_roles: dict[Principal, Principal] = Field(
        default_factory=dict, description="principal -> role, for limits.roles and learning.teacher_roles")
    principals: dict[Principal, dict[str, JsonValue]] = Field(default_factory=dict)
    max_sample_backlog: NonNegativeInt = Field(
        default=100_000, description="samples logged but not yet trained beyond which learn is refused; 0: off")
    backlog_retry_after_s: PositiveInt = 5
    cap_retry_after_s: PositiveInt = Field(
        default=1, description="Retry-After when a count cap (subscriptions, listens, WebSocket requests, "
                                  "inference calls) is full")

    def __post_init__(self) -> None:
        for where, table in (("roles", self.roles), ("principals", self.principals)):
            for name, fields in table.items():
                try:
                    PrincipalLimits(**{**dataclasses.asdict(self.default), **fields})
                except (ConfigError, TypeError) as exc:
                    raise ValueError(f"{where}.{name}: {exc}") from None
        for principal, role in self.principal_roles.items():
            if role not in self.roles:
                raise ValueError(f"principal_roles.{principal}: no role {role!r} in limits.roles")

    def of(self, principal: str) -> PrincipalLimits:
        """The limits in force for ``principal``: default, its role's, then its own."""
        role = self.roles.get(self.principal_roles.get(principal, ""), {})
        own = self.principals.get(principal, {})
        if not role and not own:
            return self.default
        return PrincipalLimits(**{**dataclasses.asdict(self.default), **role, **own})


Teacher = Annotated[str, Field(pattern=r"^(\*|[A-Za-z0-9_.@:\-]{1,128})$",
                               description="a principal name, or * for every one")]


@_section
class LearningConfig:
    """Who may teach the shared model through ``learn`` (and whose samples an operator may import).
    ``local`` is the one principal of an open gateway (no API keys); the admin API grants and
    revokes at runtime (``/admin/teachers``) over this list."""

    teachers: list[Teacher] = Field(default_factory=lambda: ["local"])
    teacher_roles: list[Principal] = Field(
        default_factory=list, description="roles (limits.principal_roles) whose principals may teach")


@_section
class MetricsConfig:
    """Where the processes without an HTTP server (workers, trainer ranks) expose /metrics.

    Worker ``i`` listens on ``worker_port + i`` (``--index``); the trainer rank with local rank ``r``
    (its index on its host) on ``trainer_port + r``. In containers every process has its own address, so index 0 /
    rank 0 ports are the ones scraped. ``port = 0`` disables that exporter.
    """

    worker_port: OptionalPort = 9101
    trainer_port: OptionalPort = 9201
    bind_host: str = "127.0.0.1"
    status_interval_s: PositiveFloat = Field(
        default=1.0, description="how often processes refresh their Redis self-report")


UpstreamName = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,32}$", description="an upstream's name")]
UPSTREAM_REVISIONS = ("auto", "2025-11-25", "2026-07-28")
_HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")
_QUERY_NAME = re.compile(r"[A-Za-z0-9._~-]{1,64}")  # RFC 3986 unreserved: sent as written


@_section
class CaptureTools:
    """Capture only these tools' calls (names as the upstream spells them, without the namespace)."""

    tools: list[str] = Field(default_factory=list)


def _check_upstream_url(url: str) -> None:
    """An http(s) URL the gateway can connect to: a host, a port in 1-65535 when one is given, no
    credentials. The messages never repeat the URL (it may carry a secret)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("url is not a URL (a bracketed IPv6 host not closed?)") from None
    _check(parts.scheme in ("http", "https"), "url must be http(s)://")
    _check("@" not in parts.netloc,
           "url must not carry credentials (user:password@): name them in headers_from_env or headers_from_file")
    # The URL is kept in Redis with the upstream set, readable by whatever reads the store; which
    # query parameter is a key cannot be told, so none rides in it.
    _check(not parts.query and "?" not in url,
           "url must not carry a query (an API key in it would be kept in Redis with the upstream set): "
           "name its parameters in query_from_env or query_from_file, or send the key as a header "
           "with headers_from_env or headers_from_file")
    _check(not parts.fragment and "#" not in url, "url must not carry a fragment (#...): it is never sent")
    _check(bool(parts.hostname), "url must name a host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("url's port must be a number in 1-65535") from None
    _check(port is None or port >= 1, "url's port must be a number in 1-65535")


@_section
class UpstreamConfig:
    """One upstream MCP server the gateway fronts (gateway/proxy/). Exactly one of ``url``
    (Streamable HTTP) or ``command`` (stdio). Credentials are named, never written here:
    ``headers_from_env`` maps a header to an environment variable, ``headers_from_file`` to a
    0600 file (``query_from_env`` / ``query_from_file`` the same for a key the upstream takes in
    its URL's query); their values are read when the upstream is opened and never shown anywhere."""

    name: UpstreamName
    url: str | None = Field(default=None, description="Streamable HTTP endpoint (http:// or https://)")
    command: list[str] | None = Field(default=None, description="stdio server: argv of the process to run")
    revision: Literal["auto", "2025-11-25", "2026-07-28"] = Field(
        default="auto", description="auto: 2026-07-28 when the upstream offers it, else 2025-11-25")
    namespace: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{0,32}$",
                                  description="prefix of its names (<namespace>.<name>); default: name; "
                                              "'' mounts them unprefixed")
    headers_from_env: dict[str, str] = Field(default_factory=dict, description="header -> environment variable")
    headers_from_file: dict[str, str] = Field(default_factory=dict, description="header -> 0600 file")
    query_from_env: dict[str, str] = Field(default_factory=dict,
                                           description="url query parameter -> environment variable")
    query_from_file: dict[str, str] = Field(default_factory=dict, description="url query parameter -> 0600 file")
    timeout_s: StrictFloat = Field(default=30.0, gt=0, le=86_400, allow_inf_nan=False,
                                   description="how long a call may take (at most a day)")
    concurrency: StrictInt = Field(default=16, ge=1, le=65_536,
                                   description="calls in flight to this upstream per gateway replica")
    principal_concurrency: StrictInt | None = Field(
        default=None, ge=1, le=65_536,
        description="calls one principal may have in flight to this upstream per replica (at most concurrency); "
                    "default: half of concurrency, at least 1")
    stdio_max_processes: StrictInt = Field(
        default=32, ge=1, le=4096, description="stdio: principals' processes alive at once per replica (one each; "
                                               "the lists' own process comes on top)")
    stdio_idle_s: StrictFloat = Field(default=300.0, gt=0, le=86_400,
                                      description="stdio: a process unused this long is stopped")
    capture: StrictBool | CaptureTools = Field(
        default=False, description="true, or {tools: [...]}: calls become entries in the caller's context")
    enabled: StrictBool = True

    def __post_init__(self) -> None:
        _check((self.url is None) != (self.command is None), "set exactly one of url or command")
        if self.url is not None:
            _check_upstream_url(self.url)
        _check(self.command is None or len(self.command) > 0, "command must name a program")
        _check(not set(self.headers_from_env) & set(self.headers_from_file),
               "a header comes from the environment or from a file, not both")
        _check(all(_HEADER_NAME.fullmatch(h) for h in (*self.headers_from_env, *self.headers_from_file)),
               "header names are letters, digits and '-'")
        _check(self.url is not None or not (self.query_from_env or self.query_from_file),
               "query_from_env and query_from_file belong to an upstream with a url")
        _check(not set(self.query_from_env) & set(self.query_from_file),
               "a query parameter comes from the environment or from a file, not both")
        _check(all(_QUERY_NAME.fullmatch(q) for q in (*self.query_from_env, *self.query_from_file)),
               "query parameter names are letters, digits and '-', '_', '.', '~'")

    @property
    def principal_share(self) -> int:
        """The slots of ``concurrency`` one principal may hold at once (gateway/proxy/gate.py)."""
        wanted = max(1, self.concurrency // 2) if self.principal_concurrency is None else self.principal_concurrency
        return min(wanted, self.concurrency)

    @property
    def prefix(self) -> str:
        """The namespace its names are mounted under ('' = unprefixed)."""
        return self.name if self.namespace is None else self.namespace

    def captures(self, tool: str) -> bool:
        return self.capture is True or (isinstance(self.capture, CaptureTools) and tool in self.capture.tools)


@_section
class ProxyAllow:
    """Who may use which upstream: entries are ``upstream``, ``upstream.tool`` or ``*``. A
    principal may use what its own list and its role's list (limits.principal_roles) name."""

    roles: dict[Principal, list[str]] = Field(default_factory=dict)
    principals: dict[Principal, list[str]] = Field(default_factory=dict)


@_section
class BreakerConfig:
    failures: PositiveInt = Field(default=5, description="consecutive failures that open an upstream's breaker")
    reset_s: PositiveFloat = Field(default=30.0, description="how long it stays open before one probe call")


@_section
class ProxyConfig:
    """Upstream MCP servers merged into the gateway's lists (docs/gateway.md, "MCP-Proxy")."""

    upstreams: list[UpstreamConfig] = Field(default_factory=list)
    allow: ProxyAllow | None = Field(default=None, description="absent: every principal may use every upstream")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    list_ttl_s: PositiveFloat = Field(default=30.0, description="how long an upstream's lists are reused "
                                                                "(list_changed refreshes them sooner)")
    list_fetch_s: PositiveFloat = Field(default=60.0, description="how long one fetch of an upstream's lists may "
                                                                  "take in all (every page of the four lists); what "
                                                                  "came by then is listed, the rest logged")
    page_size: PositiveInt = Field(default=500, description="entries per page of a merged list (nextCursor)")
    health_ttl_s: PositiveFloat = Field(default=10.0, description="how long a replica's published breaker states "
                                                                  "count; a replica that stops publishing drops out "
                                                                  "of the mesh-wide health view after it")

    def __post_init__(self) -> None:
        names = [u.name for u in self.upstreams]
        _check(len(names) == len(set(names)), "upstreams: names must be unique")
        prefixes = [u.prefix for u in self.upstreams]
        _check(len(prefixes) == len(set(prefixes)), "upstreams: two upstreams mount under the same namespace")


@_section
class Config:
    redis: RedisConfig = Field(default_factory=RedisConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    context: ContextConfig = Field(default_factory=ContextConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    consistency: ConsistencyConfig = Field(default_factory=ConsistencyConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    zmq: ZmqConfig = Field(default_factory=ZmqConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    learning: LearningConfig = Field(default_factory=LearningConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)

    def __post_init__(self) -> None:
        backlog = self.limits.max_sample_backlog
        _check(backlog == 0 or backlog >= self.trainer.max_learn_batch,
               "limits.max_sample_backlog must be 0 or >= trainer.max_learn_batch")
        _check(self.proxy.health_ttl_s >= 2 * self.metrics.status_interval_s,
               "proxy.health_ttl_s must be at least twice metrics.status_interval_s (how often a live "
               "replica refreshes its breakers' report)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CONFIG = pydantic.TypeAdapter(Config)


def config_schema() -> dict[str, Any]:
    """The whole configuration (``learnmesh.yaml``) as JSON Schema, from the same definitions
    that validate it."""
    return _CONFIG.json_schema()


def apply_overrides(cfg: Config, overrides: typing.Mapping[str, dict[str, Any]]) -> Config:
    """``cfg`` with some sections' fields replaced (validated, a copy; the other sections are
    shared with ``cfg``); raises ConfigError."""
    data: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for name, fields in overrides.items():
        base = dataclasses.asdict(getattr(cfg, name)) if name in data else {}
        data[name] = {**base, **fields}
    return _validate(data)


def patch_model(name: str, sections: typing.Mapping[str, type],
                examples: list[JsonValue] | None = None) -> type[pydantic.BaseModel]:
    """A request body of changes to some sections: every section and every field optional,
    each field with its section's type and bounds (published in OpenAPI). Rules across fields
    are checked by :func:`apply_overrides`, against the values in effect."""
    extra: dict[str, JsonValue] | None = {"examples": examples} if examples else None
    config = pydantic.ConfigDict(**_STRICT_SCALARS, json_schema_extra=extra)
    optional: dict[str, Any] = {s: (partial_model(cls) | None, None) for s, cls in sections.items()}
    return pydantic.create_model(name, __config__=config, **optional)


def partial_model(cls: type, examples: list[JsonValue] | None = None) -> type[pydantic.BaseModel]:
    """A request body of changes to one section: every field of ``cls`` optional (None: not
    given), with its type and bounds; unknown fields refused."""
    fields: dict[str, Any] = {
        field: (Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation,
                Field(default=None, description=info.description))
        for field, info in cls.__pydantic_fields__.items()}  # type: ignore[attr-defined]
    extra: dict[str, JsonValue] | None = {"examples": examples} if examples else None
    config = pydantic.ConfigDict(**_STRICT_SCALARS, json_schema_extra=extra)
    return pydantic.create_model(f"{cls.__name__}Patch", __config__=config, **fields)


def _validate(data: dict[str, Any]) -> Config:
    try:
        return _CONFIG.validate_python(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc, Config)) from None


# --------------------------------------------------------------------------- loading


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
        if rest in ("API_KEYS_FILE", "ADMIN_KEY_FILE", "REQUEST_STATE_KEYS_FILE"):
            from shared.secret_files import read_private_text

            rest, raw = rest.removesuffix("_FILE"), read_private_text(raw, f"{name} file")
        if rest == "API_KEYS":
            _set_dotted(tree, ["gateway", "api_keys"], parse_api_keys(raw.replace("\n", ",")))
        elif rest == "ADMIN_KEY":
            _set_dotted(tree, ["gateway", "admin_keys"], {"env": {"key": raw, "role": "admin"}})
        elif rest == "REQUEST_STATE_KEYS":
            _set_dotted(tree, ["gateway", "request_state_keys"],
                        [k for k in (p.strip() for p in raw.replace("\n", ",").split(",")) if k])
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


# LEARNMESH_ variables that are no configuration key: read by learnmesh (the shortcuts above,
# var_dir, log_level), by the examples (the demo's URLs and key), by the test suite, or written
# by `learnmesh compose-secrets` for compose and Kubernetes (compose/, deploy/).
OTHER_ENV = frozenset({
    CONFIG_ENV, "LEARNMESH_VAR", "LEARNMESH_LOG_LEVEL", "LEARNMESH_API_KEYS", "LEARNMESH_API_KEYS_FILE",
    "LEARNMESH_ADMIN_KEY", "LEARNMESH_ADMIN_KEY_FILE", "LEARNMESH_REQUEST_STATE_KEYS",
    "LEARNMESH_REQUEST_STATE_KEYS_FILE",
    "LEARNMESH_KEY", "LEARNMESH_URL", "LEARNMESH_WS_URL",
    "LEARNMESH_TEACHERS", "LEARNMESH_REDIS_PASSWORD", "LEARNMESH_REDIS_PASSWORD_SHA256", "LEARNMESH_DELTA_KEY_RING",
    "LEARNMESH_DELTA_SIGN_KEY", *(f"LEARNMESH_ZMQ_{role}_{part}" for role in ("GATEWAY", "WORKER", "TRAINER")
                                  for part in ("PUBLIC", "SECRET")),
    "LEARNMESH_TEST_REDIS_URL", "LEARNMESH_TEST_REDIS_CLUSTER_URL", "LEARNMESH_TEST_REDIS_MODES",
    "LEARNMESH_E2E_TRAINABLE", "LEARNMESH_FUZZ_EXAMPLES", "LEARNMESH_DEPLOY_VENV", "LEARNMESH_REQUIRE_BROWSER",
    "LEARNMESH_REQUIRE_DEPLOY_TOOLS",
})


def _setting_variables(cls: type, prefix: str) -> list[str]:
    """The override variable of every key of ``cls``, nested sections included."""
    out = []
    for name, info in cls.__pydantic_fields__.items():  # type: ignore[attr-defined]
        var = f"{prefix}{name.upper()}"
        if dataclasses.is_dataclass(info.annotation):
            out += _setting_variables(typing.cast(type, info.annotation), var + "__")
        else:
            out.append(var)
    return out


def unknown_env_variables(cfg: Config, env: typing.Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``LEARNMESH_*`` variable that sets nothing, with the known name closest to it, if any
    (``LEARNMESH_GATEWAY_PORT``: ``LEARNMESH_GATEWAY__PORT``): a typo would otherwise leave its
    default in force without a word. Variables of the ``__`` form are checked by :func:`load_config`;
    those an upstream's ``headers_from_env`` or ``query_from_env`` names are credentials the gateway reads."""
    import difflib

    env = os.environ if env is None else env
    known = OTHER_ENV | {var for u in cfg.proxy.upstreams for var in (*u.headers_from_env.values(),
                                                                      *u.query_from_env.values())}
    names = [*known, *_setting_variables(Config, ENV_PREFIX)]
    return [(name, next(iter(difflib.get_close_matches(name, names, n=1, cutoff=0.8)), None))
            for name in sorted(env) if name.startswith(ENV_PREFIX) and "__" not in name and name not in known]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("api_keys", "admin_keys"):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: YAML keeps the last one, so a
    second ``gateway:`` section would silently drop the first one's settings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, typing.Hashable):  # a list as a key: SafeLoader refuses it below
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def var_dir(env: typing.Mapping[str, str] | None = None) -> Path:
    """Where ``learnmesh up`` and an embedded Redis keep their state: ``$LEARNMESH_VAR`` or ``var``."""
    return Path((os.environ if env is None else env).get("LEARNMESH_VAR", "var"))


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(env: typing.Mapping[str, str] | None = None) -> str:
    """The log level of a learnmesh process: ``$LEARNMESH_LOG_LEVEL`` or ``INFO``."""
    level = (os.environ if env is None else env).get("LEARNMESH_LOG_LEVEL", "INFO").upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"LEARNMESH_LOG_LEVEL: {level.lower()!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return level


def _read_config_file(p: Path) -> str:
    if p.exists() and not p.is_file():  # a directory; a pipe would block the start
        raise ConfigError(f"config file {p} is not a regular file")
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start})") from None


def load_config(path: str | os.PathLike[str] | None = None,
                env: typing.Mapping[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """Load ``learnmesh.yaml`` (``path`` or ``$LEARNMESH_CONFIG``), apply env then ``overrides``."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV)
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        try:
            loaded = yaml.load(_read_config_file(p), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must be a mapping at top level")
        # a section whose keys are all commented out reads as null: it means its defaults
        data = {k: {} if v is None else v for k, v in loaded.items()}
    data = _merge(data, _env_overrides(env))
    if overrides:
        data = _merge(data, overrides)
    return _validate(data)
