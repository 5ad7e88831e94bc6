"""examples/demo.py and examples/ws_demo.py for a newcomer: the key `make run` generated is
found from any directory, and a key the gateway refuses or a mesh that is not up ends the demo
with one line that says what to do (exit status 2), not a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

ROOT = Path(__file__).resolve().parents[1]
DEMOS = {"demo": ("http", "/mcp"), "ws_demo": ("ws", "/mcp/ws")}
KEY = "demo-key-0123456789"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LEARNMESH_VAR", "LEARNMESH_KEY", "LEARNMESH_URL",
                                                           "LEARNMESH_WS_URL")}


def demo(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def gateway(redis_server: str) -> Iterator[int]:
    port = free_port()
    proc = start_gateway(port, redis_server, api_keys=f"demo:{KEY}")
    yield port
    stop(proc)


def test_the_generated_key_is_found_from_another_directory(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "examples").mkdir(parents=True)
    for name in ("demo.py", "facts.py"):
        shutil.copy(ROOT / "examples" / name, repo / "examples" / name)
    (repo / "var" / "keys").mkdir(parents=True)
    (repo / "var" / "keys" / "generated.yaml").write_text(yaml.safe_dump({"api_keys": {"demo": KEY}}))
    (tmp_path / "elsewhere").mkdir()
    code = f"import sys; sys.path.insert(0, {str(repo / 'examples')!r}); import demo; print(demo.default_key())"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "elsewhere", env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == KEY


@pytest.mark.parametrize("name", sorted(DEMOS))
@pytest.mark.parametrize("key, told", [("not-the-key-0123456789", "refused the key"), ("", "wants a key")])
def test_a_refused_key_is_one_line(gateway: int, name: str, key: str, told: str) -> None:
    scheme, path = DEMOS[name]
    run = demo(name, "--url", f"{scheme}://127.0.0.1:{gateway}{path}", "--key", key)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [f"the gateway {told} (HTTP 401): pass --key or set LEARNMESH_KEY; "
                                       "`make run` prints the demo key"]


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_no_mesh_is_one_line(name: str) -> None:
    scheme, path = DEMOS[name]
    url = f"{scheme}://127.0.0.1:{free_port()}{path}"
    run = demo(name, "--url", url, "--key", KEY)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [f"nothing answers at {url}; is the mesh up?"]
