"""Every Redis key learnmesh uses is built here.

All keys that belong to one principal carry the Redis Cluster hash tag ``{principal}``
so a Lua script touching them never spans slots. Principal names are validated at the
edge (auth) and never contain ``{`` or ``}``.
"""

from __future__ import annotations

import zlib

PREFIX = "lm:"


def _tag(principal: str) -> str:
    return "{" + principal + "}"


# ---------------------------------------------------------------- gateway / MCP sessions
# A legacy session's keys carry its principal's hash tag: an id presented by another
# principal names a different key and is simply not found (404).
def session(principal: str, session_id: str) -> str:
    """Hash: protocol version, client capabilities, log level of a legacy (2025-11-25) session, and
    the list revisions it has been told about (gateway/mcp/list_revisions.py)."""
    return f"{PREFIX}{_tag(principal)}:sess:{session_id}"


def session_events(principal: str, session_id: str) -> str:
    """Stream: events of a session's standalone SSE stream (GET /mcp), for Last-Event-ID replay."""
    return f"{PREFIX}{_tag(principal)}:sess:{session_id}:events"


def session_subscriptions(principal: str, session_id: str) -> str:
    """Set: resource URIs a legacy session subscribed to (resources/subscribe)."""
    return f"{PREFIX}{_tag(principal)}:sess:{session_id}:subs"


def session_pending(principal: str, session_id: str) -> str:
    """Hash: ids of server->client requests still awaiting the client's answer."""
    return f"{PREFIX}{_tag(principal)}:sess:{session_id}:pending"


def session_response(principal: str, session_id: str, request_id: str) -> str:
    """List: the client's answer to one server->client request (RPUSH by any replica, BLPOP by the waiter)."""
    return f"{PREFIX}{_tag(principal)}:sess:{session_id}:resp:{request_id}"


def principal_sessions(principal: str) -> str:
    """Sorted set: session ids of a principal scored by last use (for the per-principal cap)."""
    return f"{PREFIX}{_tag(principal)}:sessions"


def resource_subscribers(principal: str, uri: str) -> str:
    """Set: legacy session ids of a principal subscribed to one resource URI."""
    return f"{PREFIX}{_tag(principal)}:ressubs:{uri}"


def principal_list_revisions(principal: str) -> str:
    """Hash with the idle-session TTL: revision counter of each of the principal's own lists
    (``<kind>`` or ``<kind>@<upstream>``), bumped when a change is announced to that principal
    alone (gateway/mcp/list_revisions.py)."""
    return f"{PREFIX}{_tag(principal)}:listrevs"


def ws_ticket(principal: str, secret_digest: str) -> str:
    """String with a short TTL: a single-use WebSocket ticket of a principal (POST /mcp/ws-ticket),
    named by the SHA-256 of its secret part so the keyspace holds no usable ticket."""
    return f"{PREFIX}{_tag(principal)}:wsticket:{secret_digest}"


def auth_failures(kind: str, name: str) -> str:
    """String with the TTL of ``gateway.auth_throttle.window_s``: failed authentication attempts
    of one client address (``kind`` ``source``: the address or IPv6 /64) or of one presented
    credential (``credential``: its SHA-256, hex), counted by every replica. No principal is known
    yet: the name is the key's own hash tag, so the keys spread over a cluster's slots."""
    return f"{PREFIX}authfail:{kind}:{_tag(name)}"


def limit_bucket(principal: str, name: str) -> str:
    """String: a token bucket of the principal (``requests``, ``learn_samples``, ``learn_bytes``):
    the theoretical arrival time in µs (GCRA), expiring once the bucket is full again."""
    return f"{PREFIX}{_tag(principal)}:limit:{name}"


def listen_leases(principal: str) -> str:
    """Sorted set: the principal's open subscriptions/listen streams on every replica (lease id
    scored by its expiry in ms; a replica that dies leaves leases that simply run out)."""
    return f"{PREFIX}{_tag(principal)}:listens"


def stream_leases(principal: str) -> str:
    """Sorted set: the principal's open event streams (GET /mcp streams, WebSocket connections) on
    every replica, lease id scored by its expiry in ms, like ``listen_leases``."""
    return f"{PREFIX}{_tag(principal)}:streams"


def teacher_grant(principal: str) -> str:
    """String: ``1`` the admin API granted the principal the teach permission, ``0`` revoked it;
    absent: ``learning.teachers`` decides. In the principal's slot, next to its learn buckets,
    so one script checks the permission and takes the quota."""
    return f"{PREFIX}{_tag(principal)}:teach"


TEACHER_GRANTS = f"{PREFIX}learning:teachers"
"""Hash: principal -> JSON {teach, by, ts_ms} of every runtime grant or revoke (the listing for
operators; the per-principal ``teacher_grant`` key is what requests read)."""


def limit_override(principal: str) -> str:
    """String: JSON {limits, by, ts_ms}, the principal's limits set through the admin API over
    the config's (``limits``); absent: the config decides. In the principal's slot, next to its
    buckets and leases."""
    return f"{PREFIX}{_tag(principal)}:limits"


LIMIT_OVERRIDES = f"{PREFIX}limits:overrides"
"""Hash: principal -> the same JSON as its ``limit_override`` (the listing for operators; the
per-principal key is what replicas read)."""


GATEWAY_CONTROL_CHANNEL = f"{PREFIX}gateway:control"
"""Pub/sub: session invalidation, cancellation, resource-updated fan-out and changes made through
the admin API (runtime config, upstreams, a principal's limits) to every replica."""
LIST_REVISIONS = f"{PREFIX}gateway:listrevs"
"""Hash: revision counter of each list every principal may see — ``<kind>`` (tools | resources |
prompts, the gateway's own) and ``<kind>@<upstream>`` (a proxied server's) — bumped once per
announced change by each replica that learns of it; a legacy session compares it with the
revisions it was told about when its event stream opens (gateway/mcp/list_revisions.py). Never in
one command with a principal's keys. No principal data."""


# ---------------------------------------------------------------- gateway / MCP tasks extension (SEP-2663)
# A task's three keys share its principal's hash tag, so one Lua script can move it between
# states atomically; a task id presented by another principal names a different key (-32602).
def task(principal: str, task_id: str) -> str:
    """Hash: status, createdAt, lastUpdatedAt, ttlMs, pollIntervalMs, result/error JSON, owning replica."""
    return f"{PREFIX}{_tag(principal)}:task:{task_id}"


def task_pending(principal: str, task_id: str) -> str:
    """Hash: input request key -> JSON request the task waits on (status input_required)."""
    return f"{PREFIX}{_tag(principal)}:task:{task_id}:pending"


def task_inputs(principal: str, task_id: str) -> str:
    """Hash: input request key -> JSON answer delivered by tasks/update, consumed by the task."""
    return f"{PREFIX}{_tag(principal)}:task:{task_id}:inputs"


def running_tasks(principal: str) -> str:
    """Sorted set: the principal's tasks with a runner alive on some replica (task id scored by the
    expiry in ms of a lease its replica renews), for the per-principal cap; a replica that dies
    leaves leases that simply run out."""
    return f"{PREFIX}{_tag(principal)}:tasks"


def task_replica(replica_id: str) -> str:
    """String with a short TTL: heartbeat of a gateway replica that runs tasks (dead owner -> failed)."""
    return f"{PREFIX}gateway:tasks:replica:{replica_id}"


TASKS_CHANNEL = f"{PREFIX}gateway:tasks"
"""Pub/sub: task cancellation and input-delivered wake-ups, to the replica running the task."""


# ---------------------------------------------------------------- context store
# A principal's whole context state lives in six keys with the hash tag {principal}, so
# every context script passes a FIXED key list in KEYS (context ids are hash fields, never
# key names computed inside Lua) and touches one slot only; see docs/context.md.
def ctx_entries(principal: str) -> str:
    """Hash: ``<context_id>|<modality>|<seq>`` -> packed entry (header + raw content bytes)."""
    return f"{PREFIX}ctx:{_tag(principal)}:e"


def ctx_meta(principal: str) -> str:
    """Hash: context id -> JSON meta (version, bytes, per-channel ranges, life); and the
    principal's state in fields that start with ``\0`` (``\0bytes``, ``\0clock``, ``\0exp``,
    ``\0due``), so a script reads the state and a context's meta with one HMGET."""
    return f"{PREFIX}ctx:{_tag(principal)}:m"


def ctx_lru(principal: str) -> str:
    """Sorted set: context id -> per-principal logical clock of last use (exact LRU)."""
    return f"{PREFIX}ctx:{_tag(principal)}:lru"


def ctx_versions(principal: str) -> str:
    """Hash: ``<context_id>|<version>`` -> channel ranges of that version (last N retained)."""
    return f"{PREFIX}ctx:{_tag(principal)}:ver"


def ctx_state(principal: str) -> str:
    """Hash: per-context last version of evicted contexts (so a recreated context never
    reuses a version number)."""
    return f"{PREFIX}ctx:{_tag(principal)}:st"


def ctx_audit(principal: str) -> str:
    """Stream (capped, idle TTL like the other four): the principal's audit records, written by
    the context script in the same call as the change (shared/audit.py merges the streams)."""
    return f"{PREFIX}ctx:{_tag(principal)}:au"


def ctx_keys(principal: str) -> list[str]:
    """The fixed KEYS of every context script, in script order: all in the principal's slot."""
    return [ctx_entries(principal), ctx_meta(principal), ctx_lru(principal),
            ctx_versions(principal), ctx_state(principal), ctx_audit(principal)]


# Global accounting over all principals (the global byte budget, the LRU over principals) is
# sharded: a principal's bytes and last-use stamp live in shard crc32(principal) % N, each
# shard its own hash tag (so its own slot, spread over the masters). On one server the context
# script writes them (they are among its KEYS); on a cluster the store writes them in the same
# pipelined round trips as its script calls. The evictor sums the shards
# (shared/context/budget.py, docs/context.md).
CTX_GLOBAL_SHARDS = 16


def ctx_global_shard(principal: str) -> int:
    return zlib.crc32(principal.encode()) % CTX_GLOBAL_SHARDS


RESERVED_PRINCIPAL_PREFIX = "ctxglobal-"
"""No principal's name starts so (API keys and tokens are refused): ``ctx_lru`` of a principal
``ctxglobal-N`` would be the key of ``ctx_global_lru(N)``, and its context ids principals to evict."""


def ctx_global_bytes(shard: int) -> str:
    """Hash: principal -> bytes it holds (as reported), ``\0total`` -> their sum."""
    return f"{PREFIX}ctx:{{ctxglobal-{shard}}}:bytes"


def ctx_global_lru(shard: int) -> str:
    """Sorted set: principal -> ms of its last stamped use (global_lru_resolution_ms apart),
    for principals that hold contexts (the evictor removes the ones it evicts)."""
    return f"{PREFIX}ctx:{{ctxglobal-{shard}}}:lru"


def ctx_global_seen(shard: int) -> str:
    """Sorted set: principal -> ms of its last stamped use, for principals the evictor took
    out of ``ctx_global_lru`` (evicted, or holding nothing): with that LRU, the principals whose
    audit streams (``ctx_audit``) a merged audit read visits."""
    return f"{PREFIX}ctx:{{ctxglobal-{shard}}}:seen"


CTX_EVICTOR_LEASE = f"{PREFIX}ctx:evictor"
"""String with a TTL: the gateway replica whose evictor enforces the global budget now."""

# ---------------------------------------------------------------- samples / trainer
# The sample log is split into partitions (trainer.sample_partitions; a principal's samples all go
# to one, by a hash of its name): each partition is a stream, its sequence counter and its
# identity under one hash tag, so the append script stays in one Redis Cluster slot and the
# partitions spread over the masters. Partition 0 keeps the tag {samples}; partition p the tag
# {samples.p}. The trainer's commit record and its trained-id ledger share {trainer} (one MULTI
# commits both) and record a position per partition.
def _samples_tag(partition: int) -> str:
    return "{samples}" if partition == 0 else "{samples." + str(partition) + "}"


def sample_log(partition: int) -> str:
    """Stream: one partition of the durable sample log; one entry per accepted batch: ``seq``
    (first, dense per partition, 1-based), ``n``, ``p`` (principal), ``s`` (JSON array of samples).
    Sample id = ``<entry id>:<index>``, or ``<partition>/<entry id>:<index>`` beyond partition 0."""
    return f"{PREFIX}{_samples_tag(partition)}:log"


def sample_seq(partition: int) -> str:
    """String: last sequence number the partition handed out (INCR inside the append script)."""
    return f"{PREFIX}{_samples_tag(partition)}:seq"


def sample_log_id(partition: int) -> str:
    """String: the identity of the partition's log, made by its first append (SET NX in the append
    script). The trainer binds its position to it: a log recreated (a Redis that lost its data,
    another ``REDIS_URL``) has another id, so its sequence numbers are never mistaken for the old log's."""
    return f"{PREFIX}{_samples_tag(partition)}:logid"


def sample_requests(partition: int, principal: str) -> str:
    """List: the principal's last ``learn`` request ids in this partition, newest first, each
    ``<request id>|<n>|<last seq>|<entry id>|<log id>`` (the append script's, capped and expiring:
    see shared/samples.py APPEND_LUA). In the partition's slot, beside the log it answers for."""
    return f"{PREFIX}{_samples_tag(partition)}:req:{principal}"


def model_version_seq(partition: int, log_id: str) -> str:
    """Sorted set: published model version (member) scored by the last seq of the partition's log
    ``log_id`` its weights hold. ``learn`` answers with its partition, log and last seq; the first
    version scored at or above it contains the samples (read-your-writes without guessing a
    version). Bound to the log: seqs of a log that was lost and made again count from 1 anew,
    and a trainer still stepping on samples of the lost one must not answer for the new one's.
    In the partition's slot, with its log id and seq counter (one node to ask)."""
    return f"{PREFIX}{_samples_tag(partition)}:versionseq:{log_id}"


SAMPLE_LOG = sample_log(0)
SAMPLE_SEQ = sample_seq(0)
SAMPLE_LOG_ID = sample_log_id(0)
TRAINER_OFFSET = f"{PREFIX}{{trainer}}:offset"
"""Hash: the trainer's commit record: step, version, epoch, and per sample-log partition its position:
seq (last trained), id (its log entry), log (its identity); fields ``seq``, ``id``, ``log`` for
partition 0 and ``seq.<p>``, ``id.<p>``, ``log.<p>`` for partition p."""
TRAINER_TRAINED = f"{PREFIX}{{trainer}}:trained"
"""Hash: optimizer step -> space-separated sample ids trained in that step (the ledger)."""
TRAINER_SKIPPED = f"{PREFIX}{{trainer}}:skipped"
"""Hash: optimizer step -> space-separated ``<sample id>=<reason>`` consumed in that step without
a gradient (``no_gradient``: a down-vote; ``context_gone``: its context snapshot could not be
read; ``bad_input``: the model could not encode it). Never in the ledger of trained ids."""
TRAINER_STATUS = f"{PREFIX}trainer:status"
"""Hash: progress of the running trainer (step, loss, samples/s, updated_ms) for admin/stats."""

# ---------------------------------------------------------------- model versions / workers
MODEL_VERSION = f"{PREFIX}model:version"

# ---------------------------------------------------------------- audit
# Records of the context store are in each principal's ``ctx_audit`` stream; everything else
# (admin actions, trainer) in AUDIT_SHARDS streams chosen by principal, each its own slot.
AUDIT_SHARDS = 16


def audit_stream(principal: str) -> str:
    """Stream (capped): audit records other than the context store's, of principals of one shard."""
    return f"{PREFIX}audit:{{audit-{zlib.crc32(principal.encode()) % AUDIT_SHARDS}}}"


def audit_streams() -> list[str]:
    """Every shard of ``audit_stream``."""
    return [f"{PREFIX}audit:{{audit-{k}}}" for k in range(AUDIT_SHARDS)]

# ---------------------------------------------------------------- operations (admin API, control plane)
# Protocol documented in docs/operations.md; helpers for the receiving side in shared/control.py.
# Keys written together in one MULTI share a hash tag ({admin}, {config}), so the transaction
# stays in one Redis Cluster slot.
ADMIN_KEYS = f"{PREFIX}{{admin}}:keys"
"""Hash: sha256(admin key) hex -> JSON {name, role, created_ms, created_by}. Plaintext is never stored."""
ADMIN_KEY_NAMES = f"{PREFIX}{{admin}}:keys:names"
"""Hash: admin key name -> sha256 hex (name uniqueness and revoke by name)."""
TRAINER_CONTROL = f"{PREFIX}trainer:control"
"""Stream: one-shot operator commands for the trainer: fields ``cmd`` (checkpoint | rollback),
``id``, ``by``, ``ts_ms`` and for rollback ``to_version`` or ``anchor``. The trainer reads it each step."""
TRAINER_PAUSED = f"{PREFIX}trainer:paused"
"""String: present ("1") while an operator has paused training (durable desired state)."""
TRAINER_CONTROL_ACK = f"{PREFIX}trainer:control:ack"
"""Hash: control command id -> JSON result written by the trainer once it handled the command."""
MODEL_VERSION_LOG = f"{PREFIX}model:versions"
"""Stream (capped): one entry per published model version: version, step, loss, anchor, checkpoint, ts_ms."""
WORKERS_DRAINED = f"{PREFIX}workers:drained"
"""Set: worker ids that operators drained; every gateway replica routes no new requests to them."""
RUNTIME_CONFIG = f"{PREFIX}{{config}}:runtime"
"""Hash: config section name (compression | consistency | scheduling) -> JSON of fields changed at runtime."""
RUNTIME_CONFIG_REV = f"{PREFIX}{{config}}:runtime:rev"
"""String: incremented on every runtime config change; readers poll it cheaply."""
RUNTIME_CONFIG_CHANNEL = f"{PREFIX}config:changed"
"""Pub/sub channel: the new revision number after every runtime config change (a hint; poll the rev)."""
DELTA_KEY_ROTATE = f"{PREFIX}delta:rotate"
"""Stream: delta key rotation requests (id, by, ts_ms). The trainer's key ring rotates once per entry."""
DELTA_KEY_STATUS = f"{PREFIX}delta:key"
"""Hash: the key ring's report: key_id, epoch, rotated_ms, last_request (id of the handled rotate entry)."""
GATEWAY_STATS = f"{PREFIX}status:gateways"
"""Hash: gateway replica id -> JSON snapshot (ts_ms, req/s, latency quantiles) for the dashboard."""


RENAMED = {f"{PREFIX}admin:keys": ADMIN_KEYS, f"{PREFIX}admin:keys:names": ADMIN_KEY_NAMES,
           f"{PREFIX}config:runtime": RUNTIME_CONFIG, f"{PREFIX}config:runtime:rev": RUNTIME_CONFIG_REV}
"""Old name -> name now, for keys that gained a hash tag: a gateway renames what it finds at start
(gateway/app.py; on a cluster it moves them across slots), so admin keys created through the API
and runtime config survive."""


STATUS_INDEX = f"{PREFIX}status:index"
"""Set: component names with a self-report (so readers never SCAN the keyspace)."""


def component_status(component: str) -> str:
    """Hash: a process's self-report (``worker:<id>``, ``trainer``, ``delta``) with ``ts_ms``; short TTL."""
    return f"{PREFIX}status:{component}"


# ---------------------------------------------------------------- worker discovery
# A worker's registration is one key tagged with its own id (one slot); the index that lists
# them is one key. Worker ids are validated (shared.config.WorkerConfig) and never contain
# ``{`` or ``}``.
WORKERS_INDEX = f"{PREFIX}workers:index"
"""Sorted set: worker id -> time of its last registration heartbeat (ms, the worker's clock).
Readers look up each member's registration; members left by workers long gone are trimmed."""


def worker_registration(worker_id: str) -> str:
    """Hash with a TTL: a worker's announcement (advertised endpoint, capacity, model id and
    version, heartbeat time), renewed every ``worker.register_interval_ms``; it expires when the
    worker stops renewing it, and a worker that stops cleanly deletes it."""
    return f"{PREFIX}worker:{_tag(worker_id)}:reg"


# ---------------------------------------------------------------- MCP-Proxy (gateway/proxy/)
def proxy_session(principal: str, seat: str) -> str:
    """String: the 2025-11-25 session id the gateway holds at an upstream for ``principal``, so
    any replica continues the principal's upstream session. ``seat``: ``<upstream>/<client
    capabilities it was opened with>`` (e.g. ``weather/elicitation+sampling``)."""
    return f"{PREFIX}{_tag(principal)}:proxy:sess:{seat}"


def proxy_task(principal: str, task_id: str) -> str:
    """String with the task's TTL: the upstream that created task ``task_id`` of ``principal``
    (tasks/get, tasks/update and tasks/cancel go there, from any replica)."""
    return f"{PREFIX}{_tag(principal)}:proxy:task:{task_id}"


PROXY_UPSTREAMS = f"{PREFIX}proxy:upstreams"
"""Hash: upstream name -> its configuration as JSON (names of credential sources only, never their
values), or a removal marker for a config-file upstream deleted at runtime. No principal data."""
PROXY_BREAKERS = f"{PREFIX}proxy:breakers"
"""Hash with a TTL: gateway replica id -> JSON ``{ts_ms, upstreams: {name: {state,
consecutive_failures, opened_ms, retry_at_ms, calls, errors}}}``, each replica's view of the
upstreams' circuit breakers (gateway/proxy/health.py). A field older than ``proxy.health_ttl_s``
belongs to a replica that stopped publishing (readers delete it); the key expires when none
publishes. No principal data."""
