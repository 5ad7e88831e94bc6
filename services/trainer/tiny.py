"""A tiny byte-level model with the LearnModel interface (encode/collate/loss/score).

It exists so the trainer's distributed machinery (DDP, hooks, exactly-once, restarts) can be
tested and benchmarked in seconds on a CPU. Select it with
``trainer.model_factory: services.trainer.tiny:build_tiny_model``; the product model is
``shared.model.build_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shared.config import ModelConfig

SEP = 256
PAD = 257
VOCAB = 258


@dataclass
class TinyExample:
    tokens: list[int]
    target_start: int


@dataclass
class TinyBatch:
    tokens: torch.Tensor   # [B, T] int64
    mask: torch.Tensor     # [B, T-1] float: 1 where the next token is a target token

    def to(self, device: Any) -> TinyBatch:
        return TinyBatch(self.tokens.to(device), self.mask.to(device))


class TinyLM(nn.Module):
    def __init__(self, width: int = 32, max_seq: int = 128, seed: int = 1234) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.max_seq = max_seq
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.proj = nn.Linear(width, width * 4)
        self.head = nn.Linear(width * 4, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.model_id = f"tiny-gru-w{width}-s{seed}"

    def encode(self, context: Any, prompt: str, target: str) -> TinyExample:
        ctx = b""
        if context is not None:
            entries = context.entries() if hasattr(context, "entries") else list(context)
            ctx = b"".join(e.content for e in entries if getattr(e, "modality", "text") == "text")
        head = list(ctx + prompt.encode()) + [SEP]
        tail = list(target.encode())
        keep = self.max_seq - len(tail)
        head = head[-keep:] if keep > 0 else head[-1:]
        tokens = (head + tail)[: self.max_seq]
        return TinyExample(tokens, len(head))

    def collate(self, examples: list[TinyExample]) -> TinyBatch:
        width = max(len(e.tokens) for e in examples)
        tokens = torch.full((len(examples), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(examples), width - 1))
        for i, e in enumerate(examples):
            tokens[i, : len(e.tokens)] = torch.tensor(e.tokens)
            mask[i, e.target_start - 1: len(e.tokens) - 1] = 1.0
        return TinyBatch(tokens, mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.head(torch.relu(self.proj(h)))

    def token_losses(self, batch: TinyBatch) -> torch.Tensor:
        logits = self(batch.tokens[:, :-1])
        nll = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.tokens[:, 1:].reshape(-1),
                                          reduction="none").view_as(batch.mask)
        return nll * batch.mask

    def loss(self, batch: TinyBatch) -> torch.Tensor:
        return self.token_losses(batch).sum() / batch.mask.sum().clamp_min(1.0)

    @torch.no_grad()
    def score(self, examples: list[TinyExample]) -> list[float]:
        batch = self.collate(examples)
        per = self.token_losses(batch).sum(1) / batch.mask.sum(1).clamp_min(1.0)
        return [float(x) for x in per]

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]


def build_tiny_model(model_cfg: ModelConfig | None = None, pretrained: bool = True) -> TinyLM:
    return TinyLM(seed=model_cfg.seed if model_cfg is not None else 1234)
