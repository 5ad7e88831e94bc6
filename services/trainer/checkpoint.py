"""Checkpoints: ``ckpt-<step>.pt`` written atomically (temp file + rename + fsync), newest N kept;
the temp file of a write a kill -9 cut short goes with the next save.

A checkpoint holds the model state, optimizer and schedule state, and the commit record it
corresponds to (step, seq, id, version) — see services/trainer/ledger.py for why it is only
written after that step's commit.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")


def _list(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


def save(directory: str | os.PathLike[str], step: int, state: dict[str, Any], keep: int) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{step:010d}.pt"
    tmp = d / f".ckpt-{step:010d}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    for _, old in _list(d)[:-keep]:
        old.unlink(missing_ok=True)
    for partial in d.glob(".ckpt-*.pt.tmp"):  # a write a kill -9 cut short (rank 0 is the only writer)
        partial.unlink(missing_ok=True)
    return final


def latest_bytes(directory: str | os.PathLike[str]) -> bytes | None:
    """Raw bytes of the newest readable checkpoint (rank 0 broadcasts them to the other ranks)."""
    for _, path in reversed(_list(Path(directory))):
        try:
            data = path.read_bytes()
            load_bytes(data)  # refuse a corrupt file, fall back to the previous one
            return data
        except Exception:  # noqa: S112 - a corrupt or partial file: the next older one is tried
            continue
    return None


def load_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
