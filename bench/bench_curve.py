"""What CurveZMQ costs on the gateway -> worker path.

    python bench/bench_curve.py [--requests 3000] [--concurrency 64]

The gateway's real WorkerPool sends INFER requests to a worker stand-in in another process (a
ROUTER that answers each with a RESULT at once, so the link is all that is measured), over TCP
on loopback, once with ``zmq.curve: false`` (the baseline) and once with the shipped CURVE
setting, each with an empty request body and with a 64 KiB one (a request carrying a context
window). Printed: round-trip latency of one request at a time (p50, p99) and requests per
second with ``--concurrency`` in flight, and each CURVE figure over its baseline. Off and on
alternate for ``--rounds`` rounds and each figure is the median of its rounds, so a busy
machine weighs on both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import wire  # noqa: E402
from shared.config import Config, ZmqConfig, load_config  # noqa: E402
from shared.curve import CurveKeys  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.zmq_util import make_socket  # noqa: E402


def _echo_worker(endpoint: str, keys_dir: str, curve: bool, ready: Any, stop: Any) -> None:
    """A worker that answers HELLO with a heartbeat and INFER with a RESULT, and nothing else."""
    ctx = zmq.Context()
    keys = CurveKeys.load(ZmqConfig(curve=curve, keys_dir=keys_dir), "worker")
    sock = make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=keys.server("infer") if keys else None)
    ready.set()
    heartbeat = wire.encode(wire.MsgType.HEARTBEAT, {"worker": "echo", "version": 0, "load": 0, "lag": 0})
    while not stop.is_set():
        if not sock.poll(50):
            continue
        peer, *frames = sock.recv_multipart()
        kind, header, _ = wire.decode(frames)
        if kind == wire.MsgType.HELLO:
            sock.send_multipart([peer, *heartbeat])
        elif kind == wire.MsgType.INFER:
            sock.send_multipart([peer, *wire.encode(wire.MsgType.RESULT, {"id": header["id"], "version": 0})])
    sock.close(0)
    ctx.term()


async def _measure(cfg: Config, payload: bytes, requests: int, concurrency: int) -> dict[str, float]:
    from gateway.workers import WorkerPool

    pool = WorkerPool(cfg)
    await pool.start()
    try:
        await pool.wait_live(1, timeout_s=30)
        frames = [payload] if payload else []
        header = {"op": "generate", "prompt": "x"}
        for _ in range(200):  # warm up
            await pool.request(header, frames)
        lat = []
        for _ in range(requests):
            t0 = time.perf_counter()
            await pool.request(header, frames)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await pool.request(header, frames)

        n = requests * 4
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        rate = n / (time.perf_counter() - t0)
        return {"p50_us": statistics.median(lat) * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6, "req_s": rate}
    finally:
        await pool.close()


def run(curve: bool, payload: bytes, args: argparse.Namespace, keys_dir: str) -> dict[str, float]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    proc = spawn.Process(target=_echo_worker, args=(endpoint, keys_dir, curve, ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the echo worker did not start")
        cfg = load_config(env={}, overrides={"worker": {"endpoints": [endpoint], "heartbeat_interval_ms": 200},
                                             "zmq": {"curve": curve, "keys_dir": keys_dir}})
        return asyncio.run(_measure(cfg, payload, args.requests, args.concurrency))
    finally:
        stop.set()
        proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="sequential requests (4x that run concurrently)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    keys_dir = tempfile.mkdtemp(prefix="lm-bench-curve-")
    print(f"gateway WorkerPool -> echo worker over tcp loopback, {args.requests} sequential requests, "
          f"{args.requests * 4} with {args.concurrency} in flight")
    print(f"{'request body':>12} {'link':>9} {'p50 us':>8} {'p99 us':>8} {'req/s':>8}   vs curve off")
    for label, payload in (("empty", b""), ("64 KiB", bytes(64 * 1024))):
        rounds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for curve in (False, True):
                rounds[curve].append(run(curve, payload, args, keys_dir))
        base, got = (_median(rounds[False]), _median(rounds[True]))
        print(f"{label:>12} {'curve off':>9} {base['p50_us']:8.0f} {base['p99_us']:8.0f} {base['req_s']:8.0f}   "
              f"(baseline)")
        print(f"{label:>12} {'CURVE':>9} {got['p50_us']:8.0f} {got['p99_us']:8.0f} {got['req_s']:8.0f}   "
              f"p50 x{got['p50_us'] / base['p50_us']:.2f}, req/s x{got['req_s'] / base['req_s']:.2f}")


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


if __name__ == "__main__":
    main()
