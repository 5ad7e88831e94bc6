"""Configuration: one YAML file plus LEARNMESH_* overrides, validated once, failing loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import Config, ConfigError, load_config, parse_api_keys

ROOT = Path(__file__).resolve().parents[1]


def test_example_file_lists_every_default() -> None:
    cfg = load_config(ROOT / "learnmesh.example.yaml", env={})
    assert cfg == Config()


def test_env_overrides_and_shortcuts(tmp_path: Path) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text("gateway:\n  port: 9000\ncompression:\n  density: 0.05\n")
    cfg = load_config(path, env={"LEARNMESH_GATEWAY__PORT": "9100", "LEARNMESH_API_KEYS": "alice:KEY1aaaa,bob:KEY2bbbb",
                                 "REDIS_URL": "redis://example:6379/3"})
    assert cfg.gateway.port == 9100
    assert cfg.compression.density == 0.05
    assert cfg.gateway.api_keys == {"alice": "KEY1aaaa", "bob": "KEY2bbbb"}
    assert cfg.redis.url == "redis://example:6379/3"


@pytest.mark.parametrize("text, message", [
    ("gateway:\n  prot: 1\n", "gateway.prot"),
    ("bogus: {}\n", "bogus"),
    ("gateway:\n  port: 70000\n", "gateway.port"),
    ("gateway:\n  port: eighty\n", "gateway.port"),
    ("compression:\n  density: 2\n", "compression.density"),
    ("trainer:\n  comm_hook: magic\n", "trainer.comm_hook"),
    ("- a list\n", "mapping"),
])
def test_bad_files_fail_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(path, env={})


def test_bad_api_key_spec_is_refused() -> None:
    with pytest.raises(ConfigError):
        parse_api_keys("alice")
    with pytest.raises(ConfigError):
        load_config(env={"LEARNMESH_API_KEYS": "alice:short"})


def test_cli_reports_config_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    path = tmp_path / "learnmesh.yaml"
    path.write_text("worker:\n  max_batch_size: 0\n")
    assert main(["--config", str(path), "gateway"]) == 2
    err = capsys.readouterr().err
    assert "worker.max_batch_size" in err and "Traceback" not in err
