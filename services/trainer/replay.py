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

An answer given at a sample's last pass can be lost again by the steps that train the samples
still owed passes. So once no pass is owed any more, the model is asked again about every
fact answered since the buffer last ran empty (one copy of each) — whether greedy decoding
gives it, with no margin since no step follows. If it no longer gives a fact, every fact asked
gets one more pass (one copy each, in one step: see :meth:`_ask_again`), and all are asked
again at the next such point, up to ``answer_passes`` times per lost fact. ``after_learn`` waits until a call's last
sample and every one before it are settled (see ``settled_seqs``), so it waits for weights that
give every answer the call taught. Under traffic that never lets the buffer run empty, answers
are checked only at their last pass; recall (below) keeps them.

Answers taught are kept by rehearsal (``trainer.recall_per_step``, ``trainer.recall_facts``):
every fact the model answered at its last pass is remembered (one copy per principal, context
and prompt; a newer sample with the same prompt replaces it, and the oldest give way beyond
``recall_facts``), and every step that trains anything also trains ``recall_per_step`` of them
drawn at random. Without it a minute of other traffic makes the model forget what it was
taught; when no step runs nothing is forgotten, and none is made for recall alone.

The facts kept for recall travel in each checkpoint, so a restarted trainer recalls them too.
The replay buffer lives in rank 0's memory: after a restart, samples replayed from the log get their
passes again, and passes still due for samples already in the checkpoint are not repeated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from services.trainer.data import TrainRecord, decode_batch, encode_batch

log = logging.getLogger("learnmesh.trainer")


# Facts asked about in one forward pass when the buffer runs empty (see ReplayBuffer._ask_again).
ASK_BATCH = 256

# Judges whether the model gives each record's target (see ReplayBuffer.judge).
Answered = Callable[[list[TrainRecord]], list[bool]]


class ReplayBuffer:
    """Samples still owed passes: ``[record, passes left, answer passes taken]``, oldest first;
    and ``due``, those whose last pass the step being trained holds (see :meth:`judge`)."""

    def __init__(self, passes: int, capacity: int, seed: int = 0, *, answer_passes: int = 0,
                 answer_max_bytes: int = 0, recall_per_step: int = 0,
                 recall_facts: int = 0) -> None:
        self.extra = passes - 1
        self.capacity = capacity
        self.answer_passes = answer_passes if passes > 1 else 0
        self.answer_max_bytes = answer_max_bytes
        self._queue: list[list[TrainRecord | int]] = []
        self.due: list[list[TrainRecord | int]] = []
        self._rng = random.Random(seed)  # noqa: S311 - which replay comes next, not a secret
        self.dropped = 0
        self.answer_passes_given = 0
        # answered at their last pass since the buffer last ran empty: asked again when it does
        self._answered: dict[tuple[object, ...], list[TrainRecord | int]] = {}  # one copy per fact
        self._asked_back: dict[tuple[object, ...], int] = {}  # passes given so, per fact
        self.recall_per_step = recall_per_step
        self.recall_facts = recall_facts
        self._memory: dict[tuple[object, ...], TrainRecord] = {}  # answered facts, oldest first

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, records: list[TrainRecord]) -> None:
        """Records just trained for the first time (fresh, with a gradient)."""
        if self.extra <= 0:
            return
        for r in records:
            if r.logged.sample.training_pair() is None:
                continue
            self._memory.pop(_prompt(r), None)  # taught anew: the old answer is not rehearsed against it
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

    def judge(self, answered: Answered, given: Answered | None = None) -> int:
        """After the step that held the ``due`` samples' last pass: those whose target the
        model does not give yet (``answered``, with its margin) get one more pass; once none is
        owed, those it gave are asked again (``given``: whether greedy decoding gives them now,
        no margin needed since no step follows; default ``answered``; see the module's notes).
        Returns how many answers were found missing: samples at their last pass, then facts."""
        due, self.due = self.due, []
        again = 0
        if due:
            for item, ok in zip(due, answered(_records(due)), strict=True):
                if not ok:
                    self._again(item)
                    again += 1
                elif isinstance(item[0], TrainRecord):
                    self._answered.setdefault(_fact(item[0]), item)
                    self._remember(item[0])
            while len(self._answered) > self.capacity:  # under steady traffic: the oldest are let go
                del self._answered[next(iter(self._answered))]
        if not self._queue and self._answered:
            again += self._ask_again(given or answered)
        self.answer_passes_given += again
        return again

    def _ask_again(self, answered: Answered) -> int:
        """Ask again about the facts answered since the buffer last ran empty (one copy each, in
        batches of ``ASK_BATCH``). If the model no longer gives some (each asked back up to
        ``answer_passes`` times), every fact asked gets one more pass, one copy each, in one
        step: a step of the lost facts alone would move the weights as far as a full one
        (AdamW) and lose the others. All stay to be asked again while any fact had to go back.
        Returns how many facts were lost."""
        keys, items = list(self._answered), list(self._answered.values())
        verdicts: list[bool] = []
        for at in range(0, len(items), ASK_BATCH):
            verdicts += answered(_records(items[at:at + ASK_BATCH]))
        lost = [key for key, ok in zip(keys, verdicts, strict=True)
                if not ok and self._asked_back.get(key, 0) < self.answer_passes]
        if not lost:
            self._answered, self._asked_back = {}, {}
            return 0
        for key in lost:
            self._asked_back[key] = self._asked_back.get(key, 0) + 1
        for item in items:
            # one pass, not judged at its end: the next time the buffer runs empty asks it
            item[1], item[2] = 1, self.answer_passes
            self._queue.append(item)
        log.info("%d of the %d facts answered since the replay buffer last ran empty are no longer answered: "
                 "one more pass over all of them", len(lost), len(items))
        return len(lost)

    def _remember(self, record: TrainRecord) -> None:
        if self.recall_per_step <= 0 or self.recall_facts <= 0:
            return
        key = _prompt(record)
        self._memory.pop(key, None)
        self._memory[key] = record
        while len(self._memory) > self.recall_facts:
            del self._memory[next(iter(self._memory))]

    def recall(self) -> list[TrainRecord]:
        """Up to ``recall_per_step`` answered facts, drawn at random, for a step that trains
        anyway (marked as replays: they move no offset and settle nothing)."""
        count = min(self.recall_per_step, len(self._memory))
        if count <= 0:
            return []
        picked = self._rng.sample(list(self._memory.values()), count)
        return [TrainRecord(r.logged, r.context, replay=True) for r in picked]

    @property
    def remembered(self) -> int:
        return len(self._memory)

    def memory_bytes(self) -> bytes:
        """The facts kept for recall, oldest first, as a checkpoint keeps them (the sample log
        they came from may be trimmed by then); empty when none is kept."""
        return encode_batch("recall", list(self._memory.values())) if self._memory else b""

    def restore_memory(self, data: bytes) -> None:
        """The facts a checkpoint kept for recall (``memory_bytes``); the newest remembered
        since stay the newest."""
        if not data or self.recall_per_step <= 0:
            return
        _, records, _ = decode_batch(data)
        later, self._memory = self._memory, {}
        for r in records:
            self._remember(TrainRecord(r.logged, r.context))
        for record in later.values():
            self._remember(record)

    def _again(self, item: list[TrainRecord | int]) -> None:
        """One more pass for a sample whose answer is not given."""
        taken = item[2]
        if isinstance(taken, int):
            item[1], item[2] = 1, taken + 1
            self._queue.append(item)

    def settled_seqs(self, committed: dict[int, int]) -> dict[int, int]:
        """Per sample-log partition (``committed``: partition -> committed seq), the highest seq up
        to which every sample has had all its passes (a sample still to be judged has not)."""
        out = dict(committed)
        for item in (*self._queue, *self.due):
            logged = item[0].logged if isinstance(item[0], TrainRecord) else None
            if logged is not None and logged.partition in out:
                out[logged.partition] = min(out[logged.partition], logged.seq - 1)
        return out

    def clear(self, *, recall: bool = True) -> None:
        """Forget the passes owed; ``recall``: also the facts kept for recall (not when the weights
        that answer them stay)."""
        self._queue.clear()
        self.due = []
        self._answered, self._asked_back = {}, {}
        if recall:
            self._memory = {}


def _records(items: list[list[TrainRecord | int]]) -> list[TrainRecord]:
    return [item[0] for item in items if isinstance(item[0], TrainRecord)]


def _prompt(record: TrainRecord) -> tuple[object, ...]:
    """What a newer sample teaches anew: who taught it, the context it names, and the prompt."""
    pair = record.logged.sample.training_pair()
    return (record.logged.principal, getattr(record.logged.sample, "context_id", None), pair[0] if pair else None)


def _fact(record: TrainRecord) -> tuple[object, ...]:
    """What makes two samples the same fact to learn: who taught it, the context it names, and
    the prompt and target."""
    sample = record.logged.sample
    return (record.logged.principal, getattr(sample, "context_id", None), getattr(sample, "version", None),
            sample.training_pair())
