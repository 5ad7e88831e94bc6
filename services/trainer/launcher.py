"""``learnmesh trainer`` on one machine: torchrun (``torch.distributed.run``) with the settings
of ``learnmesh.yaml``.

torchrun starts ``trainer.ranks`` rank processes (``learnmesh trainer --as-rank``) with its
environment contract — MASTER_ADDR is ``trainer.master_addr``, the port a free one (one
machine needs no agreed port) — and when a rank dies restarts the whole group from the
latest checkpoint, up to ``trainer.max_restarts`` times in a row (counted afresh once the group
has run healthy for ``HEALTHY_RUN_S``; each rank exports the count as
``learnmesh_trainer_restarts_total``) — but not when a rank exited with ``CONFIG_ERROR_EXIT``:
it met a failure every restart would meet again (a setting, a key or checkpoint file), and the
launcher exits with that status at once. Every start of the group gets a fresh store, hosted by
rank 0 on a new port: a store kept across restarts still holds the dead group's keys, and
the new ranks would try to reach the old ranks' addresses. SIGTERM or SIGINT stops the
group: every rank gets it, rank 0 stops the others at the next step boundary and they
checkpoint; ranks still running after ``trainer.step_timeout_s`` are killed. Across
machines run torchrun itself (docs/trainer.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed.launcher.api as torch_launcher
import yaml
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shared.config import CONFIG_ERROR_EXIT, Config, ConfigError
from shared.secret_files import write_private

log = logging.getLogger("learnmesh.trainer")

RankArgv = Callable[[str], Sequence[str]]  # config path -> the rank's command line after the interpreter
_FRESH_STORE_PER_START = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch reads it; no launch option exists


def cli_rank_argv(config_path: str) -> list[str]:
    return ["-m", "services.cli", "--config", config_path, "trainer", "--as-rank"]


def launch(cfg: Config, rank_argv: RankArgv = cli_rank_argv, ready: Callable[[], bool] = lambda: True) -> int:
    """Run the rank group until it stops; the exit status of ``learnmesh trainer``. ``ready`` is
    asked once the settings are checked, before any rank starts: False ends the launch (0)."""
    cfg.trainer.ranks = local_ranks(cfg)
    # The ranks' configuration, read again at each restart of the group. Beside the checkpoints,
    # one name: the trainer's own private place, where a launcher killed with -9 leaves no copy
    # of the configuration behind but this one, which the next start replaces.
    path = Path(cfg.trainer.checkpoint_dir) / "launch-config.yaml"
    try:
        write_private(path, yaml.safe_dump(cfg.to_dict()))
    except OSError as exc:  # every start would fail here, and every checkpoint after it
        raise ConfigError(f"trainer.checkpoint_dir: cannot write {cfg.trainer.checkpoint_dir} "
                          f"({exc.strerror or exc}); give it a directory the trainer can write") from None
    try:
        return _run(cfg, rank_argv(str(path))) if ready() else 0
    finally:
        path.unlink(missing_ok=True)


def local_ranks(cfg: Config) -> int:
    """``trainer.ranks``, capped at the GPU count when the ranks would use NCCL."""
    t = cfg.trainer
    if t.backend == "gloo":  # no need to load CUDA here
        return t.ranks
    from services.trainer.dist import local_gpu_count, ranks_for_gpus

    return ranks_for_gpus(t.ranks, t.backend, local_gpu_count())


def launch_config(cfg: Config) -> LaunchConfig:
    """torchrun's settings for one machine (``--standalone`` at ``trainer.master_addr``):
    ``--nproc-per-node ranks --max-restarts N --local-addr A --shutdown-timeout step_timeout_s``."""
    t = cfg.trainer
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=t.ranks, run_id=f"learnmesh-{uuid.uuid4().hex}",
                        rdzv_backend="c10d", rdzv_endpoint=f"{t.master_addr}:0", rdzv_configs={"is_host": True},
                        local_addr=t.master_addr, max_restarts=t.max_restarts, shutdown_timeout=t.step_timeout_s,
                        # SIGTERM and SIGINT go through _StopRequest (below), which times the stop
                        signals_to_handle="SIGHUP,SIGQUIT")


HEALTHY_RUN_S = 600.0
"""How long a group runs healthy before ``trainer.max_restarts`` counts afresh: the restarts are
for a run of failures (a rank that keeps dying), not for the trainer's life, which meets a Redis
failover or a lost peer now and then."""


class _Agent(LocalElasticAgent):
    """torchrun's agent, which does not restart a group in which a rank exited with
    ``CONFIG_ERROR_EXIT``, and gives a group back its ``max_restarts`` once it has run healthy
    for ``HEALTHY_RUN_S``. (torchrun has neither setting; its launch builds the agent by this name.)"""

    _healthy_since: float | None = None
    stop_request: _StopRequest | None = None  # this launch's: _StopRequest.raise_if_dropped

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self.stop_request is not None:
            self.stop_request.raise_if_dropped()
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and _unfixable(result.failures) is not None:
            self._remaining_restarts = 0
        if result.state != WorkerState.HEALTHY:
            self._healthy_since = None
            return result
        now = time.monotonic()
        if self._healthy_since is None:
            self._healthy_since = now
        elif now - self._healthy_since >= HEALTHY_RUN_S and self._remaining_restarts < worker_group.spec.max_restarts:
            log.info("the rank group ran %.0f s without failing: %d restart(s) allowed again",
                     now - self._healthy_since, worker_group.spec.max_restarts)
            self._remaining_restarts = worker_group.spec.max_restarts
        return result


def _unfixable(failures: dict[int, Any]) -> int | None:
    """The global rank that exited with ``CONFIG_ERROR_EXIT``, if one did."""
    return next((rank for rank, failure in failures.items() if failure.exitcode == CONFIG_ERROR_EXIT), None)


def _run(cfg: Config, argv: Sequence[str]) -> int:
    # for this launch only: a process that goes on to run torchrun itself gets torch's default
    shared_store = os.environ.get(_FRESH_STORE_PER_START)
    os.environ[_FRESH_STORE_PER_START] = "1"
    torch_launcher.LocalElasticAgent = _Agent  # type: ignore[misc]
    stop = _Agent.stop_request = _StopRequest()
    try:
        elastic_launch(launch_config(cfg), sys.executable)(*argv)
        return 0
    except ChildFailedError as exc:
        unfixable = _unfixable(exc.failures)
        if unfixable is not None:
            log.error("trainer stopped: rank %d cannot start (its reason is above); fix that and start it again",
                      unfixable)
            return CONFIG_ERROR_EXIT
        rank, failure = exc.get_first_failure()
        log.error("trainer failed: rank %d exited with %s after %d restart(s)", rank, failure.exitcode,
                  cfg.trainer.max_restarts)
        return 1
    except SignalException:
        return stop.outcome(cfg.trainer.step_timeout_s)
    except Exception as exc:
        if stop.at is None:
            raise
        # The stop signal raises wherever the agent is: inside torchrun's metrics wrapper before it
        # set its start time, SignalException becomes an UnboundLocalError of that wrapper. The
        # agent shut the ranks down all the same (its run()'s finally), so this is still the stop.
        log.debug("torchrun's agent ended with %r after the stop signal", exc)
        return stop.outcome(cfg.trainer.step_timeout_s)
    finally:
        stop.restore()
        _Agent.stop_request = None
        if shared_store is None:
            os.environ.pop(_FRESH_STORE_PER_START, None)
        else:
            os.environ[_FRESH_STORE_PER_START] = shared_store


class _StopRequest:
    """SIGTERM/SIGINT as torchrun's own handler treats them (raise :class:`SignalException`:
    torchrun forwards the signal to every rank, waits up to its shutdown timeout, kills the
    rest), remembering when the stop was asked for."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.signum = signal.SIGTERM
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.at is not None:  # already stopping
            return
        self.at, self.signum = time.monotonic(), signal.Signals(signum)
        raise self._exception()

    def _exception(self) -> SignalException:
        return SignalException(f"process {os.getpid()} got signal {self.signum}", sigval=self.signum)

    def raise_if_dropped(self) -> None:
        """Raised where the agent checks its ranks: a stop asked for while the agent still
        monitors them lost its raise (a signal that lands in a finalizer: Python reports
        "Exception ignored" and goes on), and the ranks would run on, never told to stop.
        Once the agent has the exception it shuts down and monitors no more."""
        if self.at is not None:
            raise self._exception()

    def outcome(self, grace_s: float) -> int:
        """0 when the ranks stopped by themselves within ``grace_s``, else 1 (torchrun killed them)."""
        if self.at is None:
            raise RuntimeError("outcome() is asked after the stop began")
        if time.monotonic() - self.at < grace_s:
            return 0
        log.error("ranks did not stop within %ss after the stop signal; they were killed", grace_s)
        return 1

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
