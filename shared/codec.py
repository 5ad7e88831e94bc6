"""Weight-delta codec: what the trainer sends to inference workers after an optimizer step.

The encoder keeps a *reference*: a flat copy of exactly what every receiver holds. A delta
is ``new - reference``; only part of it is sent (magnitude selection, quantisation), and the
reference is advanced by exactly what the receivers will apply. What was not sent stays in
``new - reference`` and goes out with the next delta — this is error feedback, and it is why
lossy coding does not drift: the served weights trail the trainer's by a bounded residual.

Pipeline of a lossy delta (on the flat layout order of the parameters, in blocks of
``block_size`` elements):

1. threshold: either fixed, or estimated for a target density from a strided sample of
   ``new - reference`` (a full ``torch.topk`` over 10M elements is ~10x slower than the whole encode),
2. one fused pass over cache-sized tiles: subtract, energy, change detection (unchanged tiles are
   skipped), magnitude, compare, nonzero — the full delta is never materialised,
3. quantisation of the selected values with a per-block scale (fp16, int8 or sign),
4. index coding per chunk: fixed-width gaps (narrowest dtype), or a bitmap when the chunk is dense,
5. zstandard over each chunk.

A lossless mode sends the XOR of the changed elements' bit patterns (bit-exact), and full
anchors (every ``anchor_every`` publishes, and for snapshots) resend the reference densely.

Wire shape: :class:`EncodedDelta` = a small JSON-able header (format, model id, base and new
version, parameter-layout hash, codec parameters, chunk count) + independent chunk blobs,
each ``zstd(CHUNK_HDR | scales | index bytes | value bytes)``. A decoder refuses a delta whose
model, layout or base version does not match what it holds, and validates every chunk fully
before anything is applied (:meth:`DeltaDecoder.decode` then :meth:`DeltaDecoder.apply`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import torch
import zstandard

from shared.config import CompressionConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: fixed-width gap index coding (IDX_GAPS) replaces varints on the encode side
CHUNK_MAGIC = b"LMC1"
# magic, kind, quant, index coding, reserved, chunk number, start, end, count, n scales
CHUNK_HDR = struct.Struct("<4sBBBBIQQQI")
MAX_CHUNK_BYTES = 256 * 1024 * 1024  # decompressed; far below the AEAD limit and sane for memory

KIND_SPARSE, KIND_XOR, KIND_DENSE = 0, 1, 2
QUANT_NONE, QUANT_FP16, QUANT_INT8, QUANT_SIGN = 0, 1, 2, 3
IDX_VARINT, IDX_BITMAP, IDX_NONE, IDX_GAPS = 0, 1, 2, 3
_GAP_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_QUANT_CODES = {"none": QUANT_NONE, "fp16": QUANT_FP16, "int8": QUANT_INT8, "sign": QUANT_SIGN}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


class CodecError(ValueError):
    """A delta could not be decoded (malformed, inconsistent or corrupt); nothing was applied."""


class BaseMismatch(CodecError):
    """The delta was encoded against a different base version than the receiver holds."""


class LayoutMismatch(CodecError):
    """The delta belongs to another model or another parameter layout."""


# ---------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtype of the parameters, in order; its hash goes on the wire."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    offsets: np.ndarray = field(compare=False, repr=False)  # start of each param in the flat view
    numel: int = 0
    digest: str = ""

    @classmethod
    def of(cls, params: dict[str, torch.Tensor]) -> Layout:
        if not params:
            raise CodecError("no parameters")
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) != 1:
            raise CodecError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        if dtype not in _DTYPES.values():
            raise CodecError(f"unsupported parameter dtype {dtype}")
        names = tuple(params)
        shapes = tuple(tuple(int(s) for s in params[n].shape) for n in names)
        sizes = np.array([math.prod(s) for s in shapes], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        desc = orjson.dumps({"names": names, "shapes": shapes, "dtype": str(dtype)})
        digest = hashlib.sha256(desc).hexdigest()[:32]
        return cls(names, shapes, dtype, offsets, int(offsets[-1]), digest)

    def check(self, params: dict[str, torch.Tensor]) -> None:
        for name, shape in zip(self.names, self.shapes, strict=True):
            p = params.get(name)
            if p is None or tuple(p.shape) != shape or p.dtype != self.dtype:
                raise LayoutMismatch(f"parameter {name!r} does not match the layout")
            if not p.is_contiguous():
                raise CodecError(f"parameter {name!r} is not contiguous")


def flatten(params: dict[str, torch.Tensor], layout: Layout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the parameters into one flat tensor (padded with zeros to ``out``'s length)."""
    if out is None:
        out = torch.zeros(layout.numel, dtype=layout.dtype)
    with torch.no_grad():
        for i, name in enumerate(layout.names):
            a, b = int(layout.offsets[i]), int(layout.offsets[i + 1])
            out[a:b].copy_(params[name].detach().reshape(-1))
    return out


_TILE_ELEMENTS = 1 << 18  # 1 MiB of fp32 per tile: delta, magnitudes and mask stay in cache (measured best)


def _tile_segments(layout: Layout, tile: int, padded: int) -> list[tuple[int, int, list[tuple[str, int, int, int]]]]:
    """Cut the flat space into tiles; per tile, the parameter pieces that cover it
    (name, offset inside the parameter, flat start, flat end). Padding past ``numel`` is
    zeroed once in the tile buffer by the caller (it never changes)."""
    out = []
    offs = layout.offsets
    for t0 in range(0, padded, tile):
        t1 = min(padded, t0 + tile)
        segs = []
        i = max(0, int(np.searchsorted(offs, t0, side="right")) - 1)
        while i < len(layout.names) and int(offs[i]) < t1:
            a, b = max(t0, int(offs[i])), min(t1, int(offs[i + 1]))
            if b > a:
                segs.append((layout.names[i], a - int(offs[i]), a, b))
            i += 1
        out.append((t0, t1 - t0, segs))
    return out


def _scatter_add(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """``t[idx] += values`` for unique indices, in ``t``'s dtype. Encoder and decoder both go
    through here, so the reference and every receiver stay bit-identical. numpy's fancy
    indexing is about twice as fast as ``index_add_`` for scattered fp32/fp64 updates; other
    dtypes (bf16, fp16) keep torch's arithmetic."""
    if t.dtype in (torch.float32, torch.float64):
        tn = t.numpy()
        i = idx.numpy()
        tn[i] += values.numpy()
    else:
        t.index_add_(0, idx, values)


# ---------------------------------------------------------------------------- small codings


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128 of non-negative integers, vectorised."""
    v = values.astype(np.uint64, copy=False)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for j in range(1, 10):
        more = v >= np.uint64(1 << (7 * j))
        if not more.any():
            break
        nbytes += more
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for j in range(int(nbytes.max())):
        sel = nbytes > j
        part = (v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        cont = (nbytes[sel] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + j] = (part | cont).astype(np.uint8)
    return out.tobytes()


def varint_decode(data: bytes | memoryview, count: int) -> np.ndarray:
    """Inverse of :func:`varint_encode`; raises :class:`CodecError` on malformed input."""
    b = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise CodecError("trailing index bytes")
        return np.zeros(0, dtype=np.uint64)
    term = (b & 0x80) == 0
    ends = np.flatnonzero(term)
    if ends.size != count or b.size == 0 or not term[-1]:
        raise CodecError("index varints do not match the element count")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts + 1
    if int(lens.max()) > 9:
        raise CodecError("varint too long")
    pos = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lens)
    contrib = (b & 0x7F).astype(np.uint64) << (7 * pos).astype(np.uint64)
    return np.add.reduceat(contrib, starts)


def _code_indices(idx: np.ndarray, start: int, end: int) -> tuple[bytes, int]:
    """Sorted indices in [start, end): gaps ``idx[i] - idx[i-1] - 1`` in the narrowest
    unsigned width that holds them (one width byte, then the byte-plane shuffled gaps, which
    zstd squeezes as well as varints at a fraction of the cost), or a bitmap when smaller."""
    gaps = np.diff(idx, prepend=start - 1) - 1
    top = int(gaps.max()) if gaps.size else 0
    width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
    if idx.size * width > (end - start) / 8:
        bm = np.zeros(end - start, dtype=np.bool_)
        bm[idx - start] = True
        return np.packbits(bm).tobytes(), IDX_BITMAP
    return bytes([width]) + _shuffle(gaps.astype(_GAP_DTYPES[width])), IDX_GAPS


def _decode_gaps(data: memoryview, count: int, span: int) -> np.ndarray:
    """Inverse of the IDX_GAPS coding: gaps as int64; raises :class:`CodecError`."""
    if len(data) < 1 or data[0] not in _GAP_DTYPES:
        raise CodecError("bad index width")
    gaps = _unshuffle(data[1:], _GAP_DTYPES[data[0]], count).astype(np.int64)
    if count and int(gaps.max()) >= span:
        raise CodecError("index out of range")
    return gaps


def _shuffle(arr: np.ndarray) -> bytes:
    """Byte-plane shuffle (all first bytes, then all second bytes ...): helps zstd on floats."""
    if arr.itemsize == 1:
        return arr.tobytes()
    return np.ascontiguousarray(arr.view(np.uint8).reshape(-1, arr.itemsize).T).tobytes()


def _unshuffle(data: bytes | memoryview, np_dtype: Any, count: int) -> np.ndarray:
    itemsize = np.dtype(np_dtype).itemsize
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size != count * itemsize:
        raise CodecError("value bytes do not match the element count")
    if itemsize == 1:
        return raw.view(np_dtype).copy()
    out = np.ascontiguousarray(raw.reshape(itemsize, count).T)
    if not out.flags.writeable:  # one element: the transpose is already contiguous, still a view
        out = out.copy()
    return out.view(np_dtype).reshape(-1)


# ---------------------------------------------------------------------------- encoded form


@dataclass
class EncodedDelta:
    """One delta or anchor: header (JSON-able) plus chunk blobs, most important first."""

    header: dict[str, Any]
    chunks: list[bytes]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks) + len(orjson.dumps(self.header))


@dataclass
class DecodedChunk:
    kind: int
    start: int
    end: int
    idx: np.ndarray | None  # sorted global element indices (None: dense range)
    values: torch.Tensor  # param dtype (sparse/dense) or int view (xor)


@dataclass
class DecodedDelta:
    header: dict[str, Any]
    chunks: list[DecodedChunk]

    @property
    def version(self) -> int:
        return int(self.header["version"])


# ---------------------------------------------------------------------------- encoder


class DeltaEncoder:
    """Encode ``new - reference`` and advance the reference by exactly what was sent.

    ``reference`` starts as the given parameters (what a snapshot gives a receiver).
    """

    def __init__(self, cfg: CompressionConfig, params: dict[str, torch.Tensor], version: int,
                 model_id: str, priority_mode: str = "magnitude") -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.layout = Layout.of(params)
        self.layout.check(params)
        self.block = cfg.block_size
        self.nblocks = max(1, -(-self.layout.numel // self.block))
        padded = self.nblocks * self.block
        self.ref = torch.zeros(padded, dtype=self.layout.dtype)
        flatten(params, self.layout, self.ref)
        # tile buffers: the lossy pass runs over the flat space in cache-sized tiles, so the
        # delta, its magnitudes and the selection mask of a tile never leave the CPU cache
        self._tile = max(self.block, (_TILE_ELEMENTS // self.block) * self.block)
        self._td = torch.empty(self._tile, dtype=torch.float32)
        self._ta = torch.empty(self._tile, dtype=torch.float32)
        self._tm = torch.empty(self._tile, dtype=torch.bool)
        self._segments = _tile_segments(self.layout, self._tile, padded)
        self._xor: torch.Tensor | None = None  # lossless XOR buffer, allocated on first use
        self._zc = zstandard.ZstdCompressor(level=cfg.zstd_level)
        self.version = version
        self.priority_mode = priority_mode
        self.density = cfg.density
        self.threshold = cfg.threshold
        self.publishes = 0
        self.chunk_blocks = max(1, cfg.chunk_elements // self.block)
        self._rng = np.random.default_rng()
        self.last_stats: dict[str, Any] = {}

    # ---------------------------------------------------------------- public API
    def encode(self, params: dict[str, torch.Tensor], version: int, *, anchor: bool | None = None,
               max_bytes: int | None = None) -> EncodedDelta:
        """Encode the change from the reference (at ``self.version``) to ``params`` at ``version``.

        ``anchor=None`` follows ``anchor_every``. ``max_bytes`` caps the delta: chunks go out
        most important first and the rest stays in the residual (error feedback).
        """
        if version <= self.version:
            raise CodecError(f"new version {version} must exceed the reference version {self.version}")
        self.layout.check(params)
        t0 = time.perf_counter()
        if anchor is None:
            anchor = self.cfg.anchor_every > 0 and (self.publishes + 1) % self.cfg.anchor_every == 0
        if self.cfg.max_ratio > 0:
            cap = int(self.layout.numel * 4 / self.cfg.max_ratio)
            max_bytes = cap if max_bytes is None else min(max_bytes, cap)
        if anchor:
            flatten(params, self.layout, self.ref)
            enc = self._dense(version, base=self.version)
            enc.header["kind"] = "anchor"
        elif self.cfg.algorithm == "lossless":
            enc = self._lossless(params, version, max_bytes)
        else:
            enc = self._lossy(params, version, max_bytes)
        self.publishes += 1
        self.version = version
        enc.stats.update(encode_s=time.perf_counter() - t0, bytes=enc.nbytes,
                         dense_fp32_bytes=self.layout.numel * 4, density_target=self.density,
                         kind=enc.header["kind"])
        self.last_stats = enc.stats
        if self.cfg.tuner != "off" and enc.header["kind"] == "delta":
            self._tune(enc.stats)
        return enc

    def snapshot(self) -> EncodedDelta:
        """The reference as a dense anchor at the current version (what a new receiver loads)."""
        return self._dense(self.version, base=None)

    def residual_norm(self, params: dict[str, torch.Tensor]) -> float:
        """L2 norm of what receivers still lack: ``params - reference``."""
        flat = flatten(params, self.layout).float()
        return float(torch.linalg.vector_norm(flat - self.ref[: self.layout.numel].float()))

    def tuner_report(self) -> dict[str, Any]:
        return {"mode": self.cfg.tuner, "target": self.cfg.tuner_target, "density": self.density,
                "threshold": self.threshold,
                "last_bytes": self.last_stats.get("bytes"), "last_rel_error": self.last_stats.get("rel_error")}

    # ---------------------------------------------------------------- internals
    def _header(self, kind: str, base: int | None, version: int, nchunks: int) -> dict[str, Any]:
        return {"fmt": FORMAT_VERSION, "model": self.model_id, "layout": self.layout.digest,
                "kind": kind, "base": base, "version": version, "numel": self.layout.numel,
                "codec": {"algorithm": self.cfg.algorithm, "quant": self.cfg.quantization,
                          "block": self.block, "density": round(self.density, 8),
                          "threshold": self.threshold},
                "nchunks": nchunks}

    def _dense(self, version: int, base: int | None) -> EncodedDelta:
        step = self.chunk_blocks * self.block
        chunks = []
        n = self.layout.numel
        ref_bytes = self.ref[:n]
        for i, a in enumerate(range(0, n, step)):
            b = min(n, a + step)
            raw = ref_bytes[a:b].view(_INT_VIEW[self.layout.dtype.itemsize]).numpy()
            body = CHUNK_HDR.pack(CHUNK_MAGIC, KIND_DENSE, QUANT_NONE, IDX_NONE, 0, i, a, b, b - a, 0)
            chunks.append(self._zc.compress(body + _shuffle(raw)))
        return EncodedDelta(self._header("anchor", base, version, len(chunks)), chunks,
                            {"selected": n, "density": 1.0})

    def _select(self, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
        """One fused pass over ``new - reference``: change detection, energy and selection.

        Returns sorted global indices, their fp32 delta values, the threshold used, the total
        squared delta norm and the number of changed blocks. The pass walks the flat space in
        cache-sized tiles (block aligned): per tile, one subtraction per overlapping parameter,
        magnitudes, changed blocks (unchanged tiles are skipped), energy, comparison with the
        threshold and one nonzero — so the 10M-element delta is read from memory once and never
        materialised.
        """
        cfg = self.cfg
        if cfg.algorithm == "dense":
            thr = 0.0
        elif cfg.algorithm == "threshold":
            thr = float(self.threshold)
        else:
            thr = self._sampled_threshold(params)
        fp32 = self.layout.dtype == torch.float32
        block = self.block
        numel = self.layout.numel
        total_sq = 0.0
        active = 0
        idx_parts: list[torch.Tensor] = []
        val_parts: list[torch.Tensor] = []
        ref = self.ref
        with torch.no_grad():
            for t_start, t_len, segs in self._segments:
                d = self._td[:t_len]
                if t_start + t_len > numel:
                    d[max(0, numel - t_start):].zero_()  # padding past the last parameter
                for name, p_lo, a, b in segs:  # flat range [a, b) of parameter `name`, from p_lo
                    p = params[name].detach().reshape(-1)[p_lo:p_lo + b - a]
                    out = d[a - t_start:b - t_start]
                    if fp32:
                        torch.sub(p, ref[a:b], out=out)
                    else:
                        torch.sub(p.float(), ref[a:b].float(), out=out)
                dn = d.numpy()
                mag = self._ta[:t_len].numpy()
                np.abs(dn, out=mag)
                block_max = mag.reshape(-1, block).max(axis=1)
                changed = int(np.count_nonzero(block_max))
                if changed == 0:
                    continue  # change detection: nothing in this tile moved
                active += changed
                if float(block_max.max()) < 1e-18:  # squares would underflow in fp32
                    total_sq += float(np.dot(dn.astype(np.float64), dn.astype(np.float64)))
                else:
                    total_sq += float(np.dot(dn, dn))
                m = self._tm[:t_len].numpy()
                if thr > 0:
                    np.greater_equal(mag, np.float32(thr), out=m)
                else:
                    np.greater(mag, 0, out=m)
                local = torch.from_numpy(np.flatnonzero(m))
                if local.numel():
                    val_parts.append(torch.index_select(d, 0, local))
                    idx_parts.append(local.add_(t_start))
        if not idx_parts:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0), thr, total_sq, active
        return torch.cat(idx_parts), torch.cat(val_parts), thr, total_sq, active

    def _lossy(self, params: dict[str, torch.Tensor], version: int, max_bytes: int | None) -> EncodedDelta:
        cfg = self.cfg
        idx_t, vals, thr, total_sq, n_active = self._select(params)
        if n_active == 0:
            return EncodedDelta(self._header("delta", self.version, version, 0), [],
                                {"selected": 0, "density": 0.0, "residual_norm": 0.0, "rel_error": 0.0,
                                 "active_blocks": 0})
        idx = idx_t.numpy()
        blk_t = torch.div(idx_t, self.block, rounding_mode="floor")
        quant = _QUANT_CODES[cfg.quantization]
        # quantise every selected value at once with its block's scale (max |value| in the block)
        # (sign: one bit per value and the block's mean |value| — error feedback absorbs the rest)
        scales = torch.zeros(self.nblocks, dtype=torch.float32).scatter_reduce_(
            0, blk_t, vals.abs(), "mean" if quant == QUANT_SIGN else "amax", include_self=False)
        scales[scales == 0] = 1.0
        per = torch.index_select(scales, 0, blk_t)
        if quant == QUANT_FP16:
            q = (vals / per).to(torch.float16)
            deq = q.float().mul_(per)
        elif quant == QUANT_INT8:
            q = torch.round(vals / per * 127.0).to(torch.int8)
            deq = q.float().mul_(per / 127.0)
        elif quant == QUANT_SIGN:
            q = torch.where(vals < 0, -1, 1).to(torch.int8)
            deq = q.float().mul_(per)
        else:
            q, deq = vals, vals
        err = vals - deq
        deq_t = deq.to(self.layout.dtype)
        # chunks: contiguous ranges of blocks; rank them by selected energy (or keep layer order)
        step = self.chunk_blocks * self.block
        bounds = np.searchsorted(idx, np.arange(0, self.nblocks * self.block + step, step))
        sq = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.float64), (vals.double() ** 2)]), 0).numpy()
        esq = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.float64), (err.double() ** 2)]), 0).numpy()
        pieces = [(c, int(bounds[c]), int(bounds[c + 1])) for c in range(len(bounds) - 1)
                  if bounds[c + 1] > bounds[c]]
        if self.priority_mode == "magnitude":
            pieces.sort(key=lambda x: -(sq[x[2]] - sq[x[1]]))
        qn = q.numpy()
        scales_n = scales.numpy()
        chunks: list[bytes] = []
        sent: list[tuple[int, int]] = []
        sent_sq = err_sq = 0.0
        used = 0
        header_bytes = 400
        for c, lo, hi in pieces:
            start = c * step
            end = min(self.layout.numel, start + step)
            blob = self._sparse_chunk(len(chunks), start, end, idx[lo:hi], qn[lo:hi], scales_n, quant)
            if max_bytes is not None and chunks and used + len(blob) + header_bytes > max_bytes:
                continue  # not sent: stays in the residual
            used += len(blob)
            chunks.append(blob)
            sent.append((lo, hi))
            sent_sq += sq[hi] - sq[lo]
            err_sq += esq[hi] - esq[lo]
        if len(sent) == len(pieces):
            _scatter_add(self.ref, idx_t, deq_t)
        else:
            for lo, hi in sent:
                _scatter_add(self.ref, idx_t[lo:hi], deq_t[lo:hi])
        residual_sq = max(0.0, total_sq - sent_sq + err_sq)
        enc = EncodedDelta(self._header("delta", self.version, version, len(chunks)), chunks)
        enc.stats.update(selected=int(idx.size), density=idx.size / self.layout.numel,
                         threshold=thr, residual_norm=math.sqrt(residual_sq),
                         rel_error=math.sqrt(residual_sq / total_sq) if total_sq else 0.0,
                         active_blocks=n_active, chunks_dropped=len(pieces) - len(chunks))
        return enc

    def _sampled_threshold(self, params: dict[str, torch.Tensor]) -> float:
        """|delta| threshold that keeps about ``density`` of all elements, estimated from a
        strided sample of ``new - reference`` (a few ten thousand elements; no sort of the whole)."""
        n = self.layout.numel
        if self.density >= 1.0:
            return 0.0
        samples = min(n, max(65536, int(64 / max(self.density, 1e-9))))
        stride = max(1, n // samples)
        off = int(self._rng.integers(0, stride)) if stride > 1 else 0
        lay = self.layout
        parts = []
        with torch.no_grad():
            for i, name in enumerate(lay.names):
                a, b = int(lay.offsets[i]), int(lay.offsets[i + 1])
                first = a + (off - a) % stride  # first sampled flat position >= a
                if first >= b:
                    continue
                p = params[name].detach().reshape(-1)[first - a:b - a:stride]
                parts.append(p.float() - self.ref[first:b:stride].float())
        if not parts:
            return 0.0
        s = torch.cat(parts).abs_()
        kth = min(s.numel(), max(1, int(round((1.0 - self.density) * s.numel()))))
        return float(torch.kthvalue(s, kth).values)

    def _sparse_chunk(self, number: int, start: int, end: int, idx: np.ndarray, q: np.ndarray,
                      scales: np.ndarray, quant: int) -> bytes:
        b0 = start // self.block
        nsc = -(-(end - start) // self.block)
        idx_bytes, code = _code_indices(idx, start, end)
        body = b"".join([
            CHUNK_HDR.pack(CHUNK_MAGIC, KIND_SPARSE, quant, code, 0, number, start, end, idx.size, nsc),
            scales[b0:b0 + nsc].tobytes(), struct.pack("<Q", len(idx_bytes)), idx_bytes, _shuffle(q)])
        return self._zc.compress(body)

    def _lossless(self, params: dict[str, torch.Tensor], version: int, max_bytes: int | None) -> EncodedDelta:
        lay = self.layout
        itype = _INT_VIEW[lay.dtype.itemsize]
        ref_i = self.ref.view(itype)
        if self._xor is None:
            self._xor = torch.zeros_like(ref_i)
        x = self._xor
        with torch.no_grad():
            for i, name in enumerate(lay.names):
                a, b = int(lay.offsets[i]), int(lay.offsets[i + 1])
                p = params[name].detach().reshape(-1).view(itype)
                torch.bitwise_xor(p, ref_i[a:b], out=x[a:b])
        xn = x[: lay.numel].numpy()
        idx = np.flatnonzero(xn)
        step = self.chunk_blocks * self.block
        bounds = np.searchsorted(idx, np.arange(0, lay.numel + step, step))
        chunks: list[bytes] = []
        for c in range(len(bounds) - 1):
            lo, hi = int(bounds[c]), int(bounds[c + 1])
            if hi <= lo:
                continue
            start, end = c * step, min(lay.numel, (c + 1) * step)
            sel = idx[lo:hi]
            xv = xn[sel]
            idx_bytes, code = _code_indices(sel, start, end)
            body = b"".join([CHUNK_HDR.pack(CHUNK_MAGIC, KIND_XOR, QUANT_NONE, code, 0, len(chunks), start, end,
                                            sel.size, 0),
                             struct.pack("<Q", len(idx_bytes)), idx_bytes, _shuffle(xv)])
            chunks.append(self._zc.compress(body))
            ref_i[torch.from_numpy(sel)] ^= torch.from_numpy(xv)
        # max_bytes does not apply: lossless deltas are all-or-nothing
        return EncodedDelta(self._header("delta", self.version, version, len(chunks)), chunks,
                            {"selected": int(idx.size), "density": idx.size / lay.numel,
                             "residual_norm": 0.0, "rel_error": 0.0})

    def _tune(self, stats: dict[str, Any]) -> None:
        target = self.cfg.tuner_target
        if target <= 0:
            return
        old = self.density
        if self.cfg.tuner == "bytes":
            factor = min(2.0, max(0.5, (target / max(1, stats["bytes"])) ** 0.8))
        else:
            factor = 1.25 if stats.get("rel_error", 0.0) > target else 0.95
        self.density = min(1.0, max(1e-5, self.density * factor))
        if self.cfg.algorithm == "threshold" and self.threshold > 0:
            self.threshold /= factor  # more elements wanted -> lower threshold
        if abs(self.density - old) / old > 0.25:
            log.info("delta tuner (%s, target %g): density %.5f -> %.5f, threshold %g",
                     self.cfg.tuner, target, old, self.density, self.threshold)


# ---------------------------------------------------------------------------- decoder


class DeltaDecoder:
    """Validate and apply encoded deltas to a receiver's parameters (in place)."""

    def __init__(self, params: dict[str, torch.Tensor], version: int, model_id: str) -> None:
        self.layout = Layout.of(params)
        self.layout.check(params)
        self.model_id = model_id
        self.version = version
        self._zd = zstandard.ZstdDecompressor()

    def check_header(self, header: dict[str, Any]) -> None:
        """Refuse deltas for another model/layout/base; raises a :class:`CodecError` subclass."""
        if not isinstance(header, dict) or header.get("fmt") != FORMAT_VERSION:
            raise CodecError("unknown delta format")
        if header.get("model") != self.model_id or header.get("layout") != self.layout.digest:
            raise LayoutMismatch("delta is for another model or parameter layout")
        if header.get("numel") != self.layout.numel:
            raise LayoutMismatch("delta element count does not match the layout")
        kind, base, version = header.get("kind"), header.get("base"), header.get("version")
        if kind not in ("delta", "anchor") or not isinstance(version, int) or isinstance(version, bool):
            raise CodecError("bad delta kind or version")
        if kind == "delta" and base != self.version:
            raise BaseMismatch(f"delta base {base} does not match held version {self.version}")
        nchunks = header.get("nchunks")
        if not isinstance(nchunks, int) or not 0 <= nchunks <= 1_000_000:
            raise CodecError("bad chunk count")

    def decode(self, header: dict[str, Any], chunks: Sequence[bytes | memoryview]) -> DecodedDelta:
        """Fully validate a delta without touching any parameter."""
        self.check_header(header)
        if len(chunks) != header["nchunks"]:
            raise CodecError("chunk count does not match the header")
        codec = header.get("codec")
        block = codec.get("block") if isinstance(codec, dict) else None
        if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= 1 << 30:
            raise CodecError("bad block size")
        decoded = [self._chunk(c, header["kind"], block) for c in chunks]
        if header["kind"] == "anchor":
            covered = sorted((c.start, c.end) for c in decoded)
            pos = 0
            for a, b in covered:
                if a != pos:
                    raise CodecError("anchor chunks do not cover the parameters")
                pos = b
            if pos != self.layout.numel:
                raise CodecError("anchor chunks do not cover the parameters")
        return DecodedDelta(header, decoded)

    def apply(self, params: dict[str, torch.Tensor], delta: DecodedDelta) -> int:
        """Apply a decoded delta in place; returns the new version."""
        self.check_header(delta.header)
        lay = self.layout
        tensors = [params[n].data.view(-1) for n in lay.names]
        with torch.no_grad():
            for ch in delta.chunks:
                if ch.kind == KIND_DENSE:
                    self._apply_dense(tensors, ch)
                    continue
                assert ch.idx is not None
                cuts = np.searchsorted(ch.idx, lay.offsets)
                for i, t in enumerate(tensors):
                    lo, hi = int(cuts[i]), int(cuts[i + 1])
                    if hi <= lo:
                        continue
                    local = torch.from_numpy(ch.idx[lo:hi] - lay.offsets[i])
                    if ch.kind == KIND_SPARSE:
                        _scatter_add(t, local, ch.values[lo:hi])
                    else:
                        ti = t.view(_INT_VIEW[lay.dtype.itemsize])
                        ti[local] ^= ch.values[lo:hi]
        self.version = delta.version
        return self.version

    def _apply_dense(self, tensors: list[torch.Tensor], ch: DecodedChunk) -> None:
        lay = self.layout
        for i, t in enumerate(tensors):
            a, b = int(lay.offsets[i]), int(lay.offsets[i + 1])
            lo, hi = max(a, ch.start), min(b, ch.end)
            if hi > lo:
                t[lo - a:hi - a].copy_(ch.values[lo - ch.start:hi - ch.start])

    def _chunk(self, blob: bytes | memoryview, kind_name: str, block: int) -> DecodedChunk:
        try:
            body = self._zd.decompress(bytes(blob), max_output_size=MAX_CHUNK_BYTES)
        except zstandard.ZstdError as exc:
            raise CodecError(f"chunk is not valid zstd: {exc}") from None
        if len(body) < CHUNK_HDR.size:
            raise CodecError("chunk too short")
        magic, kind, quant, code, _, _, start, end, count, nsc = CHUNK_HDR.unpack_from(body)
        if magic != CHUNK_MAGIC:
            raise CodecError("bad chunk magic")
        numel = self.layout.numel
        if not (0 <= start < end <= numel) or count > end - start:
            raise CodecError("chunk range out of bounds")
        if (kind == KIND_DENSE) != (kind_name == "anchor"):
            raise CodecError("chunk kind does not match the delta kind")
        dtype = self.layout.dtype
        itemsize = dtype.itemsize
        pos = CHUNK_HDR.size
        if kind == KIND_DENSE:
            if count != end - start or quant != QUANT_NONE:
                raise CodecError("bad dense chunk")
            raw = _unshuffle(memoryview(body)[pos:], _NP_INT[itemsize], count)
            return DecodedChunk(kind, start, end, None, torch.from_numpy(raw).view(dtype))
        if kind not in (KIND_SPARSE, KIND_XOR):
            raise CodecError("unknown chunk kind")
        scales = None
        if kind == KIND_SPARSE:
            if start % block or nsc != -(-(end - start) // block):
                raise CodecError("bad scale count")
            if len(body) < pos + 4 * nsc:
                raise CodecError("chunk truncated")
            scales = torch.from_numpy(np.frombuffer(body, dtype=np.float32, count=nsc, offset=pos).copy())
            if not bool(np.isfinite(scales.numpy()).all()):
                raise CodecError("non-finite scale")
            pos += 4 * nsc
        elif nsc != 0:
            raise CodecError("xor chunk with scales")
        if len(body) < pos + 8:
            raise CodecError("chunk truncated")
        (nidx,) = struct.unpack_from("<Q", body, pos)
        pos += 8
        if nidx > len(body) - pos:
            raise CodecError("chunk truncated")
        idx_bytes = memoryview(body)[pos:pos + nidx]
        pos += nidx
        span = end - start
        if code == IDX_BITMAP:
            if nidx != (span + 7) // 8:
                raise CodecError("bad bitmap size")
            rel = np.flatnonzero(np.unpackbits(np.frombuffer(idx_bytes, dtype=np.uint8), count=span))
            if rel.size != count:
                raise CodecError("bitmap does not match the element count")
            idx = rel.astype(np.int64) + start
        elif code in (IDX_VARINT, IDX_GAPS):
            if code == IDX_GAPS:
                gaps = _decode_gaps(idx_bytes, count, span)
            else:
                gaps = varint_decode(idx_bytes, count)
                if count and int(gaps.max()) >= span:
                    raise CodecError("index out of range")
            idx = (np.cumsum(gaps.astype(np.int64) + 1) + (start - 1)).astype(np.int64)
            if count and int(idx[-1]) >= end:
                raise CodecError("index out of range")
        else:
            raise CodecError("unknown index coding")
        rest = memoryview(body)[pos:]
        if kind == KIND_XOR:
            if quant != QUANT_NONE:
                raise CodecError("bad xor chunk")
            xv = _unshuffle(rest, _NP_INT[itemsize], count)
            return DecodedChunk(kind, start, end, idx, torch.from_numpy(xv))
        assert scales is not None
        rel_blk = torch.from_numpy((idx - start) // block)
        per = scales[rel_blk] if count else scales[:0]
        if quant == QUANT_FP16:
            q = torch.from_numpy(_unshuffle(rest, np.float16, count))
            vals = q.float() * per
        elif quant == QUANT_INT8:
            q = torch.from_numpy(_unshuffle(rest, np.int8, count))
            vals = q.float() * (per / 127.0)
        elif quant == QUANT_SIGN:
            q = torch.from_numpy(_unshuffle(rest, np.int8, count))
            if count and not bool(np.isin(q.numpy(), (-1, 1)).all()):
                raise CodecError("sign values must be -1 or +1")
            vals = q.float() * per
        elif quant == QUANT_NONE:
            vals = torch.from_numpy(_unshuffle(rest, np.float32, count))
        else:
            raise CodecError("unknown quantisation")
        if not bool(np.isfinite(vals.numpy()).all()):
            raise CodecError("non-finite values")
        return DecodedChunk(kind, start, end, idx, vals.to(dtype))
