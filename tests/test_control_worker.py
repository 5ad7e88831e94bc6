"""A real worker process reports itself to the control plane (version, load, lag) and
notices when an operator drains it (docs/operations.md)."""

from __future__ import annotations

from worker_support import spawn_worker, stop, write_config

from shared import keys
from shared.redis_client import close_sync
from tests.conftest import wait_for_sync


def test_worker_reports_status_and_honours_drain(redis_target, tmp_path):
    path, _cfg = write_config(tmp_path, 1, redis_url=redis_target.url, extra={"metrics": {"status_interval_s": 0.1}})
    r = redis_target.sync_client(decode_responses=True)
    proc = spawn_worker(path, 0)
    status = keys.component_status("worker:worker-0")
    try:
        wait_for_sync(lambda: r.hget(status, "version") is not None or proc.poll() is not None, timeout_s=90)
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-2000:]
        got = r.hgetall(status)
        assert got["drained"] == "0" and got["version"] == "0" and got["load"] == "0"
        assert "worker:worker-0" in r.smembers(keys.STATUS_INDEX)
        r.sadd(keys.WORKERS_DRAINED, "worker-0")
        wait_for_sync(lambda: r.hget(status, "drained") == "1", timeout_s=10)
        assert r.hget(status, "idle") == "1"
        r.srem(keys.WORKERS_DRAINED, "worker-0")
        wait_for_sync(lambda: r.hget(status, "drained") == "0", timeout_s=10)
    finally:
        stop(proc)
        close_sync(r)
