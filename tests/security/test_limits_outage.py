"""A principal's request rate holds while Redis does not answer (gateway/limits.py): a real gateway
process over a private redis-server that is stopped under it. Each replica then bounds every
principal's requests itself, at the configured rate and burst, and refuses what is over them with
the same answer as Redis would (HTTP 429, JSON-RPC -32029, ``data.limit`` ``requests``,
``Retry-After``); what is within them passes. The fallback shows in a gauge and in one log line
as it engages and one as it ends, however many requests it checks.

Rates are one token per 1000 s: time cannot refill a bucket while a test runs."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port, wait_for_sync
from tests.gateway_support import LoggedGateway, logged_gateway
from tests.security.test_limits import assert_limited
from tests.test_gateway_http import modern
from tests.test_gateway_resilience import _redis

SLOW = 0.001
KEYS = {p: f"key-{p}-0123456789" for p in ("before", "during", "calm")}
BURST = 3
FALLBACK = "learnmesh_limits_local_fallback "


def echo(gw: LoggedGateway, principal: str) -> httpx.Response:
    body, headers = modern("tools/call", {"name": "t_echo", "arguments": {"text": "x"}})
    return httpx.post(gw.base + "/mcp", json=body, timeout=15,
                      headers={**headers, "authorization": f"Bearer {KEYS[principal]}"})


def fallback_gauge(gw: LoggedGateway) -> float:
    rows = [r for r in httpx.get(gw.base + "/metrics", timeout=10).text.splitlines() if r.startswith(FALLBACK)]
    return float(rows[0][len(FALLBACK):]) if rows else -1.0


@pytest.fixture
def redis_under_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[subprocess.Popen]]]:
    """A private redis-server's port, and its process (a list: the test restarts it)."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs a redis-server binary to stop and start")
    port, workdir = free_port(), tempfile.mkdtemp(prefix="lm-limits-outage-")
    procs = [_redis(port, workdir)]
    try:
        yield port, procs
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_request_rate_holds_while_redis_is_unreachable(redis_under_gateway: tuple[int, list[subprocess.Popen]],
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    rport, procs = redis_under_gateway
    limits = {p: {"requests_per_s": SLOW, "requests_burst": BURST} for p in ("before", "during")}
    log = tmp_path_factory.mktemp("limits-outage") / "gateway.log"
    with logged_gateway(f"redis://127.0.0.1:{rport}/0", log, log_level="info",
                        api_keys=",".join(f"{p}:{k}" for p, k in KEYS.items()),
                        overrides={"limits": {"principals": limits}}) as gw:
        # with Redis: the burst passes, the next request is refused
        assert [echo(gw, "before").status_code for _ in range(BURST)] == [200] * BURST
        with_redis = assert_limited(echo(gw, "before"), "requests")
        assert fallback_gauge(gw) == 0

        procs[0].terminate()
        procs[0].wait(10)
        # without Redis: a principal's burst passes, and what is over it is refused the same way
        assert [echo(gw, "during").status_code for _ in range(BURST)] == [200] * BURST
        for _ in range(5):
            without_redis = assert_limited(echo(gw, "during"), "requests")
        assert without_redis["code"] == with_redis["code"]
        assert without_redis["message"] == with_redis["message"]
        assert_limited(echo(gw, "before"), "requests")  # a principal refused before stays refused
        assert all(echo(gw, "calm").status_code == 200 for _ in range(10))  # others are not held back
        assert fallback_gauge(gw) == 1

        procs.append(_redis(rport, tempfile.mkdtemp(prefix="lm-limits-outage-")))  # Redis back, empty
        wait_for_sync(lambda: echo(gw, "calm").status_code == 200 and fallback_gauge(gw) == 0, timeout_s=20,
                      what="the request limits to be checked in Redis again")
    text = log.read_text()
    engaged = [row for row in text.splitlines() if "enforced by each replica" in row]
    assert len(engaged) == 1, text
    assert sum("checked in redis again" in row for row in text.splitlines()) == 1, text
    assert "Traceback" not in text
