"""tools/call throughput and latency: learnmesh gateway vs the official SDK's MCPServer.

Both servers run side by side on this machine, each one process, with the same trivial
tool (``test_simple_text``: a constant text block). ``wrk`` (Debian package) drives each
with the same load: POST /mcp with a fixed JSON-RPC ``tools/call`` body, per revision:

* 2025-11-25 (legacy): one session is initialized first; every request carries
  ``Mcp-Session-Id`` and ``MCP-Protocol-Version``.
* 2026-07-28 (stateless): every request carries ``_meta`` with the protocol version and
  client capabilities plus the ``MCP-Protocol-Version`` / ``Mcp-Method`` / ``Mcp-Name`` headers.

Prints successful req/s (non-2xx answers and socket errors are subtracted), p50 and p99
for each point and the ratio ours/SDK. The baseline (SDK) is
measured in the same run. ``--duration-s`` and ``--connections`` size it (defaults are
modest: the machine is shared).

    .venv/bin/python bench/bench_gateway.py [--duration-s 5] [--connections 16 64]
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

ROOT = Path(__file__).resolve().parents[1]
TOOL = "test_simple_text"
TOOL_TEXT = "This is a simple text response for testing."
LEGACY, MODERN = "2025-11-25", "2026-07-28"
ACCEPT = "application/json, text/event-stream"

LUA = """
wrk.method = "POST"
wrk.body = %(body)s
%(headers)s
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
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no Redis: set REDIS_URL or install redis-server")
    port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-bench-redis-")
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


def start_ours(port: int, redis_url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    env["REDIS_URL"] = redis_url
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
                             "--fixtures", "conformance"], cwd=ROOT, env=env,
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
            threads: int) -> tuple[float, float, float, int]:
    all_headers = {"Content-Type": "application/json", "Accept": ACCEPT, **headers}
    lua = LUA % {"body": json.dumps(json.dumps(body)),
                 "headers": "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in all_headers.items())}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
        script = f.name
    try:
        out = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s}s",
                              "--latency", "-s", script, url], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"\s50%\s+([\d.]+\w+)", out).group(1))
    p99 = _ms(re.search(r"\s99%\s+([\d.]+\w+)", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad.group(1)) if bad else 0) + (sum(int(g) for g in errs.groups()) if errs else 0)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=int, default=5)
    ap.add_argument("--connections", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--threads", type=int, default=2, help="wrk threads")
    ap.add_argument("--serve-sdk", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_sdk:
        serve_sdk(args.serve_sdk)
        return 0
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")

    redis_url, redis_proc, redis_dir = start_redis()
    ours_proc = sdk_proc = None
    points: list[Point] = []
    try:
        ours_port, sdk_port = free_port(), free_port()
        ours_proc, sdk_proc = start_ours(ours_port, redis_url), start_sdk(sdk_port)
        servers = {"learnmesh": f"http://127.0.0.1:{ours_port}/mcp", "sdk": f"http://127.0.0.1:{sdk_port}/mcp"}
        for revision in (LEGACY, MODERN):
            for name, url in servers.items():
                body, headers = legacy_request(url) if revision == LEGACY else modern_request()
                check_answers(url, body, headers, f"{name} {revision}")
                for conns in args.connections:
                    rps, p50, p99, errors = run_wrk(url, body, headers, conns, args.duration_s, args.threads)
                    points.append(Point(name, revision, conns, rps, p50, p99, errors))
                    print(f"  {name:9} {revision} c={conns:<3} {rps:9.0f} req/s  p50 {p50:7.2f} ms  "
                          f"p99 {p99:7.2f} ms  errors {errors}", flush=True)
    finally:
        stop(ours_proc)
        stop(sdk_proc)
        stop(redis_proc)
        if redis_dir:
            shutil.rmtree(redis_dir, ignore_errors=True)

    print(f"\ntools/call, {args.duration_s} s per point, wrk -t{args.threads}; baseline = official SDK MCPServer "
          f"(json_response) in the same run\n")
    print(f"{'revision':11} {'conns':>5} | {'learnmesh req/s':>15} {'p50 ms':>7} {'p99 ms':>7} | "
          f"{'SDK req/s':>9} {'p50 ms':>7} {'p99 ms':>7} | {'ratio':>6}")
    by_key = {(p.server, p.revision, p.connections): p for p in points}
    for revision in (LEGACY, MODERN):
        for conns in args.connections:
            ours, sdk = by_key[("learnmesh", revision, conns)], by_key[("sdk", revision, conns)]
            print(f"{revision:11} {conns:>5} | {ours.rps:15.0f} {ours.p50_ms:7.2f} {ours.p99_ms:7.2f} | "
                  f"{sdk.rps:9.0f} {sdk.p50_ms:7.2f} {sdk.p99_ms:7.2f} | {ours.rps / sdk.rps:5.1f}x")
    if any(p.errors for p in points):
        print("\nWARNING: some points had non-2xx responses or socket errors (see the per-point lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
