"""The conformance fixtures live in the source checkout, outside the package: a checkout's
gateway loads them (listed first, where the suite probes), and a gateway without them — an
installed wheel — refuses ``--fixtures`` with a clear message instead of starting."""

from __future__ import annotations

from pathlib import Path

import pytest

import gateway
from gateway import app as gateway_app
from services import cli
from shared.config import ConfigError, load_config


def test_fixtures_are_not_part_of_the_package() -> None:
    package = Path(gateway.__file__).resolve().parent
    assert not list(package.rglob("*fixtures*")), "test scaffolding must not ship in the gateway package"
    assert gateway_app.FIXTURES["conformance"].is_file()


def test_a_checkout_registers_the_conformance_fixtures_first() -> None:
    app = gateway_app.create_app(load_config(env={}, overrides={}), fixtures="conformance")
    names = list(app.registry.tools)
    assert names[0] == "test_simple_text"
    assert {"context_append", "generate", "learn"} <= set(names)


def test_without_the_checkout_fixtures_are_refused_clearly(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(gateway_app.FIXTURES, "conformance", tmp_path / "conformance" / "fixtures.py")
    with pytest.raises(ConfigError, match="source checkout"):
        gateway_app.create_app(load_config(env={}, overrides={}), fixtures="conformance")
    monkeypatch.delenv("LEARNMESH_CONFIG", raising=False)
    assert cli.main(["gateway", "--fixtures", "conformance"]) == 2
    assert "source checkout" in capsys.readouterr().err
