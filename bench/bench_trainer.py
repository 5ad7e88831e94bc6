"""Trainer benchmark (``make bench-trainer``): training, ingest and gradient traffic, each
printed against a named baseline measured in the same run.

1. Training throughput of the default model (``shared.model.build_model``, pretrained base
   from the cache) under the shipped ``TrainerConfig`` (optimizer, lr, clip, batch per rank,
   2 gloo ranks, DDP built with ``ddp_options`` as the trainer builds it), one step as
   ``Trainer.train_step`` runs it: each rank takes its strided share of ``batch_size * world``
   samples, forward + backward, clip, optimizer step, loss all-reduce. Reported as samples/s
   and tokens/s (non-pad tokens through forward and backward). Baseline: this CPU's fp32
   matmul peak, measured by the same rank processes with the same torch thread count, all
   ranks at once; the fraction is model FLOP/s over that peak, with model FLOPs per token
   = 6 x (weights of the matmuls a text token goes through) + causal attention.
2. Ingest: samples/s the gateway's ``SampleIngest`` accepts (validation, one Lua append to
   the Redis log, ZeroMQ push to a draining PULL socket). Baseline: the same sample JSON
   written with pipelined XADDs (one stream entry per sample, one pipeline per batch, no
   validation).
3. Gradient bytes all-reduced per step and throughput with each comm hook on the default
   model: DDP's own all-reduce (every bucket in full, fp32), the fp16 hook (bf16's twin on
   gloo: torch's bf16 hook needs NCCL) and PowerSGD at the shipped ``powersgd_rank``; hook
   bytes are counted by wrapping ``torch.distributed.all_reduce``, which torch's hooks call.

Rows marked "shipped" use shipped settings; the others are labelled by what they change.
A scratch ``redis-server`` on a free port holds the ingest data. ``--quick`` runs fewer
steps and samples (a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.net import free_port  # noqa: E402

WARMUP_STEPS = 3  # DDP rebuilds its buckets after step 1; PowerSGD compresses from step 2
PEAK_MATMUL_N = 1024


# ---------------------------------------------------------------- 1 + 3. training


@dataclass
class TrainCase:
    """One training run; the defaults are the shipped settings."""

    label: str
    world: int = 2
    hook: str = "none"  # trainer.comm_hook
    threads: int = 0  # torch threads per rank; 0 = as the trainer's ranks run (trainer.torch_threads); -1 = torch's default
    flip_find_unused: bool = False  # the opposite of the find_unused_parameters ddp_options ships
    count_bytes: bool = False
    measure_peak: bool = False


def training_samples(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    """``n`` (prompt, target) pairs cut from the shipped corpus: 48-192 bytes, target 8-64."""
    from shared.model.pretrain import corpus_bytes

    data = corpus_bytes()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randrange(48, 193)
        start = rng.randrange(0, len(data) - length)
        window = data[start:start + length]
        cut = length - rng.randrange(8, min(64, length // 2) + 1)
        out.append((window[:cut], window[cut:]))
    return out


def matmul_flops(model: Any) -> int:
    """Weights of the matmuls one text token goes through (embeddings are lookups; the image
    and audio projections idle on text)."""
    from torch import nn

    return sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name not in ("image_proj", "audio_proj"))


def step_flops(model: Any, lengths: list[int], n_matmul: int) -> float:
    """Forward + backward: 6 FLOPs per matmul weight per token, plus causal attention
    (QK^T and AV, 2 x 2 x d per attended pair, x3 for backward)."""
    cfg = model.cfg
    attention = 6 * cfg.n_layers * cfg.d_model * sum(n * (n + 1) for n in lengths)
    return 6.0 * n_matmul * sum(lengths) + attention


def peak_matmul_flops_s(seconds: float) -> float:
    """fp32 matmul FLOP/s of this process at its torch thread count."""
    import torch

    a = torch.randn(PEAK_MATMUL_N, PEAK_MATMUL_N)
    b = torch.randn(PEAK_MATMUL_N, PEAK_MATMUL_N)
    out = torch.empty(PEAK_MATMUL_N, PEAK_MATMUL_N)
    torch.matmul(a, b, out=out)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b, out=out)
        n += 1
    return 2 * PEAK_MATMUL_N ** 3 * n / (time.perf_counter() - t0)


@dataclass
class _Rank:
    """One rank's model, optimizer and DDP wrapper, built as the trainer builds them."""

    cfg: Any
    model: Any
    params: list[Any]
    opt: Any
    sched: Any
    ddp: Any
    find_unused: bool | None


def _build_rank(case: TrainCase, rank: int, world: int) -> _Rank:
    """Join the gloo group and build this rank's model, optimizer and DDP wrapper."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from services.trainer.dist import cpu_threads
    from services.trainer.stepper import (
        LossModule,
        build_model,
        ddp_options,
        make_optimizer,
        register_comm_hook,
    )
    from shared.config import load_config

    cfg = load_config(env={}, overrides={"trainer": {"comm_hook": case.hook},
                                         "model": {"cache_dir": str(ROOT / "var" / "model")}})
    if case.threads >= 0:
        torch.set_num_threads(case.threads or cpu_threads(cfg.trainer.torch_threads, world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(cfg)
    params = [p for _, p in model.trainable_named_parameters()]
    opt, sched = make_optimizer(params, cfg.trainer)
    ddp, find_unused = None, None
    if world > 1:
        opts = ddp_options(cfg)
        if case.flip_find_unused:
            opts["find_unused_parameters"] = not opts["find_unused_parameters"]
        find_unused = opts["find_unused_parameters"]
        ddp = DDP(LossModule(model), **opts)
        register_comm_hook(ddp, cfg)
    model.train()
    return _Rank(cfg, model, params, opt, sched, ddp, find_unused)


def _train_rank(rank: int, case: TrainCase, port: int, steps: int, peak_s: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from services.trainer.dist import leave

    world = case.world
    r = _build_rank(case, rank, world)
    allreduce = dist.all_reduce
    counted = [0]
    if case.count_bytes:
        def counting(tensor: Any, *a: Any, **k: Any) -> Any:
            counted[0] += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *a, **k)

        dist.all_reduce = counting
    totals, step_s = _run_steps(r, rank, world, steps, counted, allreduce)
    peak = torch.tensor([0.0], dtype=torch.float64)
    if case.measure_peak:
        dist.barrier()
        peak[0] = peak_matmul_flops_s(peak_s)  # every rank at once: the load training puts on the CPU
        allreduce(peak)
    if rank == 0:
        t = r.cfg.trainer
        wall_s = float(totals[3]) / world
        Path(out).write_text(json.dumps({
            "samples_per_s": float(totals[0]) / wall_s, "tokens_per_s": float(totals[1]) / wall_s,
            "model_flops_s": float(totals[2]) / wall_s, "peak_flops_s": float(peak[0]),
            "step_ms_median": 1000 * statistics.median(step_s), "bytes_per_step": counted[0] / steps,
            "ddp_bytes_per_step": 4 * sum(p.numel() for p in r.params), "torch_threads": torch.get_num_threads(),
            "find_unused_parameters": r.find_unused,
            "tokens_per_sample": float(totals[1]) / float(totals[0]), "lr": t.lr, "optimizer": t.optimizer,
            "batch_size": t.batch_size, "powersgd_rank": t.powersgd_rank}))
    dist.destroy_process_group()
    leave(0)


def _run_steps(r: _Rank, rank: int, world: int, steps: int, counted: list[int],
               allreduce: Any) -> tuple[Any, list[float]]:
    """Warm-up, then ``steps`` timed steps as ``Trainer.train_step`` runs them; returns the
    totals summed over ranks (samples, tokens, model FLOPs, seconds) and this rank's step times."""
    import torch
    import torch.distributed as dist

    t = r.cfg.trainer
    per_step = t.batch_size * world
    pool = training_samples(per_step * (WARMUP_STEPS + steps), seed=1234)
    n_matmul = matmul_flops(r.model)
    samples = tokens = 0
    flops = 0.0
    step_s: list[float] = []
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            dist.barrier()
            counted[0] = 0
        t0 = time.perf_counter()
        mine = pool[i * per_step:(i + 1) * per_step][rank::world]
        batch = r.model.collate([r.model.encode(None, p, q) for p, q in mine])
        loss = r.ddp(batch) if r.ddp is not None else r.model.loss(batch)
        loss.backward()
        if t.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(r.params, t.clip_grad_norm)
        r.opt.step()
        r.sched.step()
        r.opt.zero_grad(set_to_none=True)
        loss_sum = torch.tensor([float(loss.detach()) * len(mine), len(mine)], dtype=torch.float64)
        if world > 1:
            allreduce(loss_sum)
        if i >= WARMUP_STEPS:
            step_s.append(time.perf_counter() - t0)
            lengths = batch.lengths.tolist()
            samples += len(mine)
            tokens += sum(lengths)
            flops += step_flops(r.model, lengths, n_matmul)
    totals = torch.tensor([samples, tokens, flops, sum(step_s)], dtype=torch.float64)
    allreduce(totals)
    return totals, step_s


def run_training(case: TrainCase, steps: int, peak_s: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    fd, out = tempfile.mkstemp(prefix="lm-bench-train-")
    os.close(fd)
    try:
        mp.start_processes(_train_rank, args=(case, free_port(), steps, peak_s, out), nprocs=case.world,
                           join=True, start_method="spawn")
        return dict(json.loads(Path(out).read_text()), **asdict(case))
    finally:
        os.unlink(out)


# ---------------------------------------------------------------- 2. ingest


def start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    r.close()
    return proc, f"redis://127.0.0.1:{port}/0"


def drain(ctx: Any, cfg: Any, stop: threading.Event) -> None:
    """The trainer's end of the sample push (its CURVE key included): receive and drop."""
    import zmq

    from shared.curve import CurveKeys
    from shared.zmq_util import make_socket

    keys = CurveKeys.load(cfg.zmq, "trainer")
    pull = make_socket(ctx, zmq.PULL, bind=cfg.trainer.samples_endpoint, curve=keys.server("samples") if keys else None)
    try:
        while not stop.is_set():
            if pull.poll(50):
                pull.recv_multipart()
    finally:
        pull.close(0)


async def ingest_rates(url: str, batch: int, n: int) -> tuple[float, float]:
    """(SampleIngest samples/s, pipelined XADD samples/s) for ``n`` samples in calls of ``batch``."""
    import redis.asyncio as aioredis
    import zmq

    from gateway.tools.learning import SampleIngest
    from shared.config import load_config

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(env={}, overrides={"redis": {"url": url}, "trainer": {"samples_endpoint": endpoint,
                                                                           "sample_hwm": 1_000_000},
                                         "zmq": {"keys_dir": tempfile.mkdtemp(prefix="lm-bench-zmq-")}})
    ctx = zmq.Context()
    stop = threading.Event()
    reader = threading.Thread(target=drain, args=(ctx, cfg, stop), daemon=True)
    reader.start()
    r = aioredis.Redis.from_url(url)
    ingest = SampleIngest(r, cfg, zmq_ctx=ctx)
    calls = [[{"kind": "example", "input": f"bench question {i}?", "target": f"answer {i % 97}"}
              for i in range(s, s + batch)] for s in range(0, n, batch)]
    try:
        await ingest.submit("bench", ingest.parse({"samples": calls[0]}))  # connects the push, loads the script
        t0 = time.perf_counter()
        for items in calls:
            await ingest.submit("bench", ingest.parse({"samples": items}))
        accepted = n / (time.perf_counter() - t0)
        blobs = [[json.dumps(s, separators=(",", ":")).encode() for s in items] for items in calls]
        t0 = time.perf_counter()
        for call in blobs:
            pipe = r.pipeline(transaction=False)
            for blob in call:
                pipe.xadd("bench:xadd", {"s": blob})
            await pipe.execute()
        baseline = n / (time.perf_counter() - t0)
        await r.flushdb()
        return accepted, baseline
    finally:
        stop.set()
        reader.join()
        ingest.close()
        await r.aclose()
        ctx.term()


def bench_ingest(rows: list[tuple[int, int]]) -> list[tuple[int, float, float]]:
    workdir = tempfile.mkdtemp(prefix="lm-bench-ingest-")
    proc, url = start_redis(workdir)
    try:
        return [(batch, *asyncio.run(ingest_rates(url, batch, n))) for batch, n in rows]
    finally:
        proc.terminate()
        proc.wait()


# ---------------------------------------------------------------- report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="timed training steps per run")
    ap.add_argument("--peak-s", type=float, default=3.0, help="seconds of the matmul peak loop")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 steps, small ingest, short peak")
    args = ap.parse_args()
    steps, peak_s, scale = (3, 0.5, 0.1) if args.quick else (args.steps, args.peak_s, 1.0)

    ship = run_training(TrainCase("shipped", measure_peak=True), steps, peak_s)
    print(f"training, default model, shipped trainer settings ({ship['optimizer']} lr {ship['lr']:g}, "
          f"{ship['batch_size']} samples/rank, {ship['tokens_per_sample']:.0f} tokens/sample, "
          f"{ship['torch_threads']} torch threads/rank), {steps} steps after {WARMUP_STEPS} warm-up:")
    peak = ship["peak_flops_s"]
    print(f"  {'shipped, 2 gloo ranks':28s}{ship['samples_per_s']:7.1f} samples/s  {ship['tokens_per_s']:8.0f} tokens/s  "
          f"{ship['model_flops_s'] / 1e9:6.2f} GFLOP/s  step {ship['step_ms_median']:6.1f} ms")
    print(f"  baseline: fp32 matmul peak, both ranks at once   {peak / 1e9:6.2f} GFLOP/s "
          f"({PEAK_MATMUL_N}x{PEAK_MATMUL_N}, same threads)")
    print(f"  fraction of peak        {ship['model_flops_s'] / peak:7.1%}")
    extras = [TrainCase("1 rank, no DDP", world=1),
              TrainCase("find_unused_parameters={}", flip_find_unused=True),
              TrainCase("torch's default threads/rank", threads=-1)]
    for case in extras:
        row = run_training(case, steps, 0)
        label = case.label.format(row["find_unused_parameters"])
        print(f"  {label:28s}{row['samples_per_s']:7.1f} samples/s  {row['tokens_per_s']:8.0f} tokens/s  "
              f"step {row['step_ms_median']:6.1f} ms  ({row['samples_per_s'] / ship['samples_per_s']:.2f}x shipped)")

    rows = [(500, int(20_000 * scale)), (8, int(4_000 * scale)), (1, int(1_000 * scale))]
    print("\ningest into Redis, one client, baseline: pipelined XADD (one entry per sample, one pipeline per call):")
    for batch, accepted, baseline in bench_ingest(rows):
        label = "samples per call" if batch > 1 else "sample per call"
        print(f"  {batch:4d} {label:17s} SampleIngest {accepted:9.0f} samples/s   pipelined XADD "
              f"{baseline:9.0f} samples/s   ratio {accepted / baseline:5.2f}x")

    print(f"\ngradient all-reduce per step, default model, 2 gloo ranks (baseline: DDP's own fp32 all-reduce, "
          f"shipped), PowerSGD at rank {ship['powersgd_rank']}:")
    ref = ship["ddp_bytes_per_step"]
    print(f"  none (shipped) {ref / 1e6:8.3f} MB/step   1.0x fewer   {ship['samples_per_s']:6.1f} samples/s")
    for hook in ("fp16", "powersgd"):
        row = run_training(TrainCase(hook, hook=hook, count_bytes=True), steps, 0)
        print(f"  {hook:14s} {row['bytes_per_step'] / 1e6:8.3f} MB/step {ref / row['bytes_per_step']:6.1f}x fewer   "
              f"{row['samples_per_s']:6.1f} samples/s ({row['samples_per_s'] / ship['samples_per_s']:.2f}x)")


if __name__ == "__main__":
    main()
