"""The version floor: every version number names one set of weights for ever.

A restarted trainer numbers its restored weights ``max(checkpoint, commit record,
keys.MODEL_VERSION) + 1``. Redis alone cannot keep that above every version already served:
a Redis without persistence that restarted, or one restored from an older snapshot, has lost
the commit record and the model version, and the trainer would publish the checkpoint's
version + 1 again — a number workers already served with other weights, which a request
waiting on ``min_model_version`` or ``after_learn`` would then accept. So the trainer also
keeps, beside its checkpoints (``trainer.checkpoint_dir``), the highest version it may have
published: before a version goes out it must be at most the floor on disk. The floor is
reserved :data:`RESERVE_BLOCK` versions ahead and written durably only when a version passes
it (one fsync per block, not per publish); a restart starts above it, so it may skip up to
that many numbers, never reuse one (docs/trainer.md, "Version numbers").
"""

from __future__ import annotations

import os
from pathlib import Path

from services.trainer.checkpoint import CheckpointError

FILE_NAME = "version-floor"
RESERVE_BLOCK = 100


class VersionFloor:
    """The highest version the trainer may have published, kept in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / FILE_NAME
        self.reserved = self._read()

    def reserve(self, version: int) -> None:
        """Call before ``version`` goes out (a publish, a snapshot): raises
        :class:`~services.trainer.checkpoint.CheckpointError` when the floor cannot be written,
        rather than publish a number a restart could give again."""
        if version <= self.reserved:
            return
        floor = version + RESERVE_BLOCK
        tmp = self.path.with_name(f".{FILE_NAME}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(f"{floor}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"cannot write the version floor {self.path}: {exc.strerror or exc}. Free "
                                  f"space in {self.path.parent} (trainer.checkpoint_dir) or make it writable") from exc
        self.reserved = floor

    def _read(self) -> int:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise CheckpointError(f"cannot read the version floor {self.path}: {exc.strerror or exc}") from exc
        if not text.isdigit():
            raise CheckpointError(f"the version floor {self.path} does not hold a version ({text[:40]!r}). Write "
                                  "in it a number above every model version workers may have served, or "
                                  "delete it when Redis still holds keys.MODEL_VERSION")
        return int(text)
