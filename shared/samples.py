"""Learning samples: the one schema the gateway validates and the trainer reads.

Two kinds, a tagged union on ``kind`` (msgspec structs; their JSON Schema is the ``learn``
tool's, :func:`learn_input_schema`):

* :class:`Example` — an input and the target continuation, optionally taken from a context
  snapshot. A sample that names a context must name the version it was taken from, so
  every trainer rank reads the same bytes (context is data, never model state).
* :class:`Feedback` — on an earlier generation: a corrected answer trains
  ``input -> corrected``; an up-vote trains ``input -> output``; a down-vote is logged and
  consumed but carries no gradient (no unlikelihood objective).

``kind`` may be left out: a sample with a ``generation_id`` is feedback, any other an example.
:func:`parse_sample` turns untrusted JSON into a :data:`Sample` or raises
:class:`SampleError`; the canonical JSON (:meth:`Example.to_json`) is what the durable log
stores and what the size limit (``trainer.max_sample_bytes``) is measured against.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from shared.context.validation import REQUEST_ID_PATTERN
from shared.text import as_str
from shared.types import ContextWindow, Entry

if TYPE_CHECKING:
    from shared.config import Config

log = logging.getLogger("learnmesh.samples")


class SampleError(ValueError):
    """A sample is malformed, empty or too big; ``index`` is its position in a batch."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"sample {index}: {message}")
        self.index = index


Text = Annotated[str, Meta(min_length=1)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]
# The context store's id (shared/context/validation.py): a malformed id is named as such, not
# looked up and reported as a context without that version.
ContextId = Annotated[str, Meta(min_length=1, max_length=128, pattern="^[A-Za-z0-9][A-Za-z0-9._:-]*$",
                                description="the context the sample was taken from")]
Version = Annotated[int, Meta(ge=1, description="context version the sample was taken from (versions start at 1)")]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _not_blank(**fields: str | None) -> None:
    for name, value in fields.items():
        _check(value is None or bool(value.strip()), f"'{name}' must not be blank")


def _check_context(context_id: str | None, version: int | None, modalities: list[str] | None) -> None:
    _not_blank(context_id=context_id)
    _check(context_id is not None or version is None, "'version' needs 'context_id'")
    _check(context_id is None or version is not None, "a sample taken from a context must name its 'version'")
    _check(context_id is not None or modalities is None, "'modalities' needs 'context_id'")
    _check(modalities is None or len(modalities) > 0, "'modalities' must not be empty (leave it out for all)")


class _Sample(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """What both kinds share: the tag and the canonical encoding."""

    @property
    def kind(self) -> str:
        """``example`` or ``feedback``, the tag of the JSON form."""
        return str(self.__struct_config__.tag)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def to_json(self) -> bytes:
        """Canonical JSON: what the log stores and the size limit measures."""
        return msgspec.json.encode(self)


class Example(_Sample, tag="example"):
    """An input and the continuation to learn from it."""

    input: Annotated[str, Meta(description="the prompt / input text")]
    target: Annotated[Text, Meta(description="the continuation to learn")]
    context_id: ContextId | None = None
    version: Version | None = None
    modalities: list[str] | None = None

    def __post_init__(self) -> None:
        _not_blank(target=self.target)
        _check_context(self.context_id, self.version, self.modalities)

    def training_pair(self) -> tuple[str, str] | None:
        """(prompt, target) this sample teaches."""
        return self.input, self.target


class Feedback(_Sample, tag="feedback", kw_only=True):
    """A verdict on an earlier generation: a corrected answer, or a preference."""

    input: Annotated[Text, Meta(description="the prompt / input text")]
    context_id: ContextId | None = None
    version: Version | None = None
    modalities: list[str] | None = None
    generation_id: Annotated[Id, Meta(description="the generation it refers to")]
    output: Annotated[Text, Meta(description="the generated answer")] | None = None
    corrected: Annotated[Text, Meta(description="the corrected answer")] | None = None
    preference: Literal["up", "down"] | None = None

    def __post_init__(self) -> None:
        _not_blank(input=self.input, generation_id=self.generation_id, output=self.output,
                   corrected=self.corrected)
        _check_context(self.context_id, self.version, self.modalities)
        _check(self.corrected is not None or self.preference is not None,
               "feedback needs 'corrected' or 'preference'")
        _check(self.preference != "up" or self.corrected is not None or self.output is not None,
               "an up-vote needs the generated 'output' it approves")

    def training_pair(self) -> tuple[str, str] | None:
        """(prompt, target) this sample teaches, or None when it carries no gradient."""
        if self.corrected:
            return self.input, self.corrected
        if self.preference == "up" and self.output:
            return self.input, self.output
        return None


Sample = Example | Feedback


class SampleBatch(msgspec.Struct, forbid_unknown_fields=True):
    """Several samples, accepted all or none."""

    samples: Annotated[list[Sample], Meta(min_length=1)]


REQUEST_ID_SCHEMA: dict[str, Any] = {
    "type": "string", "pattern": f"^{REQUEST_ID_PATTERN}$",
    "description": "makes a retry safe: a learn naming the request_id of one of your last 8 learn calls "
                   "that named one (within a day) logs nothing and answers that call's ids, seqs and learned "
                   "token (with repeated: true)"}


def learn_input_schema() -> dict[str, Any]:
    """The ``learn`` tool's inputSchema: one sample (its fields at top level) or a batch
    under ``samples``, from the structs above."""
    (example, feedback, batch), defs = msgspec.json.schema_components(
        (Example, Feedback, SampleBatch), ref_template="#/$defs/{name}")
    # msgspec's tagged-union schema requires the tag and names it in an OpenAPI
    # "discriminator"; here ``kind`` may be left out, so neither holds.
    for name in ("Example", "Feedback"):
        defs[name]["required"].remove("kind")
    defs["SampleBatch"]["properties"]["samples"]["items"].pop("discriminator")
    for name in ("Example", "Feedback", "SampleBatch"):  # the call's, not a sample's: see SampleIngest.submit
        defs[name]["properties"]["request_id"] = REQUEST_ID_SCHEMA
    return {"type": "object", "anyOf": [example, feedback, batch], "$defs": defs,
            "description": "One sample (its fields at top level) or a batch under 'samples'."}


def parse_sample(obj: Any, *, max_bytes: int, modalities: list[str] | None = None,
                 index: int | None = None) -> Sample:
    """Validate one untrusted sample object; return it or raise SampleError."""
    try:
        return _parse(obj, max_bytes, modalities)
    except SampleError as exc:
        if index is None:
            raise
        raise SampleError(str(exc), index) from None


def _parse(obj: Any, max_bytes: int, modalities: list[str] | None) -> Sample:
    if not isinstance(obj, dict):
        raise SampleError("a sample must be a JSON object")
    if "kind" not in obj:
        obj = {"kind": "feedback" if "generation_id" in obj else "example", **obj}
    version = obj.get("version")
    if isinstance(version, float) and version.is_integer() and abs(version) <= 2**53:  # JSON Schema's integer includes 3.0
        obj = {**obj, "version": int(version)}
    try:
        sample: Sample = msgspec.convert(obj, Sample)
    except msgspec.ValidationError as exc:
        raise SampleError(str(exc)) from None
    size = len(sample.to_json())  # first: the errors below name what was sent
    if size > max_bytes:
        raise SampleError(f"sample is {size} bytes, over the limit of {max_bytes}")
    # Checked here, on what arrives, not in the structs: the log may hold such samples from
    # before, and refusing them when the trainer decodes them would skip their whole entry.
    twice = _repeated(sample.modalities or ())
    if twice:
        raise SampleError(f"duplicate modality in 'modalities': {_names(twice)}")
    unknown = sorted(set(sample.modalities or ()) - set(modalities)) if modalities is not None else []
    if unknown:
        raise SampleError(f"unknown modality: {_names(unknown)}")
    return sample


def _names(names: list[str]) -> str:
    """Names for an error message, each cut to a modality's longest (32) and at most 8 of them:
    the error goes back to whoever sent them, however long they were."""
    shown = [n if len(n) <= 32 else n[:32] + "…" for n in names[:8]]
    return ", ".join(shown) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")


def _repeated(names: Iterable[str]) -> list[str]:
    """The names that occur more than once, sorted (linear: the list is not bounded yet)."""
    seen: set[str] = set()
    twice: set[str] = set()
    for n in names:
        (twice if n in seen else seen).add(n)
    return sorted(twice)


def parse_batch(items: Any, *, max_bytes: int, max_count: int,
                modalities: list[str] | None = None) -> list[Sample]:
    """Validate a batch: every sample or none (the first bad one raises with its index)."""
    if not isinstance(items, list) or not items:
        raise SampleError("'samples' must be a non-empty list")
    if len(items) > max_count:
        raise SampleError(f"a batch holds at most {max_count} samples")
    return [parse_sample(o, max_bytes=max_bytes, modalities=modalities, index=i) for i, o in enumerate(items)]


_STORED = msgspec.json.Decoder(Sample)
_STORED_BATCH = msgspec.json.Decoder(list[Sample])


def load_stored(raw: bytes | str | memoryview) -> Sample:
    """Rebuild a sample from the log's canonical JSON."""
    return _STORED.decode(raw)


# ---------------------------------------------------------------- the durable log

# One round trip appends a batch: the dense sequence numbers (INCRBY) and ONE stream entry
# holding the whole batch are written atomically, so seq order == log order across gateway
# replicas and a gap in seq is visible to the trainer. One entry per batch (not per sample)
# keeps the Redis cost of a 500-sample `learn` call close to that of one sample.
# Entry fields: seq (first seq of the batch), n, p (principal), s (JSON array of samples), and
# c (the context windows the samples name, copied at acceptance: :func:`pack_windows`) when any.
# The first append also names the log (KEYS[3], SET NX with the caller's fresh random id): a
# log that is recreated gets a new name, and the trainer never mixes two logs' sequence numbers.
# The log is bounded: with a cap (ARGV[8], 0: none), a batch that would leave more than that many
# samples not yet trained (beyond the trainer's committed seq ARGV[6], if it belongs to this log:
# ARGV[7]) is refused with {-1, backlog, ''} and nothing is written; the log is never trimmed
# to make room.
REQUEST_IDS = 8  # a principal's learn request ids kept per partition (retries come before 8 newer calls)
REQUEST_IDS_TTL_S = 86_400  # and for how long after its last learn with one
APPEND_LUA = """
local n = tonumber(ARGV[2])
local cap = tonumber(ARGV[8])
-- ARGV[9], with KEYS[4] (keys.sample_requests): the call's request id. One of the principal's
-- last REQUEST_IDS ids for this same log answers that append again and logs nothing (a retry);
-- the same id for another number of samples is refused ({-2, n of the first}).
local rid = ARGV[9] or ''
if rid ~= '' then
  local current = redis.call('GET', KEYS[3])
  for _, rec in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
    local r, rn, rlast, rentry, rlog = string.match(rec, '^([^|]*)|(%d+)|(%d+)|([^|]*)|(.*)$')
    if r == rid and rlog == current then
      if tonumber(rn) ~= n then return {-2, tonumber(rn), '', 0} end
      return {tonumber(rlast), rentry, rlog, 1}
    end
  end
end
local trained = 0
if redis.call('GET', KEYS[3]) == ARGV[7] then trained = tonumber(ARGV[6]) end
local seq = tonumber(redis.call('GET', KEYS[2]) or '0')
if cap > 0 then
  local backlog = math.max(0, seq - trained)
  if backlog + n > cap then return {-1, backlog, '', 0} end
end
redis.call('SET', KEYS[3], ARGV[4], 'NX')
-- A failover can lose the newest entries (written after the master's last replication) once
-- the trainer has trained them: the counter then stands below the trainer's position, and
-- the seqs it would hand out again are skipped by the trainer. Counting on from the trainer's
-- position keeps every seq new.
if seq < trained then redis.call('SET', KEYS[2], trained) end
local last = redis.call('INCRBY', KEYS[2], n)
local id
if ARGV[5] == '' then
  id = redis.call('XADD', KEYS[1], '*', 'seq', last - n + 1, 'n', n, 'p', ARGV[1], 's', ARGV[3])
else
  id = redis.call('XADD', KEYS[1], '*', 'seq', last - n + 1, 'n', n, 'p', ARGV[1], 's', ARGV[3], 'c', ARGV[5])
end
local logid = redis.call('GET', KEYS[3])
if rid ~= '' then
  redis.call('LPUSH', KEYS[4], rid .. '|' .. n .. '|' .. last .. '|' .. id .. '|' .. logid)
  redis.call('LTRIM', KEYS[4], 0, REQUEST_IDS - 1)
  redis.call('EXPIRE', KEYS[4], REQUEST_IDS_TTL_S)
end
return {last, id, logid, 0}
""".replace("REQUEST_IDS_TTL_S", str(REQUEST_IDS_TTL_S)).replace("REQUEST_IDS", str(REQUEST_IDS))


def new_log_id() -> str:
    """A fresh identity for a sample log (passed to every append; only the first one sticks)."""
    import secrets

    return secrets.token_hex(8)


_WINDOWS = msgspec.msgpack.Decoder(list[tuple[str, str, int, dict[str, list[Entry]]]])


def pack_windows(windows: list[ContextWindow]) -> bytes:
    """The context windows a batch of samples names, as one binary blob (MessagePack; entry
    contents stay raw bytes). Copied into the log at acceptance, so a sample trains on the
    context it was taken from however many versions are written before the trainer reaches it."""
    return msgspec.msgpack.encode([(w.principal, w.context_id, w.version, w.channels) for w in windows])


def unpack_windows(blob: bytes | memoryview) -> dict[tuple[str, int], ContextWindow]:
    """(context id, version) -> window, from :func:`pack_windows`."""
    return {(cid, v): ContextWindow(p, cid, v, channels) for p, cid, v, channels in _WINDOWS.decode(blob)}


def attach_windows(samples: list[LoggedSample], blob: bytes | memoryview | None) -> None:
    """Give each sample the copied window it names (samples whose window was not copied keep
    ``window=None`` and are read from the context store at their version)."""
    if not blob:
        return
    windows = unpack_windows(blob)
    for s in samples:
        if s.sample.context_id is not None and s.sample.version is not None:
            s.window = windows.get((s.sample.context_id, s.sample.version))


def learned_token(log_id: str, last_seq: int, partition: int = 0) -> str:
    """What ``learn`` answers and ``generate`` / ``score`` accept as ``after_learn``: the log
    partition's identity, the last seq of the call's samples in it, and (beyond partition 0)
    the partition."""
    return f"{log_id}.{last_seq}" if partition == 0 else f"{log_id}.{last_seq}.{partition}"


_LEARNED = re.compile(r"([0-9A-Za-z]{1,64})\.([0-9]{1,18})(?:\.([0-9]{1,4}))?")  # ASCII: str.isdigit takes '٣'


def parse_learned_token(token: Any) -> tuple[str, int, int]:
    """(log id, seq, partition) of an ``after_learn`` token; ValueError when it is not one."""
    m = _LEARNED.fullmatch(token) if isinstance(token, str) else None
    if m is None:
        raise ValueError("after_learn must be the 'learned' token a learn call returned")
    return m[1], int(m[2]), int(m[3] or 0)


def log_entry(entry_id: str, partition: int = 0) -> str:
    """A log entry's name across partitions: its stream id, after ``<partition>/`` beyond
    partition 0 (entry ids of two partitions' streams may be equal)."""
    return entry_id if partition == 0 else f"{partition}/{entry_id}"


def sample_id(entry_id: str, index: int, partition: int = 0) -> str:
    """A sample's id: its log entry (:func:`log_entry`) and its position in that entry."""
    return f"{log_entry(entry_id, partition)}:{index}"


def position_field(name: str, partition: int) -> str:
    """The trainer commit record's field ``name`` (seq, id, log) of ``partition`` (keys.TRAINER_OFFSET)."""
    return name if partition == 0 else f"{name}.{partition}"


def partition_of(principal: str, partitions: int) -> int:
    """The sample-log partition of ``principal``'s samples: the same in every process."""
    return zlib.crc32(principal.encode()) % partitions


def sample_partitions(cfg: Config) -> int:
    """``trainer.sample_partitions``, or its default: 1 on one server, 8 on a Redis Cluster."""
    from shared.redis_client import is_cluster

    if cfg.trainer.sample_partitions is not None:
        return cfg.trainer.sample_partitions
    return CLUSTER_SAMPLE_PARTITIONS if is_cluster(cfg.redis) else 1


CLUSTER_SAMPLE_PARTITIONS = 8


def batch_json(blobs: list[bytes]) -> bytes:
    return b"[" + b",".join(blobs) + b"]"


@dataclass
class LoggedSample:
    """One sample of the log, as the trainer sees it (``entry``: its stream entry id)."""

    id: str
    seq: int
    principal: str
    sample: Sample
    entry: str = ""
    window: ContextWindow | None = None  # the context it names, when copied at acceptance
    partition: int = 0  # of the sample log


def parse_entry(entry_id: bytes | str, fields: dict[Any, Any], partition: int = 0) -> list[LoggedSample]:
    """Expand one XRANGE entry of a sample-log partition (keys.sample_log) into its samples.

    An entry that cannot be read (written in another format, or damaged) is skipped with an
    error in the log: one poison entry in the durable log must not stop training for good."""
    def get(name: str) -> Any:
        return fields.get(name.encode(), fields.get(name))

    eid = as_str(entry_id)
    try:
        principal = as_str(get("p"))
        first = int(get("seq"))
        samples = _STORED_BATCH.decode(get("s"))
        out = [LoggedSample(sample_id(eid, i, partition), first + i, principal, sample, eid, partition=partition)
               for i, sample in enumerate(samples)]
        attach_windows(out, get("c"))
        return out
    except (KeyError, TypeError, ValueError, AttributeError, msgspec.DecodeError) as exc:
        if eid not in _REPORTED_BAD and len(_REPORTED_BAD) < 10_000:
            _REPORTED_BAD.add(eid)
            log.error("skipping unreadable sample log entry %s: %s", eid, exc)
        return []


_REPORTED_BAD: set[str] = set()  # entries already reported, so a re-read does not repeat the error
