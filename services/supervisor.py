"""``learnmesh up``: run the whole mesh on one machine and keep it running.

Starts (or finds) Redis, then one gateway, ``--workers`` inference workers and a trainer
with ``--ranks`` ranks as child processes of this one. A child that exits before the mesh is
ready stops the mesh, named with its exit status and last output; one that exits later is
logged and restarted with backoff, up to ``MAX_QUICK_RESTARTS`` times in a row (counted afresh
once a start has run ``HEALTHY_RUN_S``), after which it stops the mesh the same way; Ctrl-C / SIGTERM stops them in reverse order with
SIGTERM (the gateway drains, the trainer checkpoints) and SIGKILLs what does not stop
within ``stop_timeout_s``; a kill -9 of this process has the kernel send each child SIGTERM
(shared/lifetime.py). A child that exits with a configuration error (exit code 2) is
not restarted: the mesh stops with it, named with its last output. Keys are generated on first start and kept in
``var/keys``: API and admin keys, the key sealing ``requestState``, each role's CURVE keypair
(``keys/zmq``), the delta key ring and the trainer's signing key.

The gateway has no fixed worker list: the workers announce themselves in Redis and the
gateway follows the announcements (gateway/workers.py), as gateways on many hosts do.

Secrets never travel in a child's environment (readable in ``/proc/<pid>/environ``, copied
into every process a child starts): each child reads its whole configuration from a 0600
file in ``var/keys`` (``config-<role>.yaml``), and only the gateway's holds the API and
admin keys.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import yaml

from shared.config import (
    CONFIG_ENV,
    CONFIG_ERROR_EXIT,
    ENV_PREFIX,
    Config,
    ConfigError,
    apply_overrides,
    load_config,
    log_level,
    unknown_env_variables,
)
from shared.config import var_dir as config_var_dir
from shared.lifetime import die_with_parent
from shared.net import listened_on
from shared.redis_client import check_access, cluster_addresses, is_cluster, redact_url, url_of
from shared.secret_files import read_private, write_private
from shared.zmq_util import bind_address

log = logging.getLogger("learnmesh.up")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
MAX_QUICK_RESTARTS = 5
"""How often a child that keeps exiting soon after its start is restarted in a row before `up`
stops the mesh for it: a setting only checked at runtime or a lost port fails every start the
same way, and a loop of restarts in the log never tells the user the mesh cannot work."""
HEALTHY_RUN_S = 60.0
"""How long a start must run for its exit to end a run of failures: a child that crashes now and
then (a Redis failover, a killed worker) is restarted for as long as the mesh runs."""
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
    _log_start: int = field(default=0, repr=False)  # where this start's output begins in the log

    def start(self) -> None:
        self.close_log()  # a restart's: one open log file per child, however often it restarts
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in close_log()
            self._log_start = self._log_file.tell()
        out = self._log_file if self._log_file is not None else None
        # S603: the argv is learnmesh's own executable with arguments built here, no shell.
        # SIGTERM when the supervisor dies (kill -9): the child stops as on Ctrl-C (the gateway
        # drains, the trainer checkpoints) instead of holding the mesh's ports as an orphan. (A
        # preexec_fn is safe here: `up` runs no threads.)
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,  # noqa: S603
                                     stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                     preexec_fn=die_with_parent)
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
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

    def how_it_ended(self) -> str:
        """``exited with status N`` or ``was killed by SIGNAME``, for a child that stopped."""
        code = self.proc.returncode if self.proc is not None else None
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def last_output(self, lines: int = 10, read_bytes: int = 8192) -> list[str]:
        """The last non-empty lines this start of the child wrote to its log (none without one)."""
        if self.log_path is None:
            return []
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._log_start, f.seek(0, os.SEEK_END) - read_bytes))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _read_generated(var_dir: Path) -> tuple[Path, dict[str, Any]]:
    """``var/keys/generated.yaml`` and what it holds ({} before the first start)."""
    path = var_dir / "keys" / "generated.yaml"
    if not path.is_file():
        return path, {}
    return path, _generated_keys(path, read_private(path, "generated keys file"))


def load_or_create_keys(var_dir: Path, cfg: Config) -> tuple[dict[str, str], str]:
    """API keys (principal -> key) and an admin key: from config/env when given, else
    generated once and kept in ``var/keys/generated.yaml`` (mode 0600). Only generated keys
    go into that file: keys an operator chose stay where they were given. Written there, they
    would outlive their variables, and a later start without them would take their principals
    for the demo's, who may teach (see child_configs)."""
    path, stored = _read_generated(var_dir)
    keep = dict(stored)
    api_keys = dict(cfg.gateway.api_keys)
    if not api_keys:
        api_keys = keep["api_keys"] = dict(stored.get("api_keys") or {}) or {"demo": secrets.token_urlsafe(24)}
    admin = next((k.key for k in cfg.gateway.admin_keys.values() if k.role == "admin"), None)
    if not admin:
        admin = keep["admin_key"] = stored.get("admin_key") or secrets.token_urlsafe(24)
    if keep != stored:
        write_private(path, yaml.safe_dump(keep))
    return api_keys, admin


def load_or_create_request_state_keys(var_dir: Path, cfg: Config) -> list[str]:
    """The keys sealing 2026-07-28 ``requestState``: ``gateway.request_state_keys`` when given,
    else one generated once and kept in ``var/keys/generated.yaml``, so that an
    ``input_required`` round trip begun before a restart of the mesh is still answered after it
    (a gateway left without keys makes one per process)."""
    if cfg.gateway.request_state_keys:
        return list(cfg.gateway.request_state_keys)
    path, stored = _read_generated(var_dir)
    key = stored.get("request_state_key")
    if not key:
        key = secrets.token_hex(32)
        write_private(path, yaml.safe_dump({**stored, "request_state_key": key}))
    return [key]


def _generated_keys(path: Path, text: bytes) -> dict[str, Any]:
    """The generated keys file's ``api_keys`` (principal -> key), ``admin_key`` and
    ``request_state_key``, as written by :func:`load_or_create_keys` and
    :func:`load_or_create_request_state_keys`; a file edited into another shape is refused, not
    overwritten (it holds the keys the clients use)."""
    try:
        stored = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        stored = None
    if not _is_generated_keys(stored):
        raise ConfigError(f"generated keys file {path} is not what learnmesh up writes (api_keys: principal -> key, "
                          "admin_key: key, request_state_key: 64 hex digits); mend it, or delete it to have new "
                          "keys made")
    return typing.cast(dict[str, Any], stored)


def _is_generated_keys(stored: Any) -> bool:
    if not isinstance(stored, dict):
        return False
    api_keys = stored.get("api_keys") or {}
    state_key = stored.get("request_state_key", "")
    return (isinstance(api_keys, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in api_keys.items())
            and isinstance(stored.get("admin_key", ""), str)
            and isinstance(state_key, str) and (not state_key or re.fullmatch(r"[0-9a-f]{64}", state_key) is not None))


class Supervisor:
    """Starts children, restarts the ones that die, stops all of them on request."""

    def __init__(self, children: list[Child], *, stop_timeout_s: float = STOP_TIMEOUT_S,
                 redis_answers: Callable[[], bool] | None = None) -> None:
        self.children = children
        self.stop_timeout_s = stop_timeout_s
        # Children exit while Redis is away (a rank cannot read the sample log); that is no reason
        # to stop the mesh, which waits for Redis: the bound on quick restarts holds only while
        # Redis answers (``redis_answers``; None: always counted).
        self._redis_answers = redis_answers
        self.exit_code = 0
        self.failed: str | None = None  # why the mesh stopped by itself: one line
        self._stopping = threading.Event()
        self._hurry = threading.Event()  # a second stop request: no more grace for the children

    def start(self) -> None:
        for child in self.children:
            child.start()

    def stop(self) -> None:
        """Stop everything; asked again while stopping (a second Ctrl-C), kill what still runs."""
        if self._stopping.is_set():
            self._hurry.set()
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def exited(self) -> Child | None:
        """The first started child that is no longer running."""
        return next((c for c in self.children if c.proc is not None and not c.alive()), None)

    def run(self, poll_s: float = 0.2) -> None:
        """Supervise until stop(), or until a child exits for a reason restarts do not mend."""
        while not self._stopping.wait(poll_s):
            for child in self.children:
                if child.proc is not None and not child.alive() and not self._restart(child):
                    break
        self.shutdown()

    def _restart(self, child: Child) -> bool:
        """Start ``child``, which exited, again after its backoff; False when the mesh stops instead."""
        if self._stopping.is_set():
            return False
        code = child.proc.returncode if child.proc is not None else None
        if code == CONFIG_ERROR_EXIT:
            self.give_up(child, "(a failure a restart would meet again)")
            return False
        if time.monotonic() - child.started_at >= HEALTHY_RUN_S:
            child.restarts = 0
        if child.restarts >= MAX_QUICK_RESTARTS:
            if self._redis_answers is None or self._redis_answers():
                self.give_up(child, f"again after {child.restarts} restarts in a row, each within "
                                    f"{HEALTHY_RUN_S:.0f}s of its start")
                return False
            log.warning("%s keeps exiting while Redis does not answer; restarted until Redis is back", child.name)
            child.restarts = MAX_QUICK_RESTARTS - 1  # counted again from here once Redis answers
        delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
        log.warning("%s exited with code %s; restarting in %.1fs (%d of %d restarts in a row)", child.name, code,
                    delay, child.restarts + 1, MAX_QUICK_RESTARTS)
        if self._stopping.wait(delay):
            return False
        child.restarts += 1
        child.start()
        return True

    def mend_before_ready(self, child: Child) -> bool:
        """``child`` exited before the mesh was ready: most likely again at every restart (a port,
        a path, a setting), so the mesh stops for it; unless Redis does not answer, which the mesh
        waits for (a trainer cannot start without it): then it is restarted as :meth:`run` would.
        True when it was restarted."""
        if self._redis_answers is None or self._redis_answers():
            self.give_up(child, "before the mesh was ready")
            return False
        return self._restart(child)

    def give_up(self, child: Child, why: str) -> None:
        """Stop the mesh for ``child``, which exited and would most likely do so again on every
        restart: name it, its exit status and what it last wrote; exit with its status 2 (a
        configuration error), else 1."""
        tail = child.last_output()
        log.error("%s %s %s; stopping everything. Its last output:%s", child.name, child.how_it_ended(), why,
                  "".join(f"\n    {line}" for line in tail) or " (none)")
        where = f"see {child.log_path}" if child.log_path is not None else "see its output above"
        self.failed = (f"{child.name} {child.how_it_ended()} {why}" + (f": {tail[-1]}" if tail else "")
                       + f" ({where})")
        code = child.proc.returncode if child.proc is not None else None
        self.exit_code = CONFIG_ERROR_EXIT if code == CONFIG_ERROR_EXIT else 1
        self._stopping.set()

    def shutdown(self) -> None:
        log.info("stopping: SIGTERM to %s (Ctrl-C again: kill them at once)",
                 ", ".join(c.name for c in reversed(self.children) if c.alive()))
        for child in reversed(self.children):
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for child in reversed(self.children):
            while not child.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
                if self._hurry.is_set() or time.monotonic() >= deadline:
                    why = "asked again" if self._hurry.is_set() else f"did not stop within {self.stop_timeout_s:.0f}s"
                    log.warning("%s %s; killing it", child.name, why)
                    child.signal(signal.SIGKILL)
                    child.wait(5)
                    break
            else:
                log.info("%s stopped (exit code %s)", child.name, child.proc.returncode if child.proc else None)
            child.close_log()


def _learnmesh_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def build_children(cfg: Config, args: Any, envs: dict[str, dict[str, str]], var_dir: Path) -> list[Child]:
    """The trainer, the workers and the gateway; ``envs``: each role's environment."""
    workers = _n_workers(cfg, args)
    ranks = _n_ranks(cfg, args)
    logs = var_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gw = ["gateway", "--host", cfg.gateway.host, "--port", str(cfg.gateway.port)]
    if getattr(args, "fixtures", None):
        gw += ["--fixtures", args.fixtures]
    children = [Child("trainer", _learnmesh_argv("trainer", "--ranks", str(ranks)), envs["trainer"],
                      log_path=logs / "trainer.log")]
    for i in range(workers):
        children.append(Child(f"worker-{i}", _learnmesh_argv("worker", "--index", str(i)), envs["worker"],
                              log_path=logs / f"worker-{i}.log"))
    children.append(Child("gateway", _learnmesh_argv(*gw), envs["gateway"], log_path=logs / "gateway.log"))
    return children


def _n_workers(cfg: Config, args: Any) -> int:
    return args.workers if getattr(args, "workers", None) is not None else len(cfg.worker.endpoints)


def _n_ranks(cfg: Config, args: Any) -> int:
    return args.ranks if getattr(args, "ranks", None) is not None else cfg.trainer.ranks


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


def _var_overrides(cfg: Config, var_dir: Path) -> dict[str, dict[str, str]]:
    """section -> field -> path under ``var_dir``, for the defaults in :data:`_VAR_PATHS`."""
    out: dict[str, dict[str, str]] = {}
    for (section, name), rel in _VAR_PATHS.items():
        if getattr(getattr(cfg, section), name) == f"var/{rel}":
            out.setdefault(section, {})[name] = str(var_dir / rel)
    return out


# What only the gateway needs; the other children's configuration files leave it out.
_GATEWAY_SECRETS = {("gateway", "api_keys"): {}, ("gateway", "admin_keys"): {},
                    ("gateway", "request_state_keys"): [], ("gateway", "oauth", "hs256_secret"): ""}


def child_configs(cfg: Config, args: Any, var_dir: Path, api_keys: dict[str, str],
                  admin_key: str, request_state_keys: list[str] | None = None) -> dict[str, Path]:
    """Write each role's whole configuration (``gateway``, ``worker``, ``trainer``) to a 0600
    file under ``var_dir/keys`` and check it loads; returns role -> path."""
    tree = cfg.to_dict()
    tree["worker"]["endpoints"] = _worker_endpoints(cfg, _n_workers(cfg, args))
    for section, fields in _var_overrides(cfg, var_dir).items():
        tree[section].update(fields)
    if not cfg.gateway.api_keys:  # keys made here (the demo's): their principals may teach
        tree["learning"]["teachers"] = [*cfg.learning.teachers,
                                        *(p for p in api_keys if p not in cfg.learning.teachers)]
    tree["gateway"]["api_keys"] = api_keys
    if not any(k["key"] == admin_key for k in tree["gateway"]["admin_keys"].values()):
        tree["gateway"]["admin_keys"] = {"generated": {"key": admin_key, "role": "admin"}}
    if request_state_keys:
        tree["gateway"]["request_state_keys"] = request_state_keys
    if _holds_checkpoint(tree["trainer"]["checkpoint_dir"]):
        # the trainer restores learned weights: workers take them before they serve, even where
        # Redis lost the trainer's status that would otherwise tell them (a server that keeps
        # nothing on disk, restarted; another REDIS_URL beside the same var/)
        tree["worker"]["await_snapshot"] = True
    paths = {}
    for role in ("gateway", "worker", "trainer"):
        role_tree = yaml.safe_load(yaml.safe_dump(tree))  # a deep copy
        if role == "gateway" and cfg.worker.discovery and cfg.worker.register:
            role_tree["worker"]["endpoints"] = []  # the workers announce themselves (worker discovery)
        if role != "gateway":
            for (*where, name), empty in _GATEWAY_SECRETS.items():
                node = role_tree
                for part in where:
                    node = node[part]
                node[name] = empty
        path = var_dir / "keys" / f"config-{role}.yaml"
        write_private(path, yaml.safe_dump(role_tree))
        load_config(path, env={})  # what the child will load: fail here, once, not in every child
        paths[role] = path
    return paths


def _holds_checkpoint(directory: str) -> bool:
    """Whether the trainer restores a checkpoint as it starts (``ckpt-<step>.pt``,
    services/trainer/checkpoint.py, which the supervisor does not import: it loads torch)."""
    try:
        return any(Path(directory).glob("ckpt-*.pt"))
    except OSError:
        return False


def under_var(cfg: Config, var_dir: Path) -> Config:
    """``cfg`` with the defaults of :data:`_VAR_PATHS` under ``var_dir``: the places `up`'s
    children use, and so the ones ``learnmesh keys`` must write."""
    return apply_overrides(cfg, _var_overrides(cfg, var_dir))


def prepare_keys(cfg: Config, var_dir: Path) -> None:
    """Make the mesh's ZeroMQ keypairs and delta keys before any child starts (children then
    only read them), and split a delta key file of an earlier version that still holds the
    signing key, so no worker is ever handed the trainer's private key."""
    from shared import crypto, curve

    cfg = under_var(cfg, var_dir)
    if cfg.zmq.curve:
        curve.ensure_keys(cfg.zmq.keys_dir)
    crypto.ensure_keys(cfg.security.delta_key_file, cfg.security.signing_key_path)


def ports_taken(cfg: Config, args: Any) -> list[str]:
    """The setting and address of each port the mesh would listen on that another process holds
    (another mesh, an old one still running): its child would fail to bind and be restarted for
    ever, and the other process could even answer the gateway's readiness probe."""
    zmq = [*((f"worker.endpoints[{i}]", ep) for i, ep in enumerate(_worker_endpoints(cfg, _n_workers(cfg, args)))),
           ("trainer.samples_endpoint", cfg.trainer.samples_endpoint),
           ("security.delta_pub_endpoint", cfg.security.delta_pub_endpoint),
           ("security.snapshot_endpoint", cfg.security.snapshot_endpoint),
           ("security.ack_endpoint", cfg.security.ack_endpoint)]
    # a child whose exporter cannot bind runs without it, and the other process answers its scrapes
    met = cfg.metrics
    exporters = [*((f"metrics.worker_port (worker-{i})", met.worker_port + i)
                   for i in range(_n_workers(cfg, args)) if met.worker_port),
                 *((f"metrics.trainer_port (rank {r})", met.trainer_port + r)
                   for r in range(_n_ranks(cfg, args)) if met.trainer_port)]
    wanted = [("gateway.port (--port)", f"tcp://{cfg.gateway.host}:{cfg.gateway.port}"),
              *((setting, bind_address(endpoint, cfg.zmq.bind_host)) for setting, endpoint in zmq),
              *((setting, f"tcp://{met.bind_host}:{port}") for setting, port in exporters)]
    taken = []
    for setting, address in wanted:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if port.isdigit() and listened_on(host.strip("[]"), int(port)):
            taken.append(f"{setting} ({host}:{port})")
    return taken


def wait_ready(base: str, timeout_s: float, sup: Supervisor) -> bool:
    """Poll the gateway's /readyz until it answers 200 (Redis reachable), time runs out, a stop
    is asked for or a child exits."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not sup.stopping and sup.exited() is None:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as resp:  # noqa: S310 - our own loopback URL
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def _redis_answers(cfg: Config) -> bool:
    """Whether Redis answers now (refusing our credentials counts as answering: no wait mends that)."""
    try:
        return check_access(cfg.redis, timeout_s=2.0)
    except ConfigError:
        return True


def main(cfg: Config, args: Any) -> int:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from shared.redis_embed import resolve_redis

    if getattr(args, "host", None):
        cfg.gateway.host = args.host
    if getattr(args, "port", None):
        cfg.gateway.port = args.port
    var_dir = config_var_dir().resolve()
    check_var_free(var_dir)  # before the ports: another mesh on this var/ holds them too
    taken = ports_taken(cfg, args)
    if taken:
        raise ConfigError("another process listens where this mesh would: " + ", ".join(taken)
                          + "; stop it, or give this mesh other ports (--port, --config)")
    held = hold_var(var_dir)  # noqa: F841 - held until this process ends
    redis_configured = bool(cfg.redis.url)
    redis_proc = resolve_redis(cfg.redis, var_dir)
    redis_url = redact_url(cfg.redis.url or "")
    if redis_proc is None and not redis_configured:
        log.warning("using the Redis already answering at %s: its sample log, trainer offsets and model version "
                    "are shared with whatever else uses that database; set REDIS_URL for a mesh of its own", redis_url)
    try:
        if not check_access(cfg.redis):  # wrong credentials stop the mesh here, with one message
            log.warning("Redis at %s does not answer; the mesh starts and waits for it", redis_url)
        elif is_cluster(cfg.redis):
            seed_more_nodes(cfg)
        api_keys, admin_key = load_or_create_keys(var_dir, cfg)
        state_keys = load_or_create_request_state_keys(var_dir, cfg)
        prepare_keys(cfg, var_dir)
        ignored = {name for name, _ in unknown_env_variables(cfg)}  # `learnmesh` has warned of them, once
        envs = {role: child_env(path, ignored)
                for role, path in child_configs(cfg, args, var_dir, api_keys, admin_key, state_keys).items()}
        sup = Supervisor(build_children(cfg, args, envs, var_dir), redis_answers=lambda: _redis_answers(cfg))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: sup.stop())
        sup.start()
        loopback = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104 - a wildcard bind answers on loopback
        probe = _url("http", loopback.get(cfg.gateway.host, cfg.gateway.host), cfg.gateway.port)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            ready = wait_ready(probe, deadline - time.monotonic(), sup)
            died = None if sup.stopping else sup.exited()
            if died is None or not sup.mend_before_ready(died):
                break
        if not sup.stopping:  # Ctrl-C / SIGTERM while it starts: it stops, it never was up
            if not ready:
                log.warning("the gateway is not ready after %.0fs; see %s", READY_TIMEOUT_S,
                            var_dir / "logs" / "gateway.log")
            redis_note = (f"private, started here; password in {cfg.redis.password_file}" if redis_proc is not None
                          else "existing cluster" if is_cluster(cfg.redis) else "existing server")
            print(_banner(cfg, f"{redis_url}   ({redis_note})", var_dir, api_keys, admin_key), flush=True)
        sup.run()
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            try:
                redis_proc.wait(5)
            except subprocess.TimeoutExpired:
                redis_proc.kill()
    if sup.failed is not None:
        print(f"learnmesh: {sup.failed}", file=sys.stderr, flush=True)
    return sup.exit_code


def check_var_free(var_dir: Path) -> None:
    """Refuse ``var_dir`` when another `learnmesh up` holds it, creating nothing (see :func:`hold_var`)."""
    try:
        f = open(var_dir / "up.lock")  # noqa: SIM115 - closed below
    except OSError:  # none yet, or unreadable: hold_var says what is wrong
        return
    with f:
        _lock(f, var_dir)


def _lock(f: IO[str], var_dir: Path) -> None:
    """Take ``var_dir``'s lock on ``f``; ConfigError naming the holder's pid when another has it."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        raise ConfigError(f"another learnmesh up (pid {holder}) uses {var_dir}; stop it, or give this mesh a "
                          f"directory of its own (LEARNMESH_VAR)") from None


def hold_var(var_dir: Path) -> IO[str]:
    """Lock ``var_dir`` for this mesh (``var_dir/up.lock``, released when the process ends, by
    kill -9 too). A second mesh on the same directory would roll back the first one's commit
    record from its own checkpoints and write into its keys and logs, whatever its ports."""
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
        f = open(var_dir / "up.lock", "a+")  # noqa: SIM115 - open for the life of the process
    except OSError as exc:
        raise ConfigError(f"LEARNMESH_VAR: {var_dir} is not a directory this mesh can write to "
                          f"({exc.strerror or exc}: {exc.filename}); give it one that is") from None
    try:
        _lock(f, var_dir)
    except ConfigError:
        f.close()
        raise
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def seed_more_nodes(cfg: Config) -> None:
    """Hand every process the cluster's nodes as they are at start (``redis.cluster_nodes``), not
    only the URL's: a child restarted while that one node is down (a master killed and failed
    over) finds the cluster through the others instead of failing until the node returns."""
    known = {*cfg.redis.cluster_nodes, urlsplit(url_of(cfg.redis)).netloc.rpartition("@")[2]}
    more = [a for a in cluster_addresses(cfg.redis) if a not in known]
    if more:
        cfg.redis.cluster_nodes = [*cfg.redis.cluster_nodes, *more]
        log.info("the cluster's other %d node(s) are seeds of every process too: %s", len(more), ", ".join(more))


def _is_config_variable(name: str) -> bool:
    """Environment variables that configure learnmesh (some carry secrets): a child gets its
    configuration from its file instead, so none of them is passed on."""
    return name == "REDIS_URL" or (name.startswith(ENV_PREFIX) and (
        "__" in name or name == CONFIG_ENV or name.removesuffix("_FILE") in ("LEARNMESH_API_KEYS",
                                                                            "LEARNMESH_ADMIN_KEY")))


def child_env(config_path: Path, ignored: typing.Collection[str] = ()) -> dict[str, str]:
    """A child's environment: this one without learnmesh's configuration variables and the
    ``ignored`` ones, plus the path of the child's configuration file."""
    env = {k: v for k, v in os.environ.items() if not _is_config_variable(k) and k not in ignored}
    env.update({CONFIG_ENV: str(config_path), "PYTHONUNBUFFERED": "1"})
    return env


def _url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, an IPv6 address in brackets (RFC 3986)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _banner(cfg: Config, redis: str, var_dir: Path, api_keys: dict[str, str], admin_key: str) -> str:
    base = _url("http", cfg.gateway.host, cfg.gateway.port)
    return "\n".join([
        "learnmesh is up",
        f"  MCP endpoint   {base}/mcp   (WebSocket: {_url('ws', cfg.gateway.host, cfg.gateway.port)}/mcp/ws)",
        f"  admin API      {base}/admin   (OpenAPI: {base}/admin/openapi.json)",
        f"  dashboard      {base}/admin/ui",
        f"  metrics        {base}/metrics",
        f"  redis          {redis}",
        f"  logs           {var_dir / 'logs'}",
        "  MCP API keys   " + ", ".join(f"{p}: {k}" for p, k in api_keys.items()),
        f"  admin key      {admin_key}",
        "Ctrl-C stops everything.",
    ])
