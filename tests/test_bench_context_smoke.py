"""bench/bench_context.py in miniature against the test Redis: its bulk loader must write
exactly the layout the context script writes (the bench asserts it before measuring), every
store operation must be one call, and the report must come out. Catches a script change
that the benchmark's preloading did not follow. On a cluster the bench runs ``--cluster``: the
single server, then the cluster, then the two side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import RedisTarget

ROOT = Path(__file__).resolve().parent.parent


def test_bench_context_runs_small(redis_url: str, redis_target: RedisTarget) -> None:
    cluster = ["--cluster", "--cluster-url", redis_target.url] if redis_target.is_cluster else []
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_context.py"), "--redis-url", redis_url,
                          "--principals", "10", "--ops", "64", "--repeat", "1", "--concurrency", "4",
                          "--mem-contexts", "1", *cluster], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory per 1 KiB entry" in out.stdout
    assert "ns per byte" in out.stdout  # what a byte costs a script's Lua
    sides = out.stdout.split("=== cluster ===")
    assert len(sides) == (2 if cluster else 1), out.stdout
    if cluster:
        sides[1], side_by_side = sides[1].split("single server vs 3-master cluster", 1)
        store_rows = [line for line in side_by_side.splitlines() if "store." in line]
        assert len(store_rows) == 2 and all(row.endswith("1.00    1.00") for row in store_rows), side_by_side
    for side in sides:
        _check_side(side)


def _check_side(text: str) -> None:
    """One side's report: every store operation one call, the bounds measured."""
    assert "ratios store / naive" in text
    rows = [line for line in text.splitlines() if "store." in line or "uncached." in line]
    assert len(rows) == 3 and all(" 1.00 " in row for row in rows), rows  # one call per operation
    floor = [line for line in text.splitlines() if "floor.get_window" in line]
    assert len(floor) == 1 and " 1.00 " in floor[0], floor  # the fetch-only bound, one call per read
    assert "fetch-only floor" in text
    one = [line for line in text.splitlines() if "onevalue.get_window" in line]
    assert len(one) == 1 and " 1.00 " in one[0], one  # the store's bookkeeping, the window in one value
    assert "one-value bound" in text
