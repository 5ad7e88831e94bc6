"""Redis is the trust root (admin key hashes, the sample log every model learns from): every
learnmesh client authenticates — a password, an ACL user confined to learnmesh's keys, mutual
TLS — and a process whose credentials Redis refuses stops at start with one clear line.

Each server here is a real redis-server started for the test (tests/security/redis_servers.py).
Through each: the context store (the gateway's client and the trainer's reader), a live
gateway answering ``learn``, and the trainer's sample source reading what was learned."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis as redis_sync
import zmq
from redis_servers import LEARNMESH_ACL, STARTERS, SecuredRedis, make_pki

from services.trainer.data import ContextReader, SampleSource
from shared.config import Config, ConfigError, load_config
from shared.context import ContextStore
from shared.redis_client import RedisAccessError, async_client, check_access, redact_url, sync_client
from shared.secret_files import write_private
from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

ROOT = Path(__file__).resolve().parents[2]
MODERN = "2026-07-28"
API_KEY = "alice-key-0123456789"


@pytest.fixture(params=sorted(STARTERS))
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SecuredRedis]:
    server = STARTERS[request.param](tmp_path / request.param)
    try:
        yield server
    finally:
        server.stop()


def _config(settings: dict, **sections: dict) -> Config:
    return load_config(env={}, overrides={"redis": settings, **sections})


def _learn(port: int, text: str) -> dict:
    params = {"name": "learn", "arguments": {"input": text, "target": "a fact"},
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    headers = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
               "mcp-method": "tools/call", "mcp-name": "learn", "authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"http://127.0.0.1:{port}/mcp", headers=headers, timeout=10,
                   json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
    assert r.status_code == 200, r.text
    return orjson.loads(r.text)


def test_an_unauthenticated_client_is_refused(secured: SecuredRedis) -> None:
    """The servers really demand credentials (else every other test here proves nothing)."""
    plain = {k: v for k, v in secured.settings.items() if k not in ("password_file", "username")}
    with pytest.raises(RedisAccessError):
        check_access(_config(plain).redis)


async def test_store_gateway_and_sample_log_through_an_authenticated_redis(secured: SecuredRedis,
                                                                            tmp_path: Path) -> None:
    samples_endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = _config(secured.url_settings or secured.settings, trainer={"samples_endpoint": samples_endpoint})
    assert check_access(cfg.redis) is True

    # the context store, as the gateway opens it; then the trainer's reader of snapshots
    redis = async_client(cfg.redis)
    try:
        store = ContextStore(redis, cfg.context)
        appended = await store.append("alice", "notes", "text", "user", b"kept behind a password")
        window = await store.get_window("alice", "notes")
        assert [e.content for e in window.channels["text"]] == [b"kept behind a password"]
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()
    reader = ContextReader(cfg)
    try:
        snapshot = reader.read("alice", "notes", appended.version, ["text"])
        assert [e.content for e in snapshot.channels["text"]] == [b"kept behind a password"]
    finally:
        reader.close()

    # a live gateway: ready (its Redis answers it) and `learn` acknowledged into the sample log
    port = free_port()
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as out:
        gw = start_gateway(port, secured.url, f"alice:{API_KEY}", output=out, log_level="info", overrides={
            "redis": secured.settings, "worker": {"endpoints": []}, "trainer": {"samples_endpoint": samples_endpoint},
            "learning": {"teachers": ["alice"]}})
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
            result = _learn(port, "what does the trust root hold?")["result"]["structuredContent"]
            assert result["seqs"] == [1]
        finally:
            stop(gw)
    gateway_log = log_path.read_text(errors="replace")
    assert secured.secret not in gateway_log and "Traceback" not in gateway_log

    # the trainer's sample source, on the trainer's client, reads what the gateway logged
    ctx = zmq.Context()
    trainer_redis = sync_client(cfg.redis, socket_timeout=5)
    source = SampleSource(cfg, trainer_redis, ctx, {})
    try:
        got = source.next_batch(8, 100, lambda: False)
        assert [(s.seq, s.principal, s.sample.input) for s in got] == [(1, "alice", "what does the trust root hold?")]
    finally:
        source.close()
        trainer_redis.close()
        ctx.term()


def test_the_acl_user_reaches_only_learnmesh_keys(tmp_path: Path) -> None:
    """The ACL above is a real confinement: outside ``lm:*``, or a dangerous command, is refused."""
    server = STARTERS["acl"](tmp_path)
    try:
        client = sync_client(_config(server.settings).redis)
        try:
            client.set("lm:probe", b"1")
            for forbidden in (lambda: client.set("other-app:key", b"1"), client.flushall,
                              lambda: client.config_get("maxmemory")):
                with pytest.raises(redis_sync.exceptions.NoPermissionError):
                    forbidden()
        finally:
            client.close()
        assert "-@dangerous" in LEARNMESH_ACL
    finally:
        server.stop()


def _run_cli(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("command", [["gateway", "--port", "0"], ["worker", "--endpoint", "tcp://127.0.0.1:1"],
                                     ["trainer", "--ranks", "1"], ["up", "--workers", "1", "--ranks", "1"]])
def test_a_wrong_password_stops_each_process_at_start_with_one_clear_line(command: list[str],
                                                                          tmp_path: Path) -> None:
    server = STARTERS["password"](tmp_path)
    try:
        wrong = tmp_path / "wrong.password"
        write_private(wrong, "not-the-password-123")
        env = {"REDIS_URL": server.url, "LEARNMESH_REDIS__PASSWORD_FILE": str(wrong),
               "LEARNMESH_VAR": str(tmp_path / "var"),
               "LEARNMESH_SECURITY__DELTA_KEY_FILE": str(tmp_path / "var" / "keys" / "delta.key")}
        if command[0] == "gateway":
            command = ["gateway", "--port", str(free_port())]
        done = _run_cli(*command, env=env)
        out = done.stdout + done.stderr
        assert done.returncode == 2, out
        assert "refused this process: wrong user name or password" in out, out
        assert "Traceback" not in out and "not-the-password-123" not in out and server.secret not in out
        # no password at all: told so
        done = _run_cli(*command, env={k: v for k, v in env.items() if k != "LEARNMESH_REDIS__PASSWORD_FILE"})
        assert done.returncode == 2 and "requires a password and none is configured" in done.stderr, done.stderr
    finally:
        server.stop()


def test_tls_with_an_untrusted_server_certificate_or_no_client_certificate_is_a_clear_error(
        tmp_path: Path) -> None:
    server = STARTERS["tls"](tmp_path / "tls")
    try:
        other = make_pki(tmp_path / "other", "other")  # a CA this server's certificate does not chain to
        with pytest.raises(RedisAccessError, match="TLS certificate did not verify"):
            check_access(_config({**server.settings, "tls_ca_file": str(other.ca)}).redis)
        no_client_cert = {k: v for k, v in server.settings.items() if k not in ("tls_cert_file", "tls_key_file")}
        with pytest.raises(RedisAccessError, match="TLS"):
            check_access(_config(no_client_cert).redis)
        # rediss:// with the right CA and client certificate: in
        assert check_access(_config(server.settings).redis) is True
    finally:
        server.stop()


def test_urls_print_without_their_password() -> None:
    assert redact_url("redis://learnmesh:s3cret@redis:6379/0") == "redis://learnmesh:***@redis:6379/0"
    assert redact_url("rediss://:s3cret@[::1]:6380/1") == "rediss://:***@[::1]:6380/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0?password=s3cret&db=2") == "redis://127.0.0.1:6379/0?password=***&db=2"


@pytest.mark.parametrize(("redis", "problem"), [
    ({"password": "a-password", "password_file": "/run/secrets/redis_password"}, "not both"),
    ({"url": "redis://:in-url@redis:6379/0", "password": "a-password"}, "url already carries a password"),
    ({"url": "redis://redis:6379/0", "tls_ca_file": "/ca.crt"}, "need a rediss:// url"),
    ({"url": "rediss://redis:6379/0", "tls_cert_file": "/client.crt"}, "go together"),
])
def test_contradictory_redis_settings_fail_by_key(redis: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(env={}, overrides={"redis": redis})
    assert str(err.value).startswith("redis: ") and "a-password" not in str(err.value)
    assert "in-url" not in str(err.value)
