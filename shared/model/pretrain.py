"""Pre-training of the default model on the shipped corpus, cached on disk.

Base weights are keyed by a hash of everything that determines them (architecture, seed,
pre-training settings, corpus bytes), so every process that shares ``cache_dir`` — workers,
trainer ranks — starts from the same bytes. A file lock makes concurrent starters wait for
the first one instead of all training; the file is written atomically.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from shared.config import ModelConfig
from shared.model.base import config_hash

log = logging.getLogger(__name__)
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
BASE_FIELDS = ("kind", "d_model", "n_layers", "n_heads", "max_seq", "seed", "pretrain_steps", "image_patch",
               "image_grid", "audio_frame", "pretrain_batch", "pretrain_seq", "pretrain_lr")


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    return CORPUS_PATH.read_bytes()


def base_id(cfg: ModelConfig) -> str:
    """Id of the base weights (layout + seed + pre-training + corpus)."""
    corpus = hashlib.sha256(corpus_bytes()).hexdigest()[:16]
    return config_hash(cfg, BASE_FIELDS, {"corpus": corpus, "format": 1})


def cached_base_state(cfg: ModelConfig, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Load base weights from the cache, or pre-train ``model`` (freshly initialised) and store them."""
    directory = Path(cfg.cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"base-{base_id(cfg)}.pt"
    with open(directory / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            try:
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception:  # a corrupt cache file is rebuilt, not fatal
                log.warning("model cache %s unreadable; pre-training again", path)
        log.info("pre-training base model (%d steps) into %s", cfg.pretrain_steps, path)
        pretrain(cfg, model)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return state


HELD_OUT_FRACTION = 0.1


def corpus_split(held_out: bool) -> bytes:
    """The corpus without its last tenth (what online rehearsal may draw from), or that tenth
    (held out from online training, to measure forgetting); split at a paragraph boundary."""
    data = corpus_bytes()
    cut = data.find(b"\n\n", int(len(data) * (1 - HELD_OUT_FRACTION)))
    cut = len(data) if cut < 0 else cut + 2
    return data[cut:] if held_out else data[:cut]


def corpus_windows(n: int, rng: random.Random, length: int, held_out: bool = False) -> list[tuple[bytes, bytes]]:
    """``n`` random (prompt, continuation) windows of the corpus (:func:`corpus_split`), cut
    the way pre-training cuts them: rehearsal mixes them into online steps."""
    data = corpus_split(held_out)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(data) - length)
        window = data[start:start + length]
        cut = rng.randrange(1, length // 2)
        out.append((window[:cut], window[cut:]))
    return out


def pretrain(cfg: ModelConfig, model: Any) -> None:
    """Next-byte training on random corpus windows: prompt = first part, target = the rest."""
    if cfg.pretrain_steps == 0:
        return
    data = corpus_bytes()
    rng = random.Random(cfg.seed)  # noqa: S311 - reproducible batches, not secrets
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same arithmetic in every process: identical bytes from the same seed
    try:
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.pretrain_lr, total_steps=cfg.pretrain_steps,
                                                        pct_start=0.1)
            model.train()
            L = cfg.pretrain_seq - 3
            for _ in range(cfg.pretrain_steps):
                examples = []
                for _ in range(cfg.pretrain_batch):
                    start = rng.randrange(0, len(data) - L)
                    window = data[start:start + L]
                    cut = rng.randrange(1, L // 2)
                    examples.append(model.encode(None, window[:cut], window[cut:], reserve_tokens=0))
                loss = model.loss(model.collate(examples))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
            model.eval()
            log.info("pre-training done, final loss %.3f", float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
