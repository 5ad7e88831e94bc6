"""The one init path and the one teardown path of a trainer rank's process group, and the
collectives the loop needs beyond DDP's.

Environment contract (torchrun's): MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, and TORCHELASTIC_RESTART_COUNT (how often the group was restarted). Backend: NCCL when CUDA is available (``trainer.backend: auto|nccl``), gloo
otherwise; an NCCL rank uses the visible GPU numbered by its LOCAL_RANK. With
NCCL a second, gloo group carries the control traffic (batch bytes, checkpoint bytes, loss)
so those stay CPU tensors. The init timeout is long (``trainer.init_timeout_s``: ranks on
other machines may start late); after the first step it is shortened to
``trainer.step_timeout_s`` so a dead peer fails the job quickly instead of hanging it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from shared.config import Config, ConfigError

log = logging.getLogger("learnmesh.trainer")


@dataclass
class RankEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int = 1  # ranks on this machine
    restarts: int = 0  # times torchrun restarted the group before this start

    @classmethod
    def from_environ(cls) -> RankEnv:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise RuntimeError(f"--as-rank needs the torchrun environment; missing {', '.join(missing)}")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank,
                   int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def tell_torchrun(reason: str) -> None:
    """Hand the torchrun agent why this rank fails, through its error file
    (TORCHELASTIC_ERROR_FILE): torchrun's failure summary names it, where it would only say the
    exit status and where to read about tracebacks."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": reason, "timestamp": int(time.time())}, f)
    except OSError as exc:
        log.warning("cannot hand torchrun the reason in %s: %s", path, exc.strerror or exc)


@dataclass
class RankGroup:
    """This rank's place in the group; ``ctrl`` carries the control traffic (batch bytes,
    checkpoint bytes, the loss): a gloo group beside NCCL, else None (the default group)."""

    rank: int
    world: int
    device: torch.device
    ctrl: dist.ProcessGroup | None = None

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (b"" when it has none)."""
        if self.world == 1:
            return data or b""
        mine = data if self.rank == 0 and data else b""
        n = torch.tensor([len(mine)], dtype=torch.int64)
        dist.broadcast(n, 0, group=self.ctrl)
        size = int(n.item())
        if size == 0:
            return b""
        buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.ctrl)
        return mine or buf.numpy().tobytes()

    def sum(self, tensor: torch.Tensor) -> None:
        """All-reduce a CPU tensor in place (a no-op alone)."""
        if self.world > 1:
            dist.all_reduce(tensor, group=self.ctrl)

    def shorten_timeout(self, seconds: int) -> None:
        """From now on a collective waits at most ``seconds`` for a peer (a dead one fails the job)."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        for group in {None, self.ctrl}:
            try:
                _set_pg_timeout(timedelta(seconds=seconds), group)
            except Exception as exc:  # pragma: no cover - backend without the call
                log.debug("could not shorten the process-group timeout: %s", exc)


def choose_backend(cfg: Config) -> str:
    wanted = cfg.trainer.backend
    if wanted == "nccl" or (wanted == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.backend is nccl but CUDA is not available")
        return "nccl"
    return "gloo"


def gpu_index(local_rank: int, local_world: int, gpus: int) -> int:
    """The CUDA device of an NCCL rank: its LOCAL_RANK among the ``gpus`` visible GPUs. NCCL
    refuses two ranks on one GPU, so more ranks on a machine than GPUs cannot start."""
    ranks = max(local_world, local_rank + 1)
    if ranks > gpus:
        raise ConfigError(f"{ranks} NCCL ranks on this machine but {gpus} visible GPU(s): NCCL needs one GPU per "
                           f"rank; set trainer.ranks (or torchrun --nproc-per-node) to at most {gpus}, or use "
                           "trainer.backend gloo")
    return local_rank


def ranks_for_gpus(ranks: int, backend: str, gpus: int) -> int:
    """How many ranks ``learnmesh trainer`` starts on this machine: ``ranks``, capped at the GPU count when the
    ranks would use NCCL (see :func:`gpu_index`)."""
    nccl = backend == "nccl" or (backend == "auto" and gpus > 0)
    if not nccl or gpus == 0 or ranks <= gpus:
        return ranks  # gloo, or NCCL without CUDA: the ranks themselves report that
    log.warning("trainer.ranks is %d but this machine has %d GPU(s) and NCCL needs one GPU per rank: "
                "starting %d ranks", ranks, gpus, gpus)
    return gpus


def local_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_threads(configured: int, local_world: int) -> int:
    """Intra-op threads of a CPU rank: ``trainer.torch_threads``, or (0) the machine's cores
    shared among the ranks on it — torch's default of every core per rank oversubscribes the
    machine R times over (torchrun sets one thread per rank for the same reason)."""
    if configured > 0:
        return configured
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def start_store(env: RankEnv, timeout: timedelta) -> dist.Store | None:
    """The store this start of the group meets in: None (torchrun's env:// contract) unless the
    ranks share the torchrun agent's store (TORCHELASTIC_USE_AGENT_STORE; always so with
    ``--rdzv-backend=static``, the Kubernetes trainer's). That store lives as long as torchrun,
    so after a restart it still holds the dead group's keys, and a new rank reading a peer's
    address there before the peer rewrote it connects to a process that is gone (gloo:
    "connectFullMesh failed ... Connect timeout"). Each start gets keys of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"learnmesh/start-{env.restarts}", agent)


LEADER_READY = "leader-ready"
LEADER_WAITS = "leader-waits"


def leader_ready(store: dist.Store | None) -> None:
    """Rank 0 found Redis answering: the other ranks may join the group (:func:`await_leader`)."""
    if store is not None:
        store.set(LEADER_READY, "1")


class LeaderBeat:
    """Rank 0's sign, at each turn of its wait for Redis, that it is alive and waiting."""

    def __init__(self, store: dist.Store | None) -> None:
        self.store, self.turns = store, 0

    def __call__(self) -> None:
        if self.store is not None:
            self.turns += 1
            self.store.set(LEADER_WAITS, str(self.turns))


def await_leader(store: dist.Store | None, rank: int, limit_s: float, turn_s: float = 0.5) -> None:
    """A rank other than 0 waits here while rank 0 waits for Redis before it joins: inside the
    group's init the wait would end after ``trainer.init_timeout_s`` and torchrun would spend a
    restart on a Redis that is merely late. It waits as long as rank 0 beats (:class:`LeaderBeat`),
    and gives up (TimeoutError: a failed start, which torchrun restarts) after ``limit_s``
    without a beat: a rank 0 that died, or restarted apart from this rank, never joins here.
    Only with the torchrun agent's store (its default); without it the init's own wait applies.
    Polled, not a blocking store wait: a stop signal is handled in the sleep, and a store wait
    that times out logs a warning each time."""
    if store is None:
        return
    said, beat, beat_at = False, b"", time.monotonic()
    while not store.check([LEADER_READY]):
        now = time.monotonic()
        seen = store.get(LEADER_WAITS) if store.check([LEADER_WAITS]) else b""
        if seen != beat:
            beat, beat_at = seen, now
            if not said:
                log.info("rank %d waits for rank 0, which waits for Redis, before it joins the group", rank)
                said = True
        elif now - beat_at > limit_s:
            raise TimeoutError(f"rank 0 neither joined nor said it waits for Redis within {limit_s:.0f} s")
        time.sleep(turn_s)


def init_distributed(cfg: Config, env: RankEnv, store: dist.Store | None = None) -> RankGroup:
    """Initialise the process group; ``store``: the one :func:`start_store` gave, else made here."""
    backend = choose_backend(cfg)
    if backend == "nccl":
        device = torch.device("cuda", gpu_index(env.local_rank, env.local_world, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(cfg.trainer.torch_threads, env.local_world))
    timeout = timedelta(seconds=cfg.trainer.init_timeout_s)
    dist.init_process_group(backend, store=store if store is not None else start_store(env, timeout), rank=env.rank, world_size=env.world,
                            timeout=timeout, device_id=device if backend == "nccl" else None)
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.trainer.init_timeout_s)) \
        if backend == "nccl" else None
    log.info("rank %d/%d up: backend %s, device %s", env.rank, env.world, backend, device)
    return RankGroup(env.rank, env.world, device, ctrl)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a peer already gone: nothing left to tear down cleanly
            log.debug("destroy_process_group: %s", exc)


def leave(code: int) -> NoReturn:
    """End a rank's process once everything is committed and torn down, without running the
    interpreter's and C++'s static destructors: gloo's transport threads can abort the process
    there ("terminate called without an active exception"), turning a clean stop into SIGABRT."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
