"""Learning samples: the one schema the gateway validates and the trainer reads.

Two kinds:

* ``example`` — an input and the target continuation, optionally taken from a context
  snapshot: ``{"kind": "example", "input": str, "target": str,
  "context_id": str?, "version": int?, "modalities": [str]?}``. A sample that names a
  context must name the version it was taken from, so every trainer rank reads the same
  bytes (context is data, never model state).
* ``feedback`` — on an earlier generation: ``{"kind": "feedback", "generation_id": str,
  "input": str, "output": str?, "corrected": str?, "preference": "up"|"down"?}``.
  A corrected answer trains ``input -> corrected``; an up-vote trains ``input -> output``;
  a down-vote is logged and consumed but carries no gradient (no unlikelihood objective).

:func:`parse_sample` turns untrusted JSON into a canonical :class:`Sample` or raises
:class:`SampleError`; the canonical JSON (:meth:`Sample.to_json`) is what the durable log
stores and what the size limit (``trainer.max_sample_bytes``) is measured against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from shared.types import ContextWindow, Entry

log = logging.getLogger("learnmesh.samples")

KINDS = ("example", "feedback")
PREFERENCES = ("up", "down")
_MAX_ID_CHARS = 256


class SampleError(ValueError):
    """A sample is malformed, empty or too big; ``index`` is its position in a batch."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"sample {index}: {message}")
        self.index = index


@dataclass
class Sample:
    kind: str
    input: str
    target: str = ""                       # example: the continuation to learn
    context_id: str | None = None
    version: int | None = None
    modalities: list[str] | None = None
    generation_id: str | None = None       # feedback only
    output: str | None = None
    corrected: str | None = None
    preference: str | None = None
    _json: bytes | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "input": self.input}
        for name in ("target", "context_id", "version", "modalities", "generation_id",
                     "output", "corrected", "preference"):
            value = getattr(self, name)
            if value not in (None, ""):
                out[name] = value
        return out

    def to_json(self) -> bytes:
        """Canonical JSON (computed once: validation measures it, the log stores it)."""
        if self._json is None:
            self._json = orjson.dumps(self.to_dict())
        return self._json

    def training_pair(self) -> tuple[str, str] | None:
        """(prompt, target) this sample teaches, or None when it carries no gradient."""
        if self.kind == "example":
            return self.input, self.target
        if self.corrected:
            return self.input, self.corrected
        if self.preference == "up" and self.output:
            return self.input, self.output
        return None


def _str(obj: dict[str, Any], name: str, *, required: bool, allow_empty: bool = False,
         max_chars: int | None = None) -> str | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise SampleError(f"'{name}' is required")
        return None
    if not isinstance(value, str):
        raise SampleError(f"'{name}' must be a string")
    if not allow_empty and not value.strip():
        raise SampleError(f"'{name}' must not be empty")
    if max_chars is not None and len(value) > max_chars:
        raise SampleError(f"'{name}' is longer than {max_chars} characters")
    return value


def parse_sample(obj: Any, *, max_bytes: int, modalities: list[str] | None = None,
                 index: int | None = None) -> Sample:
    """Validate one untrusted sample object; return its canonical form or raise SampleError."""
    try:
        return _parse(obj, max_bytes, modalities)
    except SampleError as exc:
        if index is None:
            raise
        raise SampleError(str(exc), index) from None


def _parse(obj: Any, max_bytes: int, modalities: list[str] | None) -> Sample:
    if not isinstance(obj, dict):
        raise SampleError("a sample must be a JSON object")
    kind = obj.get("kind", "feedback" if "generation_id" in obj else "example")
    if kind not in KINDS:
        raise SampleError(f"'kind' must be one of {', '.join(KINDS)}")
    known = {"kind", "input", "target", "context_id", "version", "modalities", "generation_id",
             "output", "corrected", "preference"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise SampleError(f"unknown field(s): {', '.join(unknown)}")
    if kind == "example":
        sample = Sample("example", input=_str(obj, "input", required=True, allow_empty=True) or "",
                        target=_str(obj, "target", required=True) or "")
        for name in ("generation_id", "output", "corrected", "preference"):
            if name in obj:
                raise SampleError(f"'{name}' belongs to feedback samples")
    else:
        sample = Sample("feedback", input=_str(obj, "input", required=True) or "",
                        generation_id=_str(obj, "generation_id", required=True, max_chars=_MAX_ID_CHARS),
                        output=_str(obj, "output", required=False),
                        corrected=_str(obj, "corrected", required=False),
                        preference=_str(obj, "preference", required=False))
        if "target" in obj:
            raise SampleError("'target' belongs to example samples (use 'corrected')")
        if sample.preference is not None and sample.preference not in PREFERENCES:
            raise SampleError("'preference' must be 'up' or 'down'")
        if sample.corrected is None and sample.preference is None:
            raise SampleError("feedback needs 'corrected' or 'preference'")
        if sample.preference == "up" and sample.corrected is None and not sample.output:
            raise SampleError("an up-vote needs the generated 'output' it approves")
    _parse_context(obj, sample, modalities)
    size = len(sample.to_json())
    if size > max_bytes:
        raise SampleError(f"sample is {size} bytes, over the limit of {max_bytes}")
    return sample


def _parse_context(obj: dict[str, Any], sample: Sample, modalities: list[str] | None) -> None:
    sample.context_id = _str(obj, "context_id", required=False, max_chars=_MAX_ID_CHARS)
    version = obj.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise SampleError("'version' must be a non-negative integer")
    if sample.context_id is None and version is not None:
        raise SampleError("'version' needs 'context_id'")
    if sample.context_id is not None and version is None:
        raise SampleError("a sample taken from a context must name its 'version'")
    sample.version = version
    mods = obj.get("modalities")
    if mods is not None:
        if sample.context_id is None:
            raise SampleError("'modalities' needs 'context_id'")
        if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
            raise SampleError("'modalities' must be a list of strings")
        if modalities is not None and (bad := sorted(set(mods) - set(modalities))):
            raise SampleError(f"unknown modality: {', '.join(bad)}")
        sample.modalities = list(mods)


def parse_batch(items: Any, *, max_bytes: int, max_count: int,
                modalities: list[str] | None = None) -> list[Sample]:
    """Validate a batch: every sample or none (the first bad one raises with its index)."""
    if not isinstance(items, list) or not items:
        raise SampleError("'samples' must be a non-empty list")
    if len(items) > max_count:
        raise SampleError(f"a batch holds at most {max_count} samples")
    return [parse_sample(o, max_bytes=max_bytes, modalities=modalities, index=i) for i, o in enumerate(items)]


def load_stored(raw: bytes | str | memoryview) -> Sample:
    """Rebuild a sample from the log's canonical JSON (already validated when written)."""
    return _from_obj(orjson.loads(raw))


# ---------------------------------------------------------------- the durable log

# One round trip appends a batch: the dense sequence numbers (INCRBY) and ONE stream entry
# holding the whole batch are written atomically, so seq order == log order across gateway
# replicas and a gap in seq is visible to the trainer. One entry per batch (not per sample)
# keeps the Redis cost of a 500-sample `learn` call close to that of one sample.
# Entry fields: seq (first seq of the batch), n, p (principal), s (JSON array of samples), and
# c (the context windows the samples name, copied at acceptance: :func:`pack_windows`) when any.
# The first append also names the log (KEYS[3], SET NX with the caller's fresh random id): a
# log that is recreated gets a new name, and the trainer never mixes two logs' sequence numbers.
APPEND_LUA = """
local n = tonumber(ARGV[2])
redis.call('SET', KEYS[3], ARGV[4], 'NX')
local last = redis.call('INCRBY', KEYS[2], n)
local id
if ARGV[5] == '' then
  id = redis.call('XADD', KEYS[1], '*', 'seq', last - n + 1, 'n', n, 'p', ARGV[1], 's', ARGV[3])
else
  id = redis.call('XADD', KEYS[1], '*', 'seq', last - n + 1, 'n', n, 'p', ARGV[1], 's', ARGV[3], 'c', ARGV[5])
end
return {last, id, redis.call('GET', KEYS[3])}
"""


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


def learned_token(log_id: str, last_seq: int) -> str:
    """What ``learn`` answers and ``generate`` / ``score`` accept as ``after_learn``: the log and
    the last seq of the call's samples."""
    return f"{log_id}.{last_seq}"


def parse_learned_token(token: Any) -> tuple[str, int]:
    """(log id, seq) of an ``after_learn`` token; ValueError when it is not one."""
    if not isinstance(token, str) or token.count(".") != 1:
        raise ValueError("after_learn must be the 'learned' token a learn call returned")
    log_id, _, seq = token.partition(".")
    if not log_id or not log_id.isalnum() or len(log_id) > 64 or not seq.isdigit() or len(seq) > 18:
        raise ValueError("after_learn must be the 'learned' token a learn call returned")
    return log_id, int(seq)


def sample_id(entry_id: str, index: int) -> str:
    """A sample's id: its log entry's stream id and its position in that entry."""
    return f"{entry_id}:{index}"


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


def parse_entry(entry_id: bytes | str, fields: dict[Any, Any]) -> list[LoggedSample]:
    """Expand one XRANGE entry of keys.SAMPLE_LOG into its samples.

    An entry that cannot be read (written in another format, or damaged) is skipped with an
    error in the log: one poison entry in the durable log must not stop training for good."""
    def get(name: str) -> Any:
        return fields.get(name.encode(), fields.get(name))

    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    try:
        principal = get("p")
        principal = principal.decode() if isinstance(principal, bytes) else str(principal)
        first = int(get("seq"))
        objs = orjson.loads(get("s"))
        if not isinstance(objs, list):
            raise TypeError("'s' is not a list of samples")
        out = [LoggedSample(sample_id(eid, i), first + i, principal, _from_obj(obj), eid)
               for i, obj in enumerate(objs)]
        attach_windows(out, get("c"))
        return out
    except (KeyError, TypeError, ValueError, AttributeError, msgspec.DecodeError) as exc:  # orjson.JSONDecodeError is a ValueError
        if eid not in _REPORTED_BAD and len(_REPORTED_BAD) < 10_000:
            _REPORTED_BAD.add(eid)
            log.error("skipping unreadable sample log entry %s: %s", eid, exc)
        return []


_REPORTED_BAD: set[str] = set()  # entries already reported, so a re-read does not repeat the error


def _from_obj(obj: dict[str, Any]) -> Sample:
    return Sample(kind=obj["kind"], input=obj.get("input", ""), target=obj.get("target", ""),
                  context_id=obj.get("context_id"), version=obj.get("version"),
                  modalities=obj.get("modalities"), generation_id=obj.get("generation_id"),
                  output=obj.get("output"), corrected=obj.get("corrected"),
                  preference=obj.get("preference"))
