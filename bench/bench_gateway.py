"""tools/call throughput and latency: learnmesh gateway vs the official SDK's MCPServer.

Both servers run side by side on this machine, each as ONE process under uvicorn with
uvloop + httptools and no access log, with the same trivial tool (``test_simple_text``:
a constant text block). ``wrk`` (Debian package, one thread by default) drives each with
the same load: POST /mcp ``tools/call``, per revision:

* 2025-11-25 (legacy): one session is initialized (and ``notifications/initialized``
  sent) per server; every request carries ``Mcp-Session-Id`` and ``MCP-Protocol-Version``.
* 2026-07-28 (stateless): every request carries ``_meta`` with the protocol version and
  client capabilities plus the ``MCP-Protocol-Version`` / ``Mcp-Method`` / ``Mcp-Name`` headers.

Every request has its own JSON-RPC id (ids must be unique within a session; the SDK
answers a reused in-flight id with HTTP 500). Only answers that are HTTP 200 *and* carry
the tool's text count as throughput. Each point runs ``--repeat`` times with the two
servers interleaved; the best run of each server is reported, with the 1-minute load
average and the server's CPU time per request (user + system from /proc), which is far
less sensitive to other load on a shared machine than req/s. ``--pin`` puts the servers
on CPU 0 and wrk on the others (off by default: on a busy 2-core machine a pinned server
cannot escape other work on its core).

    .venv/bin/python bench/bench_gateway.py [--duration-s 5] [--connections 16 64] [--repeat 2] [--pin] [--cluster]

``--cluster`` also runs a third server: the same gateway on a 3-master Redis Cluster of this
benchmark's own (``shared.redis_local_cluster``, no replicas), interleaved with the other two,
and prints it next to the gateway on one redis-server (the table's headline rows stay the
shipped single-server default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shared.redis_local_cluster import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOL = "test_simple_text"
TOOL_TEXT = "This is a simple text response for testing."
LEGACY, MODERN = "2025-11-25", "2026-07-28"
CLUSTER = "cluster"  # the learnmesh gateway on a Redis Cluster (--cluster)
ACCEPT = "application/json, text/event-stream"

# Every request carries its own JSON-RPC id ("<thread>-<n>"): ids must be unique within a
# legacy session, and the SDK keys in-flight requests by id, so a fixed id would make
# concurrent requests of one session collide. A response counts as good only when it is
# HTTP 200 and carries the tool's text (a fast JSON-RPC error must not look like throughput).
LUA = """
wrk.method = "POST"
%(headers)s
local prefix, suffix, expect = %(prefix)s, %(suffix)s, %(expect)s
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
n, bad = 0, 0
function request()
  n = n + 1
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

@dataclass
class Point:
    server: str
    revision: str
    connections: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: float  # server CPU time (user + system) per good answer: robust to other load on the machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", "Accept": ACCEPT, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def wait_up(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited during start (rc {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # answering, even if not 200 on this path
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not come up within {timeout_s}s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- servers
def serve_sdk(port: int) -> None:
    """Child process: the official SDK's MCPServer with the same trivial tool."""
    import uvicorn
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("sdk-baseline")

    @server.tool(name=TOOL, description="Tests simple text content response")
    def simple_text() -> str:
        return TOOL_TEXT

    app = server.streamable_http_app(json_response=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start_redis() -> tuple[str, subprocess.Popen | None, str | None]:
    url = os.environ.get("REDIS_URL")
    if url:
        return url, None, None
    import redis
    try:
        redis.Redis(socket_timeout=1).ping()
        return "redis://127.0.0.1:6379/0", None, None
    except redis.RedisError:
        pass
    if shutil.which("redis-server") is None:
        raise SystemExit("no Redis: set REDIS_URL or install redis-server")
    return start_private_redis("lm-bench-redis-")


def start_private_redis(prefix: str) -> tuple[str, subprocess.Popen, str]:
    """A private redis-server under a fresh temp dir named ``prefix...``: (url, process, dir)."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found")
    port, workdir = free_port(), tempfile.mkdtemp(prefix=prefix)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            return url, proc, workdir
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise SystemExit("private redis-server did not start") from None
            time.sleep(0.05)


def gateway_env(redis_url: str) -> dict[str, str]:
    """The environment of a benchmarked gateway: this Redis, no inherited LEARNMESH_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    env["REDIS_URL"] = redis_url
    # wrk is one principal at full speed, which the shipped per-principal request rate would
    # mostly refuse; above anything wrk reaches, every request still goes through the check
    # (bench/bench_limits.py measures it with many principals at the shipped rate).
    env["LEARNMESH_LIMITS__DEFAULT__REQUESTS_PER_S"] = "1000000000.0"
    env["LEARNMESH_LIMITS__DEFAULT__REQUESTS_BURST"] = "1000000000"
    return env


def start_ours(port: int, redis_url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
                             "--fixtures", "conformance"], cwd=ROOT, env=gateway_env(redis_url),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(f"http://127.0.0.1:{port}/healthz", proc, "learnmesh gateway")
    return proc


def start_sdk(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-sdk", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(f"http://127.0.0.1:{port}/mcp", proc, "SDK MCPServer")
    return proc


# ----------------------------------------------------------------------------- requests
def legacy_request(url: str) -> tuple[dict, dict[str, str]]:
    """Initialize a session; return the tools/call body and headers that use it."""
    status, headers, body = http(url, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}})
    sid = headers.get("mcp-session-id")
    if status != 200 or not sid:
        raise SystemExit(f"initialize at {url} failed: HTTP {status} {body[:200]!r}")
    common = {"Mcp-Session-Id": sid, "MCP-Protocol-Version": LEGACY}
    http(url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, common)
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": TOOL, "arguments": {}}}
    return call, common


def modern_request() -> tuple[dict, dict[str, str]]:
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"}}
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": TOOL, "arguments": {}, "_meta": meta}}
    return call, {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": TOOL}


def check_answers(url: str, body: dict, headers: dict[str, str], what: str) -> None:
    status, _, raw = http(url, body, headers)
    if status != 200 or TOOL_TEXT.encode() not in raw:
        raise SystemExit(f"{what}: tools/call did not answer as expected: HTTP {status} {raw[:300]!r}")


def run_wrk(url: str, body: dict, headers: dict[str, str], connections: int, duration_s: int,
            threads: int, cpus: set[int] | None, timeout_s: int | None = None) -> tuple[float, float, float, int]:
    """Drive ``url`` for ``duration_s``; (good req/s, p50 ms, p99 ms, bad answers). ``timeout_s``:
    wrk's per-request timeout (its default, 2 s, counts a slower answer as a socket error)."""
    all_headers = {"Content-Type": "application/json", "Accept": ACCEPT, **headers}
    prefix, suffix = json.dumps({**body, "id": "@ID@"}, separators=(",", ":")).split('"@ID@"')
    lua = LUA % {"prefix": json.dumps(prefix + '"'), "suffix": json.dumps('"' + suffix),
                 "expect": json.dumps(TOOL_TEXT),
                 "headers": "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in all_headers.items())}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
        script = f.name
    cmd = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s}s", "--latency", "-s", script, url]
    if timeout_s:
        cmd[-1:-1] = ["--timeout", f"{timeout_s}s"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None).stdout
    finally:
        os.unlink(script)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"\s50%\s+([\d.]+\w+)", out).group(1))
    p99 = _ms(re.search(r"\s99%\s+([\d.]+\w+)", out).group(1))
    bad = int(re.search(r"BAD (\d+)", out).group(1))
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = bad + (sum(int(g) for g in errs.groups()) if errs else 0)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    # Only successful answers count as throughput: a server that fails fast must not look fast.
    good_rps = rps * max(total - errors, 0) / total if total else 0.0
    return good_rps, p50, p99, errors


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value)
    if m is None:
        raise ValueError(f"unparsed wrk latency {value!r}")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[m.group(2)]
    return float(m.group(1)) * scale


def split_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(server CPUs, load-generator CPUs): each server is one single-threaded process, so it
    gets CPU 0 to itself as far as this benchmark goes and wrk gets the others."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=int, default=5)
    ap.add_argument("--connections", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs per point (servers interleaved); the best run of each server is reported")
    ap.add_argument("--pin", action="store_true",
                    help="pin the servers to CPU 0 and wrk to the other CPUs (on a busy 2-core machine this "
                         "hurts more than it helps: the pinned server cannot escape other load on CPU 0)")
    ap.add_argument("--cluster", action="store_true",
                    help="also run the gateway on a 3-master Redis Cluster and print it next to the single server")
    ap.add_argument("--serve-sdk", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


@dataclass
class Server:
    name: str
    url: str
    pid: int


Best = dict[tuple[str, str, int], tuple[Point, float]]  # (server, revision, connections) -> (point, load1)


def start_servers(procs: dict[str, subprocess.Popen], redis_url: str, cpus: set[int] | None,
                  cluster_url: str | None = None) -> list[Server]:
    """Start the servers, each recorded in ``procs`` as soon as it runs (the caller stops them)."""
    ports = {"learnmesh": free_port(), "sdk": free_port()}
    procs["learnmesh"] = start_ours(ports["learnmesh"], redis_url)
    procs["sdk"] = start_sdk(ports["sdk"])
    if cluster_url:
        ports[CLUSTER] = free_port()
        procs[CLUSTER] = start_ours(ports[CLUSTER], cluster_url)
    if cpus:
        for proc in procs.values():
            os.sched_setaffinity(proc.pid, cpus)
    return [Server(name, f"http://127.0.0.1:{ports[name]}/mcp", procs[name].pid) for name in ports]


def prepare_requests(servers: list[Server], revision: str, threads: int,
                     wrk_cpus: set[int] | None) -> dict[str, tuple[dict, dict[str, str]]]:
    """Per server, the checked and warmed-up tools/call request of ``revision``."""
    requests = {}
    for s in servers:
        body, headers = legacy_request(s.url) if revision == LEGACY else modern_request()
        check_answers(s.url, body, headers, f"{s.name} {revision}")
        run_wrk(s.url, body, headers, 16, 1, threads, wrk_cpus)  # warm-up, not reported
        requests[s.name] = (body, headers)
    return requests


def run_points(servers: list[Server], args: argparse.Namespace, wrk_cpus: set[int] | None) -> Best:
    best: Best = {}
    for revision in (LEGACY, MODERN):
        requests = prepare_requests(servers, revision, args.threads, wrk_cpus)
        for conns in args.connections:
            for rep in range(args.repeat):
                for s in servers:
                    point, la = measure_point(s, revision, conns, rep, requests[s.name], args, wrk_cpus)
                    key = (s.name, revision, conns)
                    if key not in best or point.rps > best[key][0].rps:
                        best[key] = (point, la)
    return best


def measure_point(s: Server, revision: str, conns: int, rep: int, request: tuple[dict, dict[str, str]],
                  args: argparse.Namespace, wrk_cpus: set[int] | None) -> tuple[Point, float]:
    """One wrk run against one server, printed; (the point, the load average before it)."""
    body, headers = request
    la = loadavg()
    cpu0 = cpu_s(s.pid)
    rps, p50, p99, errors = run_wrk(s.url, body, headers, conns, args.duration_s, args.threads, wrk_cpus)
    cpu_us = (cpu_s(s.pid) - cpu0) / max(rps * args.duration_s, 1) * 1e6
    print(f"  {s.name:9} {revision} c={conns:<3} run {rep + 1}: {rps:7.0f} req/s  p50 {p50:7.2f} ms"
          f"  p99 {p99:7.2f} ms  bad {errors}  cpu {cpu_us:6.0f} us/req  load1 {la:.1f}", flush=True)
    return Point(s.name, revision, conns, rps, p50, p99, errors, cpu_us), la


def print_table(best: Best, args: argparse.Namespace, server_cpus: set[int] | None, wrk_cpus: set[int] | None,
                load_start: float) -> None:
    pin = (f"servers pinned to CPU {sorted(server_cpus)}, wrk to CPU {sorted(wrk_cpus)}" if server_cpus
           else "no CPU pinning")
    print(f"\ntools/call, {args.duration_s} s per run, best of {args.repeat} runs per server, wrk -t{args.threads}, "
          f"{pin}; each server one process (uvicorn, uvloop + httptools); baseline = official SDK MCPServer "
          f"(json_response) in the same run; {os.cpu_count()} CPUs, load average {load_start:.1f} at start, "
          f"{loadavg():.1f} at end\n")
    print(f"{'revision':11} {'conns':>5} | {'learnmesh req/s':>15} {'p50 ms':>7} {'p99 ms':>7} {'cpu us':>6} | "
          f"{'SDK req/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'cpu us':>6} | {'ratio':>6} {'cpu ratio':>9} | load1")
    for revision in (LEGACY, MODERN):
        for conns in args.connections:
            (ours, la_o), (sdk, la_s) = best[("learnmesh", revision, conns)], best[("sdk", revision, conns)]
            ratio = ours.rps / sdk.rps if sdk.rps else float("inf")
            print(f"{revision:11} {conns:>5} | {ours.rps:15.0f} {ours.p50_ms:7.2f} {ours.p99_ms:7.2f} "
                  f"{ours.cpu_us:6.0f} | {sdk.rps:9.0f} {sdk.p50_ms:7.2f} {sdk.p99_ms:7.2f} {sdk.cpu_us:6.0f} | "
                  f"{ratio:5.1f}x {sdk.cpu_us / ours.cpu_us:8.1f}x | {la_o:.1f}/{la_s:.1f}")
    if any(name == CLUSTER for name, _, _ in best):
        print_cluster_rows(best, args)
    if any(p.errors for p, _ in best.values()):
        print("\nWARNING: some reported runs had bad answers or socket errors (see the per-run lines)")


def print_cluster_rows(best: Best, args: argparse.Namespace) -> None:
    print("\nthe learnmesh gateway on a 3-master Redis Cluster next to it on one redis-server, same run:\n")
    print(f"{'revision':11} {'conns':>5} | {'single req/s':>12} {'p50 ms':>7} {'p99 ms':>7} {'cpu us':>6} | "
          f"{'cluster req/s':>13} {'p50 ms':>7} {'p99 ms':>7} {'cpu us':>6} | {'cluster/single':>14}")
    for revision in (LEGACY, MODERN):
        for conns in args.connections:
            one, many = best[("learnmesh", revision, conns)][0], best[(CLUSTER, revision, conns)][0]
            print(f"{revision:11} {conns:>5} | {one.rps:12.0f} {one.p50_ms:7.2f} {one.p99_ms:7.2f} {one.cpu_us:6.0f} | "
                  f"{many.rps:13.0f} {many.p50_ms:7.2f} {many.p99_ms:7.2f} {many.cpu_us:6.0f} | "
                  f"{many.rps / one.rps if one.rps else float('inf'):13.2f}x")


def main() -> int:
    args = parse_args()
    if args.serve_sdk:
        serve_sdk(args.serve_sdk)
        return 0
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    server_cpus, wrk_cpus = split_cpus(args.pin)
    redis_url, redis_proc, redis_dir = start_redis()
    procs: dict[str, subprocess.Popen] = {}
    cluster = LocalCluster(masters=3, replicas=0).start() if args.cluster else None
    load_start = loadavg()
    try:
        best = run_points(start_servers(procs, redis_url, server_cpus, cluster.url if cluster else None),
                          args, wrk_cpus)
    finally:
        for proc in procs.values():
            stop(proc)
        if cluster is not None:
            cluster.stop()
        stop(redis_proc)
        if redis_dir:
            shutil.rmtree(redis_dir, ignore_errors=True)
    print_table(best, args, server_cpus, wrk_cpus, load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
