"""Inference throughput and latency: gateway -> ZeroMQ -> batching worker, against the same
model called one request at a time in-process (the baseline, measured in the same run).

Starts a private Redis (embedded default rules), one ``learnmesh worker`` and one
``learnmesh gateway`` on free ports, then for each concurrency level runs that many MCP
clients (2026-07-28 stateless ``tools/call generate``), each on its own keep-alive connection
(a minimal raw HTTP/1.1 client, so the client's own CPU is not billed to the gateway), sending
requests back to back.
Prints generated tokens/s, p50/p99 latency and the ratio to the baseline's tokens/s, and the
per-request overhead of gateway+ZeroMQ (and of ZeroMQ alone, via the WorkerPool) over the
in-process call for a 1-token generation, next to the round trip of a trivial request
(``server/discover``) on the same connection and what a pooled httpx client adds on top.

    .venv/bin/python bench/bench_inference.py [--model default|tiny] [--concurrency 1 4 16 64]
        [--max-tokens 32] [--requests-per-client 2] [--overhead-requests 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.workers import WorkerPool  # noqa: E402
from shared.config import load_config  # noqa: E402
from shared.model import build_model  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.redis_embed import start_redis  # noqa: E402

MODERN = "2026-07-28"
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 2, "max_seq": 256, "pretrain_steps": 20}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def body(prompt: str, max_tokens: int, seed: int) -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "generate", "arguments": {"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 1.0, "seed": seed},
                       "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}


HEADERS = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
           "mcp-method": "tools/call", "mcp-name": "generate"}


class RawClient:
    """A minimal keep-alive HTTP/1.1 client over one asyncio connection (JSON responses only).

    httpx costs about 1-3 ms of client CPU per request on this machine, which would be billed
    to the gateway; this client's own cost is a few tens of microseconds. The benchmark also
    reports the round trip of a trivial request (``server/discover``) on the same connection, so the
    HTTP+MCP floor is visible next to the inference figures.
    """

    def __init__(self, host: str, port: int, path: str = "/mcp") -> None:
        self.host, self.port, self.path = host, port, path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()

    async def post(self, payload: dict, headers: dict[str, str]) -> dict:
        assert self.reader is not None and self.writer is not None
        data = orjson.dumps(payload)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                          f"content-type: application/json\r\ncontent-length: {len(data)}\r\n{head}\r\n".encode()
                          + data)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        length = None
        for line in raw.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise RuntimeError(f"expected a JSON response with content-length, got: {raw[:200]!r}")
        return orjson.loads(await self.reader.readexactly(length))


DISCOVER = {"jsonrpc": "2.0", "id": 1, "method": "server/discover",
            "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}
DISCOVER_HEADERS = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
                    "mcp-method": "server/discover"}


async def one(client: RawClient, max_tokens: int, seed: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    msg = await client.post(body(f"The gateway {seed}", max_tokens, seed), HEADERS)
    dt = time.perf_counter() - t0
    if "result" not in msg:
        raise RuntimeError(f"generate failed: {msg}")
    return dt, int(msg["result"]["structuredContent"]["tokens"])


async def ping(client: RawClient) -> float:
    t0 = time.perf_counter()
    msg = await client.post(DISCOVER, DISCOVER_HEADERS)
    dt = time.perf_counter() - t0
    if "result" not in msg:
        raise RuntimeError(f"server/discover failed: {msg}")
    return dt


async def level(port: int, conc: int, per_client: int, max_tokens: int) -> dict:
    """``conc`` sessions, each on its own keep-alive connection, sending requests back to back."""
    lat: list[float] = []
    tokens = 0

    async def run(c: int) -> None:
        nonlocal tokens
        async with RawClient("127.0.0.1", port) as client:
            for i in range(per_client):
                dt, n = await one(client, max_tokens, c * 1000 + i)
                lat.append(dt)
                tokens += n
    t0 = time.perf_counter()
    await asyncio.gather(*(run(c) for c in range(conc)))
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000, "n": len(lat)}


def baseline(model, n: int, max_tokens: int) -> tuple[float, float]:
    """In-process, one request at a time: (tokens/s, p50 latency s of a 1-token generation)."""
    tokens, t0 = 0, time.perf_counter()
    for i in range(n):
        ex = model.encode(None, f"The gateway {i}", None, reserve_tokens=max_tokens)
        tokens += sum(1 for s in model.generate([ex], max_tokens=max_tokens, temperature=1.0, seed=i) if s[0])
    tok_s = tokens / (time.perf_counter() - t0)
    lat = []
    for i in range(20):
        t = time.perf_counter()
        ex = model.encode(None, f"The gateway {i}", None, reserve_tokens=1)
        list(model.generate([ex], max_tokens=1, temperature=1.0, seed=i))
        lat.append(time.perf_counter() - t)
    return tok_s, statistics.median(lat)


async def overheads(port: int, cfg, model, n: int) -> dict[str, float]:
    """p50s for a 1-token generation: in-process, via the WorkerPool (ZeroMQ), via the gateway
    (HTTP+MCP+ZeroMQ), and the HTTP+MCP round trip of a trivial request (``server/discover``) on the same
    keep-alive connection; also the same generation through a pooled httpx client, to show what
    a heavyweight client adds. Interleaved so that load drift on a shared machine hits all alike."""
    pool = WorkerPool(cfg)
    await pool.start()
    res: dict[str, list[float]] = {"local": [], "zmq": [], "gateway": [], "ping": [], "httpx": []}
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        await pool.wait_live(1, 60)
        async with RawClient("127.0.0.1", port) as client, httpx.AsyncClient(timeout=60) as hx:
            for i in range(n):
                t = time.perf_counter()
                ex = model.encode(None, f"The gateway {i}", None, reserve_tokens=1)
                list(model.generate([ex], max_tokens=1, temperature=1.0, seed=i))
                res["local"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await pool.request({"op": "generate", "prompt": f"The gateway {i}", "max_tokens": 1,
                                    "temperature": 1.0, "seed": i, "entries": []})
                res["zmq"].append(time.perf_counter() - t)
                res["gateway"].append((await one(client, 1, i))[0])
                res["ping"].append(await ping(client))
                t = time.perf_counter()
                r = await hx.post(url, json=body(f"The gateway {i}", 1, i), headers=HEADERS)
                res["httpx"].append(time.perf_counter() - t)
                if "result" not in r.json():
                    raise RuntimeError(f"generate failed: {r.text}")
    finally:
        await pool.close()
    return {k: statistics.median(v) for k, v in res.items()}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["default", "tiny"], default="default")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--baseline-requests", type=int, default=8)
    ap.add_argument("--overhead-requests", type=int, default=30)
    return ap.parse_args()


def config_data(tmp: Path, model: str) -> dict:
    """The run's configuration, every endpoint on a free port (Redis still to be added)."""
    return {"model": {**(TINY if model == "tiny" else {}), "cache_dir": str(ROOT / "var" / "model")},
            "worker": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"], "max_batch_size": 64, "max_wait_ms": 2.0},
            "gateway": {"port": free_port()},
            # one principal plays every session: its cap on calls in flight (16) would refuse the
            # levels above it, which measures the limit, not the pipeline
            "limits": {"default": {"inference_in_flight": 0}},
            "security": {"delta_key_file": str(tmp / "delta.key"), "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
            "zmq": {"keys_dir": str(tmp / "zmq")}}


def load_model(cfg, name: str):
    """The baseline's model, with the worker's torch thread count."""
    if cfg.worker.torch_threads:
        import torch

        torch.set_num_threads(cfg.worker.torch_threads)
    print(f"model: {name} (pre-training once if not cached in var/model) ...", flush=True)
    t0 = time.perf_counter()
    model = build_model(cfg.model)
    print(f"model ready in {time.perf_counter() - t0:.1f} s")
    print(f"model {model.model_id}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    return model


def start_services(config_path: Path) -> list[subprocess.Popen]:
    """One worker and one gateway, configured by ``config_path`` alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    return [subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(config_path), cmd, *extra],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for cmd, extra in (("worker", ["--index", "0"]), ("gateway", []))]


def stop_services(procs: list[subprocess.Popen], redis_proc: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    redis_proc.terminate()
    redis_proc.wait(10)


def wait_generating(url: str, timeout_s: float = 120) -> None:
    """Until the gateway answers a generation, which needs the worker up too."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.post(url, json=body("warm up", 1, 0), headers=HEADERS, timeout=10)
            if "result" in r.json():
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit("gateway/worker did not come up")
        time.sleep(0.2)


def report_levels(port: int, model, args: argparse.Namespace) -> None:
    """The baseline, then every concurrency level against it."""
    base_tok_s, base_1tok_s = baseline(model, args.baseline_requests, args.max_tokens)
    print(f"\nbaseline (in-process, one at a time): {base_tok_s:8.1f} tokens/s; 1-token call p50 "
          f"{base_1tok_s * 1000:.2f} ms")
    print(f"\n{'sessions':>8} {'tokens/s':>10} {'x baseline':>10} {'p50 ms':>9} {'p99 ms':>9} {'requests':>8}")
    for c in args.concurrency:
        res = asyncio.run(level(port, c, args.requests_per_client, args.max_tokens))
        print(f"{c:>8} {res['tok_s']:>10.1f} {res['tok_s'] / base_tok_s:>10.2f} {res['p50_ms']:>9.1f} "
              f"{res['p99_ms']:>9.1f} {res['n']:>8}", flush=True)


def report_overheads(port: int, cfg, model, n: int) -> None:
    ms = {k: v * 1000 for k, v in asyncio.run(overheads(port, cfg, model, n)).items()}
    print(f"\n1-token generation p50 (interleaved, {n} each): in-process {ms['local']:.2f} ms, "
          f"via ZeroMQ {ms['zmq']:.2f} ms, via gateway {ms['gateway']:.2f} ms "
          f"(keep-alive raw HTTP/1.1 client)")
    print(f"per-request overhead over in-process: ZeroMQ+worker loop {ms['zmq'] - ms['local']:+.2f} ms, "
          f"gateway(HTTP+MCP)+ZeroMQ {ms['gateway'] - ms['local']:+.2f} ms "
          f"(of which gateway over ZeroMQ {ms['gateway'] - ms['zmq']:+.2f} ms)")
    print(f"for reference: HTTP+MCP round trip of a trivial request (server/discover) {ms['ping']:.2f} ms; the same "
          f"generation through a pooled httpx client {ms['httpx']:.2f} ms "
          f"(client-side cost {ms['httpx'] - ms['gateway']:+.2f} ms, not the gateway's)")


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lm-bench-inf-"))
    data = config_data(tmp, args.model)
    port = data["gateway"]["port"]
    redis_url, redis_proc = start_redis(tmp / "redis")
    data["redis"] = {"url": redis_url}
    path = tmp / "learnmesh.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path, env={})
    model = load_model(cfg, args.model)
    procs = start_services(path)
    try:
        wait_generating(f"http://127.0.0.1:{port}/mcp")
        report_levels(port, model, args)
        report_overheads(port, cfg, model, args.overhead_requests)
    finally:
        stop_services(procs, redis_proc)


if __name__ == "__main__":
    main()
