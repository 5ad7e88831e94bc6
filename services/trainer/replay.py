"""Replay of recent samples: how a handful of taught facts becomes something the model answers.

One gradient step per sample moves a model's loss on it but rarely its greedy answer. Rank 0
keeps every freshly trained sample for ``trainer.replay_passes - 1`` more passes; each step
draws up to a batch of them at random (each sample at most once per step) beside whatever
fresh samples arrived, so a step mixes many facts — a client that sends eight copies of a fact
in a row would otherwise fill whole steps with it, and each step would undo the last. Replayed samples travel in the step's broadcast batch like fresh ones, so every rank
trains the same bytes; only fresh samples move the committed offset and the ledger (a sample
is trained exactly once in the ledger's sense; its extra passes are part of that training).

The buffer lives in rank 0's memory: after a restart, samples replayed from the log get their
passes again, and passes still due for samples already in the checkpoint are not repeated.
"""

from __future__ import annotations

import logging
import random

from services.trainer.data import TrainRecord

log = logging.getLogger("learnmesh.trainer")


class ReplayBuffer:
    """Samples still owed passes: ``[record, passes left]``, oldest first."""

    def __init__(self, passes: int, capacity: int, seed: int = 0) -> None:
        self.extra = passes - 1
        self.capacity = capacity
        self._queue: list[list[TrainRecord | int]] = []
        self._rng = random.Random(seed)  # noqa: S311 - which replay comes next, not a secret
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, records: list[TrainRecord]) -> None:
        """Records just trained for the first time (fresh, with a gradient)."""
        if self.extra <= 0:
            return
        for r in records:
            if r.logged.sample.training_pair() is None:
                continue
            self._queue.append([r, self.extra])
        if len(self._queue) > self.capacity:  # the oldest have had the most passes already
            over = len(self._queue) - self.capacity
            del self._queue[:over]
            before, self.dropped = self.dropped, self.dropped + over
            if before == 0 or before // 1000 != self.dropped // 1000:  # the first drop, then every 1000
                log.warning("replay buffer full (trainer.replay_buffer=%d): %d sample(s) lost remaining passes",
                            self.capacity, self.dropped)

    def take(self, limit: int) -> list[TrainRecord]:
        """Up to ``limit`` distinct samples drawn at random for this step, marked as replays."""
        if limit <= 0 or not self._queue:
            return []
        picked = sorted(self._rng.sample(range(len(self._queue)), min(limit, len(self._queue))))
        out: list[TrainRecord] = []
        for i in picked:
            record, left = self._queue[i]
            if not isinstance(record, TrainRecord) or not isinstance(left, int):
                raise TypeError("replay queue entries are [TrainRecord, passes left]")
            out.append(TrainRecord(record.logged, record.context, replay=True))
            self._queue[i][1] = left - 1
        self._queue = [item for item in self._queue if isinstance(item[1], int) and item[1] > 0]
        return out

    def settled_seqs(self, committed: dict[int, int]) -> dict[int, int]:
        """Per sample-log partition (``committed``: partition -> committed seq), the highest seq up
        to which every sample has had all its passes."""
        out = dict(committed)
        for item in self._queue:
            logged = item[0].logged if isinstance(item[0], TrainRecord) else None
            if logged is not None and logged.partition in out:
                out[logged.partition] = min(out[logged.partition], logged.seq - 1)
        return out

    def clear(self) -> None:
        self._queue.clear()
