"""The model interface every learnmesh process uses (gateway tools, workers, trainer).

A :class:`LearnModel` turns a context window plus a new input into an :class:`Example`
(``encode``), pads examples into a :class:`Batch` (``collate``), and runs it for training
(``loss``) or inference (``generate``, ``score``). Per-client context is *data*: it is encoded
into input tensors on every call and never kept in module state, parameters or buffers.

Token layout of one example (byte-level vocabulary, see :data:`SPECIAL`)::

    [role] context entry bytes | [role] [IMG]*patches | ... [USER] prompt [ASSISTANT] target [EOS]

Image patches and audio frames occupy placeholder positions whose embeddings are projected
feature vectors. When the sequence is longer than ``max_seq`` the oldest context is dropped
first, then the start of the prompt; generation reserves room for new tokens.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch
import torch.nn.functional as F
from torch import nn

from shared.config import ModelConfig
from shared.model.media import MediaError, audio_features, image_features
from shared.types import ContextWindow, Entry

# special tokens follow the 256 byte values
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, IMG, AUD = range(256, 264)
VOCAB_SIZE = 264
SPECIAL = {"pad": PAD, "bos": BOS, "eos": EOS, "system": SYSTEM, "user": USER,
           "assistant": ASSISTANT, "image": IMG, "audio": AUD}
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
# layout fields that define the parameter set (and so the model id)
LAYOUT_FIELDS = ("kind", "d_model", "n_layers", "n_heads", "max_seq", "trainable", "lora_rank",
                 "image_patch", "image_grid", "audio_frame", "hf_path")


class ModelInputError(ValueError):
    """An input the model cannot encode (bad modality content, empty prompt ...)."""


@dataclass
class Example:
    """One encoded sequence. ``tokens[target_start:]`` are the target (loss) tokens."""

    tokens: list[int]
    target_start: int
    image: torch.Tensor | None = None      # [Ni, patch*patch*3]
    image_pos: list[int] = field(default_factory=list)
    audio: torch.Tensor | None = None      # [Na, audio_frame]
    audio_pos: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_target(self) -> int:
        return len(self.tokens) - self.target_start


@dataclass
class Batch:
    """Left-padded examples. ``labels[b, t]`` is the token at ``t+1`` when it is a target, else -100."""

    tokens: torch.Tensor      # [B, T] long
    valid: torch.Tensor       # [B, T] bool (False = padding)
    positions: torch.Tensor   # [B, T] long
    labels: torch.Tensor      # [B, T] long
    image: torch.Tensor       # [Ni, Di]
    image_idx: torch.Tensor   # [Ni] flat index into B*T
    audio: torch.Tensor       # [Na, Da]
    audio_idx: torch.Tensor   # [Na]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        return self.valid.sum(dim=1)


def config_hash(cfg: ModelConfig, fields: Sequence[str], extra: dict[str, Any] | None = None) -> str:
    data = {f: getattr(cfg, f) for f in fields}
    data.update(extra or {})
    return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


class LearnModel(nn.Module):
    """Base of every learnmesh model. Subclasses implement ``embed_tokens``/``forward_embeds``."""

    vocab_size = VOCAB_SIZE

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq = cfg.max_seq
        self.model_id = f"{cfg.kind}-{config_hash(cfg, LAYOUT_FIELDS)}"

    # ------------------------------------------------------------------ to implement
    def forward_logits(self, batch: Batch, cache: Any = None,
                       step_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Prefill (``step_tokens is None``: logits [B, T, V]) or one decoding step with a cache."""
        raise NotImplementedError

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        raise NotImplementedError

    def text_tokens(self, data: bytes) -> list[int]:
        """One token per byte: the last n bytes of a text are its last n tokens."""
        return list(data)

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,)) if token < 256 else b""

    # ------------------------------------------------------------------ encoding
    @property
    def max_target_tokens(self) -> int:
        """The longest target, its EOS included, that :meth:`encode` keeps whole when it reserves
        nothing for generation (as for scoring): half the sequence, the rest is for the prompt
        and the context. A longer one is cut to its beginning."""
        return self.max_seq // 2

    def encode(self, context: ContextWindow | Sequence[Entry] | None, prompt: str | bytes,
               target: str | bytes | None = None, *, modalities: Sequence[str] | None = None,
               reserve_tokens: int | None = None) -> Example:
        """Encode context entries (oldest first), the prompt and an optional target.

        ``modalities`` limits which context channels are used (default: all).
        ``reserve_tokens`` leaves room for generation (default: a quarter of ``max_seq``
        when there is no target, none otherwise).
        """
        entries = context.entries() if isinstance(context, ContextWindow) else list(context or [])
        if modalities is not None:
            entries = [e for e in entries if e.modality in modalities]
        prompt_b = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
        target_toks: list[int] = []
        if target is not None:
            target_b = target.encode() if isinstance(target, str) else bytes(target)
            target_toks = self.text_tokens(target_b) + [EOS]
        if reserve_tokens is None:
            reserve_tokens = 0 if target is not None else self.max_seq // 4
        budget = self.max_seq - min(reserve_tokens, self.max_seq - 8)
        target_toks = target_toks[: max(1, budget // 2)] if target_toks else []
        head = [USER] + self.text_tokens(prompt_b) + [ASSISTANT]
        room = budget - len(target_toks)
        if len(head) > room:  # keep the end of the prompt
            head = [USER] + head[len(head) - room + 1:]
        room -= len(head)
        segments = []  # newest first while we fill the room
        for entry in reversed(entries):
            if room <= 1:
                break
            seg = self._encode_entry(entry, room)
            if seg is None:
                continue
            segments.append(seg)
            room -= len(seg[0])
        tokens: list[int] = []
        image_rows: list[torch.Tensor] = []
        audio_rows: list[torch.Tensor] = []
        image_pos: list[int] = []
        audio_pos: list[int] = []
        for toks, kind, feats in reversed(segments):
            if kind == "image":
                image_rows.append(feats)
                image_pos.extend(range(len(tokens) + 1, len(tokens) + len(toks)))
            elif kind == "audio":
                audio_rows.append(feats)
                audio_pos.extend(range(len(tokens) + 1, len(tokens) + len(toks)))
            tokens.extend(toks)
        tokens.extend(head)
        target_start = len(tokens)
        tokens.extend(target_toks)
        return Example(tokens, target_start,
                       torch.cat(image_rows) if image_rows else None, image_pos,
                       torch.cat(audio_rows) if audio_rows else None, audio_pos)

    def _encode_entry(self, entry: Entry, room: int) -> tuple[list[int], str, Any] | None:
        try:
            return self._encode_content(entry, room)
        except MediaError as exc:  # the caller learns which of the context's entries it is
            raise MediaError(f"context entry {entry.id or '?'}: {exc}") from None

    def _encode_content(self, entry: Entry, room: int) -> tuple[list[int], str, Any] | None:
        role = ROLE_TOKENS.get(entry.role, USER)
        if entry.modality == "image":
            feats = self.image_features(entry.content)
            if feats is None or len(feats) + 1 > room:
                return None
            return [role] + [IMG] * len(feats), "image", feats
        if entry.modality == "audio":
            feats = self.audio_features(entry.content)
            if feats is None:
                return None
            feats = feats[: room - 1]
            if len(feats) == 0:
                return None
            return [role] + [AUD] * len(feats), "audio", feats
        # its newest room - 1 bytes are the tokens kept: an entry of megabytes is not tokenized whole
        return [role] + self.text_tokens(entry.content[-(room - 1):]), "text", None

    def image_features(self, data: bytes) -> torch.Tensor | None:
        """Features of an image (raises MediaError); None where the model has no image input."""
        return image_features(data, patch=self.cfg.image_patch, grid=self.cfg.image_grid,
                              max_pixels=self.cfg.max_image_pixels)

    def audio_features(self, data: bytes) -> torch.Tensor | None:
        return audio_features(data, frame=self.cfg.audio_frame, max_frames=self.cfg.max_audio_frames)

    # ------------------------------------------------------------------ batching
    def collate(self, examples: Sequence[Example]) -> Batch:
        """Left-pad examples to one length; build labels, positions and feature indices."""
        if not examples:
            raise ModelInputError("cannot collate an empty list of examples")
        B, T = len(examples), max(len(e) for e in examples)
        tokens = torch.full((B, T), PAD, dtype=torch.long)
        valid = torch.zeros((B, T), dtype=torch.bool)
        labels = torch.full((B, T), -100, dtype=torch.long)
        img: list[torch.Tensor] = []
        aud: list[torch.Tensor] = []
        img_idx: list[int] = []
        aud_idx: list[int] = []
        for b, ex in enumerate(examples):
            off = T - len(ex)
            row = torch.tensor(ex.tokens, dtype=torch.long)
            tokens[b, off:] = row
            valid[b, off:] = True
            if ex.n_target:
                s = off + ex.target_start
                labels[b, s - 1: T - 1] = row[ex.target_start:]
            if ex.image is not None:
                img.append(ex.image)
                img_idx.extend(b * T + off + p for p in ex.image_pos)
            if ex.audio is not None:
                aud.append(ex.audio)
                aud_idx.extend(b * T + off + p for p in ex.audio_pos)
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        d_img = self.cfg.image_patch * self.cfg.image_patch * 3
        return Batch(tokens, valid, positions, labels,
                     torch.cat(img) if img else torch.zeros((0, d_img)),
                     torch.tensor(img_idx, dtype=torch.long),
                     torch.cat(aud) if aud else torch.zeros((0, self.cfg.audio_frame)),
                     torch.tensor(aud_idx, dtype=torch.long))

    def _as_batch(self, batch_or_examples: Batch | Sequence[Example]) -> Batch:
        if isinstance(batch_or_examples, Batch):
            return batch_or_examples
        return self.collate(list(batch_or_examples))

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ------------------------------------------------------------------ training / scoring
    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean negative log-likelihood over all target tokens of the batch.

        Every trainable parameter takes part, with weight zero where the batch does not use
        it (the image and audio projections on a text-only batch), so each gets a gradient
        every step and DDP needs no per-step search for unused parameters."""
        logits, _ = self.forward_logits(batch)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                              ignore_index=-100)
        return nll + 0.0 * sum(p.view(-1)[0] for p in self.parameters() if p.requires_grad)

    @torch.no_grad()
    def score(self, examples: Sequence[Example]) -> list[float]:
        """Mean NLL (nats per token) of each example's target; NaN for an example without one."""
        batch = self.collate(list(examples)).to(self.device)
        logits, _ = self.forward_logits(batch)
        nll = F.cross_entropy(logits.transpose(1, 2), batch.labels, ignore_index=-100, reduction="none")
        mask = batch.labels != -100
        counts = mask.sum(dim=1)
        sums = (nll * mask).sum(dim=1)
        return [float(s / c) if c else float("nan") for s, c in zip(sums.tolist(), counts.tolist(), strict=True)]

    @torch.no_grad()
    def answers(self, examples: Sequence[Example], margin: float = 0.0) -> list[bool]:
        """Whether greedy decoding gives each example's target: every target token (its end
        included) is the most likely one after what precedes it, its logit ahead of the next
        likeliest token's by at least ``margin``. False for an example without a target."""
        batch = self.collate(list(examples)).to(self.device)
        logits, _ = self.forward_logits(batch)
        mask = batch.labels != -100
        top2 = logits.topk(2, dim=-1)
        target = logits.gather(-1, batch.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        right = ((top2.indices[..., 0] == batch.labels) & (target - top2.values[..., 1] >= margin)) | ~mask
        return [bool(ok and n) for ok, n in zip(right.all(dim=1).tolist(), mask.sum(dim=1).tolist(), strict=True)]

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, batch_or_examples: Batch | Sequence[Example], *, max_tokens: int,
                 temperature: float | Sequence[float] = 1.0,
                 seed: int | Sequence[int | None] | None = None) -> Generator[list[bytes], None, None]:
        """Yield, per decoding step, one byte chunk per row; a row that has finished (EOS or
        ``max_seq`` reached) yields ``b""`` from then on. Stops when every row is done.

        ``temperature`` 0 is greedy; ``seed`` (per row or for all) makes sampling reproducible
        independently of which other rows share the batch.
        """
        batch = self._as_batch(batch_or_examples).to(self.device)
        B = batch.size
        temps = [float(temperature)] * B if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
        seeds = [seed] * B if seed is None or isinstance(seed, int) else list(seed)
        # Token sampling, not secrets: a seeded PRNG is what reproducible generation needs.
        rngs = [random.Random(None if s is None else int(s) + (i if isinstance(seed, int) else 0))  # noqa: S311
                for i, s in enumerate(seeds)]
        logits, cache = self.forward_logits(batch)
        last = logits[:, -1, :]
        lengths = batch.lengths.clone()
        done = [False] * B
        for _ in range(max_tokens):
            nxt = self._sample(last, temps, rngs)
            chunks = []
            for b in range(B):
                tok = int(nxt[b])
                if done[b]:
                    chunks.append(b"")
                    continue
                if tok == EOS or tok >= 256 and not self.token_bytes(tok):
                    done[b] = True
                    chunks.append(b"")
                    continue
                chunks.append(self.token_bytes(tok))
                if int(lengths[b]) + 1 >= self.max_seq:
                    done[b] = True
            yield chunks
            if all(done):
                return
            lengths += 1
            logits, cache = self.forward_logits(batch, cache, step_tokens=nxt.to(self.device))
            last = logits[:, -1, :]

    def _sample(self, logits: torch.Tensor, temps: list[float], rngs: list[random.Random]) -> torch.Tensor:
        """Inverse-CDF sampling, vectorised over rows; each row draws from its own RNG."""
        logits = logits.float().cpu().clone()
        logits[:, PAD] = float("-inf")
        logits[:, BOS] = float("-inf")
        if logits.shape[1] > EOS + 1:
            logits[:, EOS + 1: VOCAB_SIZE] = float("-inf")
        t = torch.tensor(temps, dtype=torch.float32)
        greedy = logits.argmax(dim=-1)
        probs = torch.softmax(logits / t.clamp(min=1e-6)[:, None], dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.tensor([r.random() for r in rngs], dtype=torch.float32)[:, None] * cdf[:, -1:]
        sampled = torch.searchsorted(cdf, u).squeeze(1).clamp(max=logits.shape[1] - 1)
        return torch.where(t > 0, sampled, greedy)
