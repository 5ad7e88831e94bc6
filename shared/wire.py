"""Wire format for every ZeroMQ message: a one-byte type frame, an orjson header frame,
then raw payload frames (tensors travel as their bytes, never pickled).

    [type:1 byte][header: orjson object][payload frame]...

Tensor frames are described in the header (``{"dtype": "float32", "shape": [..]}``) and
rebuilt with ``torch.frombuffer`` without an extra copy on receive.
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
    SAMPLE = 20        # gateway -> trainer: learning samples (PUSH/PULL)
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


def tensor_frame(t: Any) -> tuple[dict[str, Any], memoryview]:
    """Describe a tensor and expose its bytes without copying (contiguous CPU tensors)."""
    t = t.detach().contiguous().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    view = memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")
    return {"dtype": dtype, "shape": list(t.shape)}, view


def frame_tensor(meta: dict[str, Any], frame: Any) -> Any:
    """Rebuild a tensor from a header description and a raw frame (shares the frame's memory)."""
    import torch

    try:
        dtype = getattr(torch, meta["dtype"])
        shape = [int(s) for s in meta["shape"]]
    except (KeyError, AttributeError, TypeError, ValueError):
        raise WireError("bad tensor description") from None
    if not isinstance(dtype, torch.dtype):
        raise WireError("bad tensor dtype")
    buf = _as_bytes(frame)
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != len(buf):
        raise WireError("tensor frame size does not match its description")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=dtype).reshape(shape)
