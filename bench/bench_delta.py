"""Weight-delta sync benchmark (`make bench-delta`).

Trains a plain MLP (>= 10M parameters) with AdamW on a teacher-student regression task and,
after every optimizer step, encodes the change for several codec settings side by side, all
against the same trajectory. Reports, with baselines measured in the same run:

* bytes per sync: dense fp32, fp16 cast (+zstd), torch.topk + error feedback, and the
  learnmesh codec at several densities (+ lossless);
* encode GB/s per core (one torch thread; GB = dense fp32 bytes of the model) vs torch.topk
  and a memory copy; decode+apply GB/s;
* served eval loss (weights a worker holds) vs the trainer's exact weights;
* step -> serving latency with the default codec: publisher + 4 subscriber processes over real
  ZeroMQ (tcp, loopback), time from the end of the optimizer step until the last of the 4 has
  applied the version and reported it (p50 / p99);
* a PNG (bench/out/delta_density.png) of bytes per sync and loss gap against density.

``--quick`` (default) takes 1-2 minutes on 2 cores; ``--full`` runs the issue's sizes;
``--latency-only`` runs just the step -> serving part.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.codec import DeltaDecoder, DeltaEncoder, flatten  # noqa: E402
from shared.config import CompressionConfig, load_config  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def mlp(d_in: int, hidden: int, depth: int, d_out: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(d_in, hidden), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    layers.append(torch.nn.Linear(hidden, d_out))
    return torch.nn.Sequential(*layers)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters()}


class TopkEF:
    """Baseline: exact torch.topk of (delta + residual), int32 indices + fp16 values, zstd-1."""

    def __init__(self, params: dict[str, torch.Tensor], density: float) -> None:
        self.ref = torch.cat([p.reshape(-1) for p in params.values()]).clone()
        self.k = max(1, int(density * self.ref.numel()))
        self.zc = zstandard.ZstdCompressor(level=1)

    def encode(self, params: dict[str, torch.Tensor]) -> tuple[int, float]:
        t0 = time.perf_counter()
        flat = torch.cat([p.reshape(-1) for p in params.values()])
        d = flat - self.ref
        _, idx = torch.topk(d.abs(), self.k, sorted=False)
        idx, _ = torch.sort(idx)
        vals = d[idx].to(torch.float16)
        blob = self.zc.compress(idx.to(torch.int32).numpy().tobytes()) + self.zc.compress(vals.numpy().tobytes())
        self.ref.index_add_(0, idx, vals.float())
        return len(blob), time.perf_counter() - t0


def eval_loss(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None, x: torch.Tensor,
              y: torch.Tensor) -> float:
    if weights is not None:
        saved = {n: p.data.clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.data.copy_(weights[n])
    with torch.no_grad():
        loss = float(torch.nn.functional.mse_loss(model(x), y))
    if weights is not None:
        for n, p in model.named_parameters():
            p.data.copy_(saved[n])
    return loss


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, pos = {}, 0
    for n, p in like.items():
        out[n] = flat[pos:pos + p.numel()].view_as(p)
        pos += p.numel()
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


# ---------------------------------------------------------------------------- latency (processes)


def _subscriber_proc(cfg_over: dict, wid: str, arch: tuple, report_ep: str, ready: mp.Event, stop: mp.Event) -> None:
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


def latency_run(arch: tuple, steps: int, density: float, n_workers: int = 4) -> dict:
    import zmq

    from services.trainer.publisher import DeltaPublisher
    from tests.conftest import free_port
    tmp = tempfile.mkdtemp(prefix="lm-bench-delta-")
    over = {"security": {"delta_key_file": f"{tmp}/delta.key",
                         "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
            "compression": {"density": density, "anchor_every": 0},
            "consistency": {"timeout_s": 30.0}}
    cfg = load_config(env={}, overrides=over)
    model = mlp(*arch, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ctx = zmq.Context()
    pub = DeltaPublisher(cfg, ctx, params_of(model), 0, "bench")
    report_ep = f"tcp://127.0.0.1:{free_port()}"
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(report_ep)
    mpctx = mp.get_context("spawn")
    stop = mpctx.Event()
    readies = [mpctx.Event() for _ in range(n_workers)]
    procs = [mpctx.Process(target=_subscriber_proc, args=(over, f"w{i}", arch, report_ep, readies[i], stop))
             for i in range(n_workers)]
    for p in procs:
        p.start()
    for r in readies:
        if not r.wait(120):
            raise RuntimeError("a subscriber did not load its snapshot")
    g = torch.Generator().manual_seed(1)
    lat, encode_s, published, worker_cpu = [], [], [], []
    for v in range(1, steps + 1):
        x = torch.randn(32, arch[0], generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t_step = time.monotonic()
        st = pub.publish(params_of(model), v)
        published.append(time.monotonic() - t_step)
        encode_s.append(st.encode_s)
        got: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while len(got) < n_workers and time.monotonic() < deadline:
            if pull.poll(1000):
                m = pull.recv_json()
                if m.get("v") == v:
                    got[m["w"]] = m["t"]
                    worker_cpu.append(m["cpu_s"])
        if len(got) == n_workers:
            lat.append(max(got.values()) - t_step)
    stop.set()
    finals = []
    deadline = time.monotonic() + 10
    while len(finals) < n_workers and time.monotonic() < deadline:
        if pull.poll(500):
            m = pull.recv_json()
            if m.get("final"):
                finals.append(m["stats"])
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    pub.close()
    pull.close()
    ctx.term()
    return {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "measured": len(lat), "steps": steps,
            "encode_p50_ms": pct(encode_s, 50) * 1e3, "published_p50_ms": pct(published, 50) * 1e3,
            "packets": st.packets, "bytes": st.bytes, "worker_cpu_p50_ms": pct(worker_cpu, 50) * 1e3,
            "resyncs": sum(f["resyncs"] for f in finals),
            "rejected": sum(sum(f["rejected"].values()) for f in finals)}


# ---------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the issue's sizes: 200 steps, 5 densities, 60 latency steps")
    ap.add_argument("--quick", action="store_true", help="default: fewer steps and densities")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--latency-steps", type=int, default=None)
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--latency-only", action="store_true", help="only the step -> serving run")
    ap.add_argument("--warmup", type=int, default=30, help="unsynced training steps before measuring")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the synced steps")
    args = ap.parse_args()
    full = args.full
    steps = args.steps or (200 if full else 30)
    lat_steps = args.latency_steps or (60 if full else 20)
    densities = [0.001, 0.003, 0.01, 0.03, 0.1] if full else [0.003, 0.01, 0.03]
    arch = (512, 2048, 3, 512)  # 512*2048 + 2*2048^2 + 2048*512 + biases ~= 10.5M parameters
    torch.set_num_threads(1)  # "per core" figures
    OUT.mkdir(parents=True, exist_ok=True)
    if args.latency_only:
        default = CompressionConfig()
        print(f"step -> serving latency only, {lat_steps} steps, codec topk d={default.density:g} "
              f"{default.quantization} ...", flush=True)
        lat = latency_run(arch, lat_steps, default.density)
        print_latency(lat)
        return 0

    teacher = mlp(*arch, seed=123)
    model = mlp(*arch, seed=0)
    params = params_of(model)
    n = sum(p.numel() for p in params.values())
    dense_bytes = 4 * n
    g = torch.Generator().manual_seed(7)
    # online learning: a model that was trained already keeps learning on shifted data
    print(f"model: MLP {arch}, {n / 1e6:.2f}M parameters, {dense_bytes / 1e6:.1f} MB fp32; "
          f"warm-up {args.warmup} steps (not synced), then {steps} synced AdamW steps", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.warmup):
        x = torch.randn(64, arch[0], generator=g)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():  # distribution shift: the teacher moves a little
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std())
    x_eval = torch.randn(512, arch[0], generator=g)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    default = CompressionConfig()
    main_density = default.density
    main_name = f"topk d={default.density:g} {default.quantization}"
    codecs: dict[str, DeltaEncoder] = {}

    def codec(name: str, **kw: object) -> None:
        codecs[name] = DeltaEncoder(CompressionConfig(**{"anchor_every": 0, **kw}), params, 0, "b")

    for d in densities:
        codec(f"topk d={d:g} fp16", density=d, quantization="fp16")
    codec("topk d=0.01 int8", density=0.01, quantization="int8")
    # same byte budget, more elements: fewer bits per value, error feedback absorbs the coarser values
    codec("topk d=0.02 int8", density=0.02, quantization="int8")
    for d in (0.03, 0.05):
        codec(f"topk d={d:g} sign", density=d, quantization="sign")
    if main_name not in codecs:
        codec(main_name, density=default.density, quantization=default.quantization)
    if full:
        codec("topk d=0.01 fp16 anchor/50", density=0.01, quantization="fp16", anchor_every=50)
        codec("lossless (xor)", algorithm="lossless")
    recv = {k: v.clone() for k, v in params.items()}
    dec = DeltaDecoder(recv, 0, "b")
    topk = TopkEF(params, main_density)
    zc = zstandard.ZstdCompressor(level=1)
    prev = flatten(params, codecs[main_name].layout).clone()
    sizes: dict[str, list[int]] = {k: [] for k in codecs}
    times: dict[str, list[float]] = {k: [] for k in codecs}
    fp16_sizes, fp16_zstd_sizes, topk_sizes, topk_times, dec_times = [], [], [], [], []
    t_start = time.perf_counter()
    for v in range(1, steps + 1):
        x = torch.randn(64, arch[0], generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for name, enc in codecs.items():
            e = enc.encode(params, v)
            sizes[name].append(e.nbytes)
            times[name].append(e.stats["encode_s"])
            if name == main_name:
                t0 = time.perf_counter()
                dec.apply(recv, dec.decode(e.header, e.chunks))
                dec_times.append(time.perf_counter() - t0)
        flat = flatten(params, codecs[main_name].layout)
        delta16 = (flat - prev).to(torch.float16)
        fp16_sizes.append(2 * n)
        fp16_zstd_sizes.append(len(zc.compress(delta16.numpy().tobytes())))
        prev = flat
        b, t = topk.encode(params)
        topk_sizes.append(b)
        topk_times.append(t)
        if v % 10 == 0 or v == steps:
            print(f"  step {v}/{steps} loss {loss.item():.5f} ({time.perf_counter() - t_start:.0f}s)", flush=True)

    # memory-copy baseline on this core, same run
    buf = torch.empty_like(prev)
    buf.copy_(prev)
    t0 = time.perf_counter()
    for _ in range(5):
        buf.copy_(prev)
    copy_gbs = 2 * dense_bytes * 5 / (time.perf_counter() - t0) / 1e9

    exact = eval_loss(model, None, x_eval, y_eval)
    rows = []
    for name, enc in codecs.items():
        served = unflatten(enc.ref[:n], params)
        sl = eval_loss(model, served, x_eval, y_eval)
        gap = abs(sl - exact) / exact
        mean_b = float(np.mean(sizes[name]))
        rows.append({"codec": name, "bytes_per_sync": mean_b, "x_smaller_than_fp32": dense_bytes / mean_b,
                     "encode_ms_p50": pct(times[name], 50) * 1e3,
                     "encode_GBps": dense_bytes / pct(times[name], 50) / 1e9,
                     "served_loss": sl, "loss_gap_pct": 100 * gap, "density": enc.density})
    served_topk = unflatten(topk.ref, params)
    topk_loss = eval_loss(model, served_topk, x_eval, y_eval)
    baselines = [
        {"codec": "dense fp32", "bytes_per_sync": dense_bytes, "x_smaller_than_fp32": 1.0, "loss_gap_pct": 0.0},
        {"codec": "fp16 cast", "bytes_per_sync": float(np.mean(fp16_sizes)), "x_smaller_than_fp32": 2.0},
        {"codec": "fp16 cast + zstd-1", "bytes_per_sync": float(np.mean(fp16_zstd_sizes)),
         "x_smaller_than_fp32": dense_bytes / float(np.mean(fp16_zstd_sizes))},
        {"codec": f"torch.topk d={main_density:g} + EF", "bytes_per_sync": float(np.mean(topk_sizes)),
         "x_smaller_than_fp32": dense_bytes / float(np.mean(topk_sizes)),
         "encode_ms_p50": pct(topk_times, 50) * 1e3, "encode_GBps": dense_bytes / pct(topk_times, 50) / 1e9,
         "served_loss": topk_loss, "loss_gap_pct": 100 * abs(topk_loss - exact) / exact},
    ]
    print(f"\ntrainer eval loss (exact weights): {exact:.5f}")
    print(f"{'codec':28} {'bytes/sync':>12} {'x fp32':>8} {'enc ms':>8} {'enc GB/s':>9} {'loss gap %':>10}")
    for r in baselines + rows:
        print(f"{r['codec']:28} {r['bytes_per_sync']:12.0f} {r['x_smaller_than_fp32']:8.1f} "
              f"{r.get('encode_ms_p50', float('nan')):8.1f} {r.get('encode_GBps', float('nan')):9.2f} "
              f"{r.get('loss_gap_pct', float('nan')):10.3f}")
    main_row = next(r for r in rows if r["codec"] == main_name)
    dec_gbs = dense_bytes / pct(dec_times, 50) / 1e9
    print(f"\nencode (one core) {main_name}: {main_row['encode_GBps']:.2f} GB/s = "
          f"{main_row['encode_GBps'] / baselines[3]['encode_GBps']:.1f}x torch.topk+EF; "
          f"memory copy {copy_gbs:.1f} GB/s")
    print(f"decode+apply {main_name}: {pct(dec_times, 50) * 1e3:.1f} ms p50 = {dec_gbs:.2f} GB/s (dense-equivalent)")
    print(f"receiver bit-identical to encoder reference: {torch.equal(flatten(recv, codecs[main_name].layout), codecs[main_name].ref[:n])}")

    load = os.getloadavg()
    print(f"load average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    result = {"params": n, "steps": steps, "exact_loss": exact, "baselines": baselines, "codecs": rows,
              "decode_apply_GBps": dec_gbs, "decode_apply_ms_p50": pct(dec_times, 50) * 1e3,
              "memcopy_GBps": copy_gbs, "loadavg": load}
    if not args.no_latency:
        print(f"\nstep -> serving latency, 4 subscriber processes, {lat_steps} steps (d={main_density:g}) ...",
              flush=True)
        lat = latency_run(arch, lat_steps, main_density)
        result["latency"] = lat
        print_latency(lat)
    (OUT / "delta.json").write_text(json.dumps(result, indent=2))
    plot(rows, dense_bytes)
    return 0


def print_latency(lat: dict) -> None:
    print(f"step -> all 4 workers serving: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms "
          f"({lat['measured']}/{lat['steps']} steps; encode p50 {lat['encode_p50_ms']:.1f} ms, publish() returned "
          f"p50 {lat['published_p50_ms']:.1f} ms after the step; CPU per worker per delta p50 "
          f"{lat['worker_cpu_p50_ms']:.1f} ms; {lat['packets']} packets, {lat['bytes']} bytes; "
          f"resyncs {lat['resyncs']}, rejected {lat['rejected']}; load average {os.getloadavg()[0]:.2f})")


def plot(rows: list[dict], dense_bytes: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    fig, ax1 = plt.subplots(figsize=(6.4, 4))
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax2 = ax1.twinx()
    for quant, marker in (("fp16", "o"), ("int8", "s"), ("sign", "^")):
        pts = sorted((r["density"], r["bytes_per_sync"], r["loss_gap_pct"]) for r in rows
                     if r["codec"].endswith(quant))
        if not pts:
            continue
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker + "-", color="tab:blue",
                 label=f"bytes per sync ({quant})")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker + "--", color="tab:red",
                 label=f"loss gap % ({quant})")
    ax1.axhline(dense_bytes, color="tab:blue", ls=":", label="dense fp32")
    ax1.axhline(dense_bytes / 100, color="tab:gray", ls=":", label="100x smaller")
    ax1.set_xlabel("density (fraction of elements sent)")
    ax1.set_ylabel("bytes per sync", color="tab:blue")
    ax2.set_ylabel("served eval loss gap vs trainer (%)", color="tab:red")
    fig.legend(loc="upper center", ncol=3, fontsize=7)
    fig.tight_layout()
    path = OUT / "delta_density.png"
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
