"""Trainer benchmark (``make bench-trainer``).

1. Samples accepted end to end: a live gateway (``learnmesh gateway``) takes batches on
   ``POST /admin/samples``; each is validated, appended to the Redis log and pushed over
   ZeroMQ to a running trainer. Reports accepted samples/s, then waits until the trainer has
   committed every one and checks by id that none was lost or trained twice. Baseline in
   the same run: the same samples appended with one plain XADD per sample (no validation,
   no push), the floor cost of a Redis Stream write from one client.
2. Trainer steps/s with 1 and 2 gloo ranks (DDP, the tiny model at ``--width``).
3. Bytes all-reduced per step with no hook, the fp16 hook (bf16's twin on gloo: torch's bf16
   hook needs NCCL; both send 2 bytes per element) and PowerSGD — counted by
   wrapping ``torch.distributed.all_reduce``, which all of torch's hooks call (the no-hook
   case uses torch's ``allreduce_hook``, the same all-reduce DDP does in C++).

Defaults are modest for a shared 2-core machine; ``--full`` scales up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ADMIN_KEY = "bench-admin-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- 1. end to end


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    import redis
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def write_config(tmp: Path, redis_url: str, gw_port: int, batch: int) -> Path:
    import yaml
    cfg = {
        "redis": {"url": redis_url},
        "gateway": {"port": gw_port, "admin_keys": {"bench": {"key": ADMIN_KEY, "role": "operator"}},
                    "max_body_bytes": 16 * 1024 * 1024},
        "trainer": {"ranks": 1, "model_factory": "services.trainer.tiny:build_tiny_model", "batch_size": batch,
                    "checkpoint_dir": str(tmp / "ckpt"), "checkpoint_every": 1000, "batch_wait_ms": 20,
                    "samples_endpoint": f"tcp://127.0.0.1:{free_port()}", "sample_hwm": 100_000},
        "security": {"delta_key_file": str(tmp / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "worker": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
        "metrics": {"trainer_port": 0},
    }
    path = tmp / "learnmesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def post_batches(port: int, batches: list[list[dict]], concurrency: int) -> tuple[list[str], float]:
    import httpx
    ids: list[str] = []
    queue = list(batches)
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}

    async def client() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            while queue:
                batch = queue.pop()
                r = await c.post("/admin/samples", json={"principal": "bench", "samples": batch}, headers=headers)
                r.raise_for_status()
                ids.extend(r.json()["ids"])

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ids, time.perf_counter() - t0


def bench_end_to_end(n: int, batch: int, concurrency: int) -> dict:
    import redis

    from services.trainer import ledger
    from shared import keys
    tmp = Path(tempfile.mkdtemp(prefix="lm-bench-trainer-"))
    rproc, url = start_redis(str(tmp))
    gw_port = free_port()
    cfg_path = write_config(tmp, url, gw_port, batch=256)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    log = open(tmp / "procs.log", "wb")
    # one torch thread for the trainer: on a 2-core box it otherwise takes both cores from the gateway
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(cfg_path), cmd], cwd=ROOT,
                              env=dict(env, OMP_NUM_THREADS="1") if cmd == "trainer" else env,
                              stdout=log, stderr=subprocess.STDOUT) for cmd in ("trainer", "gateway")]
    r = redis.Redis.from_url(url)
    try:
        import httpx
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{gw_port}/healthz", timeout=1).status_code == 200 \
                        and r.hgetall(keys.TRAINER_OFFSET):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        batches = [[{"input": f"bench {i}", "target": f"value {i % 97}"} for i in range(s, min(n, s + batch))]
                   for s in range(0, n, batch)]
        ids, secs = asyncio.run(post_batches(gw_port, batches, concurrency))
        accepted = len(ids) / secs
        t0 = time.perf_counter()
        while int(r.hget(keys.TRAINER_OFFSET, "seq") or 0) < n and time.perf_counter() - t0 < 300:
            time.sleep(0.1)
        trained_s = time.perf_counter() - t0
        counts = collections.Counter(ledger.trained_ids(r))
        lost = len(set(ids) - set(counts))
        dup = sum(1 for c in counts.values() if c > 1)
        in_log = int(r.get(keys.SAMPLE_SEQ) or 0)
        return {"samples": n, "accepted_per_s": accepted, "lost": lost, "duplicates": dup, "in_log": in_log,
                "ack_ids": len(set(ids)), "trainer_drain_s": trained_s,
                "baseline_xadd_per_s": baseline_xadd(url, min(n, 20_000))}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        r.close()
        rproc.terminate()
        rproc.wait()
        log.close()


def baseline_xadd(url: str, n: int) -> float:
    import redis
    r = redis.Redis.from_url(url)
    t0 = time.perf_counter()
    for i in range(n):
        r.xadd("bench:baseline", {"s": f'{{"input":"bench {i}","target":"value"}}'})
    rate = n / (time.perf_counter() - t0)
    r.delete("bench:baseline")
    r.close()
    return rate


# ---------------------------------------------------------------- 2 + 3. DDP steps and bytes


def _rank(rank: int, world: int, port: int, width: int, steps: int, hook: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LEARNMESH_TINY_WIDTH"] = str(width)
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from services.trainer.loop import LossModule, ddp_options, register_comm_hook
    from services.trainer.tiny import build_tiny_model
    from shared.config import load_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counted = [0]
    real = dist.all_reduce

    def counting(tensor, *a, **k):
        counted[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *a, **k)

    dist.all_reduce = counting  # torch's hooks call dist.all_reduce: count what they send
    model = build_tiny_model()
    cfg = load_config(env={}, overrides={"trainer": {"comm_hook": hook, "powersgd_rank": 1}})
    ddp = DDP(LossModule(model), **ddp_options(cfg))
    if hook == "none":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        register_comm_hook(ddp, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    examples = [model.encode(None, f"prompt {i} " * 4, f"target {torch.randint(0, 99, (1,), generator=gen).item()}")
                for i in range(8)]
    batch = model.collate(examples)
    warm = 3
    for i in range(warm + steps):
        if i == warm:
            dist.barrier()
            counted[0] = 0
            t0 = time.perf_counter()
        loss = ddp(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dt = time.perf_counter() - t0
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        Path(out).write_text(f"{steps / dt} {counted[0] / steps} {n_params}")
    dist.destroy_process_group()


def run_ddp(world: int, width: int, steps: int, hook: str) -> tuple[float, float, int]:
    import torch.multiprocessing as mp
    out = tempfile.mktemp(prefix="lm-bench-ddp-")
    mp.start_processes(_rank, args=(world, free_port(), width, steps, hook, out), nprocs=world, join=True,
                       start_method="spawn")
    sps, nbytes, n_params = Path(out).read_text().split()
    os.unlink(out)
    return float(sps), float(nbytes), int(n_params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=500, help="samples per POST /admin/samples")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="100k samples, 100 steps, width 256")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--only-e2e", action="store_true")
    args = ap.parse_args()
    if args.full:
        args.samples, args.steps, args.width = 100_000, 100, 256

    if not args.skip_e2e:
        e2e = bench_end_to_end(args.samples, args.batch, args.concurrency)
        print(f"end to end (gateway -> Redis log -> ZeroMQ -> trainer), {e2e['samples']} samples "
              f"in batches of {args.batch}, {args.concurrency} clients:")
        print(f"  accepted           {e2e['accepted_per_s']:10.0f} samples/s")
        print(f"  baseline XADD      {e2e['baseline_xadd_per_s']:10.0f} samples/s (one plain XADD per sample)")
        print(f"  ratio              {e2e['accepted_per_s'] / e2e['baseline_xadd_per_s']:10.2f}x")
        print(f"  trainer drained all in {e2e['trainer_drain_s']:.1f}s after the last ack; lost by id: "
              f"{e2e['lost']}, trained twice: {e2e['duplicates']}, samples in the log: {e2e['in_log']}")

    if args.only_e2e:
        return
    print(f"\nDDP steps/s (tiny GRU width {args.width}, 8 examples/rank, {args.steps} steps):")
    base = None
    for world in (1, 2):
        sps, _, n_params = run_ddp(world, args.width, args.steps, "none")
        base = base or sps
        print(f"  {world} gloo rank(s)    {sps:8.2f} steps/s  ({sps / base:.2f}x of 1 rank; {n_params:,} params)")

    print("\nbytes all-reduced per step, 2 gloo ranks:")
    ref = None
    # torch's bf16 hook requires NCCL; on gloo the fp16 hook sends the same 2 bytes per element.
    for hook in ("none", "fp16", "powersgd"):
        sps, nbytes, _ = run_ddp(2, args.width, args.steps, hook)
        ref = ref or nbytes
        print(f"  {hook:9s} {nbytes / 1e6:10.3f} MB/step  ({ref / nbytes:6.1f}x fewer than no hook)  "
              f"{sps:7.2f} steps/s")


if __name__ == "__main__":
    main()
