"""Rank 0's part of the loop: what every rank does next, and what a step leaves behind.

Rank 0 alone reads the sample stream (:class:`SampleSource`), keeps the commit record
(:class:`Ledger`), owes replay passes (:class:`ReplayBuffer`), publishes weights to workers
(:class:`DeltaPublisher`) and answers the operator (:class:`TrainerOps`); the
:class:`Leader` is composed of them. Per iteration it decides one op — ``train`` (with the
batch), ``control`` (operator commands every rank runs), ``idle``, ``sync`` (publish what
lossy deltas left behind, losslessly) or ``stop`` — which the loop broadcasts; after each
step it commits, publishes every ``consistency.sync_interval`` steps and reports. A commit
that ``redis.wait_replicas`` replicas have not confirmed holds the next steps and the step's
publish: the leader answers ``idle`` and commits the same step again until it is confirmed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.trainer.data import ContextReader, SampleSource, TrainRecord, encode_batch, encode_record
from services.trainer.ledger import Ledger, Offset
from services.trainer.operations import TrainerOps
from services.trainer.publisher import DeltaPublisher
from services.trainer.replay import ReplayBuffer
from services.trainer.stepper import Stepper
from services.trainer.version_floor import VersionFloor
from shared import keys
from shared import metrics as m
from shared.config import Config
from shared.redis_client import ReplicasBehind, close_sync

log = logging.getLogger("learnmesh.trainer")


class Progress:
    """A one-line progress display on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, rate: float, seq: int) -> None:
        if self.tty:
            sys.stderr.write(f"\rtrainer step {step:>7}  loss {loss:7.4f}  {rate:8.1f} samples/s  seq {seq}   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


class Leader:
    """Rank 0's sample stream, commit record, replays, publisher and control plane."""

    def __init__(self, cfg: Config, *, weights: Stepper, world: int, offset: Offset, redis: Redis, ledger: Ledger,
                 source: SampleSource, contexts: ContextReader, replay: ReplayBuffer, publisher: DeltaPublisher,
                 ops: TrainerOps, zmq_ctx: zmq.Context, version_floor: VersionFloor) -> None:
        self.t = cfg.trainer
        self.weights = weights  # what is published: its consensus parameters
        self.world = world
        self.offset = offset
        self.version = offset.version
        self.redis, self.ledger, self.source, self.contexts = redis, ledger, source, contexts
        self.replay, self.publisher, self.ops, self.zmq_ctx = replay, publisher, ops, zmq_ctx
        self.version_floor = version_floor
        self.progress = Progress()
        self._rate = 0.0
        self._published_step = -1
        self._last_loss: float | None = None
        self._last_step_s = time.monotonic()
        self._residual = False  # workers may hold something other than the trainer's weights
        # local SGD: settled seq per partition when the ranks last agreed
        self._agreed = {part: offset.at(part).seq for part in range(len(source.parts))}
        source.on_reset = self._log_reset
        self._unconfirmed: tuple[Offset, list[str], dict[str, str]] | None = None  # a commit replicas lack
        self._unconfirmed_since = 0.0
        self._publish_owed: int | None = None  # the step whose publish waits for its commit
        # step -> commit record of the checkpoints kept on disk (the one resumed from, then each save)
        self._kept: dict[int, Offset] = {offset.step: offset}

    @property
    def cfg(self) -> Config:
        """The configuration in effect (the operator may change some sections at runtime)."""
        return self.ops.cfg

    # ---------------------------------------------------------------- the next op
    def next_payload(self, stop: Callable[[], bool]) -> bytes:
        """The op every rank runs next, as the bytes rank 0 broadcasts."""
        if stop():
            return encode_batch("stop", [])
        commands = self.ops.poll()
        if commands:
            return encode_batch("control", [], {"ctl": commands})
        if self.ops.paused:  # no steps; the publisher thread still answers snapshot requests
            self.ops.wait_paused(stop, self.t.batch_wait_ms / 1000)
            return self._idle()
        if self._unconfirmed is not None and not self._confirm(self._unconfirmed, stop):
            return encode_batch("idle", [])  # not even a sync: nothing goes out past that commit
        records = self._next_records(stop)
        if not records:
            self.ops.report(force=False)
            return self._idle()
        return encode_batch("train", records)

    def _next_records(self, stop: Callable[[], bool]) -> list[TrainRecord]:
        """Fresh samples and replays for one step. Replays pending: take what has arrived and go
        on stepping rather than wait for more, and keep half the batch for replays, so every
        step mixes facts. Replays only fill the batch up to its size: the number of optimizer
        steps, not of passes, is what makes a fact stick."""
        limit = self.t.batch_size * self.world
        fresh_limit = limit - limit // 2 if self.replay else limit
        samples = self.source.next_batch(fresh_limit, 0 if self.replay else self.t.batch_wait_ms, stop)
        records = self.source.records(samples)
        self._skip_unencodable(records)
        records += self.replay.take(limit - len(records))
        return records + self.replay.recall() if records else records

    def _skip_unencodable(self, records: list[TrainRecord]) -> None:
        """Fresh samples the model cannot encode (a context entry that is not a decodable image
        or audio clip, ...) are consumed without training, as ``bad_input``. Decided here, once
        for every rank: a rank meeting the error in its share would stop the group, and the
        sample, durable in the log, would stop it again after every restart. Their replays are
        never owed (see _commit)."""
        model = self.weights.model
        for r in records:
            pair = None if r.skip else r.logged.sample.training_pair()
            if pair is None:
                continue
            try:
                encode_record(model, r, pair)
            except ValueError as exc:  # MediaError, ModelInputError: the input, not the trainer
                log.warning("sample %s: the model cannot encode it (%s); consumed without training", r.logged.id, exc)
                r.skip = "bad_input"

    def _idle(self) -> bytes:
        """``sync`` once training has paused for ``consistency.idle_sync_ms`` and workers may hold
        something other than the trainer's weights; else ``idle``."""
        wait_ms = self.cfg.consistency.idle_sync_ms
        if self._residual and wait_ms and (time.monotonic() - self._last_step_s) * 1000 >= wait_ms:
            return encode_batch("sync", [])
        return encode_batch("idle", [])

    def _log_reset(self, part: int) -> None:
        """A partition of the sample log is another one (a Redis that lost its data, another
        ``redis.url``): its sequence numbers mean nothing in the old one's. Keep the weights,
        count from its start; replays still owed may be samples of the old log, whose seqs would
        mislead read-your-writes."""
        self.offset.positions[part] = self.source.positions()[part]
        self._agreed[part] = 0
        self.replay.clear(recall=False)  # the weights keep what they answer: recall goes on
        self.ledger.record_offset(self.offset)

    # ---------------------------------------------------------------- after a step
    def after_step(self, records: list[TrainRecord], loss: float, seconds: float, step: int) -> None:
        """Commit the step, publish it when due, report it."""
        fresh = [r for r in records if not r.replay]
        publish_now = step % self.cfg.consistency.sync_interval == 0
        trained, skipped = self._commit(fresh, step, publish_now)
        self._last_loss = None if math.isnan(loss) else loss
        self._last_step_s = time.monotonic()
        # a lossless publish of this step leaves nothing behind; anything else may
        self._residual = not (publish_now and self.cfg.compression.algorithm == "lossless")
        if publish_now and self._unconfirmed is not None:
            self._publish_owed = step
        elif publish_now:
            self.publish(step)
        m.TRAINER_SAMPLES.inc(len(trained))
        for reason in skipped.values():
            m.TRAINER_SAMPLES_SKIPPED.labels(reason).inc()
        m.TRAINER_REPLAYED.inc(len(records) - len(fresh))
        self._report(step, loss, len(records) / max(seconds, 1e-9), seconds)

    def _commit(self, fresh: list[TrainRecord], step: int, publish_now: bool) -> tuple[list[str], dict[str, str]]:
        """The step's offset and ledger entry; its trained samples are owed their replays."""
        next_version = self.version + 1 if publish_now else self.version
        # what was handed out, all of it trained now
        self.offset = Offset(step, next_version, self.offset.epoch, self.source.positions())
        trained, skipped = outcomes(fresh)
        try:
            self.ledger.commit(self.offset, trained, skipped)
        except ReplicasBehind as exc:
            self._unconfirmed, self._unconfirmed_since = (self.offset, trained, skipped), time.monotonic()
            log.warning("step %d's commit is not confirmed (%s): no further step and no publish until it is; "
                        "committing it again", step, exc)
        self.replay.add([r for r in fresh if r.logged.id not in skipped])
        return trained, skipped

    def _confirm(self, held: tuple[Offset, list[str], dict[str, str]], stop: Callable[[], bool]) -> bool:
        """Commit the held step again (the same values); True once replicas confirm it, then its
        owed publish goes out. One try per ``redis.wait_timeout_ms`` at most."""
        off, trained, skipped = held
        started = time.monotonic()
        try:
            self.ledger.commit(off, trained, skipped)
        except ReplicasBehind:  # WAIT answers at once where no replica is connected: keep the pace
            self.ops.wait_paused(stop, self.cfg.redis.wait_timeout_ms / 1000 - (time.monotonic() - started))
            return False
        except (RedisConnectionError, RedisTimeoutError):  # a failover under way: try again shortly
            self.ops.wait_paused(stop, self.t.batch_wait_ms / 1000)
            return False
        log.info("step %d's commit confirmed after %.1f s; training goes on", off.step,
                 time.monotonic() - self._unconfirmed_since)
        self._unconfirmed = None
        if self._publish_owed is not None:
            step, self._publish_owed = self._publish_owed, None
            self.publish(step)
        return True

    def resumed(self) -> None:
        """At start: the restored weights hold every sample up to the commit record's position
        (passes still owed at the stop are not repeated), so the restored version answers those
        samples' ``after_learn`` tokens, also when no sample follows to make a step. The status
        loses the passes the last run still owed (the first step reports what is owed then), before
        the version answers: whoever sees the tokens resolve sees no pass owed for them."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(keys.TRAINER_STATUS, mapping={
            "step": self.offset.step, "seq": self.offset.seq, "version": self.offset.version,
            "epoch": self.offset.epoch, "recall_facts": self.replay.remembered, "updated_ms": int(time.time() * 1000)})
        pipe.hdel(keys.TRAINER_STATUS, "replay_pending")
        pipe.execute()
        self.ledger.record_version_seq(self.offset.version, {part: self.offset.at(part).seq for part in self._agreed},
                                       self.offset)

    def _report(self, step: int, loss: float, rate: float, seconds: float) -> None:
        self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
        seq = self.offset.seq
        m.TRAINER_STEP.set(step)
        if not math.isnan(loss):
            m.TRAINER_LOSS.set(loss)
        m.TRAINER_SAMPLES_PER_S.set(self._rate)
        m.TRAINER_COMMITTED_SEQ.set(seq)
        m.TRAINER_STEP_SECONDS.observe(seconds)
        self.redis.hset(keys.TRAINER_STATUS, mapping={
            "step": step, "loss": loss, "paused": 0, "samples_per_s": round(self._rate, 2), "seq": seq,
            "replay_pending": len(self.replay), "answer_passes": self.replay.answer_passes_given,
            "recall_facts": self.replay.remembered,
            "log": self.offset.at(0).log,
            "version": self.version, "epoch": self.offset.epoch, "world": self.world,
            "updated_ms": int(time.time() * 1000)})
        if step == 1 or step % 10 == 0 or seconds > 1.0:
            log.info("step %d loss %.4f samples/s %.1f seq %d version %d", step, loss, self._rate, seq, self.version)
        self.progress.update(step, loss, self._rate, seq)

    # ---------------------------------------------------------------- publishing
    def publish(self, step: int, anchor: bool | None = None, rollback_of: int | None = None,
                lossless: bool = False) -> None:
        """Send workers the consensus weights as the next version."""
        self.version = max(self.version, self.offset.version)
        self.version_floor.reserve(self.version)
        self.ops.before_publish(self.version)
        cpu0 = time.thread_time()
        params = self.weights.consensus_params()
        stats = self.publisher.publish(params, self.version, anchor=anchor, lossless=lossless)
        self._record_version_seq()
        stats.extra.update(served_gap(params, self.publisher.encoder.last_stats))
        m.CODEC_CPU_SECONDS.labels("encode").inc(time.thread_time() - cpu0)
        if self.weights.agreed():  # else what went out is an earlier average, not this step's weights
            self._published_step = step
        self.ops.published(stats, step, self._last_loss, rollback_of)
        m.TRAINER_VERSION.set(self.version)

    def _record_version_seq(self) -> None:
        """The published version holds every pass over the samples of each partition up to its
        settled seq."""
        seqs = self.replay.settled_seqs({part: self.offset.at(part).seq for part in self._agreed})
        if self.weights.agreed():
            self._agreed = dict(seqs)
        else:  # local SGD between averages: what went out is the last average, holding less
            seqs = {part: min(seq, self._agreed[part]) for part, seq in seqs.items()}
        self.ledger.record_version_seq(self.version, seqs, self.offset)

    def idle_sync(self, step: int) -> None:
        """Publish what lossy deltas left behind, losslessly, as a new version: workers then
        serve bit-exactly the weights the trainer holds (with local SGD: the last average)."""
        self._next_version()
        self.publish(step, lossless=True)
        self._status_version()
        self._residual = False
        m.TRAINER_IDLE_SYNCS.inc()
        log.info("training paused: published the residual losslessly as version %d (served == trainer)",
                 self.version)

    def rolled_back(self, target: int, step: int) -> None:
        """Every rank loaded the weights of version ``target``: publish them as a new, higher
        version (a full anchor) so workers follow. The learning of the steps after that version
        is discarded; their samples stay consumed (not replayed)."""
        self._next_version()
        self.replay.clear()  # the learning of the discarded steps is not to be repeated
        self.publish(step, anchor=True, rollback_of=target)
        self._status_version()

    def _status_version(self) -> None:
        """A publish without a step (whose report names its version): the trainer's status
        (/admin/trainer) names the version workers are sent, not the last step's."""
        self.redis.hset(keys.TRAINER_STATUS, "version", self.version)

    def _next_version(self) -> None:
        self.offset = dataclasses.replace(self.offset, version=max(self.version, self.offset.version) + 1)

    # ---------------------------------------------------------------- checkpoints and commands
    def checkpoint_fields(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` records besides the weights: its commit record, and
        whether the weights are exactly a published version (rollback targets need that)."""
        first = self.offset.at(0)
        fields: dict[str, Any] = {
            "seq": first.seq, "id": first.id, "log": first.log, "version": self.version,
            "positions": {part: [pos.seq, pos.id, pos.log] for part, pos in self.offset.positions.items()},
            "published_version": self.version if self._published_step == step else None}
        recall = self.replay.memory_bytes()
        if recall:  # a tensor: checkpoints are read with torch.load(weights_only=True)
            fields["recall"] = torch.frombuffer(bytearray(recall), dtype=torch.uint8)
        return fields

    def checkpointed(self, path: Path, step: int) -> None:
        """After a checkpoint is written: the log keeps what the oldest checkpoint kept on disk
        needs, so a newest checkpoint found unreadable at restart falls back to one whose later
        samples can still be trained again from the log."""
        self._kept[step] = self.offset
        for old in sorted(self._kept)[:-self.t.checkpoint_keep]:
            del self._kept[old]
        if self.t.trim_log:
            self.ledger.trim_log(self._kept[min(self._kept)], self.offset)
        log.info("checkpoint %s (step %d, seq %d, version %d)", path, step, self.offset.seq, self.version)

    def ack(self, command_id: str, ok: bool = True, **result: Any) -> None:
        self.ops.ack(command_id, ok, **result)

    def end_display(self) -> None:
        self.progress.close()

    def close(self) -> None:
        self.source.close()
        self.publisher.close()
        self.contexts.close()
        self.zmq_ctx.term()
        close_sync(self.redis)


def served_gap(params: dict[str, torch.Tensor], enc_stats: dict[str, Any]) -> dict[str, Any]:
    """How far what workers hold is from ``params`` after a publish: ``served_gap`` =
    ‖trainer − served‖ / ‖trainer‖, and the weights' digest when they are bit-identical."""
    residual = float(enc_stats.get("residual_norm", 0.0))
    if residual == 0.0:
        from shared.delta.codec import weights_digest

        return {"served_gap": 0.0, "weights_digest": weights_digest(params)}
    norm = math.sqrt(sum(float(p.detach().float().pow(2).sum()) for p in params.values()))
    return {"served_gap": residual / norm if norm else 0.0, "weights_digest": ""}


def outcomes(records: list[TrainRecord]) -> tuple[list[str], dict[str, str]]:
    """(ids whose gradient the step holds, {id: reason} of those consumed without one)."""
    trained: list[str] = []
    skipped: dict[str, str] = {}
    for r in records:
        if r.skip:
            skipped[r.logged.id] = r.skip
        elif r.logged.sample.training_pair() is None:
            skipped[r.logged.id] = "no_gradient"
        else:
            trained.append(r.logged.id)
    return trained, skipped
