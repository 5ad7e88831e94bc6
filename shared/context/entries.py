"""The stored form of an entry: a MessagePack array of the fields of ``Entry`` (content as
raw bytes, never base64). The entries of a window reply, joined behind one array header,
decode in one C call straight into ``Entry`` objects."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgspec

from shared.types import Entry

_ENCODE = msgspec.msgpack.Encoder().encode
_INTS = struct.Struct(">BIBIBQ")  # tokens, size_bytes, ts_ms of a stored entry (see pack_entry)
_DECODE_RUN = msgspec.msgpack.Decoder(list[Entry]).decode


def pack_entry(role: str, content: bytes, *, tokens: int, ts_ms: int, mime: str | None = None,
               links: Sequence[str] = ()) -> bytes:
    """The body of an entry's stored form: the MessagePack of its fields after id and
    modality (role, content, mime, tokens, size_bytes, ts_ms, links), without the array
    header. Its length is what budgets count. The script stores it behind the array header,
    the id and the modality (see stored_entry): only the script knows the sequence number.
    The integers have fixed widths (MessagePack uint32, uint32, uint64; decoders take any
    width), so an entry's counted size does not depend on its time or token count."""
    return b"".join((_ENCODE(role), _ENCODE(content), _ENCODE(mime), _INTS.pack(0xCE, tokens, 0xCE, len(content),
                                                                              0xCF, ts_ms), _ENCODE(tuple(links))))


def stored_entry(modality: str, seq: int, body: bytes) -> bytes:
    """An entry as the script stores it (see context.lua): a MessagePack array of the
    fields of ``Entry`` — what ``msgspec.msgpack.decode(.., type=Entry)`` reads back."""
    return b"\x99" + _ENCODE(f"{modality}:{seq}") + _ENCODE(modality) + body


def array_header(n: int) -> bytes:
    """The MessagePack header of an array of ``n`` items (a run of ``n`` stored entries)."""
    if n < 16:
        return bytes((0x90 + n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 65536 else b"\xdd" + n.to_bytes(4, "big")


def decode_run(values: Sequence[bytes]) -> list[Entry]:
    """Stored entries as ``Entry`` objects: one MessagePack array, one C call. A value that
    is not a stored entry raises ``msgspec.DecodeError``."""
    return _DECODE_RUN(b"".join((array_header(len(values)), *values)))
