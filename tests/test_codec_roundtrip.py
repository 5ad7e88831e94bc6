"""DeltaEncoder/DeltaDecoder: round trips, error feedback, lossless, anchors, refusal, fuzz."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.config import CompressionConfig
from shared.delta.codec import (
    BaseMismatch,
    CodecError,
    DeltaDecoder,
    DeltaEncoder,
    LayoutMismatch,
    flatten,
)


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(300, 40, generator=g).to(dtype), "w": torch.randn(64, 129, generator=g).to(dtype),
            "bias": torch.randn(7, generator=g).to(dtype)}


def cfg(**kw: Any) -> CompressionConfig:
    base: dict[str, Any] = {"block_size": 256, "chunk_elements": 2048, "anchor_every": 0, "density": 0.02, "tuner": "off"}
    base.update(kw)
    return CompressionConfig(**base)


def step(params: dict[str, torch.Tensor], g: torch.Generator, scale: float = 1e-3) -> None:
    for p in params.values():
        p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


def receiver_matches_reference(enc: DeltaEncoder, recv: dict[str, torch.Tensor]) -> bool:
    return torch.equal(flatten(recv, enc.layout), enc.ref[: enc.layout.numel])


@pytest.mark.parametrize("algorithm,quant", [("topk", "fp16"), ("topk", "int8"), ("topk", "none"), ("topk", "sign"),
                                             ("threshold", "fp16"), ("dense", "fp16")])
def test_lossy_receiver_tracks_reference_bit_exactly(algorithm: str, quant: str) -> None:
    params = make_params()
    enc = DeltaEncoder(cfg(algorithm=algorithm, quantization=quant, threshold=1.5e-3), params, 0, "m")
    recv = {k: v.clone() for k, v in params.items()}
    dec = DeltaDecoder(recv, 0, "m")
    g = torch.Generator().manual_seed(1)
    for v in range(1, 21):
        step(params, g)
        e = enc.encode(params, v)
        assert dec.apply(recv, dec.decode(e.header, e.chunks)) == v
    assert receiver_matches_reference(enc, recv)
    assert dec.version == enc.version == 20
    dense = sum(p.numel() for p in params.values()) * 4
    if algorithm == "topk":
        assert e.nbytes < dense / 8
        assert 0.01 < e.stats["density"] < 0.04


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_selection_matches_a_plain_threshold_over_the_flat_delta(monkeypatch, dtype) -> None:
    """The fused pass walks tiles that cut across parameters and padding; it must select exactly
    what a plain |new - reference| >= threshold over the whole flat vector selects."""
    import shared.delta.codec as codec

    monkeypatch.setattr(codec, "_TILE_ELEMENTS", 512)  # many tiles, each spanning parameter edges
    params = make_params(dtype=dtype)
    params["unchanged"] = torch.zeros(1000, dtype=dtype)  # whole tiles without change are skipped
    enc = DeltaEncoder(cfg(algorithm="threshold", threshold=1e-3), params, 0, "m")
    assert len(enc.scanner.segments) > 20
    g = torch.Generator().manual_seed(3)
    for name, p in params.items():
        if name != "unchanged":
            p.add_((torch.randn(p.shape, generator=g) * 1e-3).to(dtype))
    flat = flatten(params, enc.layout).float() - enc.ref[: enc.layout.numel].float()
    scan = enc.scanner.scan(params, enc._threshold(params), enc.scanner.segments)
    idx, vals = torch.from_numpy(scan.indices()), torch.from_numpy(scan.values())
    expect = torch.nonzero(flat.abs() >= 1e-3).squeeze(1)
    assert enc._threshold(params) == 1e-3
    assert torch.equal(idx, expect)
    assert torch.equal(vals, flat[expect])
    assert scan.total_sq == pytest.approx(float((flat.double() ** 2).sum()), rel=1e-5)
    assert scan.active == int((flat.new_zeros(enc.nblocks * enc.block).index_copy_(0, torch.arange(flat.numel()), flat)
                          .view(enc.nblocks, enc.block) != 0).any(1).sum())


def test_sampled_threshold_hits_the_target_density() -> None:
    g = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(400_000, generator=g)}
    enc = DeltaEncoder(cfg(density=0.01, block_size=4096, chunk_elements=1 << 20), params, 0, "m")
    params["w"].add_(torch.randn(400_000, generator=g) * 1e-3)
    e = enc.encode(params, 1)
    assert 0.008 < e.stats["density"] < 0.012


@pytest.mark.parametrize("gap", [3, 300, 70_000])
def test_gap_index_coding_picks_a_width_and_round_trips(gap: int) -> None:
    params = {"w": torch.zeros(300_000)}
    enc = DeltaEncoder(cfg(algorithm="threshold", threshold=0.5, chunk_elements=1 << 18, block_size=1024),
                       params, 0, "m")
    recv = {"w": torch.zeros(300_000)}
    dec = DeltaDecoder(recv, 0, "m")
    params["w"][::gap] = 1.0
    e = enc.encode(params, 1)
    dec.apply(recv, dec.decode(e.header, e.chunks))
    assert receiver_matches_reference(enc, recv)
    assert torch.equal(recv["w"], params["w"])  # 1.0 is exact in fp16 with scale 1


def test_sign_values_other_than_plus_minus_one_are_refused() -> None:
    import zstandard

    import shared.delta.codec as codec

    params = make_params()
    enc = DeltaEncoder(cfg(quantization="sign"), params, 0, "m")
    recv = {k: v.clone() for k, v in params.items()}
    dec = DeltaDecoder(recv, 0, "m")
    step(params, torch.Generator().manual_seed(5))
    e = enc.encode(params, 1)
    body = bytearray(zstandard.ZstdDecompressor().decompress(e.chunks[0]))
    assert body[5] == codec.QUANT_SIGN
    body[-1] = 2  # last value byte
    bad = [zstandard.ZstdCompressor().compress(bytes(body)), *e.chunks[1:]]
    with pytest.raises(CodecError):
        dec.decode(e.header, bad)
    before = flatten(recv, enc.layout).clone()
    dec.apply(recv, dec.decode(e.header, e.chunks))
    assert not torch.equal(flatten(recv, enc.layout), before)


def test_error_feedback_keeps_served_error_bounded() -> None:
    params = make_params()
    start = {k: v.clone() for k, v in params.items()}
    enc = DeltaEncoder(cfg(density=0.01), params, 0, "m")
    g = torch.Generator().manual_seed(2)
    residuals = []
    for v in range(1, 301):
        # a consistent direction plus noise: without error feedback, the dropped 99% would pile up
        for p in params.values():
            p.add_(1e-4 + torch.randn(p.shape, generator=g) * 1e-4)
        enc.encode(params, v)
        residuals.append(enc.residual_norm(params))
    drift = float(torch.linalg.vector_norm(flatten(params, enc.layout) - flatten(start, enc.layout)))
    assert max(residuals[200:]) < 1.3 * max(residuals[100:200])  # bounded, not growing
    assert residuals[-1] < 0.3 * drift  # served weights follow the trainer (no feedback: ~0.99)


def test_lossless_is_bit_exact_including_bf16() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(dtype=dtype)
        enc = DeltaEncoder(cfg(algorithm="lossless"), params, 5, "m")
        recv = {k: v.clone() for k, v in params.items()}
        dec = DeltaDecoder(recv, 5, "m")
        g = torch.Generator().manual_seed(3)
        for v in range(6, 16):
            # change only some elements, like a sparse optimizer step
            for p in params.values():
                mask = torch.rand(p.shape, generator=g) < 0.05
                p.add_((torch.randn(p.shape, generator=g) * mask).to(dtype))
            e = enc.encode(params, v)
            dec.apply(recv, dec.decode(e.header, e.chunks))
            for k in params:
                assert torch.equal(recv[k].view(torch.int16 if dtype != torch.float32 else torch.int32),
                                   params[k].view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert e.stats["selected"] > 0


def test_anchor_restores_exact_weights_and_snapshot_loads_anywhere() -> None:
    params = make_params()
    enc = DeltaEncoder(cfg(anchor_every=5, density=0.01), params, 0, "m")
    recv = {k: v.clone() for k, v in params.items()}
    dec = DeltaDecoder(recv, 0, "m")
    g = torch.Generator().manual_seed(4)
    kinds = []
    for v in range(1, 11):
        step(params, g)
        e = enc.encode(params, v)
        kinds.append(e.header["kind"])
        dec.apply(recv, dec.decode(e.header, e.chunks))
        if e.header["kind"] == "anchor":
            assert all(torch.equal(recv[k], params[k]) for k in params)
    assert kinds.count("anchor") == 2
    fresh = {k: torch.zeros_like(v) for k, v in params.items()}
    fdec = DeltaDecoder(fresh, -1, "m")
    snap = enc.snapshot()
    fdec.apply(fresh, fdec.decode(snap.header, snap.chunks))
    assert fdec.version == 10 and receiver_matches_reference(enc, fresh)


def test_wrong_base_layout_or_model_is_refused_and_nothing_applied() -> None:
    params = make_params()
    enc = DeltaEncoder(cfg(), params, 0, "m")
    step(params, torch.Generator().manual_seed(5))
    e = enc.encode(params, 1)
    recv = {k: v.clone() for k, v in make_params().items()}
    before = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(BaseMismatch):
        DeltaDecoder(recv, 7, "m").decode(e.header, e.chunks)
    with pytest.raises(LayoutMismatch):
        DeltaDecoder(recv, 0, "other-model").decode(e.header, e.chunks)
    other = dict(recv, extra=torch.zeros(3))
    with pytest.raises(LayoutMismatch):
        DeltaDecoder(other, 0, "m").decode(e.header, e.chunks)
    reshaped = dict(recv, w=recv["w"].reshape(129, 64))
    with pytest.raises(LayoutMismatch):
        DeltaDecoder(reshaped, 0, "m").decode(e.header, e.chunks)
    with pytest.raises(CodecError):
        DeltaDecoder(recv, 0, "m").decode(e.header, e.chunks[:-1])
    assert all(torch.equal(before[k], recv[k]) for k in recv)


def test_byte_budget_sends_most_important_chunks_and_keeps_the_rest() -> None:
    params = make_params()
    enc = DeltaEncoder(cfg(density=0.05), params, 0, "m")
    recv = {k: v.clone() for k, v in params.items()}
    dec = DeltaDecoder(recv, 0, "m")
    with torch.no_grad():
        params["emb"][:10].add_(1.0)  # one hot region: must go first
        params["w"].add_(1e-3)
    e = enc.encode(params, 1, max_bytes=1200)
    assert e.stats["chunks_dropped"] > 0
    dec.apply(recv, dec.decode(e.header, e.chunks))
    assert torch.allclose(recv["emb"][:10], params["emb"][:10], atol=1e-2)
    v = 2
    while enc.residual_norm(params) > 1e-3 and v < 200:  # unlimited budget: the residual drains
        e = enc.encode(params, v)
        dec.apply(recv, dec.decode(e.header, e.chunks))
        v += 1
    assert enc.residual_norm(params) <= 1e-3 and receiver_matches_reference(enc, recv)


def test_bytes_tuner_reaches_its_budget_and_reports() -> None:
    params = {"w": torch.randn(200_000)}
    enc = DeltaEncoder(cfg(block_size=1024, chunk_elements=65536, density=0.2, tuner="bytes",
                           tuner_target=8000), params, 0, "m")
    g = torch.Generator().manual_seed(6)
    sizes = []
    for v in range(1, 31):
        step(params, g)
        sizes.append(enc.encode(params, v).nbytes)
    report = enc.tuner_report()
    assert report["mode"] == "bytes" and report["density"] < 0.2
    assert 0.6 * 8000 < float(np.mean(sizes[-5:])) < 1.5 * 8000


def test_error_tuner_raises_density_until_the_residual_budget_holds() -> None:
    params = {"w": torch.randn(40_000)}
    enc = DeltaEncoder(cfg(block_size=1024, chunk_elements=65536, density=0.001, tuner="error",
                           tuner_target=0.5), params, 0, "m")
    g = torch.Generator().manual_seed(8)
    for v in range(1, 31):
        step(params, g)
        e = enc.encode(params, v)
    assert enc.tuner_report()["density"] > 0.01
    assert e.stats["rel_error"] < 0.75


def test_threshold_tuner_moves_the_threshold() -> None:
    params = {"w": torch.randn(100_000)}
    enc = DeltaEncoder(cfg(algorithm="threshold", threshold=1e-2, block_size=1024, chunk_elements=65536,
                           tuner="bytes", tuner_target=20_000), params, 0, "m")
    g = torch.Generator().manual_seed(9)
    for v in range(1, 21):
        step(params, g)
        enc.encode(params, v)
    assert enc.tuner_report()["threshold"] < 1e-2  # nothing passed 1e-2: it had to come down


def test_an_index_coding_the_format_does_not_define_is_refused() -> None:
    import zstandard

    import shared.delta.codec as codec

    params = make_params()
    enc = DeltaEncoder(cfg(), params, 0, "m")
    dec = DeltaDecoder({k: v.clone() for k, v in params.items()}, 0, "m")
    step(params, torch.Generator().manual_seed(14))
    e = enc.encode(params, 1)
    body = bytearray(zstandard.ZstdDecompressor().decompress(e.chunks[0]))
    assert body[6] in (codec.IDX_GAPS, codec.IDX_BITMAP)
    for code in (0, 4, 255):
        body[6] = code
        bad = [zstandard.ZstdCompressor().compress(bytes(body)), *e.chunks[1:]]
        with pytest.raises(CodecError, match="index coding"):
            dec.decode(e.header, bad)


_FUZZ_PARAMS = make_params(9)
_FUZZ_ENC = DeltaEncoder(cfg(chunk_elements=8192), _FUZZ_PARAMS, 0, "m")
step(_FUZZ_PARAMS, torch.Generator().manual_seed(10))
_FUZZ_DELTA = _FUZZ_ENC.encode(_FUZZ_PARAMS, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_decoder_never_crashes_or_applies_garbage(data: st.DataObject) -> None:
    import zstandard

    chunks = list(_FUZZ_DELTA.chunks)
    i = data.draw(st.integers(0, len(chunks) - 1))
    raw = bytearray(zstandard.ZstdDecompressor().decompress(chunks[i]))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "raw"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=64))
    blob = zstandard.ZstdCompressor().compress(bytes(raw)) if how != "raw" else data.draw(st.binary(max_size=512))
    chunks[i] = blob
    recv = {k: v.clone() for k, v in make_params(9).items()}
    dec = DeltaDecoder(recv, 0, "m")
    try:
        decoded = dec.decode(_FUZZ_DELTA.header, chunks)
    except CodecError:
        return
    # a mutation that still decodes (e.g. a flipped value bit) is a valid delta: apply must be safe
    dec.apply(recv, decoded)
    assert all(torch.isfinite(t).all() for t in recv.values())


def test_fuzz_decoder_thousands_of_random_mutations() -> None:
    import zstandard

    rng = np.random.default_rng(11)
    bodies = [bytearray(zstandard.ZstdDecompressor().decompress(c)) for c in _FUZZ_DELTA.chunks]
    zc = zstandard.ZstdCompressor(level=1)
    recv = {k: v.clone() for k, v in make_params(9).items()}
    before = {k: v.clone() for k, v in recv.items()}
    refused = 0
    for _ in range(2000):
        i = int(rng.integers(len(bodies)))
        raw = bytearray(bodies[i])
        if rng.random() < 0.5:  # header, scales and index bytes are where structure lives
            pos = rng.integers(0, min(len(raw), 96), size=int(rng.integers(1, 4)))
        else:
            pos = rng.integers(0, len(raw), size=int(rng.integers(1, 4)))
        for p in pos:
            raw[int(p)] ^= int(rng.integers(1, 256))
        if rng.random() < 0.2:
            raw = raw[: int(rng.integers(0, len(raw)))]
        chunks = list(_FUZZ_DELTA.chunks)
        chunks[i] = zc.compress(bytes(raw))
        dec = DeltaDecoder(recv, 0, "m")
        try:
            dec.decode(_FUZZ_DELTA.header, chunks)
        except CodecError:
            refused += 1
    assert refused > 700  # most structural damage is detected; decode() never touches params
    assert all(torch.equal(before[k], recv[k]) for k in recv)


def _stream_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    # "frozen" sits in the middle of the flat space: its chunk ranges see no change at all
    return {"a": torch.randn(3000, generator=g), "frozen": torch.zeros(4096), "b": torch.randn(5000, generator=g)}


def test_streaming_sink_gets_every_range_as_it_is_encoded_and_chunks_decode_one_by_one(monkeypatch) -> None:
    import shared.delta.codec as codec

    monkeypatch.setattr(codec, "_TILE_ELEMENTS", 512)
    params = _stream_model()
    enc = DeltaEncoder(cfg(chunk_elements=1024), params, 0, "m")
    recv = {k: v.clone() for k, v in params.items()}
    dec = DeltaDecoder(recv, 0, "m")
    g = torch.Generator().manual_seed(22)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one encoding thread: ranges are scanned strictly in order
    try:
        for v in range(1, 6):
            params["a"].add_(torch.randn(3000, generator=g) * 1e-3)
            params["b"].add_(torch.randn(5000, generator=g) * 1e-3)
            ref_before = enc.ref.clone()
            seen: list[tuple[int, int, bool]] = []

            def sink(header: dict, i: int, blob: bytes, ref_before: torch.Tensor = ref_before,
                     seen: list = seen, v: int = v) -> None:
                assert header["nchunks"] == 12  # ceil(12096 / 1024) ranges, every one sent
                seen.append((i, enc.version, torch.equal(enc.ref, ref_before)))
                if i == 0 and v == 3:
                    params["b"].add_(1.0)  # "b" lies in later ranges: not scanned yet

            e = enc.encode(params, v, sink=sink)
            assert [s[0] for s in seen] == list(range(12)) and e.stats["streamed"]
            assert all(version == v - 1 and unmoved for _, version, unmoved in seen)  # reference: after the last
            if v == 3:  # the change made while chunk 0 was out is in this delta: chunks stream
                assert float((enc.ref[7096:12096] - ref_before[7096:12096]).abs().max()) > 0.5
            assert e.header["nchunks"] == len(e.chunks) == 12
            decoded = [dec.decode_chunk(e.header, c) for c in e.chunks]
            assert sum(d.idx.size for d in decoded if d.idx is not None) == e.stats["selected"]
            assert decoded[4].idx is not None and decoded[4].idx.size == 0  # an empty range still travels
            assert dec.apply(recv, dec.finish(e.header, decoded)) == v
    finally:
        torch.set_num_threads(threads)
    assert receiver_matches_reference(enc, recv)
    with pytest.raises(CodecError):
        dec.finish(e.header, decoded[:-1])


def test_a_failing_sink_leaves_the_encoder_whole() -> None:
    params = _stream_model()
    enc = DeltaEncoder(cfg(chunk_elements=1024), params, 0, "m")
    params["a"].add_(0.01)
    calls = []

    def sink(header: dict, i: int, blob: bytes) -> None:
        calls.append(i)
        if i == 1:
            raise OSError("socket closed")

    with pytest.raises(OSError):
        enc.encode(params, 1, sink=sink)
    assert calls == [0, 1] and enc.version == 1  # no further chunk went out; the delta is complete
    fresh = {k: torch.zeros_like(v) for k, v in params.items()}
    fdec = DeltaDecoder(fresh, -1, "m")
    snap = enc.snapshot()  # what a worker that missed chunks resyncs from
    fdec.apply(fresh, fdec.decode(snap.header, snap.chunks))
    e = enc.encode(params, 2, sink=lambda h, i, b: None)
    assert e.header["base"] == 1
    fdec.apply(fresh, fdec.decode(e.header, e.chunks))
    assert receiver_matches_reference(enc, fresh)


def test_encoding_threads_give_bit_identical_deltas(monkeypatch) -> None:
    import shared.delta.codec as codec

    monkeypatch.setattr(codec, "_TILE_ELEMENTS", 512)
    params = make_params(12)
    one = DeltaEncoder(cfg(chunk_elements=1024), params, 0, "m")
    two = DeltaEncoder(cfg(chunk_elements=1024), params, 0, "m")
    assert len(two._units) > 4
    g = torch.Generator().manual_seed(13)
    threads = torch.get_num_threads()
    try:
        for v in range(1, 6):
            step(params, g)
            torch.set_num_threads(1)
            a = one.encode(params, v, sink=lambda h, i, b: None)
            torch.set_num_threads(3)
            b = two.encode(params, v, sink=lambda h, i, b: None)
            assert two.pool.threads == 3
            assert a.chunks == b.chunks and a.stats["residual_norm"] == b.stats["residual_norm"]
            assert torch.equal(one.ref, two.ref)
    finally:
        torch.set_num_threads(threads)
        two.close()


@pytest.mark.parametrize("numel,block,tile,chunk", [(10_000, 256, 512, 2048), (10_000, 256, 4096, 1024),
                                                     (10_000, 256, 768, 1024), (300, 64, 256, 128)])
def test_work_units_cover_every_tile_and_range_once(numel: int, block: int, tile: int, chunk: int) -> None:
    import shared.delta.codec as codec

    lay = codec.Layout.of({"w": torch.zeros(numel)})
    padded = -(-numel // block) * block
    tiles = codec._tile_segments(lay, tile, padded)
    units = codec._work_units(tiles, chunk, numel)
    assert [t for ts, _ in units for t in ts] == tiles
    assert [c for _, cs in units for c in cs] == list(range(-(-numel // chunk)))
    for ts, cs in units:  # a unit's tiles cover exactly its ranges
        lo, hi = ts[0][0], min(numel, ts[-1][0] + ts[-1][1])
        assert lo == cs[0] * chunk and hi == min(numel, (cs[-1] + 1) * chunk)
