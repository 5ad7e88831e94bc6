"""``learnmesh up`` keeps secrets out of its children's environments (``/proc/<pid>/environ``
is copied into every process a child starts and shows up in crash reports), and its private
Redis requires a generated password that no other local user can read.

Both tests run a real, tiny mesh (gateway, trainer with one gloo rank)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from redis_servers import STARTERS

from bench.mesh_support import write_mesh_config
from shared.secret_files import write_private
from tests.conftest import wait_for_sync

ROOT = Path(__file__).resolve().parents[2]
API_KEY, ADMIN_KEY = "alice-key-0123456789", "admin-key-0123456789"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


def _descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone meanwhile
        return b""


class Up:
    """``learnmesh up`` (``argv`` before it: e.g. a network namespace) with its output in a file."""

    def __init__(self, workdir: Path, env: dict[str, str], prefix: list[str], *args: str) -> None:
        self.log = workdir / "up.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "services.cli", "up", *args], cwd=ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self) -> str:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"learnmesh up exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            return "learnmesh is up" in self.text()
        wait_for_sync(up, timeout_s=240, interval_s=0.25, what=lambda: "learnmesh up:\n" + self.text()[-4000:])
        return self.text()

    def children(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", self.text())}

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator:
    server = STARTERS["password"](tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


def test_children_environments_hold_no_key_and_no_redis_password(tmp_path: Path, password_redis) -> None:
    var = tmp_path / "var"
    config = tmp_path / "learnmesh.yaml"
    cfg = write_mesh_config(config, var, workers=1, metrics={"worker_port": 0, "trainer_port": 0})
    port = password_redis.url.rsplit(":", 1)[1].split("/")[0]
    secret_url = f"redis://:{password_redis.secret}@127.0.0.1:{port}/0"
    env = _clean_env(REDIS_URL=secret_url, LEARNMESH_API_KEYS=f"alice:{API_KEY}", LEARNMESH_ADMIN_KEY=ADMIN_KEY,
                     LEARNMESH_CONFIG=str(config), LEARNMESH_VAR=str(var))
    up = Up(tmp_path, env, [], "--workers", "1", "--ranks", "1")
    try:
        banner = up.wait_up()
        assert password_redis.secret not in banner and f"redis://:***@127.0.0.1:{port}/0" in banner
        children = up.children()
        assert set(children) == {"trainer", "worker-0", "gateway"}
        base = f"http://127.0.0.1:{cfg['gateway']['port']}"
        # every child reached the passworded Redis: rank 0 resumed from its ledger, the worker reports
        trainer_log = var / "logs" / "trainer.log"
        wait_for_sync(lambda: "resumed at step" in trainer_log.read_text(errors="replace"), timeout_s=240,
                      interval_s=0.25, what=lambda: "trainer rank 0:\n" + trainer_log.read_text()[-3000:])
        wait_for_sync(lambda: httpx.get(f"{base}/admin/workers", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                                        timeout=10).json().get("workers"), timeout_s=240, interval_s=0.25,
                      what="the worker's status report in Redis")
        pids = set().union(*(_descendants(pid) for pid in children.values()))
        assert len(pids) > len(children), "the trainer's rank runs below it"
        for pid in pids:
            environ = _environ(pid)
            for secret in (API_KEY, ADMIN_KEY, password_redis.secret):
                assert secret.encode() not in environ, f"pid {pid} has a secret in its environment"
            assert b"REDIS_URL=" not in environ and b"LEARNMESH_ADMIN_KEY" not in environ
        # the gateway got its keys all the same, through its 0600 configuration file
        assert httpx.get(f"{base}/admin/workers", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10).status_code == 200
        assert httpx.get(f"{base}/admin/workers", headers={"authorization": "Bearer wrong-key-0123"},
                         timeout=10).status_code == 401
        for role in ("gateway", "worker", "trainer"):
            path = var / "keys" / f"config-{role}.yaml"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            gateway_keys = yaml.safe_load(path.read_text())["gateway"]
            assert bool(gateway_keys["api_keys"]) == bool(gateway_keys["admin_keys"]) == (role == "gateway")
    finally:
        assert up.stop() == 0, up.text()[-4000:]


def _netns_available() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("nsenter") and shutil.which("redis-cli")
            and shutil.which("redis-server")):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _netns_available(), reason="needs unshare -n (root), ip, nsenter, redis-server, redis-cli")
def test_the_private_redis_of_an_existing_var_gets_a_password_no_one_else_can_read(tmp_path: Path) -> None:
    """No Redis configured and none on 6379 (a network namespace of its own, as on a fresh
    machine): ``up`` starts redis-server with a generated password, in a var/ an earlier run
    left without one."""
    var = tmp_path / "var"
    (var / "redis").mkdir(parents=True, mode=0o755)
    write_private(var / "keys" / "generated.yaml", yaml.safe_dump({"api_keys": {"demo": "earlier-demo-key-123"},
                                                                    "admin_key": "earlier-admin-key-123"}))
    config = tmp_path / "learnmesh.yaml"
    write_mesh_config(config, var, workers=0)
    env = _clean_env(LEARNMESH_CONFIG=str(config), LEARNMESH_VAR=str(var))
    up = Up(tmp_path, env, ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"'],
            "--workers", "0", "--ranks", "1")
    try:
        banner = up.wait_up()
        trainer_log = var / "logs" / "trainer.log"  # rank 0 reached Redis with the password
        wait_for_sync(lambda: "resumed at step" in trainer_log.read_text(errors="replace"), timeout_s=240,
                      interval_s=0.25, what=lambda: "trainer rank 0:\n" + trainer_log.read_text()[-3000:])
        password_file = var / "keys" / "redis.password"
        password = password_file.read_text().strip()
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600 and len(password) >= 32
        assert stat.S_IMODE((var / "redis").stat().st_mode) == 0o700
        assert password not in banner and f"password in {password_file}" in banner
        assert "earlier-demo-key-123" in banner  # the earlier run's keys still hold
        port = re.search(r"redis +redis://127\.0\.0\.1:(\d+)/0", banner).group(1)
        servers = [pid for pid in _descendants(up.proc.pid)
                   if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert servers, "the private redis-server runs under learnmesh up"
        for pid in servers:  # what every local user can read
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert password.encode() not in _environ(pid)
        netns = ["nsenter", f"--net=/proc/{up.proc.pid}/ns/net", "redis-cli", "-p", port]
        anonymous = subprocess.run([*netns, "ping"], capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr
        authed = subprocess.run([*netns, "ping"], capture_output=True, text=True, timeout=10,
                                env={**os.environ, "REDISCLI_AUTH": password})
        assert authed.stdout.strip() == "PONG"
    finally:
        assert up.stop() == 0, up.text()[-4000:]
