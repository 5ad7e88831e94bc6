"""The default learnmesh model: a small pre-norm decoder-only transformer over bytes.

Image patches and audio frames are linear projections into the token embedding space,
placed at their placeholder positions. Optional low-rank adapters (``trainable: lora``) sit
on the attention and MLP projections; the base weights are then frozen. No buffers: masks
are built per call, so a module's state is exactly its parameters.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import ModelConfig
from shared.model.base import Batch, LearnModel


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with B initialised to zero (starts as the base layer)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv: nn.Module = nn.Linear(d, 3 * d)
        self.proj: nn.Module = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1: nn.Module = nn.Linear(d, 4 * d)
        self.fc2: nn.Module = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, D = x.shape
        H = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, (k, v)


class ByteTransformer(LearnModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.tok_emb = nn.Embedding(self.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.max_seq, d)
        self.image_proj = nn.Linear(cfg.image_patch * cfg.image_patch * 3, d)
        self.audio_proj = nn.Linear(cfg.audio_frame, d)
        self.blocks = nn.ModuleList(Block(d, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def add_lora(self) -> None:
        """Wrap attention/MLP projections with low-rank adapters (after base weights are loaded)."""
        for blk in self.blocks:
            for name in ("qkv", "proj", "fc1", "fc2"):
                setattr(blk, name, LoRALinear(getattr(blk, name), self.cfg.lora_rank, self.cfg.lora_alpha))

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        mode = self.cfg.trainable
        if mode == "all":
            return list(self.named_parameters())
        if mode == "head":
            return [(n, p) for n, p in self.named_parameters() if n.startswith(("head.", "ln_f."))]
        return [(n, p) for n, p in self.named_parameters() if ".lora_" in n]

    def forward_logits(self, batch: Batch, cache: Any = None,
                       step_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        if step_tokens is None:
            return self._prefill(batch)
        return self._step(step_tokens, cache)

    def _prefill(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        B, T = batch.tokens.shape
        x = self.tok_emb(batch.tokens)
        if batch.image_idx.numel() or batch.audio_idx.numel():
            flat = x.reshape(B * T, -1)
            if batch.image_idx.numel():
                flat = flat.index_copy(0, batch.image_idx, self.image_proj(batch.image).to(flat.dtype))
            if batch.audio_idx.numel():
                flat = flat.index_copy(0, batch.audio_idx, self.audio_proj(batch.audio).to(flat.dtype))
            x = flat.view(B, T, -1)
        x = x + self.pos_emb(batch.positions)
        causal = torch.ones((T, T), dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        mask = (causal & batch.valid[:, None, :]) | eye  # a pad query attends to itself only
        mask = mask[:, None, :, :]
        kv = []
        for blk in self.blocks:
            x, past = blk(x, mask, None)
            kv.append(past)
        logits = self.head(self.ln_f(x))
        return logits, {"kv": kv, "valid": batch.valid, "pos": batch.positions[:, -1]}

    def _step(self, tokens: torch.Tensor, cache: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        pos = (cache["pos"] + 1).clamp(max=self.max_seq - 1)
        x = self.tok_emb(tokens[:, None]) + self.pos_emb(pos[:, None])
        valid = torch.cat([cache["valid"], torch.ones_like(cache["valid"][:, :1])], dim=1)
        mask = valid[:, None, None, :]
        kv = []
        for blk, past in zip(self.blocks, cache["kv"], strict=True):
            x, new = blk(x, mask, past)
            kv.append(new)
        return self.head(self.ln_f(x)), {"kv": kv, "valid": valid, "pos": pos}
