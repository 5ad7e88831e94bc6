"""The learnmesh model: :func:`build_model` returns a :class:`LearnModel`.

``model.kind: bytes`` (default) is the built-in byte-level transformer
(:mod:`shared.model.transformer`), pre-trained on the shipped corpus and cached;
``model.kind: hf`` wraps a local Hugging Face causal LM (:mod:`shared.model.hf`).
"""

from __future__ import annotations

import torch

from shared.config import ModelConfig
from shared.model.base import EOS, PAD, SPECIAL, VOCAB_SIZE, Batch, Example, LearnModel, ModelInputError
from shared.model.media import MediaError

__all__ = ["EOS", "PAD", "SPECIAL", "VOCAB_SIZE", "Batch", "Example", "LearnModel", "MediaError",
           "ModelInputError", "build_model"]


def build_model(cfg: ModelConfig, *, pretrained: bool = True) -> LearnModel:
    """Build the model deterministically from ``cfg.seed`` (eval mode, CPU).

    ``pretrained=True`` loads base weights cached in ``cfg.cache_dir`` (pre-training and
    caching them first when absent); ``False`` gives the seeded random initialisation.
    Trainable parameters follow ``cfg.trainable``; the others have ``requires_grad=False``.
    """
    if cfg.kind == "hf":
        from shared.model.hf import HFModel

        model: LearnModel = HFModel(cfg)
    else:
        from shared.model.pretrain import cached_base_state
        from shared.model.transformer import ByteTransformer

        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed)
            bt = ByteTransformer(cfg)
        if pretrained:
            bt.load_state_dict(cached_base_state(cfg, bt))
        if cfg.trainable == "lora":
            with torch.random.fork_rng():
                torch.manual_seed(cfg.seed + 1)
                bt.add_lora()
        model = bt
    trainable = {id(p) for _, p in model.trainable_named_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    return model.eval()
