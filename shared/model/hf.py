"""Adapter: a Hugging Face ``transformers`` causal LM as a :class:`LearnModel`.

``model.kind: hf`` with ``model.hf_path`` pointing at a local directory: weights are loaded
with ``from_pretrained(local_files_only=True)``; a directory holding only ``config.json`` gives
a randomly initialised model seeded from ``model.seed`` (what the tests use). Nothing is
downloaded. ``transformers`` is an optional dependency (``pip install 'learnmesh[hf]'``).

The adapter keeps learnmesh's byte-level token ids (0-255 bytes, 256-263 specials), so the
wrapped model needs ``vocab_size >= 264``; image and audio entries are skipped (text only).
Trainable modes: ``all`` and ``head`` (the output embedding); ``lora`` is refused.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.config import ConfigError, ModelConfig
from shared.model.base import VOCAB_SIZE, Batch, LearnModel


class HFModel(LearnModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        try:
            import transformers
        except ImportError:
            raise ConfigError("model.kind 'hf' needs the transformers package (pip install 'learnmesh[hf]')") from None
        if cfg.trainable == "lora":
            raise ConfigError("model.trainable 'lora' is not supported for model.kind 'hf' (use all or head)")
        path = Path(cfg.hf_path or "")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.hf_path {path} has no config.json")
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed)
            if has_weights:
                lm = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
            else:
                hf_cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
                lm = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        if lm.config.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"the HF model's vocab_size must be >= {VOCAB_SIZE} (byte-level ids)")
        max_pos = getattr(lm.config, "max_position_embeddings", None) or getattr(lm.config, "n_positions", None)
        if max_pos is not None and max_pos < cfg.max_seq:
            raise ConfigError(f"model.max_seq {cfg.max_seq} exceeds the HF model's {max_pos} positions")
        self.lm = lm
        params = inspect.signature(lm.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x

    def image_features(self, data: bytes) -> None:
        return None

    def audio_features(self, data: bytes) -> None:
        return None

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.cfg.trainable == "head":
            head = {id(p) for p in self.lm.get_output_embeddings().parameters()}
            return [(n, p) for n, p in self.named_parameters() if id(p) in head]
        return list(self.named_parameters())

    def forward_logits(self, batch: Batch, cache: Any = None,
                       step_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        if step_tokens is None:
            out = self.lm(input_ids=batch.tokens, attention_mask=batch.valid.long(),
                          position_ids=batch.positions, use_cache=True)
            state = {"pkv": self._out_cache(out), "valid": batch.valid, "pos": batch.positions[:, -1]}
            return out.logits[..., :VOCAB_SIZE], state
        pos = (cache["pos"] + 1).clamp(max=self.max_seq - 1)
        valid = torch.cat([cache["valid"], torch.ones_like(cache["valid"][:, :1])], dim=1)
        out = self.lm(input_ids=step_tokens[:, None], attention_mask=valid.long(), position_ids=pos[:, None],
                      use_cache=True, **{self._cache_arg: cache["pkv"]})
        return out.logits[..., :VOCAB_SIZE], {"pkv": self._out_cache(out), "valid": valid, "pos": pos}

    @staticmethod
    def _out_cache(out: Any) -> Any:
        found = getattr(out, "cache", None)
        return found if found is not None else out.past_key_values
