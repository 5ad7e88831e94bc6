"""Inference request/reply shapes between the gateway's WorkerPool and workers.

An INFER message carries the request in its header and the context entries' contents as raw
frames (binary image/audio bytes travel as they are, never base64)::

    INFER  {"id", "op": "generate"|"score", "prompt", "target"?, "max_tokens", "temperature",
            "seed"?, "modalities"?, "stream"?: bool (default true: send TOKENs),
            "entries": [{"id","modality","role","mime","ts_ms"}, ...]}
           + one frame per entry (its content)
    TOKEN  {"id", "text", "version"}                      partial text (UTF-8 safe deltas)
    RESULT {"id", "version", "model_id", "text", "tokens", "finish_reason"}   (generate)
           {"id", "version", "model_id", "nll", "tokens"}                     (score)
    ERROR  {"id", "version", "code": "bad_input"|"cancelled"|"internal", "message"}
    HELLO  {"gateway"}            gateway -> worker, every heartbeat interval
    HEARTBEAT {"worker", "version", "load", "model_id", "max_batch_size"}   reply to HELLO
    CANCEL {"id"}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared.types import Entry

if TYPE_CHECKING:
    from shared.config import Config

ENTRY_DESCRIPTION_BYTES = 1024
"""Room for one entry's description in an INFER header (its id, modality, role, mime of at
most 128 bytes JSON-escaped, time)."""
FRAME_SLACK_BYTES = 64 * 1024


def max_frame_bytes(cfg: Config) -> int:
    """The longest frame a gateway sends a worker (the worker's ROUTER disconnects a peer that
    sends a longer one): an entry's content, or the header, which holds what the client sent
    (a body of at most ``gateway.max_body_bytes``) and one description per entry of the window."""
    ctx = cfg.context
    entries = ctx.channel_max_entries * len(ctx.modalities)
    header = cfg.gateway.max_body_bytes + entries * ENTRY_DESCRIPTION_BYTES
    return max(ctx.max_entry_bytes, header) + FRAME_SLACK_BYTES


REPLY_TOKEN_BYTES = 4096
"""Room in a reply for one generated token: its text JSON-escaped, with room to spare."""


def max_reply_frame_bytes(cfg: Config) -> int:
    """The longest frame a worker sends a gateway: a RESULT's text of at most
    ``worker.max_tokens_limit`` tokens, or a shorter TOKEN, ERROR or HEARTBEAT."""
    return cfg.worker.max_tokens_limit * REPLY_TOKEN_BYTES + FRAME_SLACK_BYTES


def pack_entries(entries: Sequence[Entry], text_tail_bytes: int | None = None
                 ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Descriptions and content frames of ``entries``. ``text_tail_bytes``: a text entry goes as
    its last that many bytes, all a model of that ``max_seq`` reads of it (its tokens are bytes),
    so an entry of megabytes does not travel whole with every request."""
    meta = [{"id": e.id, "modality": e.modality, "role": e.role, "mime": e.mime, "ts_ms": e.ts_ms}
            for e in entries]
    if text_tail_bytes is None:
        return meta, [bytes(e.content) for e in entries]
    return meta, [bytes(e.content[-text_tail_bytes:] if e.modality == "text" else e.content) for e in entries]


def unpack_entries(meta: Any, frames: Sequence[Any]) -> list[Entry]:
    if not isinstance(meta, list) or len(meta) != len(frames):
        raise ValueError("entries header does not match the content frames")
    out = []
    for m, f in zip(meta, frames, strict=True):
        if not isinstance(m, dict) or not isinstance(m.get("modality"), str) or not isinstance(m.get("role"), str):
            raise ValueError("bad entry description")
        content = bytes(f.buffer if hasattr(f, "buffer") else f)
        out.append(Entry(str(m.get("id", "")), m["modality"], m["role"], content, m.get("mime"),
                         size_bytes=len(content), ts_ms=int(m.get("ts_ms") or 0)))
    return out
