"""Wire format for every ZeroMQ message: a one-byte type frame, an orjson header frame,
then raw payload frames (binary payloads travel as their bytes, never pickled).

    [type:1 byte][header: orjson object][payload frame]...
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import orjson


class WireError(ValueError):
    """A message could not be decoded (bad type byte, bad header, missing frames)."""


class MsgType(enum.IntEnum):
    # gateway <-> worker
    INFER = 1          # gateway -> worker: generate / score request
    TOKEN = 2          # worker -> gateway: streamed partial text
    RESULT = 3         # worker -> gateway: final result
    ERROR = 4          # worker -> gateway: request failed
    HEARTBEAT = 5      # worker -> gateway: alive, version, load
    HELLO = 6          # gateway -> worker: register this DEALER
    CANCEL = 7         # gateway -> worker: drop a request
    # samples
    SAMPLE = 20        # gateway -> trainer: the sample log grew (a wake-up; the log holds the samples)
    # deltas / snapshots (Clone pattern)
    DELTA = 40         # trainer PUB -> workers
    SNAPSHOT_REQ = 41  # worker -> trainer ROUTER
    SNAPSHOT = 42      # trainer -> worker
    ACK = 43           # worker -> trainer: applied version
    CONTROL = 50       # admin control messages (drain, pause, rollback ...)


def encode(msg_type: MsgType, header: dict[str, Any], frames: Sequence[bytes | memoryview] = ()) -> list:
    """Build the multipart frame list for ``socket.send_multipart(..., copy=False)``."""
    return [bytes((int(msg_type),)), orjson.dumps(header), *frames]


def decode(frames: Sequence[bytes | memoryview | Any]) -> tuple[MsgType, dict[str, Any], list]:
    """Split a multipart message into (type, header, payload frames); raise WireError if malformed."""
    if len(frames) < 2:
        raise WireError("message has fewer than two frames")
    raw_type = _as_bytes(frames[0])
    if len(raw_type) != 1:
        raise WireError("type frame must be one byte")
    try:
        msg_type = MsgType(raw_type[0])
    except ValueError:
        raise WireError(f"unknown message type {raw_type[0]}") from None
    try:
        header = orjson.loads(_as_bytes(frames[1]))
    except orjson.JSONDecodeError:
        raise WireError("header frame is not JSON") from None
    if not isinstance(header, dict):
        raise WireError("header must be a JSON object")
    return msg_type, header, list(frames[2:])


def _as_bytes(frame: Any) -> bytes | memoryview:
    if isinstance(frame, (bytes, memoryview)):
        return frame
    return frame.buffer  # zmq.Frame
