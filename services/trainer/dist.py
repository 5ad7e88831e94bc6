"""The one init path and the one teardown path of a trainer rank's process group.

Environment contract (torchrun's): MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK.
Backend: NCCL when CUDA is available (``trainer.backend: auto|nccl``), gloo otherwise. With
NCCL a second, gloo group carries the control traffic (batch bytes, checkpoint bytes, loss)
so those stay CPU tensors. The init timeout is long (``trainer.init_timeout_s``: ranks on
other machines may start late); after the first step it is shortened to
``trainer.step_timeout_s`` so a dead peer fails the job quickly instead of hanging it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("learnmesh.trainer")


@dataclass
class RankEnv:
    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise RuntimeError(f"--as-rank needs the torchrun environment; missing {', '.join(missing)}")
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))


def choose_backend(cfg: Any) -> str:
    wanted = cfg.trainer.backend
    if wanted == "nccl" or (wanted == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.backend is nccl but CUDA is not available")
        return "nccl"
    return "gloo"


def init_distributed(cfg: Any, env: RankEnv) -> tuple[torch.device, Any]:
    """Initialise the process group; returns (device, control group)."""
    backend = choose_backend(cfg)
    if backend == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=env.rank, world_size=env.world,
                            timeout=timedelta(seconds=cfg.trainer.init_timeout_s),
                            device_id=device if backend == "nccl" else None)
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.trainer.init_timeout_s)) \
        if backend == "nccl" else None
    log.info("rank %d/%d up: backend %s, device %s", env.rank, env.world, backend, device)
    return device, ctrl


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a peer already gone: nothing left to tear down cleanly
            log.debug("destroy_process_group: %s", exc)
