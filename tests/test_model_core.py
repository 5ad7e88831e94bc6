"""The model interface: determinism, shapes, trainable modes, multimodal encoding,
and that per-client context never becomes module state."""

from __future__ import annotations

import io
import struct
import wave
from dataclasses import replace

import pytest
import torch

from shared.config import ConfigError, ModelConfig
from shared.model import EOS, Batch, MediaError, build_model
from shared.types import ContextWindow, Entry


def tiny(tmp_path, **kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=2, n_heads=2, max_seq=64, pretrain_steps=3, pretrain_batch=2,
                pretrain_seq=32, image_patch=4, image_grid=2, audio_frame=16, max_audio_frames=4,
                cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return ModelConfig(**base)


def png(w: int = 10, h: int = 7) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def wav(n: int = 50) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(struct.pack(f"<{n}h", *range(n)))
    return buf.getvalue()


def window(*entries: Entry) -> ContextWindow:
    return ContextWindow("alice", "c1", 3, {"text": [e for e in entries if e.modality == "text"],
                                            "image": [e for e in entries if e.modality == "image"],
                                            "audio": [e for e in entries if e.modality == "audio"]})


def test_build_is_deterministic_and_cached(tmp_path):
    cfg = tiny(tmp_path)
    a, b = build_model(cfg), build_model(cfg)
    assert list((tmp_path / "cache").glob("base-*.pt")), "pre-trained weights were not cached"
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    fresh = build_model(cfg, pretrained=False)
    assert not torch.equal(fresh.head.weight, a.head.weight), "pre-training changed nothing"
    other = build_model(replace(cfg, seed=cfg.seed + 1), pretrained=False)
    assert not torch.equal(fresh.head.weight, other.head.weight)
    assert a.model_id == b.model_id == fresh.model_id
    assert build_model(replace(cfg, d_model=64, n_heads=2), pretrained=False).model_id != a.model_id


def test_loss_score_generate_shapes(tmp_path):
    m = build_model(tiny(tmp_path), pretrained=False)
    exs = [m.encode(None, "hello", "world"), m.encode(None, "a much longer prompt here", "x")]
    batch = m.collate(exs)
    assert isinstance(batch, Batch) and batch.tokens.shape == batch.labels.shape
    assert batch.tokens.shape[0] == 2 and int((batch.labels != -100).sum()) == len("world") + 1 + 1 + 1
    m.train()
    loss = m.loss(batch)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert m.head.weight.grad is not None
    m.eval()
    scores = m.score(exs)
    assert len(scores) == 2 and all(s > 0 for s in scores)
    steps = list(m.generate([m.encode(None, "hi", None)] * 3, max_tokens=5, temperature=0.0))
    assert 1 <= len(steps) <= 5 and all(len(s) == 3 for s in steps)
    assert steps[0][0] == steps[0][1] == steps[0][2], "greedy rows with the same input must agree"


def test_seeded_sampling_is_independent_of_batch_mates(tmp_path):
    m = build_model(tiny(tmp_path), pretrained=False)
    a = m.encode(None, "the worker", None)
    alone = [s[0] for s in m.generate([a], max_tokens=8, temperature=1.0, seed=[7])]
    mixed = [s[1] for s in m.generate([m.encode(None, "zz", None), a], max_tokens=8, temperature=1.0,
                                      seed=[3, 7])]
    assert b"".join(alone) == b"".join(mixed[: len(alone)])


def test_trainable_modes(tmp_path):
    full = build_model(tiny(tmp_path))
    head = build_model(tiny(tmp_path, trainable="head"))
    lora = build_model(tiny(tmp_path, trainable="lora"))
    assert len(full.trainable_named_parameters()) == len(list(full.parameters()))
    names = [n for n, _ in head.trainable_named_parameters()]
    assert names and all(n.startswith(("head.", "ln_f.")) for n in names)
    assert not head.tok_emb.weight.requires_grad and head.head.weight.requires_grad
    lnames = [n for n, _ in lora.trainable_named_parameters()]
    assert lnames and all(".lora_" in n for n in lnames)
    assert all(not p.requires_grad for n, p in lora.named_parameters() if ".lora_" not in n)
    ex = [full.encode(None, "same", "output")]
    assert full.score(ex) == pytest.approx(lora.score(ex), rel=1e-5), "fresh adapters must not change output"
    assert lora.model_id != full.model_id


def test_context_is_data_not_state(tmp_path):
    m = build_model(tiny(tmp_path), pretrained=False)
    assert list(m.buffers()) == []
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ctx = window(Entry("1", "text", "user", b"my secret context", ts_ms=1),
                 Entry("2", "image", "user", png(), ts_ms=2), Entry("3", "audio", "user", wav(), ts_ms=3))
    ex = m.encode(ctx, "what did I say?", None)
    list(m.generate([ex], max_tokens=4, temperature=1.0, seed=1))
    m.score([m.encode(ctx, "q", "a")])
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert list(m.buffers()) == []


def test_multimodal_encoding(tmp_path):
    cfg = tiny(tmp_path)
    m = build_model(cfg, pretrained=False)
    ctx = window(Entry("1", "text", "user", b"look", ts_ms=1), Entry("2", "image", "user", png(), ts_ms=2),
                 Entry("3", "audio", "assistant", wav(40), ts_ms=3))
    ex = m.encode(ctx, "describe", "it is red")
    assert len(ex.image_pos) == cfg.image_grid ** 2 and ex.image.shape == (4, 4 * 4 * 3)
    assert len(ex.audio_pos) == 3 and ex.audio.shape == (3, 16)  # 40 samples / 16 per frame
    assert ex.tokens[-1] == EOS
    text_only = m.encode(ctx, "describe", "it is red", modalities=["text"])
    assert text_only.image is None and text_only.audio is None
    b = m.collate([ex, text_only])
    assert b.image_idx.numel() == 4 and b.audio_idx.numel() == 3
    s_mm, s_text = m.score([ex, text_only])
    assert s_mm != s_text, "image/audio features must reach the model"


def test_bad_media_is_a_clear_error(tmp_path):
    m = build_model(tiny(tmp_path), pretrained=False)
    with pytest.raises(MediaError, match="could not be decoded"):
        m.encode(window(Entry("1", "image", "user", b"\x89PNG not really", ts_ms=1)), "q")
    small = build_model(tiny(tmp_path, max_image_pixels=50), pretrained=False)
    with pytest.raises(MediaError, match="pixels"):
        small.encode(window(Entry("1", "image", "user", png(10, 10), ts_ms=1)), "q")
    with pytest.raises(MediaError, match="WAV"):
        m.encode(window(Entry("1", "audio", "user", b"RIFF\x00\x00\x00\x00WAVEjunk", ts_ms=1)), "q")


def test_long_context_is_truncated_oldest_first(tmp_path):
    m = build_model(tiny(tmp_path), pretrained=False)
    entries = [Entry(str(i), "text", "user", f"turn {i} ".encode() * 5, ts_ms=i) for i in range(50)]
    ex = m.encode(window(*entries), "final question", None)
    assert len(ex) <= m.max_seq - m.max_seq // 4
    assert bytes(t for t in ex.tokens if t < 256).endswith(b"final question")
    assert b"turn 49" in bytes(t for t in ex.tokens if t < 256)
    assert b"turn 0 " not in bytes(t for t in ex.tokens if t < 256)
    long_ex = m.encode(None, "p" * 500, "t" * 500)
    assert len(long_ex) <= m.max_seq and long_ex.n_target > 0


def test_hf_adapter_tiny_random(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tiny-gpt2"
    transformers.GPT2Config(vocab_size=264, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=257,
                            eos_token_id=258).save_pretrained(path)
    cfg = tiny(tmp_path, kind="hf", hf_path=str(path))
    a, b = build_model(cfg), build_model(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    exs = [a.encode(None, "hello", "world"), a.encode(None, "longer prompt", "x")]
    a.train()
    loss = a.loss(a.collate(exs))
    assert torch.isfinite(loss) and loss.requires_grad
    a.eval()
    assert len(a.score(exs)) == 2
    steps = list(a.generate(exs, max_tokens=4, temperature=0.0))
    assert steps and all(len(s) == 2 for s in steps)
    head = build_model(replace(cfg, trainable="head"))
    assert 0 < len(head.trainable_named_parameters()) < len(list(head.parameters()))
    with pytest.raises(ConfigError):
        build_model(replace(cfg, trainable="lora"))


def test_answers_is_greedy_decodings_verdict_on_the_target(tmp_path):
    """``answers`` (what the trainer asks before letting a taught fact go) says True exactly when
    greedy decoding gives the target and stops: checked at every step of learning two facts
    (prompts of other lengths, so left padding is exercised); with a margin it is stricter."""
    m = build_model(tiny(tmp_path), pretrained=False)
    facts = [("The capital of Zorblat is", " Quennix."), ("Flim", " copper rain.")]
    taught = [m.encode(None, p, t) for p, t in facts]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    said: list[list[bool]] = []
    for _ in range(150):
        loss = m.loss(m.collate(taught))
        opt.zero_grad()
        loss.backward()
        opt.step()
        verdict = m.answers(taught)
        chunks = m.generate([m.encode(None, p, None) for p, _ in facts], max_tokens=20, temperature=0.0)
        given = [b"".join(row).decode(errors="replace") for row in zip(*chunks, strict=True)]
        assert verdict == [g == t for g, (_, t) in zip(given, facts, strict=True)], (verdict, given)
        strict = m.answers(taught, margin=1.0)
        assert all(v or not s for v, s in zip(verdict, strict, strict=True)), "a margin only takes answers away"
        said.append(verdict)
        if all(strict):
            break
    assert said[0] == [False, False] and all(said[-1]), "the facts went from not answered to answered"
    assert m.answers([m.encode(None, "no target", None)]) == [False]


def test_a_long_text_entry_is_tokenized_only_as_far_as_it_is_kept(tmp_path):
    """A context entry may hold megabytes of text, of which the sequence keeps the end: turning
    all of it into tokens would cost the worker's serving loop a second per entry and request
    (time in which it answers no heartbeat). Only what the sequence keeps is tokenized."""
    m = build_model(tiny(tmp_path), pretrained=False)
    tokenized: list[int] = []
    text_tokens = m.text_tokens

    def counting(data: bytes) -> list[int]:
        tokenized.append(len(data))
        return text_tokens(data)

    m.text_tokens = counting  # type: ignore[method-assign]
    big = b"old " * 250_000 + b"the newest words"
    ex = m.encode(window(Entry("1", "text", "user", big, ts_ms=1)), "q", None)
    assert bytes(t for t in ex.tokens if t < 256).endswith(b"the newest wordsq")
    assert max(tokenized) <= m.max_seq, tokenized
