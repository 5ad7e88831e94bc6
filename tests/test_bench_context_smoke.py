"""bench/bench_context.py in miniature against the test Redis: its bulk loader must write
exactly the layout the context script writes (the bench asserts it before measuring), every
store operation must be one call, and the report must come out. Catches a script change
that the benchmark's preloading did not follow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_context_runs_small(redis_url):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_context.py"), "--redis-url", redis_url,
                          "--principals", "10", "--ops", "64", "--repeat", "1", "--concurrency", "4",
                          "--mem-contexts", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratios store / naive" in out.stdout and "memory per 1 KiB entry" in out.stdout
    rows = [line for line in out.stdout.splitlines() if "store." in line or "uncached." in line]
    assert len(rows) == 3 and all(" 1.00 " in row for row in rows), rows  # one call per operation
    floor = [line for line in out.stdout.splitlines() if "floor.get_window" in line]
    assert len(floor) == 1 and " 1.00 " in floor[0], floor  # the fetch-only bound, one call per read
    assert "fetch-only floor" in out.stdout
    one = [line for line in out.stdout.splitlines() if "onevalue.get_window" in line]
    assert len(one) == 1 and " 1.00 " in one[0], one  # the store's bookkeeping, the window in one value
    assert "one-value bound" in out.stdout
    assert "ns per byte" in out.stdout  # what a byte costs a script's Lua
