"""Samples in: the ``learn`` tool and the :class:`SampleIngest` behind it (and behind the
admin sample routes in gateway/admin/samples.py).

Flow of one ``learn`` call: validate every sample (schema, size, context version) —
nothing is written unless all pass; check that the caller may teach and take the samples
from its learn quota (gateway/limits.py); append them to the durable log (keys.SAMPLE_LOG)
in one Lua round trip that also hands out dense sequence numbers, unless the log already
holds ``limits.max_sample_backlog`` samples the trainer has not trained; record who taught
what in the audit stream; acknowledge with the ids;
then wake the trainer over ZeroMQ PUSH (non-blocking, explicit HWM). The wake-up carries no
sample: the trainer reads bodies and principals from the log alone, so what it trains is
what was acknowledged. If the push queue is full or no trainer is connected the
acknowledgement says ``queued: false`` — the samples are durable and the trainer picks them
up from the log at its next idle read; nothing is dropped silently. A malformed sample
raises :class:`~shared.samples.SampleError` and Redis errors propagate: gateway/errors.py
decides what the client sees.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import zmq
from redis.exceptions import NoScriptError, RedisError

from gateway.errors import InvalidParams, Unavailable
from gateway.limits import exceeded
from gateway.registry import Registry, ToolContext
from gateway.tools.context import announcing
from shared import keys, wire
from shared import metrics as m
from shared.aio import pause
from shared.audit import audit
from shared.config import Config
from shared.context import ContextError, ContextNotFound, ContextStore, VersionUnavailable
from shared.curve import CurveKeys, HandshakeWatch
from shared.redis_client import check_replicas
from shared.samples import (
    APPEND_LUA,
    Sample,
    SampleError,
    batch_json,
    learn_input_schema,
    learned_token,
    log_entry,
    new_log_id,
    pack_windows,
    parse_batch,
    parse_sample,
    partition_of,
    position_field,
    sample_id,
    sample_partitions,
)
from shared.text import as_str
from shared.types import ContextWindow
from shared.zmq_util import make_socket

log = logging.getLogger("learnmesh.learning")
TRAINER_LINK_READ_S = 0.5  # how often the trainer link's reports are read (they fill a queue in minutes)

LEARN_INPUT_SCHEMA = learn_input_schema()

LEARN_OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ids": {"type": "array", "items": {"type": "string"}},
        "seqs": {"type": "array", "items": {"type": "integer"}},
        "queued": {"type": "boolean", "description": "false: trainer queue full or absent (samples are durable)"},
        "learned": {"type": "string", "description": "pass as 'after_learn' to generate or score: they then wait "
                    "for (and are answered by) a model version that has finished training these samples"},
        "repeated": {"type": "boolean", "description": "true: the request_id named an earlier learn, whose "
                     "answer this is; nothing was logged"},
    },
    "required": ["ids", "seqs", "queued", "learned"],
}


@dataclass
class LogTotals:
    entries: int
    last_seq: int
    trained_seq: int
    backlog: int
    written: bool  # some partition has had a sample
    offset: dict[str, str]


class SampleIngest:
    """Validates, logs and forwards samples; one per gateway process (``Gateway.samples``).
    Without a ``store``, samples that name a context are refused."""

    def __init__(self, redis: aioredis.Redis, cfg: Config, store: ContextStore | None = None,
                 zmq_ctx: zmq.Context | None = None) -> None:
        self.redis = redis
        self.cfg = cfg
        self.store = store
        self._own_ctx = zmq_ctx is None
        self.ctx = zmq_ctx or zmq.Context()
        keys = CurveKeys.load(cfg.zmq, "gateway")
        endpoint = cfg.trainer.samples_endpoint
        # with or without CURVE: it also reconnects a connection the peer broke (shared/curve.py)
        self.watch: HandshakeWatch | None = HandshakeWatch(self.ctx, "trainer", endpoint)
        self.push = make_socket(self.ctx, zmq.PUSH, connect=endpoint, hwm=cfg.trainer.sample_hwm, immediate=True,
                                curve=keys.client("trainer") if keys else None, monitor=self.watch.address)
        self.watch.attach(self.push)
        # immediate: with no trainer connected (or one without the pinned trainer key) a send
        # fails (reported as backpressure) instead of queueing for a peer that may never come.
        self._append = redis.register_script(APPEND_LUA)
        self.partitions = sample_partitions(cfg)
        self.pushed = 0
        self.backpressured = 0

    # -- validation
    def parse(self, args: dict[str, Any]) -> list[Sample]:
        t = self.cfg.trainer
        mods = self.cfg.context.modalities
        try:
            if "samples" in args:
                if set(args) - {"samples"}:
                    raise SampleError("give either 'samples' or one sample's fields, not both")
                return parse_batch(args["samples"], max_bytes=t.max_sample_bytes,
                                   max_count=t.max_learn_batch, modalities=mods)
            return [parse_sample(args, max_bytes=t.max_sample_bytes, modalities=mods)]
        except SampleError:
            m.SAMPLES_REJECTED.labels("invalid").inc()
            raise

    async def check_contexts(self, principal: str, samples: list[Sample], *,
                             batch: bool = False) -> list[ContextWindow] | None:
        """Every (context_id, version) named must be readable now; else -32602, nothing written,
        its data naming the context, the version and (``batch``) the first sample that named it.
        Returns the windows read (what the samples will be trained with) while they fit in
        ``trainer.max_context_copy_bytes``, None once they do not: a batch may name thousands of
        windows, and holding them all until the end would let one call take gigabytes here."""
        wanted: dict[tuple[str, int | None], int] = {}  # (context, version) -> first sample naming it
        for i, s in enumerate(samples):
            if s.context_id is not None:
                wanted.setdefault((s.context_id, s.version), i)
        if not wanted:
            return []
        windows: list[ContextWindow] | None = []
        kept, cap = 0, self.cfg.trainer.max_context_copy_bytes
        if self.store is None:
            raise Unavailable("the context store is not available; samples with context_id cannot be checked")
        for (context_id, version), index in wanted.items():
            window, kind = None, ContextNotFound.kind
            try:
                current = await self.store.version(principal, context_id)
                kind = VersionUnavailable.kind
                if current is not None and version is not None and version <= int(current):
                    window = await self.store.read_at_version(principal, context_id, version)
            except ContextError:  # unknown context, or that version is no longer retained
                pass
            if window is None:
                m.SAMPLES_REJECTED.labels("context").inc()
                where = f"sample {index}: " if batch else ""
                data: dict[str, Any] = {"kind": kind, "context_id": context_id, "version": version}
                if batch:
                    data["index"] = index
                raise InvalidParams(f"{where}context {context_id!r} has no version {version} (unknown or no "
                                    "longer retained)", data)
            if windows is not None:
                kept += sum(len(e.content) for ch in window.channels.values() for e in ch)
                if kept <= cap:
                    windows.append(window)
                else:
                    windows = None
        return windows

    def _context_copy(self, windows: list[ContextWindow] | None) -> bytes:
        """The windows to store with the samples (``trainer.max_context_copy_bytes`` in all; over
        it — None — the trainer reads them from the store at their version, while it still retains them)."""
        if windows is None:
            m.SAMPLES_CONTEXT_NOT_COPIED.inc()
            return b""
        return pack_windows(windows) if windows else b""

    # -- write, then forward
    async def submit(self, principal: str, samples: list[Sample], *, admin: str | None = None,
                     batch: bool = False, request_id: str | None = None) -> dict[str, Any]:
        """Log ``samples`` as taught by ``principal`` (imported by the admin key named ``admin``)
        and wake the trainer. Raises :class:`LimitExceeded` (nothing written) while the
        log holds ``limits.max_sample_backlog`` samples the trainer has not trained.
        ``batch``: they came as a list, and an error names the sample by its index.
        ``request_id``: one of the principal's last 8 (within a day) logs nothing and answers
        that call again, with ``repeated``; the same id with another number of samples is -32602."""
        contexts = self._context_copy(await self.check_contexts(principal, samples, batch=batch))
        blobs = [s.to_json() for s in samples]
        part = partition_of(principal, self.partitions)
        trained_seq, trained_log = await self._trained(part)
        cap = self._partition_cap()
        last, entry, log_id, repeated = await self._log(
            part, [principal, len(blobs), batch_json(blobs), new_log_id(), contexts, trained_seq, trained_log, cap],
            (principal, request_id) if request_id else None)
        last = int(last)
        if last == -2:
            raise InvalidParams(f"request_id {request_id!r} was sent with {entry} sample(s), this call has "
                                f"{len(blobs)}: a retry sends the same samples; new samples take a new request_id",
                                {"request_id": request_id})
        if last < 0:
            m.SAMPLES_REJECTED.labels("backlog").inc()
            raise exceeded("sample_backlog", f"the trainer is behind: {entry} samples wait to be trained (at most "
                           f"{cap}); retry later", self.cfg.limits.backlog_retry_after_s)
        entry = entry.decode() if isinstance(entry, bytes) else str(entry)
        ids = [sample_id(entry, i, part) for i in range(len(blobs))]
        seqs = list(range(last - len(ids) + 1, last + 1))
        log_id = as_str(log_id)
        learned = learned_token(log_id, last, part)
        if repeated:  # logged, audited and announced to the trainer by the call it repeats
            return {"ids": ids, "seqs": seqs, "queued": False, "learned": learned, "repeated": True}
        m.SAMPLES_ACCEPTED.inc(len(ids))
        await self._audit(principal, log_entry(entry, part), seqs, sum(len(b) for b in blobs), admin)
        queued = self._wake_trainer(log_id, last, len(ids), part)
        return {"ids": ids, "seqs": seqs, "queued": queued, "learned": learned}

    def _partition_cap(self) -> int:
        """Each partition's share of ``limits.max_sample_backlog`` (0: off), never below one full
        ``learn`` batch: the bound over the whole log is at most partitions x that batch higher."""
        cap = self.cfg.limits.max_sample_backlog
        return max(-(-cap // self.partitions), self.cfg.trainer.max_learn_batch) if cap else 0

    async def _log(self, part: int, args: list[Any], request: tuple[str, str] | None = None) -> Any:
        """The append script's reply; with ``redis.wait_replicas`` the write is also confirmed by
        that many replicas (WAIT on the same connection, in the same round trip) or refused.
        ``request``: (principal, request id) of a call that named one."""
        log_keys = [keys.sample_log(part), keys.sample_seq(part), keys.sample_log_id(part)]
        if request is not None:
            log_keys.append(keys.sample_requests(part, request[0]))
            args = [*args, request[1]]
        if not self.cfg.redis.wait_replicas:
            return await self._append(keys=log_keys, args=args)
        try:
            return await self._append_confirmed(log_keys, args)
        except NoScriptError:
            await self.redis.script_load(APPEND_LUA)  # first use, or a master that never had it
            return await self._append_confirmed(log_keys, args)

    async def _append_confirmed(self, log_keys: list[str], args: list[Any]) -> Any:
        pipe = self.redis.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", self._append.sha, len(log_keys), *log_keys, *args)  # evalsha(): not in a cluster pipeline
        # on a cluster WAIT names no key: it goes to the node of the log's slot, next to the script
        where: dict[str, Any] = {"target_nodes": self.redis.get_node_from_key(log_keys[0])} \
            if isinstance(self.redis, aioredis.RedisCluster) else {}
        pipe.execute_command("WAIT", self.cfg.redis.wait_replicas, self.cfg.redis.wait_timeout_ms, **where)
        reply, acked = await pipe.execute()
        check_replicas(self.cfg.redis, int(acked))
        return reply

    async def _trained(self, part: int) -> tuple[int, str]:
        """The trainer's committed seq in partition ``part`` and the log it belongs to (what the
        backlog is counted from, and what the log's seqs continue after)."""
        seq, log_id = await self.redis.hmget(keys.TRAINER_OFFSET, [position_field("seq", part),
                                                                      position_field("log", part)])
        return int(seq or 0), as_str(log_id or b"")

    async def _audit(self, principal: str, entry: str, seqs: list[int], nbytes: int, admin: str | None) -> None:
        """Who taught what: the log entry (sample ids are ``<entry>:<index>``), seqs, count, bytes.
        The samples are durable already and their log entry names the principal too, so a lost
        record is logged, not answered as a failure."""
        try:
            await audit(self.redis, principal=principal, action="learn", entry=entry, first_seq=seqs[0],
                        last_seq=seqs[-1], count=len(seqs), bytes=nbytes, admin=admin)
        except (RedisError, OSError):
            log.warning("could not write the audit record of log entry %s", entry)

    def _wake_trainer(self, log_id: str, last_seq: int, n: int, part: int) -> bool:
        """Tell the trainer the log grew. ``log``: it notices a recreated log from the first
        wake-up, not only when it idles."""
        msg = wire.encode(wire.MsgType.SAMPLE, {"log": log_id, "seq": last_seq, "part": part})
        if self.watch is not None:
            self.watch.poll()  # report a trainer without the pinned key; reconnect when due
        try:
            self.push.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.backpressured += n
            m.SAMPLES_BACKPRESSURE.inc(n)
            return False
        self.pushed += n
        return True

    async def log_totals(self) -> LogTotals:
        """Entries, last seq and trained seq summed over every partition of the sample log, the
        backlog per partition summed, and the trainer's commit record."""
        parts = range(self.partitions)
        pipe = self.redis.pipeline(transaction=False)
        for p in parts:
            pipe.xlen(keys.sample_log(p))
            pipe.get(keys.sample_seq(p))
        pipe.hgetall(keys.TRAINER_OFFSET)
        *per_part, raw_offset = await pipe.execute()
        offset = {as_str(k): as_str(v) for k, v in (raw_offset or {}).items()}
        lengths, lasts = per_part[0::2], [int(v or 0) for v in per_part[1::2]]
        trained = [int(offset.get(position_field("seq", p), 0) or 0) for p in parts]
        return LogTotals(sum(lengths), sum(lasts), sum(trained),
                         sum(max(0, last - done) for last, done in zip(lasts, trained, strict=True)),
                         any(v is not None for v in per_part[1::2]), offset)

    async def stats(self) -> dict[str, Any]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(keys.TRAINER_STATUS)
        pipe.hvals(keys.TRAINER_SKIPPED)
        status, skipped_steps = await pipe.execute()
        totals = await self.log_totals()
        skipped: dict[str, int] = {}
        for step in skipped_steps or []:
            for item in as_str(step).split():
                reason = item.rpartition("=")[2]
                skipped[reason] = skipped.get(reason, 0) + 1
        status = {as_str(k): as_str(v) for k, v in (status or {}).items()}
        return {"log_entries": totals.entries, "last_seq": totals.last_seq, "trained_seq": totals.trained_seq,
                "lag": totals.backlog, "partitions": self.partitions, "trainer_offset": totals.offset,
                "trainer": status, "skipped": skipped,
                "pushed_by_this_gateway": self.pushed, "backpressured_by_this_gateway": self.backpressured}

    async def follow_trainer_link(self) -> None:
        """Read the trainer link's connection reports until cancelled. While the trainer is away
        libzmq reports every attempt to reach it (ten a second) through a queue that its one I/O
        thread blocks on once full, and with it every ZeroMQ socket of this replica (the worker
        links: heartbeats missed, inference refused); ``learn`` alone would leave the queue unread
        for as long as nobody teaches."""
        while True:
            if self.watch is not None:
                self.watch.poll()
            await pause(TRAINER_LINK_READ_S)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.push.close(0)
        if self._own_ctx:
            self.ctx.term()


def register(registry: Registry) -> None:
    @registry.tool("learn", description="Submit learning samples (one, or a batch under 'samples'). Each is an "
                   "example (input + target, optionally from a context at a version) or feedback on an earlier "
                   "generation (corrected answer or preference). Acknowledged after the durable write.",
                   input_schema=LEARN_INPUT_SCHEMA, output_schema=LEARN_OUTPUT_SCHEMA, title="Learn",
                   annotations={"destructiveHint": False, "idempotentHint": False})
    @announcing
    async def learn(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
        ingest = ctx.state.samples
        args = dict(args or {})
        request_id = args.pop("request_id", None)
        samples = ingest.parse(args)
        refund = await ctx.state.limits.admit_learn(ctx.principal, samples)
        try:
            out = await ingest.submit(ctx.principal, samples, batch="samples" in args, request_id=request_id)
        except Exception:
            await refund()  # nothing was written: the quota is not spent
            raise
        if out.get("repeated"):
            await refund()  # the call it repeats spent it
        return out
