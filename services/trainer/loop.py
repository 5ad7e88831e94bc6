"""One trainer rank: the training loop (DDP, accumulation, comm hooks, local SGD, commit,
publish, checkpoint). Process-group set-up and teardown live in services/trainer/dist.py.

Per iteration rank 0 decides (``train`` / ``idle`` / ``stop``) and broadcasts the batch
bytes; every rank decodes the same bytes, takes its strided shard, and runs
``grad_accum_steps`` micro-batches (all but the last under ``DDP.no_sync()``). Ranks always
run the same number of forward/backward passes: a rank whose shard is short runs a
zero-weighted pass so the gradient all-reduce still lines up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from services.trainer import checkpoint, ledger
from services.trainer.data import ContextReader, SampleSource, TrainRecord, decode_batch, encode_batch
from services.trainer.replay import ReplayBuffer
from shared import keys
from shared import metrics as m

log = logging.getLogger("learnmesh.trainer")


def build_model(cfg: Any) -> Any:
    spec = cfg.trainer.model_factory or "shared.model:build_model"
    module, _, fn = spec.partition(":")
    factory = getattr(importlib.import_module(module), fn)
    return factory(cfg.model, pretrained=cfg.trainer.pretrained)


class LossModule(nn.Module):
    """DDP must see the loss computation as ``forward`` to prepare its gradient buckets."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model: Any = model

    def forward(self, batch: Any) -> torch.Tensor:
        return self.model.loss(batch)


def ddp_options(cfg: Any) -> dict[str, Any]:
    """No ``find_unused_parameters``: the model's loss gives every trainable parameter a
    gradient every step (``LearnModel.loss`` weights the ones a batch leaves idle, such as
    the image projection on a text-only batch, by zero); with a model that does not, DDP
    raises at the next step that some parameters did not receive a gradient.

    That flag would make DDP all-reduce a used-parameter map while the PowerSGD hook's
    follow-up all-reduces (issued from future callbacks on gloo's threads) are in flight;
    two ranks then issue them in different orders and gloo aborts ("op.preamble.length <=
    op.nbytes"). For the same reason PowerSGD over gloo gets a single gradient bucket, so one
    hook chain is in flight at a time. NCCL keeps DDP's buckets."""
    opts: dict[str, Any] = {"find_unused_parameters": False}
    if cfg.trainer.comm_hook == "powersgd" and dist.get_backend() == "gloo":
        opts["bucket_cap_mb"] = 4096
    return opts


def register_comm_hook(ddp: DDP, cfg: Any, group: Any = None) -> Any:
    """Attach one of torch's own DDP communication hooks; returns the hook state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name = cfg.trainer.comm_hook
    if name == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return group
    if name == "bf16":
        if dist.get_backend(group) != "nccl":  # torch ships bf16 compression for NCCL/XCCL only
            raise RuntimeError("trainer.comm_hook bf16 needs the NCCL backend; use fp16 (same 2 bytes per "
                               "gradient element) with gloo")
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        return group
    if name == "powersgd":
        # start_powerSGD_iter=2: PowerSGD needs DDP's first iteration to rebuild its buckets.
        state = powerSGD_hook.PowerSGDState(process_group=group,
                                            matrix_approximation_rank=cfg.trainer.powersgd_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None


def make_optimizer(params: list[nn.Parameter], t: Any) -> tuple[torch.optim.Optimizer, Any]:
    if t.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=t.lr, momentum=0.9, weight_decay=t.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "cosine":
            frac = min(1.0, (step - t.warmup_steps) / t.schedule_steps)
            return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


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


class Trainer:
    def __init__(self, cfg: Any, rank: int, world: int, device: torch.device, ctrl_group: Any,
                 stop_flag: Any) -> None:
        self.cfg = cfg
        self.t = cfg.trainer
        self.rank, self.world, self.device = rank, world, device
        self.ctrl_group = ctrl_group
        self.stop_flag = stop_flag
        self.model: Any = build_model(cfg).to(device)
        self.params = [p for _, p in self.model.trainable_named_parameters()]
        trainable = {id(p) for p in self.params}
        for p in self.model.parameters():
            p.requires_grad_(id(p) in trainable)
        self.opt, self.sched = make_optimizer(self.params, self.t)
        self.step = 0
        self.version = 0
        self.offset = ledger.Offset()
        self.redis: Any = None
        self.source: SampleSource | None = None
        self.publisher: Any = None
        self.zmq_ctx: Any = None
        self.contexts: ContextReader | None = None
        self.progress = Progress()
        self._rate = 0.0
        self._saved_step = -1
        self._last_ckpt: str | None = None
        self._published_step = -1
        self._last_loss: float | None = None
        self.ops: Any = None
        self.replay = ReplayBuffer(self.t.replay_passes, self.t.replay_buffer, seed=cfg.model.seed)  # rank 0 only
        self._last_step_s = time.monotonic()
        self._residual = False  # rank 0: workers may hold something other than the trainer's weights
        self._agreed_seq = 0  # rank 0, local SGD: settled seq when the ranks last agreed
        self._fault = _parse_fault(os.environ.get("LEARNMESH_TRAINER_FAULT", ""))
        self._resume()
        self.ddp = DDP(LossModule(self.model), device_ids=[device.index] if device.type == "cuda" else None,
                       **ddp_options(cfg)) if world > 1 else None
        self.hook_state = register_comm_hook(self.ddp, cfg) if self.ddp is not None and not self.local_sgd else None
        self.averager: LocalSGDAverager | None = None
        self._consensus: dict[str, torch.Tensor] | None = None
        self._agreed_at = 0
        if self.local_sgd and world > 1:
            self.averager = LocalSGDAverager(self.t.local_sgd_period, self.step, self._ranks_agreed)
            self._ranks_agreed()  # building DDP broadcast rank 0's parameters to every rank
        self.model.train()

    @property
    def local_sgd(self) -> bool:
        return self.t.local_sgd_period > 0

    # ---------------------------------------------------------------- start-up
    def _resume(self) -> None:
        data = checkpoint.latest_bytes(self.t.checkpoint_dir) if self.rank == 0 else None
        data = self.broadcast_bytes(data or b"")
        ck_off = ledger.Offset()
        if data:
            state = checkpoint.load_bytes(data)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.sched.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            ck_off = ledger.Offset(int(state["seq"]), str(state["id"]), self.step, int(state["version"]),
                                   log=str(state.get("log", "")))
        if self.rank != 0:
            return
        import redis as redis_sync
        import zmq

        self.redis = redis_sync.Redis.from_url(redis_url(self.cfg), socket_timeout=30)
        self.offset, rolled = ledger.rollback(self.redis, ck_off)
        # versions of the lost steps no longer hold the samples after the checkpoint's seq
        self.redis.zremrangebyscore(keys.MODEL_VERSION_SEQ, f"({self.offset.seq}", "+inf")
        self.version = self.offset.version
        self._agreed_seq = self.offset.seq
        log.info("trainer resumed at step %d (seq %d, epoch %d); %d uncheckpointed step(s) rolled back and "
                 "will be replayed from the log", self.step, self.offset.seq, self.offset.epoch, rolled)
        self.zmq_ctx = zmq.Context()
        self.contexts = ContextReader(self.cfg, redis_url(self.cfg))
        self.source = SampleSource(self.cfg, self.redis, self.zmq_ctx, self.offset.seq, self.offset.id, self.contexts,
                                   log_id=self.offset.log)
        self.source.on_reset = self._log_reset
        self.source.check_log()  # the checkpoint's offsets count in its log; is that the log found now?
        # The restored lineage becomes a version newer than anything served before: the
        # publisher's snapshot (what joining/re-syncing workers fetch) starts at it.
        self.publisher = self._make_publisher()
        m.TRAINER_VERSION.set(self.version)
        from services.trainer.operations import TrainerOps

        self.ops = TrainerOps(self)

    def _log_reset(self) -> None:
        """The sample log is another one (a Redis that lost its data, another ``REDIS_URL``): its
        sequence numbers mean nothing in the old one's. Keep the weights, count from its start;
        replays still owed are samples of the old log, whose seqs would mislead read-your-writes."""
        assert self.source is not None
        self.offset = dataclasses.replace(self.offset, seq=0, id="", log=self.source.log_id)
        self._agreed_seq = 0
        self.replay.clear()
        ledger.record_offset(self.redis, self.offset)

    def _make_publisher(self) -> Any:
        try:
            from services.trainer.publisher import DeltaPublisher
        except ImportError:
            log.warning("services.trainer.publisher is not available: weights are not published to workers")
            return None
        return DeltaPublisher(self.cfg, self.zmq_ctx, self.named_params(), self.version,
                              getattr(self.model, "model_id", "model"))

    def named_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in self.model.trainable_named_parameters()}

    def consensus_params(self) -> dict[str, torch.Tensor]:
        """The weights workers may be sent. With local SGD the ranks drift apart between
        averages, so that is the last parameters every rank held; otherwise the current ones.
        No collective: rank 0 calls it alone, from publish."""
        return self._consensus if self._consensus is not None else self.named_params()

    def _ranks_agreed(self) -> None:
        """Every rank holds the same parameters now (an average, a rollback, start-up): rank 0
        keeps a copy to publish until the next time."""
        assert self.averager is not None
        self._agreed_at = self.averager.step
        if self.rank == 0:
            self._consensus = {n: p.detach().to("cpu", copy=True) for n, p in self.model.trainable_named_parameters()}

    def _ranks_agree(self) -> bool:
        """No optimizer step since the ranks last agreed; the same answer on every rank."""
        return self.averager is None or self._agreed_at == self.averager.step

    # ---------------------------------------------------------------- collectives
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        if self.world == 1:
            return data or b""
        n = torch.tensor([len(data) if self.rank == 0 and data else 0], dtype=torch.int64)
        dist.broadcast(n, 0, group=self.ctrl_group)
        size = int(n.item())
        if size == 0:
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data \
            else torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.ctrl_group)
        return data if self.rank == 0 and data else buf.numpy().tobytes()

    def _set_timeout(self, seconds: int) -> None:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        for group in {None, self.ctrl_group}:
            try:
                _set_pg_timeout(timedelta(seconds=seconds), group)
            except Exception as exc:  # pragma: no cover - backend without the call
                log.debug("could not shorten the process-group timeout: %s", exc)

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        first = True
        try:
            while True:
                payload = self._next_payload() if self.rank == 0 else None
                op, records, extra = decode_batch(self.broadcast_bytes(payload))
                if op == "stop":
                    break
                if op == "control":
                    self.run_commands(extra.get("ctl") or [])
                    continue
                if op == "idle":
                    continue
                if op == "sync":
                    self.idle_sync()
                    continue
                self.train_step(records)
                if first:
                    self._set_timeout(self.t.step_timeout_s)
                    first = False
        finally:
            self.progress.close()
        self.save_checkpoint()
        dump = os.environ.get("LEARNMESH_TRAINER_DUMP_DIR")
        if dump:  # tests compare every rank's parameters after a clean stop
            torch.save({n: p.detach().cpu() for n, p in self.model.trainable_named_parameters()},
                       os.path.join(dump, f"rank{self.rank}.pt"))

    def _next_payload(self) -> bytes:
        assert self.source is not None
        if self.stop_flag():
            return encode_batch("stop", [])
        if self.ops is not None:
            commands = self.ops.poll()
            if commands:
                return encode_batch("control", [], {"ctl": commands})
            if self.ops.paused:  # no steps; the publisher thread still answers snapshot requests
                self.ops.wait_paused(self.stop_flag, self.t.batch_wait_ms / 1000)
                return self._idle()
        limit = self.t.batch_size * self.world
        # Replays pending: take what has arrived and go on stepping rather than wait for more, and
        # keep half the batch for replays, so every step mixes facts. Replays only fill the batch
        # up to its size: the number of optimizer steps, not of passes, is what makes a fact stick.
        fresh_limit = limit - limit // 2 if self.replay else limit
        samples = self.source.next_batch(fresh_limit, 0 if self.replay else self.t.batch_wait_ms, self.stop_flag)
        records = self.source.records(samples)
        records += self.replay.take(limit - len(records))
        if not records:
            if self.ops is not None:
                self.ops.report(force=False)
            return self._idle()
        return encode_batch("train", records)

    def _idle(self) -> bytes:
        """``sync`` once training has paused for ``consistency.idle_sync_ms`` and workers may hold
        something other than the trainer's weights; else ``idle``."""
        wait_ms = self.cfg.consistency.idle_sync_ms
        if self._residual and wait_ms and self.publisher is not None \
                and (time.monotonic() - self._last_step_s) * 1000 >= wait_ms:
            return encode_batch("sync", [])
        return encode_batch("idle", [])

    def idle_sync(self) -> None:
        """Publish what lossy deltas left behind, losslessly, as a new version: workers then
        serve bit-exactly the weights the trainer holds (with local SGD: the last average)."""
        if self.rank != 0:
            return
        self.offset = dataclasses.replace(self.offset, version=max(self.version, self.offset.version) + 1)
        self.publish(lossless=True)
        self._residual = False
        m.TRAINER_IDLE_SYNCS.inc()
        log.info("training paused: published the residual losslessly as version %d (served == trainer)",
                 self.version)

    def train_step(self, records: list[TrainRecord]) -> None:
        t0 = time.perf_counter()
        items = [(r, pair) for r in records if not r.skip and (pair := r.logged.sample.training_pair())]
        rehearsal = self._rehearsal_count(len(items))
        total = len(items) + rehearsal if items else 0
        loss_sum = torch.zeros(2, dtype=torch.float64)
        if total:
            mine = [self._encode(r, p) for r, p in items[self.rank::self.world]] + self._rehearsal(rehearsal)
            n_micro = self.t.grad_accum_steps
            chunks = [mine[i::n_micro] for i in range(n_micro)]
            for i, chunk in enumerate(chunks):
                last = i == n_micro - 1
                sync = last and not self.local_sgd
                ctx = self.ddp.no_sync() if self.ddp is not None and not sync else contextlib.nullcontext()
                weight = len(chunk) / total * self.world
                use = chunk or mine[:1] or [self._encode(*items[0])]  # a zero-weighted pass keeps the all-reduce aligned
                with ctx:
                    batch = self.model.collate(use).to(self.device)
                    loss = self.ddp(batch) if self.ddp is not None else self.model.loss(batch)
                    (loss * (weight if chunk else 0.0)).backward()
                if chunk:
                    loss_sum += torch.tensor([float(loss.detach()) * len(chunk), len(chunk)], dtype=torch.float64)
            if self.t.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.t.clip_grad_norm)
            self.opt.step()
            if self.world > 1 and not self.local_sgd:
                hook, nbytes = _allreduce_bytes(self)
                m.TRAINER_ALLREDUCE_BYTES.labels(hook).inc(nbytes)
            if self.averager is not None:  # before zero_grad: torch's averager skips grad-less params
                self.averager.average_parameters(self.params)
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        if self.world > 1:
            dist.all_reduce(loss_sum, group=self.ctrl_group)
        loss_value = float(loss_sum[0] / loss_sum[1]) if loss_sum[1] > 0 else float("nan")
        self.step += 1
        self._maybe_fault()
        if self.rank == 0:
            self._after_step(records, loss_value, time.perf_counter() - t0)
        if self.step % self.t.checkpoint_every == 0:
            self.save_checkpoint()

    def _rehearsal_count(self, samples: int) -> int:
        """Corpus windows for a step of ``samples``: all of ``trainer.rehearsal_per_step`` in a full
        step, a proportional share (rounded up) in a smaller one."""
        full = self.t.batch_size * self.world
        return min(self.t.rehearsal_per_step, -(-self.t.rehearsal_per_step * samples // full))

    def _rehearsal(self, count: int) -> list[Any]:
        """This rank's share of the step's ``count`` corpus windows (each rank draws its own,
        from a generator seeded by step and rank: reproducible, no broadcast)."""
        n = count // self.world + (self.rank < count % self.world)
        if not n:
            return []
        from shared.model.pretrain import corpus_windows

        rng = random.Random(f"rehearsal:{self.step}:{self.rank}")
        return [self.model.encode(None, a.decode(errors="replace"), b.decode(errors="replace"))
                for a, b in corpus_windows(n, rng, max(8, self.cfg.model.pretrain_seq - 3))]

    def _encode(self, record: TrainRecord, pair: tuple[str, str]) -> Any:
        mods = record.logged.sample.modalities
        if mods:
            try:
                return self.model.encode(record.context, pair[0], pair[1], modalities=mods)
            except TypeError:
                pass
        return self.model.encode(record.context, pair[0], pair[1])

    def _after_step(self, records: list[TrainRecord], loss: float, seconds: float) -> None:
        assert self.source is not None
        fresh = [r for r in records if not r.replay]
        publish_now = self.step % self.cfg.consistency.sync_interval == 0
        next_version = self.version + 1 if publish_now else self.version
        seq, entry = self.source.seq, self.source.last_id  # what was handed out, all of it trained now
        self.offset = ledger.Offset(seq, entry, self.step, next_version, self.offset.epoch, self.source.log_id)
        trained, skipped = outcomes(fresh)
        ledger.commit(self.redis, self.offset, trained, skipped)
        self.replay.add([r for r in fresh if r.logged.id not in skipped])
        self._last_loss = None if math.isnan(loss) else loss
        self._last_step_s = time.monotonic()
        # a lossless publish of this step leaves nothing behind; anything else may
        self._residual = not (publish_now and self.cfg.compression.algorithm == "lossless")
        if publish_now:
            self.publish()
        m.TRAINER_SAMPLES.inc(len(trained))
        for reason in skipped.values():
            m.TRAINER_SAMPLES_SKIPPED.labels(reason).inc()
        m.TRAINER_REPLAYED.inc(len(records) - len(fresh))
        rate = len(records) / max(seconds, 1e-9)
        self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
        m.TRAINER_STEP.set(self.step)
        if not math.isnan(loss):
            m.TRAINER_LOSS.set(loss)
        m.TRAINER_SAMPLES_PER_S.set(self._rate)
        m.TRAINER_COMMITTED_SEQ.set(seq)
        m.TRAINER_STEP_SECONDS.observe(seconds)
        self.redis.hset(keys.TRAINER_STATUS, mapping={
            "step": self.step, "loss": loss, "paused": 0, "samples_per_s": round(self._rate, 2), "seq": seq,
            "replay_pending": len(self.replay), "log": self.source.log_id,
            "version": self.version, "epoch": self.offset.epoch, "world": self.world,
            "updated_ms": int(time.time() * 1000)})
        if self.step == 1 or self.step % 10 == 0 or seconds > 1.0:
            log.info("step %d loss %.4f samples/s %.1f seq %d version %d", self.step, loss, self._rate,
                     seq, self.version)
        self.progress.update(self.step, loss, self._rate, seq)

    def publish(self, anchor: bool | None = None, rollback_of: int | None = None, lossless: bool = False) -> None:
        self.version = max(self.version, self.offset.version)
        if self.publisher is not None:
            if self.ops is not None:
                self.ops.before_publish(self.version)
            cpu0 = time.thread_time()
            params = self.consensus_params()
            stats = self.publisher.publish(params, self.version, anchor=anchor, lossless=lossless)
            self._record_version_seq()
            stats.extra.update(served_gap(params, self.publisher.encoder.last_stats))
            m.CODEC_CPU_SECONDS.labels("encode").inc(time.thread_time() - cpu0)
            if self._ranks_agree():  # else what went out is an earlier average, not this step's weights
                self._published_step = self.step
            if self.ops is not None:
                self.ops.published(stats, self.step, self._last_loss, rollback_of)
        m.TRAINER_VERSION.set(self.version)

    def _record_version_seq(self) -> None:
        """keys.MODEL_VERSION_SEQ: this version holds every pass over the samples up to the seq
        it is scored with (read-your-writes for ``learn``)."""
        seq = self.replay.settled_seq(self.offset.seq)
        if self._ranks_agree():
            self._agreed_seq = seq
        else:  # local SGD between averages: what went out is the last average, holding less
            seq = min(seq, self._agreed_seq)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(keys.MODEL_VERSION_SEQ, {str(self.version): seq})
        pipe.zremrangebyrank(keys.MODEL_VERSION_SEQ, 0, -_VERSION_SEQS_KEPT - 1)
        pipe.execute()

    # ---------------------------------------------------------------- operator commands
    def run_commands(self, commands: list[dict[str, Any]]) -> None:
        """Run the operator commands rank 0 resolved and broadcast; every rank runs them."""
        for c in commands:
            if c.get("cmd") == "checkpoint":
                self._saved_step = -1
                path = self.save_checkpoint()
                if self.rank == 0 and self.ops is not None:
                    self.ops.ack(c["id"], path=path, step=self.step, version=self.version)
            elif c.get("cmd") == "rollback":
                self.rollback(c)

    def rollback(self, c: dict[str, Any]) -> None:
        """Load the checkpointed weights of ``c['to_version']`` on every rank and publish them
        as a new, higher version (a full anchor) so workers follow. The learning of the steps
        after that version is discarded; their samples stay consumed (not replayed)."""
        data = None
        if self.rank == 0:
            try:
                data = open(c["path"], "rb").read()
            except OSError as exc:
                log.error("rollback: cannot read %s: %s", c["path"], exc)
        data = self.broadcast_bytes(data)
        if not data:
            if self.rank == 0 and self.ops is not None:
                self.ops.ack(c["id"], ok=False, error="the checkpoint could not be read")
            return
        state = checkpoint.load_bytes(data)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.averager is not None:
            self._ranks_agreed()
        target = int(c["to_version"])
        if self.rank == 0:
            self.offset = dataclasses.replace(self.offset, version=max(self.version, self.offset.version) + 1)
            self.replay.clear()  # the learning of the discarded steps is not to be repeated
            self.publish(anchor=True, rollback_of=target)
        self._saved_step = -1
        # Every rank: with local SGD saving is a collective. A restart resumes the rolled-back lineage.
        path = self.save_checkpoint()
        if self.rank != 0:
            return
        log.warning("rolled back to version %d, published as version %d", target, self.version)
        if self.ops is not None:
            self.ops.ack(c["id"], to_version=target, new_version=self.version, checkpoint=path)

    def save_checkpoint(self) -> str | None:
        """Write a checkpoint on rank 0. Every rank calls it at the same point: with local SGD
        the ranks first average their parameters (the checkpoint holds the consensus model,
        not rank 0's drift)."""
        if not self._ranks_agree():
            assert self.averager is not None
            self.averager.average_now(self.params)
        if self.rank != 0 or self._saved_step == self.step:
            return self._last_ckpt
        self._saved_step = self.step
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "step": self.step, "seq": self.offset.seq,
                 "id": self.offset.id, "log": self.offset.log, "version": self.version, "model_id": getattr(self.model, "model_id", ""),
                 # the weights are exactly this published version (rollback targets need that)
                 "published_version": self.version if self._published_step == self.step else None}
        path = checkpoint.save(self.t.checkpoint_dir, self.step, state, self.t.checkpoint_keep)
        self._last_ckpt = str(path)
        if self.t.trim_log and self.offset.id:
            # Replay after a crash starts at this checkpoint's entry: older entries are never read again.
            self.redis.xtrim(keys.SAMPLE_LOG, minid=self.offset.id, approximate=False)
        log.info("checkpoint %s (step %d, seq %d, version %d)", path, self.step, self.offset.seq, self.version)
        return self._last_ckpt

    def _maybe_fault(self) -> None:
        """Test hook: LEARNMESH_TRAINER_FAULT=rank:step:marker kills this rank once (kill -9)."""
        if self._fault and self._fault[0] == self.rank and self.step >= self._fault[1]:
            marker = self._fault[2]
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(self.step))
                os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.contexts is not None:
            self.contexts.close()
        if self.zmq_ctx is not None:
            self.zmq_ctx.term()
        if self.redis is not None:
            self.redis.close()


class LocalSGDAverager:
    """Local SGD's model average (``trainer.local_sgd_period`` H): after optimizer steps H, 2H, …
    every rank's parameters are replaced by their mean, then ``on_average`` runs.

    torch's PeriodicModelAverager leaves out parameters without a gradient; when a batch uses a
    parameter on one rank only (an image projection), ranks would all-reduce different lists,
    and a parameter trained earlier would never be averaged. This one averages every parameter
    it is given; ``step`` counts optimizer steps like torch's."""

    def __init__(self, period: int, step: int, on_average: Callable[[], None]) -> None:
        self.period = period
        self.step = step
        self.on_average = on_average

    def average_parameters(self, params: list[nn.Parameter]) -> None:
        """Call once after each optimizer step, on every rank."""
        self.step += 1
        if self.step % self.period == 0:
            self.average_now(params)

    def average_now(self, params: list[nn.Parameter]) -> None:
        """A collective: every rank calls it at the same point."""
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        group = dist.group.WORLD
        assert group is not None, "the process group is not initialised"
        average_parameters(iter(params), group)
        self.on_average()


_VERSION_SEQS_KEPT = 4096


def served_gap(params: dict[str, torch.Tensor], enc_stats: dict[str, Any]) -> dict[str, Any]:
    """How far what workers hold is from ``params`` after a publish: ``served_gap`` =
    ‖trainer − served‖ / ‖trainer‖, and the weights' digest when they are bit-identical."""
    residual = float(enc_stats.get("residual_norm", 0.0))
    if residual == 0.0:
        from shared.codec import weights_digest

        return {"served_gap": 0.0, "weights_digest": weights_digest(params)}
    norm = math.sqrt(sum(float(p.detach().float().pow(2).sum()) for p in params.values()))
    return {"served_gap": residual / norm if norm else 0.0, "weights_digest": ""}


def outcomes(records: list[TrainRecord]) -> tuple[list[str], dict[str, str]]:
    """(ids whose gradient the step holds, {id: reason} of those consumed without one)."""
    trained: list[str] = []
    skipped: dict[str, str] = {}
    for r in records:
        if r.skip:
            skipped[r.logged.id] = "context_gone"
        elif r.logged.sample.training_pair() is None:
            skipped[r.logged.id] = "no_gradient"
        else:
            trained.append(r.logged.id)
    return trained, skipped


def _allreduce_bytes(trainer: Any) -> tuple[str, int]:
    from services.trainer.operations import allreduce_bytes

    return allreduce_bytes(trainer)


def _parse_fault(spec: str) -> tuple[int, int, str] | None:
    if not spec:
        return None
    rank, step, marker = spec.split(":", 2)
    return int(rank), int(step), marker


def redis_url(cfg: Any) -> str:
    return cfg.redis.url or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
