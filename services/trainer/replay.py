"""Replay of recent samples: how a handful of taught facts becomes something the model answers.

One gradient step per sample moves a model's loss on it but rarely its greedy answer. Rank 0
keeps every freshly trained sample for ``trainer.replay_passes - 1`` more passes; each step
takes up to one batch of them, round-robin (the oldest first, then to the back of the queue),
beside whatever fresh samples arrived, so a step mixes several facts rather than eight copies
of one. Replayed samples travel in the step's broadcast batch like fresh ones, so every rank
trains the same bytes; only fresh samples move the committed offset and the ledger (a sample
is trained exactly once in the ledger's sense; its extra passes are part of that training).

The buffer lives in rank 0's memory: after a restart, samples replayed from the log get their
passes again, and passes still due for samples already in the checkpoint are not repeated.
"""

from __future__ import annotations

import logging
from collections import deque

from services.trainer.data import TrainRecord

log = logging.getLogger("learnmesh.trainer")


class ReplayBuffer:
    """Samples still owed passes: ``[record, passes left]`` in round-robin order."""

    def __init__(self, passes: int, capacity: int) -> None:
        self.extra = passes - 1
        self.capacity = capacity
        self._queue: deque[list[TrainRecord | int]] = deque()
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
        while len(self._queue) > self.capacity:  # the oldest have had the most passes already
            self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("replay buffer full (trainer.replay_buffer=%d): %d sample(s) lost remaining passes",
                            self.capacity, self.dropped)

    def take(self, limit: int) -> list[TrainRecord]:
        """Up to ``limit`` distinct samples for this step, each marked as a replay."""
        out: list[TrainRecord] = []
        back: list[list[TrainRecord | int]] = []
        while self._queue and len(out) < limit:
            item = self._queue.popleft()
            record, left = item
            assert isinstance(record, TrainRecord) and isinstance(left, int)
            out.append(TrainRecord(record.logged, record.context, replay=True))
            if left > 1:
                back.append([record, left - 1])
        self._queue.extend(back)
        return out

    def settled_seq(self, committed_seq: int) -> int:
        """The highest seq up to which every sample has had all its passes."""
        owed = [item[0].logged.seq for item in self._queue if isinstance(item[0], TrainRecord)]
        return min(owed) - 1 if owed else committed_seq

    def clear(self) -> None:
        self._queue.clear()
