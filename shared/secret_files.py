"""Files that hold secrets: read only when no one but their owner can read them, written 0600.

A key file another local user can read is a key that user holds, so it is refused at
start rather than used: the error names the file and the fix. Every file learnmesh reads
a secret from goes through :func:`read_private` (delta key ring, generated keys, Redis
password, TLS client key, the per-process config files ``learnmesh up`` writes)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from shared.config import ConfigError


class InsecureFileError(ConfigError):
    """A secret file is readable or writable by group or others, or cannot be read."""


def check_private(path: str | os.PathLike[str], what: str = "key file") -> None:
    """Raise :class:`InsecureFileError` unless ``path`` is a regular file only its owner may
    read or write (a symlink is judged by its target: Kubernetes mounts secrets that way)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise InsecureFileError(f"cannot read {what} {p}: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InsecureFileError(f"{what} {p} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InsecureFileError(f"{what} {p} is open to group or others (mode {mode:04o}); "
                                f"run `chmod 600 {p}` (or 400), or replace the key if others may have read it")


def read_private(path: str | os.PathLike[str], what: str = "key file") -> bytes:
    """The bytes of a secret file, after :func:`check_private`."""
    check_private(path, what)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InsecureFileError(f"cannot read {what} {path}: {exc.strerror or type(exc).__name__}") from None


def read_private_text(path: str | os.PathLike[str], what: str = "key file") -> str:
    """A one-value secret file (a password, a key) without its trailing newline."""
    return read_private(path, what).decode().strip()


def write_private(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o600) -> None:
    """Replace ``path`` atomically with a file of ``mode`` (0600 unless it is a public part; its
    directory made 0700 when created)."""
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
