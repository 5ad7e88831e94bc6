"""Rank 0's side of the sample stream: the Redis log (the one source of samples), ZeroMQ PULL
for the wake-ups that say it grew, context snapshots read at the version each sample names,
and the byte format in which a batch is broadcast to the other ranks.

Why rank 0 reads and broadcasts (rather than ranks reading disjoint partitions): the log
gives one total order (dense ``seq``), so a single committed offset describes exactly what
has been trained; with one reader the offset, the ledger and the batch boundaries are
decided in one place and every rank receives the *same bytes* — including the context
snapshot — and takes its strided shard of them. The cost is one broadcast of the raw
batch per step, small next to the gradient all-reduce.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import zmq
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.trainer.ledger import Position
from shared import keys, wire
from shared.config import Config
from shared.curve import CurveKeys
from shared.samples import LoggedSample, load_stored, parse_entry
from shared.text import as_str
from shared.types import ContextWindow, Entry
from shared.zmq_util import DroppedMessages, bind_address, make_socket

log = logging.getLogger("learnmesh.trainer.data")


class TrainRecord:
    """A sample plus the context snapshot it names: everything a rank needs to encode it."""

    __slots__ = ("logged", "context", "skip", "replay")

    def __init__(self, logged: LoggedSample, context: ContextWindow | None, skip: str = "",
                 replay: bool = False) -> None:
        self.logged = logged
        self.context = context
        self.skip = skip  # why it is consumed without a gradient ("": it is not; see leader.outcomes)
        self.replay = replay  # a further pass over a sample already trained (services/trainer/replay.py)


def encode_record(model: Any, record: TrainRecord, pair: tuple[str, str]) -> Any:
    """The model's example of ``record``: its context, prompt and target ``pair``, with the
    sample's modalities where the model takes them. Raises ``ValueError`` (MediaError,
    ModelInputError) for an input the model cannot encode."""
    mods = record.logged.sample.modalities
    if mods:
        try:
            return model.encode(record.context, pair[0], pair[1], modalities=mods)
        except TypeError:
            pass
    return model.encode(record.context, pair[0], pair[1])


# ---------------------------------------------------------------- batch bytes


def encode_batch(op: str, records: list[TrainRecord], extra: dict[str, Any] | None = None) -> bytes:
    """[8-byte header length][orjson header][raw entry contents]: no pickle, no base64."""
    blobs: list[bytes] = []
    out = []
    for r in records:
        ls = r.logged
        item: dict[str, Any] = {"id": ls.id, "e": ls.entry, "seq": ls.seq, "p": ls.principal, "s": ls.sample.to_dict(),
                                "pt": ls.partition, "skip": r.skip, "rp": r.replay}
        if r.context is not None:
            ents = []
            for mod, entries in r.context.channels.items():
                for e in entries:
                    ents.append({"id": e.id, "m": mod, "r": e.role, "mime": e.mime, "t": e.ts_ms,
                                 "n": len(e.content), "links": list(e.links)})
                    blobs.append(e.content)
            item["ctx"] = {"cid": r.context.context_id, "v": r.context.version, "e": ents}
        out.append(item)
    header = orjson.dumps({"op": op, "records": out, **(extra or {})})
    return struct.pack("<Q", len(header)) + header + b"".join(blobs)


def decode_batch(data: bytes | memoryview) -> tuple[str, list[TrainRecord], dict[str, Any]]:
    data = memoryview(data)
    (hlen,) = struct.unpack("<Q", data[:8])
    header = orjson.loads(bytes(data[8: 8 + hlen]))
    pos = 8 + hlen
    records = []
    for item in header.pop("records"):
        sample = load_stored(orjson.dumps(item["s"]))
        ctx = None
        if "ctx" in item:
            c = item["ctx"]
            channels: dict[str, list[Entry]] = {}
            for e in c["e"]:
                content = bytes(data[pos: pos + e["n"]])
                pos += e["n"]
                channels.setdefault(e["m"], []).append(
                    Entry(id=e["id"], modality=e["m"], role=e["r"], content=content, mime=e["mime"],
                          size_bytes=e["n"], ts_ms=e["t"], links=tuple(e["links"])))
            ctx = ContextWindow(item["p"], c["cid"], c["v"], channels)
        records.append(TrainRecord(LoggedSample(item["id"], item["seq"], item["p"], sample, item["e"],
                                                partition=int(item.get("pt", 0))), ctx,
                                   str(item.get("skip") or ""), bool(item.get("rp"))))
    op = header.pop("op")
    return op, records, header


# ---------------------------------------------------------------- context snapshots


class ContextReader:
    """Reads context snapshots through the (async) ContextStore on a private event loop thread."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._redis: Any = None

    def _start(self) -> None:
        from shared.context import ContextStore  # imported with the reader's first use
        from shared.redis_client import async_client

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ctx-reader", daemon=True)
        self._thread.start()

        async def make() -> Any:
            self._redis = async_client(self.cfg.redis)
            return ContextStore(self._redis, self.cfg.context)

        self._store = asyncio.run_coroutine_threadsafe(make(), self._loop).result(30)

    def read(self, principal: str, context_id: str, version: int, modalities: list[str] | None) -> ContextWindow:
        if self._loop is None:
            self._start()
        if self._loop is None:
            raise RuntimeError("the context reader's loop did not start")
        fut = asyncio.run_coroutine_threadsafe(
            self._store.read_at_version(principal, context_id, version, modalities=modalities), self._loop)
        return fut.result(30)

    async def _closed(self) -> None:
        if self._store is not None:
            await self._store.aclose()  # its batches first: a batch connecting would outlive the client
        await self._redis.aclose()

    def close(self) -> None:
        if self._loop is None:
            return
        if self._redis is not None:
            asyncio.run_coroutine_threadsafe(self._closed(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop.close()
        self._loop = None


# ---------------------------------------------------------------- the stream


class _Partition:
    """Rank 0's position in one partition of the sample log, and what it read ahead of it."""

    def __init__(self, index: int, pos: Position) -> None:
        self.index = index
        self.log_key, self.id_key = keys.sample_log(index), keys.sample_log_id(index)
        self.seq = pos.seq           # last seq handed out (== committed once the step commits)
        self.last_id = pos.id
        self.log_id = pos.log        # the partition's log identity that seq and last_id count in ("": not known yet)
        self.ahead: list[LoggedSample] = []  # read from the log, not handed out yet (seq order)
        self.read_id = ""            # last log entry read into ``ahead`` ("": none since the position)

    def position(self) -> Position:
        return Position(self.seq, self.last_id, self.log_id)

    def fill(self, redis: Any, limit: int) -> tuple[int, bool]:
        """Read log entries after the last one read until ``limit`` samples are ahead or the
        partition ends; returns the reads made, and whether the log is not ``log_id`` (the caller
        adopts or restarts on it: SampleSource.check_log). Each read takes the log's identity with
        its entries (one pipeline, one slot), so entries are never counted in a log they are not
        of, however the log changed since its identity was last looked at."""
        start = "(" + self.read_id if self.read_id else (self.last_id or "-")
        after = self.ahead[-1].seq if self.ahead else self.seq
        first, reads = len(self.ahead), 0
        while len(self.ahead) < limit:
            reads += 1
            pipe = redis.pipeline(transaction=False)
            pipe.get(self.id_key)
            pipe.xrange(self.log_key, min=start, max="+", count=8)
            raw_id, entries = pipe.execute()
            if (as_str(raw_id) if raw_id is not None else "") != self.log_id:
                return reads, True
            for eid, fields in entries:
                self.ahead.extend(s for s in parse_entry(eid, fields, self.index) if s.seq > after)
                self.read_id = as_str(eid)
            if len(entries) < 8:
                break
            start = "(" + self.read_id
        if len(self.ahead) > first and self.ahead[first].seq != after + 1:
            log.error("sample log partition %d does not continue at seq %d (found %d): entries were trimmed "
                      "before being trained; continuing from the log", self.index, after + 1, self.ahead[first].seq)
        return reads, False

    def restart(self, log_id: str) -> None:
        """Count from the start of the partition's log ``log_id``."""
        self.log_id, self.seq, self.last_id = log_id, 0, ""
        self.ahead, self.read_id = [], ""

    def take(self, n: int) -> list[LoggedSample]:
        got, self.ahead = self.ahead[:n], self.ahead[n:]
        if got:
            self.seq, self.last_id = got[-1].seq, got[-1].entry
        return got


class SampleSource:
    """Hands rank 0 the next samples of the log after the committed position of every partition.

    The Redis log is the only source of sample bodies and principals: what was acknowledged to
    a client is exactly what is trained. A push over PULL (bound here; gateways connect PUSH)
    is only a wake-up naming the log and its last seq, so a fresh sample is read at once
    instead of at the next idle poll; whatever else a pushed message carries is ignored, so a
    forged push can cost at most one log read, never a sample. Without pushes (a lost one, a
    gateway that died after its write) the log is read whenever a wait ends empty. Samples at
    or below a partition's committed seq are never handed out again: they are already in the
    model. A batch takes the oldest entries over all partitions first (stream ids are times),
    each partition in its own order, so one position per partition describes what was trained.
    """

    def __init__(self, cfg: Config, redis: Any, zmq_ctx: zmq.Context, positions: dict[int, Position],
                 contexts: ContextReader | None = None, partitions: int = 1) -> None:
        self.cfg = cfg
        self.redis = redis
        keys = CurveKeys.load(cfg.zmq, "trainer")
        self.pull = make_socket(zmq_ctx, zmq.PULL, bind=bind_address(cfg.trainer.samples_endpoint, cfg.zmq.bind_host), hwm=cfg.trainer.sample_hwm,
                                curve=keys.server("samples") if keys else None)
        self.dropped = DroppedMessages("samples", log)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.parts = [_Partition(p, positions.get(p, Position())) for p in range(partitions)]
        self.contexts = contexts
        self.on_reset: Callable[[int], None] | None = None  # called after a partition restarts on a new log
        self._backlog = True          # the log may hold more than a batch: read it without waiting
        self._woken = False           # a wake-up arrived since the log was last read
        self.wakeups = 0
        self.log_reads = 0

    def positions(self) -> dict[int, Position]:
        """What was handed out, per partition."""
        return {p.index: p.position() for p in self.parts}

    @property
    def ahead(self) -> int:
        return sum(len(p.ahead) for p in self.parts)

    def _drain(self, timeout_ms: int) -> None:
        """Take the wake-ups waiting on PULL (at most ``timeout_ms`` for the first one)."""
        wait = timeout_ms
        while self.poller.poll(wait):
            wait = 0
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                kind, header, _ = wire.decode(frames)
            except wire.WireError as exc:
                self.dropped.drop(exc)
                continue
            if kind != wire.MsgType.SAMPLE:
                self.dropped.drop(f"unexpected message type {kind.name}")
                continue
            self.wakeups += 1
            self._woken = True
            pushed_log, part = header.get("log"), header.get("part", 0)
            if (isinstance(pushed_log, str) and pushed_log and isinstance(part, int) and 0 <= part < len(self.parts)
                    and pushed_log != self.parts[part].log_id):
                self.check_log()  # adopt, or restart on, the logs Redis holds now (never the pushed name)

    def _fill(self, limit: int) -> None:
        for part in self.parts:
            reads, changed = part.fill(self.redis, limit)
            self.log_reads += reads
            if changed:  # adopt, or restart on, the log Redis holds now, then read it
                self.check_log()
                self.log_reads += part.fill(self.redis, limit)[0]

    def check_log(self) -> bool:
        """Follow each partition's log identity: adopt it when first seen; when it changes (the
        log was recreated: a Redis that lost its data, or emptied), start that partition over at
        its first sample. True when a position was reset."""
        pipe = self.redis.pipeline(transaction=False)
        for part in self.parts:
            pipe.get(part.id_key)
        reset = False
        for part, raw in zip(self.parts, pipe.execute(), strict=True):
            current = as_str(raw) if raw is not None else ""
            if current == part.log_id:
                continue
            if not part.log_id:
                part.log_id = current
                continue
            self._restart(part, current)
            reset = True
        return reset

    def _restart(self, part: _Partition, current: str) -> None:
        from shared import metrics

        log.warning("sample log partition %d changed (%s, trained up to seq %d, is gone; now %s): training the "
                    "current log from its start, keeping the weights", part.index, part.log_id, part.seq,
                    current or "no log yet")
        metrics.TRAINER_LOG_RESETS.inc()
        if part.log_id:
            self.redis.delete(keys.model_version_seq(part.index, part.log_id))
        part.restart(current)
        self._backlog = True
        if self.on_reset is not None:
            self.on_reset(part.index)

    def next_batch(self, limit: int, wait_ms: int, stop: Callable[[], bool]) -> list[LoggedSample]:
        """Up to ``limit`` samples continuing the stream; [] after ``wait_ms`` with nothing new.
        Short of a full batch it waits (up to ``wait_ms``) for wake-ups, unless a backlog is
        being read, which goes out at once."""
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            self._drain(0)
            if self._backlog or self._woken:
                self._woken = False
                backlog, self._backlog = self._backlog, False
                self._fill(limit)
                if backlog and self.ahead:
                    self._backlog = self.ahead >= limit  # a full batch: maybe more behind it
                    break
            if self.ahead >= limit:
                break
            remaining = int((deadline - time.monotonic()) * 1000)
            if remaining > 0 and not stop():
                self._drain(min(remaining, 50))
                continue
            if not self.ahead:  # idle: read anyway, a push may have been refused or lost
                self.check_log()
                self._fill(limit)
                self._backlog = self.ahead >= limit
            break
        return self._oldest(limit)

    def _oldest(self, limit: int) -> list[LoggedSample]:
        """Up to ``limit`` samples, the oldest log entries over every partition first."""
        if len(self.parts) == 1:
            return self.parts[0].take(limit)
        heads = {p.index: 0 for p in self.parts}
        for _ in range(limit):
            waiting = [p for p in self.parts if heads[p.index] < len(p.ahead)]
            if not waiting:
                break
            first = min(waiting, key=lambda p: _stream_time(p.ahead[heads[p.index]].entry))
            heads[first.index] += 1
        return [s for p in self.parts for s in p.take(heads[p.index])]

    def records(self, samples: list[LoggedSample]) -> list[TrainRecord]:
        out: list[TrainRecord] = []
        for s in samples:
            ctx = s.window  # copied at acceptance: no store read, cannot have aged out
            if ctx is None and s.sample.context_id is not None and s.sample.version is not None:
                try:
                    if self.contexts is None:
                        raise RuntimeError("no context reader is configured")
                    ctx = self.contexts.read(s.principal, s.sample.context_id, s.sample.version,
                                             s.sample.modalities)
                except (RedisConnectionError, RedisTimeoutError):
                    raise  # Redis unreachable: fail the step (and restart), never skip the sample
                except Exception as exc:  # snapshot evicted since the gateway checked it
                    log.warning("sample %s: context %s@%s unreadable (%s); consumed without training",
                                s.id, s.sample.context_id, s.sample.version, type(exc).__name__)
                    out.append(TrainRecord(s, None, skip="context_gone"))
                    continue
            out.append(TrainRecord(s, ctx))
        return out

    def close(self) -> None:
        self.pull.close(0)


def _stream_time(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    return int(ms or 0), int(n or 0)
