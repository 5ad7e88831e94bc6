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

from shared.redis_embed import start_redis
from tests.conftest import free_port, wait_for_sync
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


@pytest.mark.parametrize("name, mode", [("demo", []), ("demo", ["--mode", "legacy"]), ("ws_demo", ["--stateless"]),
                                        ("ws_demo", [])])
def test_a_redis_away_for_seconds_delays_the_demo_and_loses_nothing(tmp_path: Path, name: str,
                                                                    mode: list[str]) -> None:
    """A Redis restart (or a cluster's failover) is seconds of -32050 + Retry-After on every call
    that needs it: the demo, which users copy, waits what the answer asks and carries on; it
    does not end at the first one. (No worker runs here, so it ends, as it says, at generate.)"""
    free_redis = free_port()
    url, server = start_redis(tmp_path / "redis", port=free_redis)
    gw_port = free_port()
    gw = start_gateway(gw_port, url, api_keys=f"demo:{KEY}",
                       overrides={"redis": {"retry_after_s": 1, "socket_timeout_s": 1.0}})
    scheme, path = DEMOS[name]
    out_path = tmp_path / "demo.out"
    try:
        server.terminate()
        server.wait(timeout=10)
        with out_path.open("w") as out:
            run = subprocess.Popen([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--url",
                                    f"{scheme}://127.0.0.1:{gw_port}{path}", "--key", KEY, "--timeout", "1",
                                    "--context", "outage", *mode], cwd=ROOT, env=_env(), stdout=out,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_sync(lambda: "asking again" in out_path.read_text() or run.poll() is not None, timeout_s=30,
                          what="the demo waiting for Redis")
            assert run.poll() is None, out_path.read_text()
            _, server = start_redis(tmp_path / "redis", port=free_redis)
            assert run.wait(timeout=60) == 1, out_path.read_text()
        finally:
            if run.poll() is None:
                run.kill()
        text = out_path.read_text()
        # told once why it waits: a call's -32050, or (WebSocket) the upgrade's HTTP 503
        assert text.count("asking again") == 1 and ("-32050" in text or "HTTP 503" in text), text
        assert "version 2 (text turn linked to" in text, text  # both appends made once Redis was back
        assert "error -32050: no inference worker" in text.splitlines()[-1], text
        assert "Traceback" not in text, text
    finally:
        stop(gw)
        server.terminate()
        server.wait(timeout=10)
