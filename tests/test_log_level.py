"""``LEARNMESH_LOG_LEVEL`` sets how much every learnmesh process logs (docs/operations.md,
"Logs"): real ``learnmesh gateway`` and ``learnmesh worker`` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from worker_support import write_config

from shared import keys
from shared.net import free_port
from shared.redis_client import close_sync, sync_client
from tests.conftest import wait_for_sync

ROOT = Path(__file__).resolve().parents[1]


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    return {**env, "OMP_NUM_THREADS": "1", **more}


def _stop(proc: subprocess.Popen) -> str:
    """Stop ``proc`` with SIGTERM and return what it wrote."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=5)
    return out.decode(errors="replace")


def _gateway_output(tmp_path: Path, redis_url: str, **env: str) -> str:
    """What an open gateway (no keys, so it warns that it is open) writes from its start to its stop."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--port", str(port)], cwd=tmp_path,
                            env=_env(PYTHONPATH=str(ROOT), REDIS_URL=redis_url, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def answers() -> bool:
        assert proc.poll() is None, _stop(proc)
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for_sync(answers, timeout_s=60, what="gateway /healthz")
    finally:
        out = _stop(proc)
    return out


def test_a_gateway_logs_at_the_level_asked_for(tmp_path: Path, redis_url: str) -> None:
    for name in ("default", "quiet"):
        (tmp_path / name).mkdir()
    default = _gateway_output(tmp_path / "default", redis_url)
    assert "is OPEN (no API keys)" in default and "made CURVE keypairs" in default
    quiet = _gateway_output(tmp_path / "quiet", redis_url, LEARNMESH_LOG_LEVEL="error")
    assert "is OPEN" not in quiet and "made CURVE keypairs" not in quiet, quiet


def test_a_worker_logs_at_the_level_asked_for(tmp_path: Path, redis_url: str) -> None:
    path, cfg = write_config(tmp_path, 1, redis_url=redis_url, extra={"metrics": {"status_interval_s": 0.1}})
    r = sync_client(cfg.redis, decode_responses=True)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "worker", "--index", "0"],
                            cwd=ROOT, env=_env(LEARNMESH_LOG_LEVEL="WARNING"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_sync(lambda: r.hget(keys.component_status("worker:worker-0"), "version") is not None
                      or proc.poll() is not None, timeout_s=90, what="the worker's first status report")
    finally:
        out = _stop(proc)
        close_sync(r)
    assert "ready" not in out and " INFO " not in out, out


def test_an_unknown_level_stops_the_process_with_one_line(tmp_path: Path, redis_url: str) -> None:
    """Refused as the command line is read, before any process starts (each is given its own Redis
    and ports all the same, so that one started by mistake disturbs nothing)."""
    path, _ = write_config(tmp_path, 1, redis_url=redis_url)
    for command in (["gateway", "--port", str(free_port())], ["worker", "--endpoint", "tcp://127.0.0.1:*"]):
        run = subprocess.run([sys.executable, "-m", "services.cli", "--config", str(path), *command], cwd=tmp_path,
                             env=_env(PYTHONPATH=str(ROOT), LEARNMESH_LOG_LEVEL="loud"), timeout=60,
                             capture_output=True, text=True)
        assert run.returncode == 2, run.stderr
        assert run.stderr.strip() == ("learnmesh: configuration error: LEARNMESH_LOG_LEVEL: 'loud' is not a log level "
                                      "(DEBUG, INFO, WARNING, ERROR, CRITICAL)")
