"""What the per-principal request rate limit (gateway/limits.py) adds to every MCP request.

Two learnmesh gateways run side by side against one private redis-server, the same as
bench/bench_gateway.py runs them (one process each, uvicorn + uvloop + httptools, the
conformance fixtures' trivial tool), with API keys for ``--principals`` principals: the
baseline with the request limit off (``limits.default.requests_per_s: 0``: no Redis call),
the other with the shipped limits. ``wrk`` drives 2026-07-28 ``tools/call`` on each,
interleaved, every request from the next principal in turn, so each principal stays under
its shipped rate (a refused request counts as bad) while all of them together load the
gateway. Reported: good answers per second, p50, and CPU time per request of the gateway
process and of redis-server (from /proc), whose differences are the check's cost. A last
part times ``Limits.admit_request`` alone in this process, against a ``PING`` through the
same auto-pipeline (the cheapest round trip there is).

    .venv/bin/python bench/bench_limits.py [--duration-s 5] [--connections 16 64] [--repeat 2] [--principals 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench_gateway import (
    ACCEPT,
    TOOL_TEXT,
    _ms,
    check_answers,
    cpu_s,
    free_port,
    loadavg,
    modern_request,
    start_private_redis,
    stop,
    wait_up,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OFF, ON = "limit off", "limit on"

# One principal after the other, request by request (wrk's Lua API); only HTTP 200 answers
# that carry the tool's text count.
LUA = """
wrk.method = "POST"
%(headers)s
local tokens, prefix, suffix, expect = %(tokens)s, %(prefix)s, %(suffix)s, %(expect)s
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
n, bad = 0, 0
function request()
  n = n + 1
  wrk.headers["Authorization"] = "Bearer " .. tokens[(n %% #tokens) + 1]
  return wrk.format(nil, nil, nil, prefix .. tid .. "-" .. n .. suffix)
end
function response(status, headers, body)
  if status ~= 200 or not string.find(body, expect, 1, true) then bad = bad + 1 end
end
function done(summary, latency, requests)
  local total = 0
  for _, t in ipairs(threads) do total = total + t:get("bad") end
  io.write(string.format("BAD %%d\\n", total))
end
"""


def start_redis() -> tuple[str, subprocess.Popen, str]:
    """A private redis-server (its CPU time is part of the cost)."""
    return start_private_redis("lm-bench-limits-")


def start_gateway(port: int, redis_url: str, api_keys: dict[str, str], limited: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    env.update({"REDIS_URL": redis_url, "LEARNMESH_API_KEYS": ",".join(f"{p}:{k}" for p, k in api_keys.items())})
    if not limited:
        env["LEARNMESH_LIMITS__DEFAULT__REQUESTS_PER_S"] = "0"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
                             "--fixtures", "conformance"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(f"http://127.0.0.1:{port}/healthz", proc, "learnmesh gateway")
    return proc


def run_wrk(url: str, tokens: list[str], connections: int, duration_s: int) -> tuple[float, float, int]:
    """(good req/s, p50 ms, bad answers) of ``duration_s`` of 2026-07-28 tools/call."""
    body, headers = modern_request()
    all_headers = {"Content-Type": "application/json", "Accept": ACCEPT, **headers}
    prefix, suffix = json.dumps({**body, "id": "@ID@"}, separators=(",", ":")).split('"@ID@"')
    lua = LUA % {"prefix": json.dumps(prefix + '"'), "suffix": json.dumps('"' + suffix),
                 "expect": json.dumps(TOOL_TEXT), "tokens": "{" + ",".join(json.dumps(t) for t in tokens) + "}",
                 "headers": "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in all_headers.items())}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
        script = f.name
    try:
        out = subprocess.run(["wrk", "-t", "1", "-c", str(connections), "-d", f"{duration_s}s", "--latency", "-s",
                              script, url], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+([\d.]+\w+)", out).group(1))  # type: ignore[union-attr]
    bad = int(re.search(r"BAD (\d+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return (rps * max(total - bad, 0) / total if total else 0.0), p50, bad


async def admit_alone(redis_url: str, calls: int, callers: int, principals: int) -> tuple[float, float]:
    """(µs of wall time per admit_request, per PING) with ``callers`` concurrent callers; shipped
    limits, ``principals`` principals in turn (their bursts hold every call: none is refused)."""
    import redis.asyncio as aioredis

    from gateway.limits import Limits
    from shared.config import load_config
    from shared.redis_batch import AutoPipeline

    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    limits, ping = Limits(client, load_config(env={})), AutoPipeline(client)
    names = [f"micro{i}" for i in range(principals)]

    async def timed(op: Callable[[int], Awaitable[object]]) -> float:
        async def caller(first: int, n: int) -> None:
            for i in range(first, first + n):
                await op(i)
        share = calls // callers
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(c * share, share) for c in range(callers)))
        return (time.perf_counter() - t0) / (share * callers) * 1e6

    try:
        return (await timed(lambda i: limits.admit_request(names[i % principals])),
                await timed(lambda i: ping.execute("PING")))
    finally:
        await client.aclose()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=int, default=5)
    ap.add_argument("--connections", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeat", type=int, default=2, help="runs per point, gateways interleaved; the best is kept")
    ap.add_argument("--principals", type=int, default=32, help="principals taking turns, each under its limit")
    return ap.parse_args()


Point = tuple[float, float, float, float]  # good req/s, p50 ms, gateway us/req, redis us/req


def start_gateways(procs: dict[str, subprocess.Popen], redis_url: str, api_keys: dict[str, str]) -> dict[str, str]:
    """Start the gateway without and with the limit, each recorded in ``procs`` as soon as it runs
    (the caller stops them); their /mcp URLs."""
    ports = {OFF: free_port(), ON: free_port()}
    for name, port in ports.items():
        procs[name] = start_gateway(port, redis_url, api_keys, name == ON)
    return {name: f"http://127.0.0.1:{port}/mcp" for name, port in ports.items()}


def check_and_warm_up(urls: dict[str, str], tokens: list[str]) -> None:
    body, headers = modern_request()
    for name, url in urls.items():
        check_answers(url, body, {**headers, "Authorization": f"Bearer {tokens[0]}"}, name)
        run_wrk(url, tokens, 16, 1)  # warm-up


def run_points(urls: dict[str, str], pids: dict[str, int], redis_pid: int, tokens: list[str],
               args: argparse.Namespace) -> dict[tuple[str, int], Point]:
    """Every point ``--repeat`` times, gateways interleaved; the best run of each."""
    best: dict[tuple[str, int], Point] = {}
    for conns in args.connections:
        for rep in range(args.repeat):
            for name, url in urls.items():
                point = measure_point(name, url, (pids[name], redis_pid), tokens, conns, rep, args.duration_s)
                if (name, conns) not in best or point[0] > best[(name, conns)][0]:
                    best[(name, conns)] = point
    return best


def measure_point(name: str, url: str, pids: tuple[int, int], tokens: list[str], conns: int, rep: int,
                  duration_s: int) -> Point:
    """One wrk run, printed; ``pids``: the gateway's and redis-server's, whose CPU time it bills."""
    gw_pid, redis_pid = pids
    gw0, rd0 = cpu_s(gw_pid), cpu_s(redis_pid)
    rps, p50, bad = run_wrk(url, tokens, conns, duration_s)
    n = max(rps * duration_s, 1)
    gw_us = (cpu_s(gw_pid) - gw0) / n * 1e6
    rd_us = (cpu_s(redis_pid) - rd0) / n * 1e6
    print(f"  {name:9} c={conns:<3} run {rep + 1}: {rps:7.0f} req/s  p50 {p50:6.2f} ms"
          f"  gateway {gw_us:5.1f} us/req  redis {rd_us:5.2f} us/req  bad {bad}"
          f"  load1 {loadavg():.1f}", flush=True)
    return rps, p50, gw_us, rd_us


def print_table(best: dict[tuple[str, int], Point], args: argparse.Namespace, load_start: float) -> None:
    print(f"\n2026-07-28 tools/call, wrk -t1, {args.principals} principals in turn, {args.duration_s} s per run, best "
          f"of {args.repeat}; baseline = the same gateway with the request limit off, in the same run; "
          f"{os.cpu_count()} CPUs, load average {load_start:.1f} at start, {loadavg():.1f} at end\n")
    print(f"{'conns':>5} | {'off req/s':>9} {'on req/s':>9} {'ratio':>6} | {'p50 off':>7} {'p50 on':>7} | "
          f"{'gateway us/req off':>18} {'on':>5} | {'redis us/req off':>16} {'on':>5}")
    for conns in args.connections:
        off, on = best[(OFF, conns)], best[(ON, conns)]
        print(f"{conns:>5} | {off[0]:9.0f} {on[0]:9.0f} {on[0] / off[0]:5.2f}x | {off[1]:7.2f} {on[1]:7.2f} | "
              f"{off[2]:18.1f} {on[2]:5.1f} | {off[3]:16.2f} {on[3]:5.2f}")


def print_admit_alone(alone: dict[int, tuple[float, float]]) -> None:
    print("\nLimits.admit_request alone (this process, shipped limits, the same principals in turn; wall time "
          "per call; baseline = PING through the same auto-pipeline):")
    for callers, (admit_us, ping_us) in alone.items():
        print(f"  {callers:>2} callers: admit_request {admit_us:6.1f} us, PING {ping_us:6.1f} us "
              f"({admit_us / ping_us:.2f}x)")


def main() -> int:
    args = parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    api_keys = {f"p{i}": f"bench-key-{i:04d}-{os.urandom(4).hex()}" for i in range(args.principals)}
    tokens = list(api_keys.values())
    redis_url, redis_proc, redis_dir = start_redis()
    procs: dict[str, subprocess.Popen] = {}
    load_start = loadavg()
    try:
        urls = start_gateways(procs, redis_url, api_keys)
        check_and_warm_up(urls, tokens)
        best = run_points(urls, {name: p.pid for name, p in procs.items()}, redis_proc.pid, tokens, args)
        alone = {c: asyncio.run(admit_alone(redis_url, 20_000, c, args.principals)) for c in (1, 64)}
    finally:
        for proc in procs.values():
            stop(proc)
        stop(redis_proc)
        shutil.rmtree(redis_dir, ignore_errors=True)
    print_table(best, args, load_start)
    print_admit_alone(alone)
    return 0


if __name__ == "__main__":
    sys.exit(main())
