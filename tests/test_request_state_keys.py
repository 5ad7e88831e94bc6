"""The key sealing 2026-07-28 ``requestState`` as each way of running learnmesh provides it:
``learnmesh up`` generates one and keeps it in ``var/keys/generated.yaml``, compose and
Kubernetes hand every gateway replica the same one through ``LEARNMESH_REQUEST_STATE_KEYS_FILE``.
A state one replica seals is opened by another, and by the same gateway after a restart; a
gateway left without keys seals with one of its own, which no other process opens."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from services.supervisor import child_configs, load_or_create_keys, load_or_create_request_state_keys
from shared.config import ConfigError, load_config
from shared.secret_files import write_private
from tests.conftest import RedisTarget, free_port, wait_for_sync
from tests.gateway_support import stop

ROOT = Path(__file__).resolve().parents[1]
MODERN = "2026-07-28"
KEY = "alice-key-0123456789"
TOOL = "test_input_required_result_request_state"


def test_up_generates_one_key_keeps_it_and_hands_it_to_the_gateway_alone(tmp_path: Path) -> None:
    cfg = load_config(env={})
    keys = load_or_create_request_state_keys(tmp_path, cfg)
    assert len(keys) == 1 and len(bytes.fromhex(keys[0])) == 32
    path = tmp_path / "keys" / "generated.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    api_keys, admin = load_or_create_keys(tmp_path, cfg)  # the same file: neither write loses the other
    assert load_or_create_request_state_keys(tmp_path, cfg) == keys, "the next start: the same key"
    assert load_or_create_keys(tmp_path, cfg) == (api_keys, admin)

    given = ["ab" * 32, "cd" * 16]
    mine = load_config(env={"LEARNMESH_REQUEST_STATE_KEYS": ",".join(given)})
    assert load_or_create_request_state_keys(tmp_path, mine) == given
    assert "ab" * 32 not in path.read_text(), "keys an operator chose are never written to the generated keys file"

    paths = child_configs(cfg, argparse.Namespace(workers=None), tmp_path, api_keys, admin, keys)
    assert load_config(paths["gateway"], env={}).gateway.request_state_keys == keys
    for role in ("worker", "trainer"):
        assert load_config(paths[role], env={}).gateway.request_state_keys == [], role


def test_the_keys_file_shortcut_takes_a_key_per_line_and_refuses_what_is_no_key(tmp_path: Path) -> None:
    path = tmp_path / "request_state_keys"
    write_private(path, f"{'ab' * 32}\n{'cd' * 32}\n")
    cfg = load_config(env={"LEARNMESH_REQUEST_STATE_KEYS_FILE": str(path)})
    assert cfg.gateway.request_state_keys == ["ab" * 32, "cd" * 32]
    for bad in ("not-hex", "ab" * 15, "a" * 33):  # not hex; 15 bytes; an odd number of digits
        write_private(path, bad)
        with pytest.raises(ConfigError) as e:
            load_config(env={"LEARNMESH_REQUEST_STATE_KEYS_FILE": str(path)})
        assert str(e.value) == ("gateway.request_state_keys.0: must be hex digits, an even number of them and at "
                                "least 32 (16 bytes)"), "named in words, the value never echoed"
    write_private(path, "ab" * 32)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="LEARNMESH_REQUEST_STATE_KEYS_FILE"):
        load_config(env={"LEARNMESH_REQUEST_STATE_KEYS_FILE": str(path)})


def _learnmesh_keys(var: Path, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    done = subprocess.run([sys.executable, "-m", "services.cli", "keys"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "LEARNMESH_VAR": str(var), **extra}, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_learnmesh_keys_writes_ups_key_to_a_file_gateways_started_by_hand_load(tmp_path: Path) -> None:
    var = tmp_path / "var"
    out = _learnmesh_keys(var)
    path = var / "keys" / "request-state.keys"
    assert f"request-state key (every gateway) made: {path}" in out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_config(env={"LEARNMESH_REQUEST_STATE_KEYS_FILE": str(path)}).gateway.request_state_keys
    assert loaded == load_or_create_request_state_keys(var, load_config(env={})), "the key `learnmesh up` seals with"
    assert loaded[0] not in out, "the key itself is never printed"

    rotated = f"{'ef' * 32}\n{loaded[0]}\n"  # an operator's rotation in progress
    write_private(path, rotated)
    assert "kept" in _learnmesh_keys(var) and path.read_text() == rotated

    given = tmp_path / "given"
    out = _learnmesh_keys(given, LEARNMESH_REQUEST_STATE_KEYS="ab" * 32)
    assert "given by gateway.request_state_keys; no file made" in out
    assert not (given / "keys" / "request-state.keys").exists() and "ab" * 32 not in out


@contextmanager
def _gateway(tmp_path: Path, name: str, redis_url: str, keys_file: Path | None) -> Iterator[str]:
    """A real `learnmesh gateway` with the conformance fixtures; yields its /mcp URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    env.update(REDIS_URL=redis_url, LEARNMESH_API_KEYS=f"alice:{KEY}",
               LEARNMESH_GATEWAY__AUTH_THROTTLE__FAILURES_PER_SOURCE="0")
    if keys_file is not None:
        env["LEARNMESH_REQUEST_STATE_KEYS_FILE"] = str(keys_file)
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port",
                                 str(port), "--fixtures", "conformance"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for_sync(ready, timeout_s=60, what=f"gateway {name}")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


def _call(url: str, **params: object) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": TOOL, "arguments": {}, **params,
                       "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                 "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}}}
    headers = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
               "mcp-method": "tools/call", "mcp-name": TOOL, "authorization": f"Bearer {KEY}"}
    return httpx.post(url, json=body, headers=headers, timeout=30)


def test_replicas_given_one_keys_file_open_each_others_request_state(tmp_path: Path,
                                                                      redis_target: RedisTarget) -> None:
    keys_file = tmp_path / "request_state_keys"
    write_private(keys_file, "ef" * 32)
    answer = {"confirm": {"action": "accept", "content": {"ok": True}}}
    with _gateway(tmp_path, "a", redis_target.url, keys_file) as a, \
            _gateway(tmp_path, "b", redis_target.url, keys_file) as b, \
            _gateway(tmp_path, "alone", redis_target.url, None) as alone:
        first = _call(a).json()["result"]
        assert first["resultType"] == "input_required" and "confirm" in first["inputRequests"]
        state = first["requestState"]
        done = _call(b, requestState=state, inputResponses=answer)
        assert done.status_code == 200, done.text
        assert done.json()["result"]["content"][0]["text"].startswith("state-ok"), done.text
        refused = _call(alone, requestState=state, inputResponses=answer)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == -32602, refused.text
        own = _call(alone).json()["result"]["requestState"]
        assert _call(a, requestState=own, inputResponses=answer).json()["error"]["code"] == -32602
    assert "ephemeral key" in (tmp_path / "alone.log").read_text()
    for name in ("a", "b"):
        text = (tmp_path / f"{name}.log").read_text()
        assert "ephemeral key" not in text and "ef" * 32 not in text, name
    assert keys_file.read_text() == "ef" * 32, "the file is read, never rewritten"
