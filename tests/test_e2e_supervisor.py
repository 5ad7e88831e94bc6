"""`learnmesh up` pieces that need no running mesh: generated keys and $LEARNMESH_VAR paths."""

from __future__ import annotations

import stat
from pathlib import Path

from conftest import free_port

from services.supervisor import Child, Supervisor, _var_overrides, load_or_create_keys, wait_ready
from shared.config import load_config


def test_keys_are_generated_once_private_and_config_keys_win(tmp_path: Path) -> None:
    cfg = load_config(env={})
    keys1, admin1 = load_or_create_keys(tmp_path, cfg)
    path = tmp_path / "keys" / "generated.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_keys(tmp_path, cfg) == (keys1, admin1)
    mine = load_config(env={"LEARNMESH_API_KEYS": "alice:alice-key-123", "LEARNMESH_ADMIN_KEY": "admin-key-123"})
    assert load_or_create_keys(tmp_path, mine) == ({"alice": "alice-key-123"}, "admin-key-123")


def test_default_var_paths_move_under_learnmesh_var(tmp_path: Path) -> None:
    env = _var_overrides(load_config(env={}), tmp_path)
    assert env["LEARNMESH_TRAINER__CHECKPOINT_DIR"] == str(tmp_path / "checkpoints")
    assert env["LEARNMESH_MODEL__CACHE_DIR"] == str(tmp_path / "model")
    assert env["LEARNMESH_SECURITY__DELTA_KEY_FILE"] == str(tmp_path / "keys" / "delta.key")
    explicit = load_config(env={}, overrides={"trainer": {"checkpoint_dir": "/elsewhere"}})
    assert "LEARNMESH_TRAINER__CHECKPOINT_DIR" not in _var_overrides(explicit, tmp_path)
    # what the children get parses back into the config they run with
    assert load_config(env=env).trainer.checkpoint_dir == str(tmp_path / "checkpoints")


def test_wait_ready_gives_up_on_a_gateway_that_never_answers() -> None:
    sup = Supervisor([Child("none", ["true"], {})])
    assert wait_ready(f"http://127.0.0.1:{free_port()}", 0.5, sup) is False
