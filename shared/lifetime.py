"""Processes that end with the process that started them.

``learnmesh up`` starts its children in sessions of their own (a Ctrl-C in the terminal reaches
the supervisor alone, which stops them in order) and torchrun does the same with its ranks, so
a kill -9 of the parent would leave them running: children holding the mesh's ports (the next
``learnmesh up`` refuses to start), a private redis-server writing under ``var/redis`` beside
the one the next start makes. On Linux the kernel signals a child when the process that
started it dies; elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
# loaded in the parent: a child calls it between fork and exec, where loading a library is unsafe
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``sig`` when its parent dies (Linux). As a
    ``preexec_fn``: the child stops as it does on SIGTERM from its parent."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig)
