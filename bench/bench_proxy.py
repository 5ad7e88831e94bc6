"""Proxied tools/call: learnmesh's proxy vs calling the upstream directly vs FastMCP's proxy.

Per upstream kind (``--upstream``):

* ``sdk``: the official SDK's MCPServer (``bench_gateway.py --serve-sdk``: one tool,
  ``test_simple_text``, JSON responses), the kind of server people put behind a gateway;
* ``learnmesh``: a learnmesh gateway with the conformance fixtures (the same tool), a fast
  upstream that leaves the proxy's own cost visible.

In front of it, each one process: a learnmesh gateway without fixtures whose config mounts
the upstream (``proxy.upstreams``: ``namespace: ""`` so every target answers the same request
body, ``revision: auto``, shipped timeout and concurrency; ``principal_concurrency`` the whole
``concurrency``, since wrk's one principal stands for many callers), and FastMCP's proxy
(``fastmcp.server.create_proxy``, FastMCP 4.2.3 on mcp 2.3.0, run by ``--fastmcp-python``:
``make bench-proxy`` builds ``.venv-bench-proxy`` for it so the test venv keeps its pins).
``wrk`` drives each target with the same 2026-07-28 ``tools/call`` (``--revision 2025-11-25``:
one legacy session per target) at each ``--connections``; only HTTP 200 answers carrying the
tool's text count, within ``--wrk-timeout-s``. FastMCP runs twice: ``create_proxy(url)``
opens a fresh backend session for every request (its default, which keeps callers apart), and
``create_proxy(connected client)`` reuses one session for everyone (its opt-in); learnmesh
keeps one upstream session per principal. Targets are interleaved, ``--repeat`` runs each, the best run is reported
with the target process's CPU time per request. Every process (upstream, proxies, private
Redis servers) is started here and stopped at the end.

    .venv/bin/python bench/bench_proxy.py [--upstream sdk learnmesh] [--connections 16 64]
        [--duration-s 5] [--repeat 2] [--fastmcp-python .venv-bench-proxy/bin/python]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench_gateway import (
    LEGACY,
    MODERN,
    Point,
    check_answers,
    cpu_s,
    free_port,
    gateway_env,
    legacy_request,
    loadavg,
    modern_request,
    run_wrk,
    start_ours,
    start_private_redis,
    start_sdk,
    stop,
    wait_up,
)

ROOT = Path(__file__).resolve().parents[1]
DIRECT, OURS, FASTMCP, FASTMCP_SHARED = "direct", "learnmesh proxy", "FastMCP proxy", "FastMCP shared"
TARGETS = (DIRECT, OURS, FASTMCP, FASTMCP_SHARED)


@dataclass
class Target:
    name: str
    url: str | None  # None: not available in this run (the reason is in ``missing``)
    pid: int = 0
    missing: str = ""


class Processes:
    """Everything the bench started, stopped in reverse order."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[str] = []

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def redis(self, prefix: str) -> str:
        url, proc, workdir = start_private_redis(prefix)
        self.add(proc)
        self.dirs.append(workdir)
        return url

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        for workdir in self.dirs:
            shutil.rmtree(workdir, ignore_errors=True)
        self.procs, self.dirs = [], []


def start_upstream(kind: str, ps: Processes) -> Target:
    port = free_port()
    if kind == "sdk":
        proc = ps.add(start_sdk(port))
    else:
        proc = ps.add(start_ours(port, ps.redis("lm-bench-proxy-upstream-")))
    return Target(DIRECT, f"http://127.0.0.1:{port}/mcp", proc.pid)


UPSTREAM_CONCURRENCY = 16  # an upstream's shipped concurrency (proxy.upstreams[].concurrency)


def start_learnmesh_proxy(upstream_url: str, ps: Processes) -> Target:
    port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-bench-proxy-")
    ps.dirs.append(workdir)
    config = Path(workdir) / "learnmesh.yaml"
    config.write_text(f"proxy:\n  upstreams:\n    - name: bench\n      url: {upstream_url}\n"
                      f"      revision: auto\n      namespace: \"\"\n"
                      # wrk sends every call as one principal, standing for many callers: it gets
                      # the upstream's every slot (shipped: half of them per principal).
                      f"      principal_concurrency: {UPSTREAM_CONCURRENCY}\n")
    # A private Redis: the upstream set lives there, and one left by an earlier run would win.
    env = gateway_env(ps.redis("lm-bench-proxy-redis-"))
    proc = ps.add(subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(config), "gateway",
                                    "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_up(f"http://127.0.0.1:{port}/healthz", proc, "learnmesh proxy")
    return Target(OURS, f"http://127.0.0.1:{port}/mcp", proc.pid)


def start_fastmcp_proxy(name: str, upstream_url: str, python: str, ps: Processes) -> Target:
    """``FASTMCP``: ``create_proxy(url)``, a fresh backend session per request (its default);
    ``FASTMCP_SHARED``: ``create_proxy(connected client)``, one backend session for all."""
    if not Path(python).exists():
        return Target(name, None, missing=f"{python} not found (make bench-proxy builds it)")
    port = free_port()
    session = "shared" if name == FASTMCP_SHARED else "fresh"
    proc = ps.add(subprocess.Popen([python, str(ROOT / "bench" / "fastmcp_proxy.py"), "--upstream", upstream_url,
                                    "--port", str(port), "--session", session], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_up(f"http://127.0.0.1:{port}/mcp", proc, name)
    return Target(name, f"http://127.0.0.1:{port}/mcp", proc.pid)


Best = dict[tuple[str, int], Point]  # (target, connections) -> best run


def measure(targets: list[Target], args: argparse.Namespace) -> Best:
    live = [t for t in targets if t.url]
    requests = {}
    for t in live:
        body, headers = legacy_request(t.url) if args.revision == LEGACY else modern_request()
        check_answers(t.url, body, headers, t.name)
        run_wrk(t.url, body, headers, 16, 1, args.threads, None, args.wrk_timeout_s)  # warm-up, not reported
        requests[t.name] = (body, headers)
    best: Best = {}
    for conns in args.connections:
        for rep in range(args.repeat):
            for t in live:
                point = run_point(t, conns, requests[t.name], args)
                print(f"  {t.name:15} c={conns:<3} run {rep + 1}: {point.rps:7.0f} req/s  p50 {point.p50_ms:7.2f} ms"
                      f"  p99 {point.p99_ms:7.2f} ms  bad {point.errors}  cpu {point.cpu_us:6.0f} us/req"
                      f"  load1 {loadavg():.1f}", flush=True)
                if (t.name, conns) not in best or point.rps > best[(t.name, conns)].rps:
                    best[(t.name, conns)] = point
    return best


def run_point(t: Target, conns: int, request: tuple[dict, dict[str, str]], args: argparse.Namespace) -> Point:
    assert t.url is not None
    body, headers = request
    cpu0 = cpu_s(t.pid)
    rps, p50, p99, errors = run_wrk(t.url, body, headers, conns, args.duration_s, args.threads, None,
                                    args.wrk_timeout_s)
    cpu_us = (cpu_s(t.pid) - cpu0) / max(rps * args.duration_s, 1) * 1e6
    return Point(t.name, args.revision, conns, rps, p50, p99, errors, cpu_us)


def bench_upstream(kind: str, args: argparse.Namespace) -> tuple[list[Target], Best]:
    ps = Processes()
    try:
        upstream = start_upstream(kind, ps)
        assert upstream.url is not None
        targets = [upstream, start_learnmesh_proxy(upstream.url, ps),
                   *(start_fastmcp_proxy(name, upstream.url, args.fastmcp_python, ps)
                     for name in (FASTMCP, FASTMCP_SHARED))]
        print(f"upstream {kind}: " + ", ".join(f"{t.name} {t.url or 'not available: ' + t.missing}"
                                             for t in targets), flush=True)
        return targets, measure(targets, args)
    finally:
        ps.stop_all()


def print_table(kind: str, targets: list[Target], best: Best, args: argparse.Namespace) -> None:
    print(f"\nupstream: {kind}; client revision {args.revision}; {args.duration_s} s per run, best of {args.repeat};"
          f" wrk -t{args.threads}; {os.cpu_count()} CPUs, load average {loadavg():.1f}")
    print(f"{'target':15} {'conns':>5} | {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'cpu us':>6} | bad")
    for conns in args.connections:
        for t in targets:
            p = best.get((t.name, conns))
            if p is None:
                print(f"{t.name:15} {conns:>5} | not available: {t.missing}")
                continue
            print(f"{t.name:15} {conns:>5} | {p.rps:7.0f} {p.p50_ms:7.2f} {p.p99_ms:7.2f} {p.cpu_us:6.0f} | {p.errors}")
    print(f"\n{'conns':>5} | {'proxy/direct req/s':>18} {'added p50 ms':>12} | {'learnmesh/FastMCP req/s':>23}"
          f" {'learnmesh/FastMCP shared':>24}")
    for conns in args.connections:
        direct, ours, fast, shared = (best.get((name, conns)) for name in TARGETS)
        print(f"{conns:>5} | {ratio(ours, direct):>18} {added_p50(ours, direct):>12} | {ratio(ours, fast):>23}"
              f" {ratio(ours, shared):>24}")
    if any(p.errors for p in best.values()):
        print("WARNING: some reported runs had bad answers or socket errors (see the per-run lines)")


def ratio(a: Point | None, b: Point | None) -> str:
    return f"{a.rps / b.rps:.2f}x" if a and b and b.rps else "n/a"


def added_p50(proxied: Point | None, direct: Point | None) -> str:
    return f"{proxied.p50_ms - direct.p50_ms:+.2f}" if proxied and direct else "n/a"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", nargs="+", choices=["sdk", "learnmesh"], default=["sdk", "learnmesh"])
    ap.add_argument("--connections", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--duration-s", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--revision", choices=[MODERN, LEGACY], default=MODERN, help="what the load speaks")
    ap.add_argument("--wrk-timeout-s", type=int, default=30,
                    help="per-request timeout: FastMCP's proxy takes seconds per answer at 64 connections")
    ap.add_argument("--fastmcp-python", default=str(ROOT / ".venv-bench-proxy" / "bin" / "python"),
                    help="interpreter with fastmcp==4.2.3 installed (make bench-proxy builds it)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    results = [(kind, *bench_upstream(kind, args)) for kind in args.upstream]
    for kind, targets, best in results:
        print_table(kind, targets, best, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
