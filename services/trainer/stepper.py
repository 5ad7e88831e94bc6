"""The numerics of one trainer rank: the model, its optimizer and schedule, and how gradients
meet across ranks — DDP with one of torch's communication hooks, or local SGD's periodic
average.

A step takes this rank's share of the step's examples and runs ``grad_accum_steps``
micro-batches (all but the last under ``DDP.no_sync()``). Ranks always run the same number of
forward/backward passes: a rank whose share is short runs a zero-weighted pass so the
gradient all-reduce still lines up. Each share's loss is weighted by its size over the
step's total, times the world size, so the all-reduced mean gradient is exactly the one a
single process would compute over the whole batch.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from services.trainer.dist import RankGroup
from shared import metrics as m
from shared.config import Config, TrainerConfig


def build_model(cfg: Config) -> Any:
    """The LearnModel named by ``trainer.model_factory`` (default: the product model)."""
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


def ddp_options(cfg: Config) -> dict[str, Any]:
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


def register_comm_hook(ddp: DDP, cfg: Config, group: Any = None) -> Any:
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


def make_optimizer(params: list[nn.Parameter], t: TrainerConfig) -> tuple[torch.optim.Optimizer, Any]:
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


def allreduce_bytes(t: TrainerConfig, params: list[nn.Parameter], hook_state: Any) -> tuple[str, int]:
    """Gradient bytes one synchronising step all-reduces on this rank, from the tensor shapes
    and the comm hook (fp16/bf16: 2 bytes per element; PowerSGD: P and Q factors of each
    matrix, vectors uncompressed, full precision before its start iteration)."""
    numel = sum(p.numel() for p in params)
    if t.comm_hook in ("fp16", "bf16"):
        return t.comm_hook, 2 * numel
    if t.comm_hook != "powersgd":
        return "none", 4 * numel
    if hook_state is None or getattr(hook_state, "iter", 0) < getattr(hook_state, "start_powerSGD_iter", 0):
        return t.comm_hook, 4 * numel
    total = 0
    for p in params:
        if p.dim() <= 1:
            total += p.numel()
        else:
            n = p.shape[0]
            mm = p.numel() // n
            total += (n + mm) * min(t.powersgd_rank, n, mm)
    return t.comm_hook, 4 * total


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
        if group is None:
            raise RuntimeError("the process group is not initialised")
        average_parameters(iter(params), group)
        self.on_average()


class Stepper:
    """The model and its optimizer on one rank, and how the ranks' gradients (or, with local
    SGD, parameters) meet. Build it, :meth:`restore` a checkpoint, then :meth:`distribute`."""

    def __init__(self, cfg: Config, group: RankGroup, model: Any) -> None:
        self.cfg = cfg
        self.t = cfg.trainer
        self.group = group
        self.model: Any = model
        self.params = [p for _, p in model.trainable_named_parameters()]
        trainable = {id(p) for p in self.params}
        for p in model.parameters():
            p.requires_grad_(id(p) in trainable)
        self.opt, self.sched = make_optimizer(self.params, self.t)
        self.ddp: DDP | None = None
        self.hook_state: Any = None
        self.averager: LocalSGDAverager | None = None
        self._consensus: dict[str, torch.Tensor] | None = None
        self._agreed_at = 0

    @property
    def local_sgd(self) -> bool:
        return self.t.local_sgd_period > 0

    # ---------------------------------------------------------------- set-up
    def restore(self, state: dict[str, Any], *, schedule: bool = True) -> None:
        """Load checkpointed weights and optimizer state (and the schedule's position)."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if schedule:
            self.sched.load_state_dict(state["scheduler"])
        if self.averager is not None:
            self._ranks_agreed()

    def distribute(self, step: int) -> None:
        """Wrap the model for the group: building DDP broadcasts rank 0's parameters to every
        rank; with local SGD the averager counts from ``step``."""
        if self.group.world > 1:
            device = self.group.device
            self.ddp = DDP(LossModule(self.model), device_ids=[device.index] if device.type == "cuda" else None,
                           **ddp_options(self.cfg))
            if not self.local_sgd:
                self.hook_state = register_comm_hook(self.ddp, self.cfg)
            else:
                self.averager = LocalSGDAverager(self.t.local_sgd_period, step, self._ranks_agreed)
                self._ranks_agreed()
        self.model.train()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict()}

    # ---------------------------------------------------------------- one step
    def step(self, mine: list[Any], pad: list[Any], total: int) -> float:
        """One optimizer step over ``mine`` (this rank's examples of the step's ``total``;
        ``pad``: what a pass without examples runs, weighted by zero). Every rank calls it,
        ``total`` 0 included (then only the loss is exchanged). Returns the step's mean
        loss over every rank's examples (nan without any)."""
        loss_sum = torch.zeros(2, dtype=torch.float64)
        if total:
            self._accumulate(mine, pad, total, loss_sum)
            self._update()
        self.group.sum(loss_sum)
        return float(loss_sum[0] / loss_sum[1]) if loss_sum[1] > 0 else float("nan")

    def _accumulate(self, mine: list[Any], pad: list[Any], total: int, loss_sum: torch.Tensor) -> None:
        n_micro = self.t.grad_accum_steps
        for i in range(n_micro):
            chunk = mine[i::n_micro]
            sync = i == n_micro - 1 and not self.local_sgd
            ctx = self.ddp.no_sync() if self.ddp is not None and not sync else contextlib.nullcontext()
            weight = len(chunk) / total * self.group.world
            with ctx:
                batch = self.model.collate(chunk or pad).to(self.group.device)
                loss = self.ddp(batch) if self.ddp is not None else self.model.loss(batch)
                (loss * (weight if chunk else 0.0)).backward()
            if chunk:
                loss_sum += torch.tensor([float(loss.detach()) * len(chunk), len(chunk)], dtype=torch.float64)

    def _update(self) -> None:
        if self.t.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.t.clip_grad_norm)
        self.opt.step()
        if self.group.world > 1 and not self.local_sgd:
            hook, nbytes = allreduce_bytes(self.t, self.params, self.hook_state)
            m.TRAINER_ALLREDUCE_BYTES.labels(hook).inc(nbytes)
        if self.averager is not None:  # before zero_grad: torch's averager skips grad-less params
            self.averager.average_parameters(self.params)
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- agreement across ranks
    def settle(self) -> None:
        """Make every rank hold the same parameters (local SGD between averages: average now).
        A collective when it acts: every rank calls it at the same point."""
        if not self.agreed():
            self._averager().average_now(self.params)

    def agreed(self) -> bool:
        """No optimizer step since the ranks last agreed; the same answer on every rank."""
        return self.averager is None or self._agreed_at == self.averager.step

    def named_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in self.model.trainable_named_parameters()}

    def consensus_params(self) -> dict[str, torch.Tensor]:
        """The weights workers may be sent. With local SGD the ranks drift apart between
        averages, so that is the last parameters every rank held; otherwise the current ones.
        No collective: rank 0 calls it alone, from publish."""
        return self._consensus if self._consensus is not None else self.named_params()

    def _averager(self) -> LocalSGDAverager:
        if self.averager is None:
            raise RuntimeError("local SGD is off: there is no averager")
        return self.averager

    def _ranks_agreed(self) -> None:
        """Every rank holds the same parameters now (an average, a rollback, start-up): rank 0
        keeps a copy to publish until the next time."""
        self._agreed_at = self._averager().step
        if self.group.rank == 0:
            self._consensus = {n: p.detach().to("cpu", copy=True) for n, p in self.model.trainable_named_parameters()}
