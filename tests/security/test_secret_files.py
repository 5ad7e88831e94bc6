"""A key file another local user can read is a key that user holds: every file learnmesh reads
a secret from is refused when group or others may read it, with the file and the fix named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.supervisor import load_or_create_keys
from shared.config import ConfigError, load_config
from shared.crypto import KeyFileError, KeyRing
from shared.redis_client import client_kwargs
from shared.secret_files import InsecureFileError, read_private_text, write_private

ROOT = Path(__file__).resolve().parents[2]


def _opened(path: Path, mode: int = 0o644) -> Path:
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_file_open_to_group_or_others_is_refused_naming_it_and_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secret"
    write_private(path, "s3cret-value")
    assert read_private_text(path) == "s3cret-value"
    _opened(path, mode)
    with pytest.raises(InsecureFileError) as err:
        read_private_text(path)
    assert str(path) in str(err.value) and f"chmod 600 {path}" in str(err.value)
    assert "s3cret-value" not in str(err.value)


def test_the_delta_key_ring_is_refused_when_others_can_read_it(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "delta.key"
    KeyRing.load_or_create(path)
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    _opened(path)
    with pytest.raises(KeyFileError, match=r"chmod 600"):
        KeyRing.load(path)


def test_generated_keys_redis_password_and_key_file_shortcuts_are_refused_when_open(tmp_path: Path) -> None:
    cfg = load_config(env={})
    load_or_create_keys(tmp_path, cfg)
    _opened(tmp_path / "keys" / "generated.yaml")
    with pytest.raises(InsecureFileError, match="generated.yaml"):
        load_or_create_keys(tmp_path, cfg)

    pw = tmp_path / "redis.password"
    write_private(pw, "pw-123")
    assert client_kwargs(load_config(env={}, overrides={"redis": {"password_file": str(pw)}}).redis) == \
        {"password": "pw-123"}
    _opened(pw, 0o640)
    with pytest.raises(ConfigError, match="redis.password_file"):
        client_kwargs(load_config(env={}, overrides={"redis": {"password_file": str(pw)}}).redis)

    admin = tmp_path / "admin_key"
    write_private(admin, "admin-key-0123456789\n")
    cfg = load_config(env={"LEARNMESH_ADMIN_KEY_FILE": str(admin)})
    assert cfg.gateway.admin_keys["env"].key == "admin-key-0123456789"
    _opened(admin)
    with pytest.raises(ConfigError, match="LEARNMESH_ADMIN_KEY_FILE"):
        load_config(env={"LEARNMESH_ADMIN_KEY_FILE": str(admin)})


@pytest.mark.parametrize("command", [["trainer", "--ranks", "1"], ["worker", "--endpoint", "tcp://127.0.0.1:1"]])
def test_a_process_refuses_to_start_on_a_readable_delta_key_file(command: list[str], tmp_path: Path) -> None:
    key = tmp_path / "delta.key"
    KeyRing.load_or_create(key)
    _opened(key)
    config = tmp_path / "learnmesh.yaml"
    config.write_text(yaml.safe_dump({"security": {"delta_key_file": str(key)}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    done = subprocess.run([sys.executable, "-m", "services.cli", "--config", str(config), *command], cwd=ROOT,
                          env={**env, "REDIS_URL": "redis://127.0.0.1:1/0"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"chmod 600 {key}" in done.stderr and "Traceback" not in done.stderr
