"""Replay of recent samples: how a handful of taught facts becomes something the model answers.

One gradient step per sample moves a model's loss on it but rarely its greedy answer. Rank 0
keeps every freshly trained sample for ``trainer.replay_passes - 1`` more passes; each step
draws up to a batch of them at random (each sample at most once per step) beside whatever
fresh samples arrived, so a step mixes many facts — a client that sends eight copies of a fact
in a row would otherwise fill whole steps with it, and each step would undo the last. Replayed samples travel in the step's broadcast batch like fresh ones, so every rank
trains the same bytes; only fresh samples move the committed offset and the ledger (a sample
is trained exactly once in the ledger's sense; its extra passes are part of that training).

A short answer is checked before it is let go (``trainer.answer_passes``): after a sample's
last pass, rank 0 asks the model whether it now gives the sample's target greedily — every
target token, end included, the most likely one after what precedes it (:meth:`judge`). If not,
the sample gets one more pass, up to ``answer_passes`` more. How fast a few copies of a fact
turn into the answer depends on the base weights (those pre-trained on one CPU learn a fact in
fewer steps than those pre-trained on another), so a fixed number of passes answers some
facts and not others; these passes go only to the facts not answered yet. Targets longer than
``trainer.answer_max_bytes`` are text to learn from, not an answer to give back word for word,
and keep their fixed passes.

The buffer lives in rank 0's memory: after a restart, samples replayed from the log get their
passes again, and passes still due for samples already in the checkpoint are not repeated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from services.trainer.data import TrainRecord

log = logging.getLogger("learnmesh.trainer")


# Judges whether the model gives each record's target (see ReplayBuffer.judge).
Answered = Callable[[list[TrainRecord]], list[bool]]


class ReplayBuffer:
    """Samples still owed passes: ``[record, passes left, answer passes taken]``, oldest first;
    and ``due``, those whose last pass the step being trained holds (see :meth:`judge`)."""

    def __init__(self, passes: int, capacity: int, seed: int = 0, *, answer_passes: int = 0,
                 answer_max_bytes: int = 0) -> None:
        self.extra = passes - 1
        self.capacity = capacity
        self.answer_passes = answer_passes if passes > 1 else 0
        self.answer_max_bytes = answer_max_bytes
        self._queue: list[list[TrainRecord | int]] = []
        self.due: list[list[TrainRecord | int]] = []
        self._rng = random.Random(seed)  # noqa: S311 - which replay comes next, not a secret
        self.dropped = 0
        self.answer_passes_given = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, records: list[TrainRecord]) -> None:
        """Records just trained for the first time (fresh, with a gradient)."""
        if self.extra <= 0:
            return
        for r in records:
            if r.logged.sample.training_pair() is None:
                continue
            self._queue.append([r, self.extra, 0])
        if len(self._queue) > self.capacity:  # the oldest have had the most passes already
            over = len(self._queue) - self.capacity
            del self._queue[:over]
            before, self.dropped = self.dropped, self.dropped + over
            if before == 0 or before // 1000 != self.dropped // 1000:  # the first drop, then every 1000
                log.warning("replay buffer full (trainer.replay_buffer=%d): %d sample(s) lost remaining passes",
                            self.capacity, self.dropped)

    def take(self, limit: int) -> list[TrainRecord]:
        """Up to ``limit`` distinct samples drawn at random for this step, marked as replays.
        Those taking their last pass wait in ``due`` for :meth:`judge`."""
        self.due = []
        if limit <= 0 or not self._queue:
            return []
        picked = sorted(self._rng.sample(range(len(self._queue)), min(limit, len(self._queue))))
        out: list[TrainRecord] = []
        for i in picked:
            item = self._queue[i]
            record, left = item[0], item[1]
            if not isinstance(record, TrainRecord) or not isinstance(left, int):
                raise TypeError("replay queue entries are [TrainRecord, passes left, answer passes]")
            out.append(TrainRecord(record.logged, record.context, replay=True))
            item[1] = left - 1
            if left == 1 and self._judged(record, item[2]):
                self.due.append(item)
        self._queue = [item for item in self._queue if isinstance(item[1], int) and item[1] > 0]
        return out

    def _judged(self, record: TrainRecord, taken: TrainRecord | int) -> bool:
        """Whether ``record``, at its last pass, is asked if it is answered: a short target with
        answer passes left."""
        if not isinstance(taken, int) or taken >= self.answer_passes:
            return False
        pair = record.logged.sample.training_pair()
        return pair is not None and len(pair[1].encode()) <= self.answer_max_bytes

    def judge(self, answered: Answered) -> int:
        """After the step that held the ``due`` samples' last pass: those whose target the
        model does not give yet get one more pass. Returns how many did."""
        due, self.due = self.due, []
        if not due:
            return 0
        records = [item[0] for item in due if isinstance(item[0], TrainRecord)]
        again = 0
        for item, ok in zip(due, answered(records), strict=True):
            if not ok and isinstance(item[2], int):
                item[1], item[2] = 1, item[2] + 1
                self._queue.append(item)
                again += 1
        self.answer_passes_given += again
        return again

    def settled_seqs(self, committed: dict[int, int]) -> dict[int, int]:
        """Per sample-log partition (``committed``: partition -> committed seq), the highest seq up
        to which every sample has had all its passes (a sample still to be judged has not)."""
        out = dict(committed)
        for item in (*self._queue, *self.due):
            logged = item[0].logged if isinstance(item[0], TrainRecord) else None
            if logged is not None and logged.partition in out:
                out[logged.partition] = min(out[logged.partition], logged.seq - 1)
        return out

    def clear(self) -> None:
        self._queue.clear()
        self.due = []
