"""Checkpoints: ``ckpt-<step>.pt`` written atomically (temp file + rename + fsync), newest N kept;
the temp file of a write a kill -9 cut short goes with the next save.

A checkpoint holds the model state, optimizer and schedule state, and the commit record it
corresponds to (step, seq, id, version) — see services/trainer/ledger.py for why it is only
written after that step's commit.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("learnmesh.trainer")

_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
UNREADABLE_SUFFIX = ".unreadable"


class CheckpointError(RuntimeError):
    """A checkpoint the trainer cannot resume from or write; the message names the file and what to do."""


def _list(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


def save(directory: str | os.PathLike[str], step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step``; :class:`CheckpointError` when the directory
    refuses it (full, read-only), with no partial file left to fill it further."""
    d = Path(directory)
    final = d / f"ckpt-{step:010d}.pt"
    tmp = d / f".ckpt-{step:010d}.pt.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True)
        _write_durably(tmp, final, state)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {exc.strerror or exc}. Free space in "
                              f"{d} (trainer.checkpoint_dir) or make it writable; on restart the trainer "
                              "resumes from the last checkpoint written and trains the later steps again") from exc
    except RuntimeError as exc:  # torch.save reports a failed write (ENOSPC) as its own error
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint {final} ({shutil.disk_usage(d).free} bytes free there): "
                              f"{str(exc).strip().splitlines()[0]}. Free space in {d} "
                              "(trainer.checkpoint_dir); on restart the trainer resumes from the last "
                              "checkpoint written and trains the later steps again") from exc
    for _, old in _list(d)[:-keep]:
        old.unlink(missing_ok=True)
    for partial in d.glob(".ckpt-*.pt.tmp"):  # a write a kill -9 cut short (rank 0 is the only writer)
        partial.unlink(missing_ok=True)
    return final


def _write_durably(tmp: Path, final: Path, state: dict[str, Any]) -> None:
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dfd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def latest(directory: str | os.PathLike[str]) -> tuple[Path, bytes] | None:
    """The newest readable checkpoint and its raw bytes (rank 0 broadcasts them to the other
    ranks); None when the directory holds none. Newer files that cannot be read (cut short,
    zero bytes, not a checkpoint) are logged and renamed ``<name>.unreadable``, out of the
    way of the next saves; when no file reads, :class:`CheckpointError` — starting over from
    untrained weights would drop everything the checkpoints hold."""
    found = list(reversed(_list(Path(directory))))
    bad: list[tuple[Path, str]] = []
    for _, path in found:
        try:
            data = path.read_bytes()
            load_bytes(data)
        except Exception as exc:  # a corrupt, partial or unreadable file: the next older one is tried
            bad.append((path, _reason(exc)))
            continue
        for unreadable, reason in bad:
            _set_aside(unreadable, reason, path)
        return path, data
    if bad:
        listed = "; ".join(f"{p.name}: {reason}" for p, reason in bad)
        raise CheckpointError(f"no checkpoint in {directory} (trainer.checkpoint_dir) can be read ({listed}). "
                              "Put a good checkpoint back, or move these files away to train from the "
                              "untrained model (the ledger then starts over)")
    return None


def _set_aside(path: Path, reason: str, instead: Path) -> None:
    aside = path.with_name(path.name + UNREADABLE_SUFFIX)
    try:
        path.rename(aside)
    except OSError as exc:
        log.error("checkpoint %s cannot be read (%s); resuming from the older %s. It could not be renamed "
                  "(%s): delete or replace it", path, reason, instead.name, exc.strerror or exc)
        return
    log.error("checkpoint %s cannot be read (%s); resuming from the older %s (the steps after it are "
              "trained again from the sample log). The file is kept as %s for inspection", path, reason,
              instead.name, aside.name)


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__


def load_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def recall_bytes(state: dict[str, Any] | None) -> bytes:
    """The facts a checkpoint kept for recall (services/trainer/replay.py); empty when none."""
    kept = state.get("recall") if state is not None else None
    return kept.numpy().tobytes() if isinstance(kept, torch.Tensor) else b""
