"""``learnmesh trainer``: spawn ``trainer.ranks`` rank processes with torchrun's environment
contract, or run as one rank under torchrun (``--as-rank``).

Spawn mode is a small elastic agent for one machine: it starts every rank, watches them,
and when one dies it kills the rest and restarts the whole group from the latest
checkpoint (up to ``trainer.max_restarts`` times, like ``torchrun --max-restarts``). SIGTERM
is forwarded to every rank; rank 0 then stops the group, which checkpoints and exits.
Across machines use torchrun itself (see docs/trainer.md).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import yaml

log = logging.getLogger("learnmesh.trainer")


def main(cfg: Any, args: Any) -> int:
    if getattr(args, "ranks", None):
        cfg.trainer.ranks = int(args.ranks)
    _logging(os.environ.get("RANK", "agent") if getattr(args, "as_rank", False) else "agent")
    if getattr(args, "as_rank", False):
        code = run_rank(cfg)
        # Everything is checkpointed, committed and torn down by now. Leave without running
        # interpreter/C++ static destructors: gloo's transport threads can otherwise abort
        # the process at exit ("terminate called without an active exception"), turning a
        # clean stop into exit code 1 (seen on torch 2.13).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return Agent(cfg).run()


def _logging(who: str) -> None:
    logging.basicConfig(level=os.environ.get("LEARNMESH_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s trainer[{who}] %(levelname)s %(message)s")


# ---------------------------------------------------------------- one rank


def run_rank(cfg: Any) -> int:
    from services.trainer.dist import RankEnv, init_distributed, teardown
    from services.trainer.loop import Trainer

    env = RankEnv.from_environ()
    stop = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    _metrics_server(cfg, env.rank)
    trainer = None
    try:
        device, ctrl = init_distributed(cfg, env)
        trainer = Trainer(cfg, env.rank, env.world, device, ctrl, stop.is_set)
        trainer.run()
        log.info("rank %d stopped cleanly at step %d", env.rank, trainer.step)
        return 0
    except Exception as exc:
        log.error("rank %d failed: %s: %s", env.rank, type(exc).__name__, exc,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        teardown()


def _metrics_server(cfg: Any, rank: int) -> None:
    mcfg = getattr(cfg, "metrics", None)
    port = getattr(mcfg, "trainer_port", 0) if mcfg is not None else 0
    if not port:
        return
    from prometheus_client import start_http_server

    try:
        start_http_server(port + rank, addr=getattr(mcfg, "bind_host", "127.0.0.1"))
    except OSError as exc:
        log.warning("metrics port %d unavailable: %s", port + rank, exc)


# ---------------------------------------------------------------- the local agent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.stopping = False
        self.procs: list[subprocess.Popen[bytes]] = []

    def _ranks(self) -> int:
        t = self.cfg.trainer
        if t.backend == "gloo":  # no need to load torch and probe CUDA here
            return t.ranks
        from services.trainer.dist import local_gpu_count, ranks_for_gpus

        return ranks_for_gpus(t.ranks, t.backend, local_gpu_count())

    def _write_config(self) -> str:
        fd, path = tempfile.mkstemp(prefix="learnmesh-trainer-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f)
        return path

    def _spawn(self, path: str, port: int) -> None:
        world = self.cfg.trainer.ranks
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", "--config", path, "trainer", "--as-rank"], env=env))

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def _forward_term(self, signum: int, frame: Any) -> None:
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def run(self) -> int:
        from shared import metrics as m

        signal.signal(signal.SIGTERM, self._forward_term)
        signal.signal(signal.SIGINT, self._forward_term)
        self.cfg.trainer.ranks = self._ranks()
        path = self._write_config()
        try:
            for attempt in range(self.cfg.trainer.max_restarts + 1):
                # One machine: any free port will do (trainer.master_port is torchrun's, across machines).
                self._spawn(path, _free_port())
                failed = self._watch()
                if failed is None:
                    return 0
                if self.stopping:
                    return 1
                if attempt < self.cfg.trainer.max_restarts:
                    m.TRAINER_RESTARTS.inc()
                    log.warning("rank %d exited with %s; restarting all ranks from the latest checkpoint "
                                "(restart %d of %d)", failed[0], failed[1], attempt + 1, self.cfg.trainer.max_restarts)
            log.error("trainer failed: a rank kept dying (%d restarts used)", self.cfg.trainer.max_restarts)
            return 1
        finally:
            self._kill_all()
            os.unlink(path)

    def _watch(self) -> tuple[int, int] | None:
        """Wait for the group; None when every rank exited 0, else (rank, code) of the first failure."""
        grace_deadline: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    self._kill_all()  # the others are blocked in a collective with a dead peer
                    return rank, code
            if all(c == 0 for c in codes):
                return None
            if self.stopping:
                grace_deadline = grace_deadline or time.monotonic() + self.cfg.trainer.step_timeout_s
                if time.monotonic() > grace_deadline:
                    log.error("ranks did not stop within %ss after SIGTERM; killing them",
                              self.cfg.trainer.step_timeout_s)
                    self._kill_all()
                    return -1, -9
            time.sleep(0.05)
