"""``learnmesh up``: run the whole mesh on one machine and keep it running.

Starts (or finds) Redis, then one gateway, ``--workers`` inference workers and a trainer
with ``--ranks`` ranks as child processes of this one. A child that exits unexpectedly is
logged and restarted with backoff; Ctrl-C / SIGTERM stops them in reverse order with
SIGTERM (the gateway drains, the trainer checkpoints) and SIGKILLs what does not stop
within ``stop_timeout_s``. Keys are generated on first start and kept in ``var/keys``: API
and admin keys, each role's CURVE keypair (``keys/zmq``), the delta key ring and the
trainer's signing key.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shared.config import Config, parse_api_keys

log = logging.getLogger("learnmesh.up")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STOP_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 120.0


@dataclass
class Child:
    """One supervised process: how to start it, and its restart history."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    log_path: Path | None = None
    _log_file: Any = field(default=None, repr=False)

    def start(self) -> None:
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        out = self._log_file if self._log_file is not None else None
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True)
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def load_or_create_keys(var_dir: Path, cfg: Config) -> tuple[dict[str, str], str]:
    """API keys (principal -> key) and an admin key: from config/env when given, else
    generated once and kept in ``var/keys/generated.yaml`` (mode 0600)."""
    path = var_dir / "keys" / "generated.yaml"
    stored: dict[str, Any] = {}
    if path.is_file():
        stored = yaml.safe_load(path.read_text()) or {}
    api_keys = dict(cfg.gateway.api_keys) or dict(stored.get("api_keys") or {})
    if not api_keys:
        api_keys = {"demo": secrets.token_urlsafe(24)}
    admin = next((k.key for k in cfg.gateway.admin_keys.values() if k.role == "admin"), None)
    admin = admin or stored.get("admin_key") or secrets.token_urlsafe(24)
    if stored != {"api_keys": api_keys, "admin_key": admin}:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            yaml.safe_dump({"api_keys": api_keys, "admin_key": admin}, fh)
    return api_keys, admin


class Supervisor:
    """Starts children, restarts the ones that die, stops all of them on request."""

    def __init__(self, children: list[Child], *, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.children = children
        self.stop_timeout_s = stop_timeout_s
        self._stopping = threading.Event()

    def start(self) -> None:
        for child in self.children:
            child.start()

    def stop(self) -> None:
        self._stopping.set()

    def run(self, poll_s: float = 0.2) -> None:
        """Supervise until stop(); restart children that exit while we are not stopping."""
        while not self._stopping.wait(poll_s):
            for child in self.children:
                if child.proc is not None and not child.alive() and not self._stopping.is_set():
                    code = child.proc.returncode
                    delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                    if time.monotonic() - child.started_at > 60:
                        child.restarts = 0
                    log.warning("%s exited with code %s; restarting in %.1fs", child.name, code, delay)
                    if self._stopping.wait(delay):
                        break
                    child.restarts += 1
                    child.start()
        self.shutdown()

    def shutdown(self) -> None:
        log.info("stopping: SIGTERM to %s", ", ".join(c.name for c in reversed(self.children) if c.alive()))
        for child in reversed(self.children):
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for child in reversed(self.children):
            if not child.wait(max(0.0, deadline - time.monotonic())):
                log.warning("%s did not stop within %.0fs; killing it", child.name, self.stop_timeout_s)
                child.signal(signal.SIGKILL)
                child.wait(5)
            else:
                log.info("%s stopped (exit code %s)", child.name, child.proc.returncode if child.proc else None)
            child.close_log()


def _learnmesh_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def build_children(cfg: Config, args: Any, env: dict[str, str], var_dir: Path) -> list[Child]:
    workers = args.workers if getattr(args, "workers", None) is not None else len(cfg.worker.endpoints)
    ranks = args.ranks if getattr(args, "ranks", None) is not None else cfg.trainer.ranks
    logs = var_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gw = ["gateway", "--host", cfg.gateway.host, "--port", str(cfg.gateway.port)]
    if getattr(args, "fixtures", None):
        gw += ["--fixtures", args.fixtures]
    children = [Child("trainer", _learnmesh_argv("trainer", "--ranks", str(ranks)), env, log_path=logs / "trainer.log")]
    for i in range(workers):
        children.append(Child(f"worker-{i}", _learnmesh_argv("worker", "--index", str(i)), env,
                              log_path=logs / f"worker-{i}.log"))
    children.append(Child("gateway", _learnmesh_argv(*gw), env, log_path=logs / "gateway.log"))
    return children


def _worker_endpoints(cfg: Config, n: int) -> list[str]:
    eps = list(cfg.worker.endpoints)
    if n <= len(eps):
        return eps[:n]
    host, _, port = eps[-1].rpartition(":")
    return eps + [f"{host}:{int(port) + i}" for i in range(1, n - len(eps) + 1)]


# Config defaults that name places under ./var: `up` moves them under $LEARNMESH_VAR so one
# mesh's checkpoints, model cache and keys never mix with another's (explicit values are kept).
_VAR_PATHS = {
    ("trainer", "checkpoint_dir"): "checkpoints",
    ("model", "cache_dir"): "model",
    ("security", "delta_key_file"): "keys/delta.key",
    ("zmq", "keys_dir"): "keys/zmq",
}


def _var_overrides(cfg: Config, var_dir: Path) -> dict[str, str]:
    out = {}
    for (section, name), rel in _VAR_PATHS.items():
        value = getattr(getattr(cfg, section), name)
        if value == f"var/{rel}":
            out[f"LEARNMESH_{section.upper()}__{name.upper()}"] = str(var_dir / rel)
    return out


def prepare_keys(cfg: Config, var_dir: Path) -> None:
    """Make the mesh's ZeroMQ keypairs and delta keys before any child starts (children then
    only read them), and split a delta key file of an earlier version that still holds the
    signing key, so no worker is ever handed the trainer's private key."""
    from shared import crypto, curve

    def path(section: str, name: str) -> str:
        value = str(getattr(getattr(cfg, section), name))
        return str(var_dir / _VAR_PATHS[(section, name)]) if value == f"var/{_VAR_PATHS[(section, name)]}" else value

    if cfg.zmq.curve:
        curve.ensure_keys(path("zmq", "keys_dir"))
    ring = path("security", "delta_key_file")
    crypto.ensure_keys(ring, cfg.security.delta_sign_key_file or str(Path(ring).with_name("delta-sign.key")))


def wait_ready(base: str, timeout_s: float, sup: Supervisor) -> bool:
    """Poll the gateway's /readyz until it answers 200 (Redis reachable) or time runs out."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not sup._stopping.is_set():
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as resp:  # noqa: S310 - our own loopback URL
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def main(cfg: Config, args: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from shared.redis_embed import resolve_redis_url

    if getattr(args, "host", None):
        cfg.gateway.host = args.host
    if getattr(args, "port", None):
        cfg.gateway.port = args.port
    var_dir = Path(os.environ.get("LEARNMESH_VAR", "var")).resolve()
    redis_url, redis_proc = resolve_redis_url(cfg.redis.url, workdir=var_dir / "redis")
    if redis_proc is None and not cfg.redis.url:
        log.warning("using the Redis already answering at %s: its sample log, trainer offsets and model version "
                    "are shared with whatever else uses that database; set REDIS_URL for a mesh of its own", redis_url)
    api_keys, admin_key = load_or_create_keys(var_dir, cfg)
    prepare_keys(cfg, var_dir)
    env = _child_env(cfg, args, redis_url, api_keys, admin_key, var_dir)
    sup = Supervisor(build_children(cfg, args, env, var_dir))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sup.stop())
    sup.start()
    base = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    if not wait_ready(base.replace("0.0.0.0", "127.0.0.1"), READY_TIMEOUT_S, sup):
        log.warning("the gateway is not ready after %.0fs; see %s", READY_TIMEOUT_S, var_dir / "logs" / "gateway.log")
    redis_note = "private, started here" if redis_proc is not None else "existing server"
    print(_banner(cfg, f"{redis_url}   ({redis_note})", var_dir, api_keys, admin_key), flush=True)
    try:
        sup.run()
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            try:
                redis_proc.wait(5)
            except subprocess.TimeoutExpired:
                redis_proc.kill()
    return 0


def _child_env(cfg: Config, args: Any, redis_url: str, api_keys: dict[str, str], admin_key: str,
               var_dir: Path) -> dict[str, str]:
    """The children's environment: this one plus what makes them one mesh (Redis, keys,
    endpoints, places under ``var_dir``)."""
    n_workers = args.workers if getattr(args, "workers", None) is not None else len(cfg.worker.endpoints)
    env = dict(os.environ)
    env.update({
        "REDIS_URL": redis_url,
        "LEARNMESH_API_KEYS": ",".join(f"{p}:{k}" for p, k in api_keys.items()),
        "LEARNMESH_ADMIN_KEY": admin_key,
        "LEARNMESH_GATEWAY__HOST": cfg.gateway.host,
        "LEARNMESH_GATEWAY__PORT": str(cfg.gateway.port),
        "LEARNMESH_WORKER__ENDPOINTS": "[" + ",".join(_worker_endpoints(cfg, n_workers)) + "]",
        "PYTHONUNBUFFERED": "1",
        **_var_overrides(cfg, var_dir),
    })
    parse_api_keys(env["LEARNMESH_API_KEYS"])  # fail early on a bad spec
    if getattr(args, "config", None):
        env["LEARNMESH_CONFIG"] = str(Path(args.config).resolve())
    return env


def _banner(cfg: Config, redis: str, var_dir: Path, api_keys: dict[str, str], admin_key: str) -> str:
    base = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    return "\n".join([
        "learnmesh is up",
        f"  MCP endpoint   {base}/mcp   (WebSocket: ws://{cfg.gateway.host}:{cfg.gateway.port}/mcp/ws)",
        f"  admin API      {base}/admin   (OpenAPI: {base}/admin/openapi.json)",
        f"  dashboard      {base}/admin/ui",
        f"  metrics        {base}/metrics",
        f"  redis          {redis}",
        f"  logs           {var_dir / 'logs'}",
        "  MCP API keys   " + ", ".join(f"{p}: {k}" for p, k in api_keys.items()),
        f"  admin key      {admin_key}",
        "Ctrl-C stops everything.",
    ])
