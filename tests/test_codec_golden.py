"""The codec's output is pinned: every encoding mode produces exactly the chunk bodies it
produced when these digests were recorded.

A receiver decodes what any trainer of the same format sends, so a change to the encoder's
bytes is a format change. The digests cover the header and each chunk's decompressed body
(zstd's own output may differ between zstandard releases; the body is ours)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import orjson
import pytest
import torch
import zstandard

from shared.config import CompressionConfig
from shared.delta.codec import ChunkSink, DeltaEncoder, EncodedDelta

_STEPS = 3


def _params(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"emb": torch.randn(300, 40, generator=g).to(dtype), "w": torch.randn(64, 129, generator=g).to(dtype),
            "frozen": torch.zeros(2000, dtype=dtype), "bias": torch.randn(7, generator=g).to(dtype)}


def _move(params: dict[str, torch.Tensor], g: torch.Generator) -> None:
    for name, p in params.items():
        if name != "frozen":
            p.add_((torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype))


def _recorder(sent: list[tuple[int, bytes]]) -> ChunkSink:
    return lambda header, i, blob: sent.append((i, blob))


def _digest(enc: EncodedDelta, streamed: list[tuple[int, bytes]] | None = None) -> str:
    h = hashlib.sha256(orjson.dumps(enc.header, option=orjson.OPT_SORT_KEYS))
    zd = zstandard.ZstdDecompressor()
    blobs = [b for _, b in streamed] if streamed is not None else enc.chunks
    for blob in blobs:
        h.update(zd.decompress(blob))
    if streamed is not None:
        h.update(bytes(i for i, _ in streamed))
    return h.hexdigest()[:16]


def _run(dtype: torch.dtype = torch.float32, *, stream: bool = False, max_bytes: int | None = None,
         lossless: bool = False, anchor_at: int = 0, priority: str = "magnitude", **codec: Any) -> list[str]:
    params = _params(dtype)
    cfg = CompressionConfig(**{"block_size": 256, "chunk_elements": 2048, "density": 0.05, "tuner": "off", **codec})
    enc = DeltaEncoder(cfg, params, 0, "golden", priority_mode=priority)
    enc._rng = np.random.default_rng(3)  # the sampled threshold's offset
    g = torch.Generator().manual_seed(11)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for v in range(1, _STEPS + 1):
            _move(params, g)
            sent: list[tuple[int, bytes]] = []
            e = enc.encode(params, v, max_bytes=max_bytes, lossless=lossless, anchor=v == anchor_at or None,
                           sink=_recorder(sent) if stream else None)
            out.append(_digest(e, sent if stream else None))
        out.append(_digest(enc.snapshot()))
    finally:
        torch.set_num_threads(threads)
        enc.close()
    return out


GOLDEN: dict[str, tuple[dict[str, Any], list[str]]] = {
    "topk-int8": ({"quantization": "int8"},
        ['295c22cb947c837b', '97217ff28eca037d', '72ddcfd8d349ef94', '40594dbdff0bf175']),
    "topk-fp16": ({"quantization": "fp16"},
        ['6c091d95a7c7a309', '562a63600a9c9a37', '13f2cf18d5a992e2', '093f3510b392cb59']),
    "topk-sign": ({"quantization": "sign"},
        ['7afa3086abba425f', 'a83186d1e0941dde', '0dbfc8d2bae4c8bc', '3b35834d6d2dd6b0']),
    "topk-none": ({"quantization": "none"},
        ['bbd139da3e79f1d2', 'be88d7cfe408771b', 'ac4a6a89d68ac1f4', 'b6b5dc08bf2a4e33']),
    "threshold-int8": ({"algorithm": "threshold", "threshold": 1.5e-3},
        ['5a51b63218efced9', '4543f2de37a11f56', 'f2e88635489d7580', 'f6ac2326e711792b']),
    "dense-fp16": ({"algorithm": "dense", "quantization": "fp16"},
        ['096be6465583a0f2', '920b2dcd32714a04', '76ea38ecff6b9d54', '5357f9a442fc85c0']),
    "stream-int8": ({"stream": True},
        ['fbc84750babed50e', '7d985e25afc3784f', '03fb85436bc6dfdc', '40594dbdff0bf175']),
    "budget-magnitude": ({"max_bytes": 1500},
        ['c66e83937e387d12', '44daeb66760832b1', 'f6bb31bbf51fdcd5', '29789cb16626cea4']),
    "budget-layer": ({"max_bytes": 1500, "priority": "layer"},
        ['d7b092a8354581b4', '2f4d846f74e36262', 'd25ef6af7bcd5f7a', '7be017d697cccf23']),
    "lossless": ({"algorithm": "lossless"},
        ['075bcf3088fe44aa', 'de466a90dc3e8e08', '19c854e7dd352c01', '37e130bbfee0c5f4']),
    "lossless-flag-bf16": ({"lossless": True, "dtype": torch.bfloat16},
        ['2a0ff2d45d614e3a', '9a4a48ba902bb007', '4f8d4a9e76c676c1', 'f4632e9985dfb407']),
    "tuner-error": ({"tuner": "error", "tuner_target": 0.3},
        ["295c22cb947c837b", "22c84ebd09bbb619", "0558b6b38ae16df7", "fe024450a51b1ece"]),
    "tuner-bytes": ({"tuner": "bytes", "tuner_target": 1500},
        ["295c22cb947c837b", "6271049108845eb8", "ffdec671af79746d", "01bbb7af8906ef5f"]),
    "anchor": ({"anchor_at": 2},
        ['295c22cb947c837b', '13c7ba280d8ec10b', '51382685cd1212e3', 'e61aa0a300bbf0cd']),
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_encoded_bytes_match_the_recorded_digests(case: str) -> None:
    kwargs, expected = GOLDEN[case]
    assert _run(**kwargs) == expected
