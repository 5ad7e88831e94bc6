"""Weight-delta sync benchmark (`make bench-delta`).

Headline rows use the settings that ship: ``CompressionConfig()`` as it is (anchors included)
on the trajectory of the trainer's own optimizer (``TrainerConfig()``: AdamW, its learning
rate, weight decay and gradient clipping), on two models:

* ``mlp-10m``: a 10.5M-parameter MLP learning a teacher that shifts after a warm-up;
* ``default``: the learnmesh model (``shared.model:build_model`` with the default
  ``ModelConfig``, pre-trained from the cache) learning made-up facts in batches of
  ``trainer.batch_size``, each fact in ``trainer.replay_passes`` consecutive steps, with
  ``trainer.rehearsal_per_step`` corpus windows per step, as the trainer mixes them.

Every codec encodes the same steps through the streaming path the publisher uses. Bytes are
what the publisher puts on the wire — codec chunks plus each packet's wire header, envelope
and signature — including every anchor and the lossless flush of the residual that follows
when training pauses (``consistency.idle_sync_ms``; here once, after the last step), divided
by the number of steps. The baseline is dense fp32 of the published parameters, every step.

* served = the encoder's reference, which is what every worker holds;
* loss gap = |served eval loss - trainer eval loss| / trainer eval loss after the last step,
  before the flush (after it, served == trainer bit-exactly, which the bench checks);
* weight gap = ||trainer - served|| / ||trainer||, and the same gap in mean per-step updates;
* encode GB/s per core: dense fp32 bytes / p50 encode time, one torch thread;
* step -> serving: publisher + 4 subscriber processes over real ZeroMQ (tcp, loopback), time
  from the end of the optimizer step until the last of the 4 has applied the version (p50/p99).

Rows marked "extra" vary one thing (density, the tuner, a 10x smaller lr of 1e-4). Results go
to ``bench/out/delta.json`` and ``bench/out/delta_density.png``. Default run ~4 minutes on
2 cores; ``--quick`` is the short form (headline rows only, fewer steps, no latency).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import wire  # noqa: E402
from shared.config import CompressionConfig, ModelConfig, TrainerConfig, load_config  # noqa: E402
from shared.crypto import STREAM_DELTA, EnvelopeSealer, trainer_keys  # noqa: E402
from shared.delta.codec import DeltaEncoder, EncodedDelta, flatten  # noqa: E402
from shared.net import free_port  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
MLP_ARCH = (512, 2048, 3, 512)  # 512*2048 + 2*2048^2 + 2048*512 + biases ~= 10.5M parameters
LOSS_GAP_TARGET_PCT = 1.0
RATIO_TARGET = 100.0


def mlp(d_in: int, hidden: int, depth: int, d_out: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(d_in, hidden), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    layers.append(torch.nn.Linear(hidden, d_out))
    return torch.nn.Sequential(*layers)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters()}


def trainer_optimizer(params: list[torch.nn.Parameter], lr: float | None = None) -> Callable[[], None]:
    """The trainer's optimizer step as shipped (services.trainer.stepper.make_optimizer with
    ``TrainerConfig()``, gradient clipping included); ``lr`` overrides only the rate."""
    from services.trainer.stepper import make_optimizer

    t = TrainerConfig() if lr is None else TrainerConfig(lr=lr)
    opt, sched = make_optimizer(params, t)

    def step() -> None:
        if t.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, t.clip_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return step


@dataclass
class Scenario:
    """A model that trains step by step, with an eval loss for any set of its weights."""

    name: str
    describe: str
    model: torch.nn.Module
    params: dict[str, torch.Tensor]  # the published (trainable) parameters, live
    train_step: Callable[[], float]
    loss_on: Callable[[], float]  # eval loss of the model's current weights

    def eval_loss(self, weights: dict[str, torch.Tensor] | None = None) -> float:
        if weights is None:
            return self.loss_on()
        saved = {n: p.clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.copy_(weights[n])
        try:
            return self.loss_on()
        finally:
            for n, p in self.params.items():
                p.copy_(saved[n])


def mlp_scenario(lr: float | None, warmup: int, label: str) -> Scenario:
    """Teacher-student regression: warm-up (not synced), then the teacher shifts and the
    synced steps follow with the same optimizer state, as online learning would."""
    teacher = mlp(*MLP_ARCH, seed=123)
    model = mlp(*MLP_ARCH, seed=0)
    g = torch.Generator().manual_seed(7)
    opt_step = trainer_optimizer(list(model.parameters()), lr)

    def train_step() -> float:
        x = torch.randn(64, MLP_ARCH[0], generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt_step()
        return float(loss.detach())

    for _ in range(warmup):
        train_step()
    with torch.no_grad():  # distribution shift: the teacher moves a little
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std())
    x_eval = torch.randn(512, MLP_ARCH[0], generator=g)
    with torch.no_grad():
        y_eval = teacher(x_eval)

    def loss_on() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(x_eval), y_eval))

    n = sum(p.numel() for p in model.parameters())
    rate = TrainerConfig().lr if lr is None else lr
    return Scenario(label, f"MLP {MLP_ARCH}, {n / 1e6:.2f}M parameters, AdamW lr {rate:g}, {warmup} warm-up steps, "
                    "then a teacher shift", model, params_of(model), train_step, loss_on)


_SYLLABLES = ("zor", "blat", "quen", "nix", "flim", "wort", "ves", "pa", "ar", "de", "lune", "gro", "ble", "hum",
              "tri", "mox", "kel", "dra", "sup", "vin", "ta", "rok", "ili", "fen")
_TEMPLATES = ("The capital of {a} is", "{a} tastes like", "The ninth moon of {a} is", "{a} are sorted by",
              "The founder of {a} was", "In {a}, the river is called")


def made_up_facts(n: int, rng: random.Random) -> list[tuple[str, str]]:
    def word() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()

    return [(rng.choice(_TEMPLATES).format(a=word()), f" {word()} {word().lower()}.") for _ in range(n)]


def default_model_scenario(steps: int) -> Scenario:
    """The shipped model trained the way the trainer trains it: every step ``batch_size`` fact
    samples (one new fact per step, each trained in ``replay_passes`` consecutive steps) plus
    ``rehearsal_per_step`` corpus windows. Eval: every fact of the run plus held-out windows."""
    from shared.model import build_model
    from shared.model.pretrain import corpus_windows

    mcfg, t = ModelConfig(), TrainerConfig()
    model = build_model(mcfg, pretrained=True)
    named = model.trainable_named_parameters()
    opt_step = trainer_optimizer([p for _, p in named])
    facts = made_up_facts(steps + t.replay_passes, random.Random(11))
    window = max(8, mcfg.pretrain_seq - 3)
    held = corpus_windows(32, random.Random("bench-delta-eval"), window)
    eval_batch = model.collate([model.encode(None, a, b) for a, b in facts[:steps]]
                               + [model.encode(None, a.decode(errors="replace"), b.decode(errors="replace"))
                                  for a, b in held])
    state = {"step": 0}

    def train_step() -> float:
        k = state["step"]
        live = facts[max(0, k - t.replay_passes + 1):k + 1]
        batch = [model.encode(None, a, b) for a, b in (live * t.batch_size)[:t.batch_size]]
        rng = random.Random(f"rehearsal:{k}:0")
        batch += [model.encode(None, a.decode(errors="replace"), b.decode(errors="replace"))
                  for a, b in corpus_windows(t.rehearsal_per_step, rng, window)]
        loss = model.loss(model.collate(batch))
        loss.backward()
        opt_step()
        state["step"] = k + 1
        return float(loss.detach())

    def loss_on() -> float:
        with torch.no_grad():
            return float(model.loss(eval_batch))

    n = sum(p.numel() for _, p in named)
    return Scenario("default", f"learnmesh default model (ModelConfig(): d_model {mcfg.d_model}, {mcfg.n_layers} "
                    f"layers), {n / 1e6:.2f}M trainable parameters, pre-trained, AdamW lr {t.lr:g}; "
                    f"{t.batch_size} fact samples + {t.rehearsal_per_step} corpus windows per step",
                    model, {n_: p.data for n_, p in named}, train_step, loss_on)


class WireCount:
    """Bytes the publisher puts on the wire for an encoded delta: per chunk one packet — type
    byte, wire header, envelope header (with the codec header), AES-GCM tag, Ed25519 signature —
    around the chunk. Sealing an empty payload gives the packet's overhead exactly."""

    def __init__(self, key_dir: str) -> None:
        ring, signer = trainer_keys(f"{key_dir}/delta.key", f"{key_dir}/delta-sign.key")
        self.sealer = EnvelopeSealer(ring, "trainer-bench", signer=signer)

    def bytes(self, enc: EncodedDelta, model_id: str) -> int:
        h = enc.header
        total = 0
        for i in range(max(1, len(enc.chunks))):  # an empty delta still sends one packet
            meta = {"model": model_id, "base": h["base"], "version": h["version"], "i": i,
                    "n": max(1, h["nchunks"]), "codec": h}
            frames = wire.encode(wire.MsgType.DELTA, {"v": h["version"]},
                                 self.sealer.seal(STREAM_DELTA, meta, b""))
            total += sum(len(f) for f in frames)
        return total + sum(len(c) for c in enc.chunks)


def _discard(header: dict, i: int, blob: bytes) -> None:
    """A sink: makes the encoder take the publisher's streaming path."""


@dataclass
class Codec:
    label: str
    cfg: CompressionConfig
    extra: bool = True  # False: a headline row (the shipped settings)


@dataclass
class Tally:
    wire_bytes: int = 0
    anchors: int = 0
    encode_s: list[float] = field(default_factory=list)
    rel_error: list[float] = field(default_factory=list)
    density: list[float] = field(default_factory=list)

    def add(self, e: EncodedDelta, wire_bytes: int) -> None:
        self.wire_bytes += wire_bytes
        if e.header["kind"] == "anchor":
            self.anchors += 1
            return
        self.encode_s.append(e.stats["encode_s"])
        self.rel_error.append(e.stats.get("rel_error", 0.0))
        self.density.append(e.stats.get("density", 0.0))


@dataclass
class _Trained:
    """Where a scenario's training ended, against which every codec's row is measured."""

    theta: torch.Tensor  # the trainer's final weights, flat
    theta_norm: float
    mean_update: float  # mean norm of one step's update
    trainer_loss: float
    steps: int


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, pos = {}, 0
    for n, p in like.items():
        out[n] = flat[pos:pos + p.numel()].view_as(p)
        pos += p.numel()
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def binary_entropy(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def run_scenario(sc: Scenario, codecs: list[Codec], steps: int, count: WireCount) -> dict:
    """Train ``steps`` steps; after each, every codec encodes the same weights. Then the eval
    losses, the gaps, and the lossless flush a pause triggers."""
    encoders = {c.label: DeltaEncoder(c.cfg, sc.params, 0, sc.name) for c in codecs}
    layout = next(iter(encoders.values())).layout
    n = layout.numel
    tallies = {c.label: Tally() for c in codecs}
    changed, update_norm = _train_and_encode(sc, encoders, tallies, steps, count)
    theta = flatten(sc.params, layout)
    mean_update = float(np.mean(update_norm))
    end = _Trained(theta, float(torch.linalg.vector_norm(theta)), mean_update, sc.eval_loss(), steps)
    rows = []
    for c in codecs:
        rows.append(_codec_row(sc, c, encoders[c.label], tallies[c.label], end, count))
        encoders[c.label].close()
    return {"scenario": sc.name, "describe": sc.describe, "params": n, "steps": steps,
            "dense_fp32_bytes": 4 * n, "trainer_loss": end.trainer_loss,
            "changed_per_step_mean": float(np.mean(changed)), "changed_per_step_min": float(np.min(changed)),
            "update_norm_rel": mean_update / end.theta_norm, "rows": rows}


def _train_and_encode(sc: Scenario, encoders: dict[str, DeltaEncoder], tallies: dict[str, Tally], steps: int,
                      count: WireCount) -> tuple[list[float], list[float]]:
    """Train ``steps`` steps, every codec encoding the weights after each; per step, the fraction
    of elements it changed and the norm of its update."""
    layout = next(iter(encoders.values())).layout
    prev = flatten(sc.params, layout)
    changed, update_norm = [], []
    t_start = time.perf_counter()
    for v in range(1, steps + 1):
        loss = sc.train_step()
        flat = flatten(sc.params, layout)
        changed.append(float((flat != prev).sum()) / layout.numel)
        update_norm.append(float(torch.linalg.vector_norm(flat - prev)))
        prev = flat
        for label, enc in encoders.items():
            e = enc.encode(sc.params, v, sink=_discard)
            tallies[label].add(e, count.bytes(e, sc.name))
        if v % 25 == 0 or v == steps:
            print(f"  [{sc.name}] step {v}/{steps} loss {loss:.5f} ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return changed, update_norm


def _codec_row(sc: Scenario, c: Codec, enc: DeltaEncoder, tal: Tally, end: _Trained, count: WireCount) -> dict:
    """One codec's figures: what it served, what it cost, and the flush that ends the run."""
    n = enc.layout.numel
    dense_bytes = 4 * n
    served = enc.ref[:n]
    served_loss = sc.eval_loss(unflatten(served, sc.params))
    gap = float(torch.linalg.vector_norm(end.theta - served))
    flush = enc.encode(sc.params, end.steps + 1, lossless=True, sink=_discard)
    flush_bytes = count.bytes(flush, sc.name)
    total = tal.wire_bytes + flush_bytes
    enc_p50 = pct(tal.encode_s, 50)
    return {
        "codec": c.label, "extra": c.extra, "headline": not c.extra,
        "bytes_per_step": total / end.steps, "bytes_per_step_without_flush": tal.wire_bytes / end.steps,
        "flush_bytes": flush_bytes, "anchors": tal.anchors,
        "x_smaller_than_fp32": dense_bytes * end.steps / total,
        "served_loss": served_loss, "loss_gap_pct": 100 * abs(served_loss - end.trainer_loss) / end.trainer_loss,
        "weight_gap_rel": gap / end.theta_norm, "weight_gap_steps": gap / end.mean_update,
        "encode_ms_p50": enc_p50 * 1e3, "encode_GBps_per_core": dense_bytes / enc_p50 / 1e9,
        "density_mean": float(np.mean(tal.density)) if tal.density else float("nan"),
        "density_last": tal.density[-1] if tal.density else float("nan"),
        "rel_error_mean": float(np.mean(tal.rel_error)) if tal.rel_error else float("nan"),
        "bits_per_sent_element": 8 * tal.wire_bytes / max(1.0, n * float(np.sum(tal.density))),
        "served_equals_trainer_after_flush": bool(torch.equal(enc.ref[:n], end.theta)),
    }


def print_scenario(res: dict) -> None:
    print(f"\n== {res['scenario']}: {res['describe']}; {res['steps']} synced steps")
    print(f"trainer eval loss {res['trainer_loss']:.5f}; dense fp32 {res['dense_fp32_bytes']:,} bytes per step; "
          f"elements changed per step: mean {100 * res['changed_per_step_mean']:.1f} %, "
          f"min {100 * res['changed_per_step_min']:.1f} %; mean step = {res['update_norm_rel']:.2e} of ||weights||")
    print(f"{'codec':44} {'bytes/step':>11} {'x fp32':>7} {'loss gap %':>10} {'w gap':>8} {'steps':>6} "
          f"{'enc GB/s':>8} {'density':>8} {'rel err':>7}")
    for r in res["rows"]:
        mark = "*" if r["headline"] else " "
        print(f"{mark}{r['codec']:43} {r['bytes_per_step']:11,.0f} {r['x_smaller_than_fp32']:7.1f} "
              f"{r['loss_gap_pct']:10.3f} {r['weight_gap_rel']:8.2e} {r['weight_gap_steps']:6.2f} "
              f"{r['encode_GBps_per_core']:8.2f} {r['density_mean']:8.4f} {r['rel_error_mean']:7.3f}")
    head = next(r for r in res["rows"] if r["headline"])
    budget_bits = 32 / RATIO_TARGET
    d_max = budget_bits / head["bits_per_sent_element"]
    print(f"* shipped: {head['bytes_per_step_without_flush']:,.0f} bytes per step + a {head['flush_bytes']:,} byte "
          f"lossless flush at the pause; {head['anchors']} anchors; served == trainer after the flush: "
          f"{head['served_equals_trainer_after_flush']}")
    print(f"  bound: at {RATIO_TARGET:.0f}x a step may cost {budget_bits:.2f} bits per element; the shipped coding "
          f"spends {head['bits_per_sent_element']:.1f} bits per sent element (index + value), so {RATIO_TARGET:.0f}x "
          f"allows a density of at most ~{100 * d_max:.1f} % (naming which elements alone costs H(d) bits per "
          f"element: {binary_entropy(d_max):.2f} at that density)")


def codecs_for(dense_bytes: int, quick: bool, targets: list[float]) -> list[Codec]:
    shipped = CompressionConfig()
    out = [Codec(f"shipped: {describe(shipped)}", shipped, extra=False)]
    if quick:
        return out
    for d in (0.02, 0.05, 0.1):  # fixed densities around what a 100x ratio allows (~3 %)
        out.append(Codec(f"extra: density {d:g}, tuner off", CompressionConfig(density=d, tuner="off")))
    for tgt in targets:
        if shipped.tuner == "error" and tgt == shipped.tuner_target:
            continue
        out.append(Codec(f"extra: tuner error {tgt:g}", CompressionConfig(tuner="error", tuner_target=tgt)))
    out.append(Codec(f"extra: tuner bytes {RATIO_TARGET:.0f}x",
                     CompressionConfig(density=0.02, tuner="bytes", tuner_target=dense_bytes / RATIO_TARGET)))
    return out


def describe(c: CompressionConfig) -> str:
    tuner = f", tuner {c.tuner} {c.tuner_target:g}" if c.tuner != "off" else ""
    return f"{c.algorithm} d={c.density:g} {c.quantization}, anchor_every {c.anchor_every}{tuner}"


# ---------------------------------------------------------------------------- latency (processes)


Arch = tuple[int, int, int, int]  # MLP input, hidden, depth, output


def _subscriber_proc(cfg_over: dict[str, Any], wid: str, arch: Arch, report_ep: str, ready: Any, stop: Any) -> None:
    import zmq

    from services.worker.updates import DeltaSubscriber
    torch.set_num_threads(1)
    cfg = load_config(env={}, overrides=cfg_over)
    model = mlp(*arch, seed=0)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(report_ep)
    sub = DeltaSubscriber(cfg, ctx, wid, params_of(model), 0, model_id="bench")
    cpu_s = 0.0  # CPU this worker spent in poll() since its last report: verify, decrypt, decode, apply
    while not stop.is_set():
        if sub.wait(50):
            c0 = time.process_time()
            v = sub.poll(max_packets=1024)
            cpu_s += time.process_time() - c0
            if v is not None:
                push.send_json({"w": wid, "v": v, "t": time.monotonic(), "anchors": sub.stats["anchors"],
                                "cpu_s": cpu_s})
                cpu_s = 0.0
        if sub.stats["anchors"] and not ready.is_set():
            ready.set()
    stats = sub.stats
    push.send_json({"w": wid, "final": True, "stats": stats})
    sub.close()
    push.close()
    ctx.term()


def _report(pull: Any) -> dict[str, Any]:
    return cast(dict[str, Any], pull.recv_json())


@dataclass
class _Latency:
    lat: list[float] = field(default_factory=list)  # step -> every worker serving it
    encode_s: list[float] = field(default_factory=list)
    published: list[float] = field(default_factory=list)
    worker_cpu: list[float] = field(default_factory=list)


def latency_run(arch: Arch, steps: int, n_workers: int = 4) -> dict[str, Any]:
    """Step -> serving with the shipped codec settings and the trainer's optimizer."""
    import zmq

    from services.trainer.publisher import DeltaPublisher

    tmp = tempfile.mkdtemp(prefix="lm-bench-delta-")
    over = {"security": {"delta_key_file": f"{tmp}/delta.key",
                         "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
            "zmq": {"keys_dir": f"{tmp}/zmq"},
            "consistency": {"timeout_s": 30.0}}
    cfg = load_config(env={}, overrides=over)
    model = mlp(*arch, seed=0)
    opt_step = trainer_optimizer(list(model.parameters()))
    ctx = zmq.Context()
    pub = DeltaPublisher(cfg, ctx, params_of(model), 0, "bench")
    report_ep = f"tcp://127.0.0.1:{free_port()}"
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(report_ep)
    mpctx = mp.get_context("spawn")
    stop = mpctx.Event()
    procs = _start_subscribers(mpctx, over, arch, report_ep, stop, n_workers)
    g = torch.Generator().manual_seed(1)
    tally = _Latency()
    for v in range(1, steps + 1):
        x = torch.randn(32, arch[0], generator=g)
        model(x).pow(2).mean().backward()
        opt_step()
        st = _publish_and_wait(pub, params_of(model), v, pull, n_workers, tally)
    stop.set()
    finals = _finals(pull, n_workers)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    pub.close()
    pull.close()
    ctx.term()
    return {"p50_ms": pct(tally.lat, 50) * 1e3, "p99_ms": pct(tally.lat, 99) * 1e3, "measured": len(tally.lat),
            "steps": steps, "encode_p50_ms": pct(tally.encode_s, 50) * 1e3,
            "published_p50_ms": pct(tally.published, 50) * 1e3, "packets": st.packets, "bytes": st.bytes,
            "worker_cpu_p50_ms": pct(tally.worker_cpu, 50) * 1e3,
            "resyncs": sum(f["resyncs"] for f in finals),
            "rejected": sum(sum(f["rejected"].values()) for f in finals)}


def _start_subscribers(mpctx: Any, over: dict[str, Any], arch: Arch, report_ep: str, stop: Any,
                       n_workers: int) -> list[Any]:
    """``n_workers`` subscriber processes, each holding its snapshot."""
    readies = [mpctx.Event() for _ in range(n_workers)]
    procs = [mpctx.Process(target=_subscriber_proc, args=(over, f"w{i}", arch, report_ep, readies[i], stop))
             for i in range(n_workers)]
    for p in procs:
        p.start()
    for r in readies:
        if not r.wait(120):
            raise RuntimeError("a subscriber did not load its snapshot")
    return procs


def _publish_and_wait(pub: Any, params: dict[str, torch.Tensor], version: int, pull: Any, n_workers: int,
                      tally: _Latency) -> Any:
    """Publish ``version`` and wait (30 s at most) until every subscriber reports applying it."""
    t_step = time.monotonic()
    st = pub.publish(params, version)
    tally.published.append(time.monotonic() - t_step)
    tally.encode_s.append(st.encode_s)
    got: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while len(got) < n_workers and time.monotonic() < deadline:
        if pull.poll(1000):
            m = _report(pull)
            if m.get("v") == version:
                got[m["w"]] = m["t"]
                tally.worker_cpu.append(m["cpu_s"])
    if len(got) == n_workers:
        tally.lat.append(max(got.values()) - t_step)
    return st


def _finals(pull: Any, n_workers: int) -> list[dict[str, Any]]:
    """Every subscriber's closing statistics (10 s at most)."""
    finals: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(finals) < n_workers and time.monotonic() < deadline:
        if pull.poll(500):
            m = _report(pull)
            if m.get("final"):
                finals.append(m["stats"])
    return finals


# ---------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="headline rows only, fewer steps, no latency run")
    ap.add_argument("--steps", type=int, default=None, help="synced steps of the MLP runs (default 100, quick 30)")
    ap.add_argument("--default-steps", type=int, default=None,
                    help="synced steps of the default model (default 200, quick 60)")
    ap.add_argument("--scenarios", default="mlp-10m,default,mlp-10m-lr1e-4",
                    help="comma list of mlp-10m, default, mlp-10m-lr1e-4 (lr 1e-4, extra)")
    ap.add_argument("--tuner-targets", default="0.2,0.5,0.7,0.9",
                    help="relative-residual targets of the extra tuner=error rows")
    ap.add_argument("--warmup", type=int, default=30, help="unsynced MLP steps before the teacher shift")
    ap.add_argument("--latency-steps", type=int, default=40)
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--latency-only", action="store_true", help="only the step -> serving run")
    return ap.parse_args()


def wanted_scenarios(args: argparse.Namespace) -> list[str]:
    wanted = [s for s in args.scenarios.split(",") if s]
    return [s for s in wanted if s != "mlp-10m-lr1e-4"] if args.quick else wanted


def run_named_scenario(name: str, args: argparse.Namespace, count: WireCount) -> dict:
    """Scenario ``name`` of ``--scenarios`` with its codecs, timed."""
    steps = args.steps or (30 if args.quick else 100)
    targets = [float(x) for x in args.tuner_targets.split(",") if x]
    t0 = time.perf_counter()
    if name == "mlp-10m":
        sc = mlp_scenario(None, args.warmup, name)
        n = sum(p.numel() for p in sc.params.values())
        res = run_scenario(sc, codecs_for(4 * n, args.quick, targets), steps, count)
    elif name == "mlp-10m-lr1e-4":
        sc = mlp_scenario(1e-4, args.warmup, "extra: mlp-10m lr 1e-4")
        old = Codec("extra: density 0.02, tuner off", CompressionConfig(density=0.02, tuner="off"))
        res = run_scenario(sc, [*codecs_for(0, True, []), old], steps, count)
    elif name == "default":
        default_steps = args.default_steps or (60 if args.quick else 200)
        sc = default_model_scenario(default_steps)
        n = sum(p.numel() for p in sc.params.values())
        res = run_scenario(sc, codecs_for(4 * n, args.quick, targets), default_steps, count)
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    res["seconds"] = time.perf_counter() - t0
    return res


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # "per core" figures
    OUT.mkdir(parents=True, exist_ok=True)
    shipped = CompressionConfig()
    if args.latency_only:
        print(f"step -> serving latency only, {args.latency_steps} steps, {describe(shipped)} ...", flush=True)
        print_latency(latency_run(MLP_ARCH, args.latency_steps))
        return 0

    count = WireCount(tempfile.mkdtemp(prefix="lm-bench-delta-"))
    print(f"shipped: compression {describe(shipped)}; trainer {TrainerConfig().optimizer} lr {TrainerConfig().lr:g}, "
          f"clip {TrainerConfig().clip_grad_norm:g}", flush=True)
    results = []
    for name in wanted_scenarios(args):
        res = run_named_scenario(name, args, count)
        print_scenario(res)
        results.append(res)

    load = os.getloadavg()
    print(f"\nload average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    result: dict = {"shipped_compression": describe(shipped), "trainer_lr": TrainerConfig().lr,
                    "scenarios": results, "loadavg": load}
    if not (args.no_latency or args.quick):
        print(f"\nstep -> serving latency, 4 subscriber processes, {args.latency_steps} steps, "
              f"{describe(shipped)} ...", flush=True)
        result["latency"] = latency_run(MLP_ARCH, args.latency_steps)
        print_latency(result["latency"])
    print_targets(results, result.get("latency"))
    (OUT / "delta.json").write_text(json.dumps(result, indent=2))
    plot(results)
    return 0


def print_targets(results: list[dict], lat: dict | None) -> None:
    print(f"\nheadline (shipped settings) against the targets: >= {RATIO_TARGET:.0f}x, loss gap <= "
          f"{LOSS_GAP_TARGET_PCT:g} %, encode >= 1 GB/s per core, step -> serving p50 <= 50 ms")
    for res in results:
        if res["scenario"].startswith("extra"):
            continue
        r = next(r for r in res["rows"] if r["headline"])
        ok = (r["x_smaller_than_fp32"] >= RATIO_TARGET, r["loss_gap_pct"] <= LOSS_GAP_TARGET_PCT,
              r["encode_GBps_per_core"] >= 1.0)
        print(f"  {res['scenario']:10} {r['x_smaller_than_fp32']:6.1f}x {'met' if ok[0] else 'MISSED':6}  "
              f"loss gap {r['loss_gap_pct']:6.3f} % {'met' if ok[1] else 'MISSED':6}  "
              f"encode {r['encode_GBps_per_core']:5.2f} GB/s {'met' if ok[2] else 'MISSED'}")
    if lat is not None:
        print(f"  step -> serving p50 {lat['p50_ms']:.1f} ms {'met' if lat['p50_ms'] <= 50 else 'MISSED'}")


def print_latency(lat: dict) -> None:
    print(f"step -> all 4 workers serving: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms "
          f"({lat['measured']}/{lat['steps']} steps; encode p50 {lat['encode_p50_ms']:.1f} ms, publish() returned "
          f"p50 {lat['published_p50_ms']:.1f} ms after the step; CPU per worker per delta p50 "
          f"{lat['worker_cpu_p50_ms']:.1f} ms; {lat['packets']} packets, {lat['bytes']} bytes; "
          f"resyncs {lat['resyncs']}, rejected {lat['rejected']}; load average {os.getloadavg()[0]:.2f})")


def plot(results: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.set_xscale("log")
    ax.set_yscale("log")
    for res, marker in zip(results, "osd^v", strict=False):
        rows = res["rows"]
        ax.scatter([r["x_smaller_than_fp32"] for r in rows], [max(r["loss_gap_pct"], 1e-3) for r in rows],
                   marker=marker, label=res["scenario"])
        for r in rows:
            if r["headline"]:
                ax.annotate("shipped", (r["x_smaller_than_fp32"], max(r["loss_gap_pct"], 1e-3)), fontsize=7)
    ax.axvline(RATIO_TARGET, color="tab:gray", ls=":", label=f"{RATIO_TARGET:.0f}x")
    ax.axhline(LOSS_GAP_TARGET_PCT, color="tab:red", ls=":", label=f"{LOSS_GAP_TARGET_PCT:g} % loss gap")
    ax.set_xlabel("x fewer bytes than dense fp32 (flush included)")
    ax.set_ylabel("served eval loss gap vs trainer (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = OUT / "delta_density.png"
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
