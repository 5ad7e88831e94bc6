"""``learnmesh trainer`` with the observers the trainer tests need, installed on every rank:

    python -m tests.trainer_entry --config PATH [--kill RANK:STEP:MARKER] [--dump-dir DIR]

``--kill``: rank RANK kills itself (SIGKILL) after its optimizer step STEP, once — the file
MARKER records that it fired, so the restarted group runs on. ``--dump-dir``: after a clean
stop every rank saves its trainable parameters to ``DIR/rank<R>.pt``. The launcher is the
production one; only the ranks' command line names this module instead of ``services.cli``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import NoReturn

import torch

from services.trainer.dist import leave
from services.trainer.launcher import launch
from services.trainer.loop import StepObserver, Trainer
from services.trainer.main import configure_logging, rank_main
from shared.config import load_config


class KillOnce:
    """kill -9 of one rank after a given step, at most once across restarts."""

    def __init__(self, spec: str) -> None:
        rank, step, marker = spec.split(":", 2)
        self.rank, self.step, self.marker = int(rank), int(step), Path(marker)

    def on_step(self, trainer: Trainer) -> None:
        if trainer.group.rank == self.rank and trainer.step >= self.step and not self.marker.exists():
            self.marker.write_text(str(trainer.step))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_stop(self, trainer: Trainer) -> None:
        pass


class DumpParameters:
    """Every rank's trainable parameters after a clean stop (tests compare the ranks)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_step(self, trainer: Trainer) -> None:
        pass

    def on_stop(self, trainer: Trainer) -> None:
        torch.save(trainer.stepper.named_params(), self.directory / f"rank{trainer.group.rank}.pt")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tests.trainer_entry")
    p.add_argument("--config", required=True)
    p.add_argument("--as-rank", action="store_true")
    p.add_argument("--kill", metavar="RANK:STEP:MARKER")
    p.add_argument("--dump-dir")
    return p


def main() -> NoReturn:
    args = _parser().parse_args()
    cfg = load_config(args.config)
    if args.as_rank:
        observers: list[StepObserver] = []
        if args.kill:
            observers.append(KillOnce(args.kill))
        if args.dump_dir:
            observers.append(DumpParameters(args.dump_dir))
        rank_main(cfg, observers)
    configure_logging("launcher")
    extra = [*(["--kill", args.kill] if args.kill else []), *(["--dump-dir", args.dump_dir] if args.dump_dir else [])]
    leave(launch(cfg, lambda path: ["-m", "tests.trainer_entry", "--config", path, "--as-rank", *extra]))


if __name__ == "__main__":
    main()
