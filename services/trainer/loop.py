"""One trainer rank's loop. Rank 0's :class:`Leader` decides each iteration's op (``train``,
``control``, ``idle``, ``sync`` or ``stop``) and the batch; every rank receives the same
bytes, encodes its strided share of the batch and takes the optimizer step together
(:class:`Stepper`); rank 0 then commits, publishes and reports. Checkpoints are taken at the
same point on every rank.

The loop is composed, not self-building: ``services.trainer.main.build_trainer`` makes the
stepper and, on rank 0, the leader with its sample source, ledger and publisher.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.trainer import checkpoint
from services.trainer.data import TrainRecord, decode_batch, encode_record
from services.trainer.dist import RankGroup
from services.trainer.leader import Leader
from services.trainer.stepper import Stepper
from shared import metrics as m
from shared.config import Config

log = logging.getLogger("learnmesh.trainer")


class StepObserver(Protocol):
    """Something that watches a rank's loop without being part of it (metrics, diagnostics)."""

    def on_step(self, trainer: Trainer) -> None:
        """After each optimizer step, before rank 0 commits it."""

    def on_stop(self, trainer: Trainer) -> None:
        """After a clean stop, once the final checkpoint is written."""


class Trainer:
    """The loop of one rank; ``leader`` is rank 0's part (None on the other ranks)."""

    def __init__(self, cfg: Config, group: RankGroup, stepper: Stepper, leader: Leader | None,
                 stop: Callable[[], bool], *, step: int = 0, observers: Sequence[StepObserver] = ()) -> None:
        self.cfg = cfg
        self.t = cfg.trainer
        self.group = group
        self.stepper = stepper
        self.leader = leader
        self.stop = stop
        self.step = step
        self.observers = list(observers)
        self._saved_step = -1
        self._last_ckpt: str | None = None
        self._timeout_shortened = False

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        """Iterate until rank 0 decides to stop, then checkpoint (every rank takes part)."""
        try:
            while self._iterate():
                pass
        finally:
            if self.leader is not None:
                self.leader.end_display()
        self.save_checkpoint()
        for observer in self.observers:
            observer.on_stop(self)

    def _iterate(self) -> bool:
        """One broadcast op; False once it is ``stop``."""
        payload = self.leader.next_payload(self.stop) if self.leader is not None else None
        op, records, extra = decode_batch(self.group.broadcast_bytes(payload))
        if op == "stop":
            return False
        if op == "control":
            self.run_commands(extra.get("ctl") or [])
        elif op == "sync":
            if self.leader is not None:
                self.leader.idle_sync(self.step)
        elif op == "train":
            self.train_step(records)
            if not self._timeout_shortened:  # a long first step (start-up) is over
                self.group.shorten_timeout(self.t.step_timeout_s)
                self._timeout_shortened = True
        return True

    def train_step(self, records: list[TrainRecord]) -> None:
        """One optimizer step over a broadcast batch, on every rank."""
        t0 = time.perf_counter()
        items = [(r, pair) for r in records if not r.skip and (pair := r.logged.sample.training_pair())]
        rehearsal = self._rehearsal_count(len(items))
        total = len(items) + rehearsal if items else 0
        mine, pad = self._examples(items, rehearsal) if total else ([], [])
        loss = self.stepper.step(mine, pad, total)
        self.step += 1
        for observer in self.observers:
            observer.on_step(self)
        if self.leader is not None:
            m.TRAINER_ANSWER_PASSES.inc(self.leader.replay.judge(self._answered, self._given))
            self.leader.after_step(records, loss, time.perf_counter() - t0, self.step)
        if self.step % self.t.checkpoint_every == 0:
            self.save_checkpoint()

    # ---------------------------------------------------------------- examples
    def _examples(self, items: list[tuple[TrainRecord, tuple[str, str]]], rehearsal: int) -> tuple[list[Any], list[Any]]:
        """This rank's strided share of the samples plus its rehearsal windows, and what a
        pass without any of them runs (weighted by zero, to keep the all-reduce aligned)."""
        world = self.group.world
        mine = [self._encode(r, p) for r, p in items[self.group.rank::world]] + self._rehearsal(rehearsal)
        return mine, mine[:1] or [self._encode(*items[0])]

    def _rehearsal_count(self, samples: int) -> int:
        """Corpus windows for a step of ``samples``: all of ``trainer.rehearsal_per_step`` in a full
        step, a proportional share (rounded up) in a smaller one."""
        full = self.t.batch_size * self.group.world
        return min(self.t.rehearsal_per_step, -(-self.t.rehearsal_per_step * samples // full))

    def _rehearsal(self, count: int) -> list[Any]:
        """This rank's share of the step's ``count`` corpus windows (each rank draws its own,
        from a generator seeded by step and rank: reproducible, no broadcast)."""
        rank, world = self.group.rank, self.group.world
        n = count // world + (rank < count % world)
        if not n:
            return []
        from shared.model.pretrain import corpus_windows

        rng = random.Random(f"rehearsal:{self.step}:{rank}")  # noqa: S311 - reproducible draws, not secrets
        model = self.stepper.model
        return [model.encode(None, a.decode(errors="replace"), b.decode(errors="replace"))
                for a, b in corpus_windows(n, rng, max(8, self.cfg.model.pretrain_seq - 3))]

    def _answered(self, records: list[TrainRecord], margin: float | None = None) -> list[bool]:
        """Whether the model (rank 0's, the same weights as every rank's) gives each record's
        target greedily, each token ahead of the next likeliest by ``margin`` (default
        ``trainer.answer_margin``); a model that cannot say counts every target as given."""
        model = self.stepper.model
        pairs = [r.logged.sample.training_pair() for r in records]
        if not hasattr(model, "answers"):
            return [True] * len(records)
        examples = [self._encode(r, p) for r, p in zip(records, pairs, strict=True) if p is not None]
        said = iter(model.answers(examples, self.t.answer_margin if margin is None else margin) if examples else [])
        return [next(said) if p is not None else True for p in pairs]

    def _given(self, records: list[TrainRecord]) -> list[bool]:
        """Whether greedy decoding gives each record's target now, by any margin."""
        return self._answered(records, 0.0)

    def _encode(self, record: TrainRecord, pair: tuple[str, str]) -> Any:
        return encode_record(self.stepper.model, record, pair)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str | None:
        """Write a checkpoint on rank 0. Every rank calls it at the same point: with local SGD
        the ranks first average their parameters (the checkpoint holds the consensus model,
        not rank 0's drift)."""
        self.stepper.settle()
        if self.leader is None or self._saved_step == self.step:
            return self._last_ckpt
        self._saved_step = self.step
        state = {**self.stepper.state(), "step": self.step,
                 "model_id": getattr(self.stepper.model, "model_id", ""), **self.leader.checkpoint_fields(self.step)}
        path = checkpoint.save(self.t.checkpoint_dir, self.step, state, self.t.checkpoint_keep)
        self._last_ckpt = str(path)
        self.leader.checkpointed(path, self.step)
        return self._last_ckpt

    # ---------------------------------------------------------------- operator commands
    def run_commands(self, commands: list[dict[str, Any]]) -> None:
        """Run the operator commands rank 0 resolved and broadcast; every rank runs them."""
        for c in commands:
            if c.get("cmd") == "checkpoint":
                self._checkpoint_now(c)
            elif c.get("cmd") == "rollback":
                self.rollback(c)

    def _checkpoint_now(self, c: dict[str, Any]) -> None:
        self._saved_step = -1
        path = self.save_checkpoint()
        if self.leader is not None:
            self.leader.ack(c["id"], path=path, step=self.step, version=self.leader.version)

    def rollback(self, c: dict[str, Any]) -> None:
        """Load the checkpointed weights of ``c['to_version']`` on every rank; rank 0 publishes
        them as a new version. A restart resumes the rolled-back lineage."""
        data = self.group.broadcast_bytes(_read(c["path"]) if self.leader is not None else None)
        if not data:
            if self.leader is not None:
                self.leader.ack(c["id"], ok=False, error="the checkpoint could not be read")
            return
        state = checkpoint.load_bytes(data)
        self.stepper.restore(state, schedule=False)
        target = int(c["to_version"])
        if self.leader is not None:
            self.leader.rolled_back(target, self.step)
            self.leader.replay.restore_memory(checkpoint.recall_bytes(state))  # what those weights recalled
        self._saved_step = -1
        path = self.save_checkpoint()  # every rank: with local SGD saving is a collective
        if self.leader is not None:
            log.warning("rolled back to version %d, published as version %d", target, self.leader.version)
            self.leader.ack(c["id"], to_version=target, new_version=self.leader.version, checkpoint=path)

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()


def _read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        log.error("rollback: cannot read %s: %s", path, exc)
        return None
