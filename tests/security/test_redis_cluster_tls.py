"""learnmesh on a Redis Cluster as production runs one: TLS on every port of every node (clients,
cluster bus, replication), client certificates required, the default user off and learnmesh's
own ACL user (tests/security/redis_servers.py: ``start_tls_cluster``, 3 masters + 3 replicas).

Configured as a user would: a ``rediss+cluster://learnmesh:PASSWORD@node/0`` URL naming one
node and ``redis.tls_*`` files; the other nodes are found from the cluster's map, so every
connection to them must carry the same credentials and TLS settings. Through it: the context
store and the trainer's reader, a live gateway (context append/read for principals whose keys
sit on different masters, ``learn`` into the sample log, admin listings across masters, the
function library on every master, the control and tasks channels), a worker announcing itself,
the trainer's sample source; the trainer process itself (training, its commit record and
checkpoints, its control plane, the sealed deltas a worker applies); a master added later and
a slot moved onto it; and the clear start-up errors of a wrong password or a missing CA. No
secret reaches a log."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync
import yaml
import zmq
from redis.cluster import key_slot
from redis_servers import LEARNMESH_ACL, SecuredCluster, make_pki, start_tls_cluster

from gateway import pubsub
from services.trainer import ledger
from services.trainer.checkpoint import load_bytes
from services.trainer.data import ContextReader, SampleSource
from shared import keys
from shared.config import Config, load_config
from shared.context import ContextStore
from shared.redis_client import (
    RedisAccessError,
    async_client,
    check_access,
    close_sync,
    for_each_primary,
    sync_client,
    without_password,
)
from shared.samples import partition_of, position_field, sample_partitions
from shared.text import as_str
from tests.conftest import free_port, wait_for, wait_for_sync
from tests.failover_drill import failover_drill
from tests.gateway_support import start_gateway, stop
from tests.trainer_support import TrainerProc, trained_total
from tests.worker_support import TINY_MODEL, spawn_worker

ROOT = Path(__file__).resolve().parents[2]
MODERN = "2026-07-28"
ADMIN_KEY = "cluster-admin-key-0123456789"
CANDIDATES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCluster]:
    cluster = start_tls_cluster(tmp_path_factory.mktemp("tls-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def flushed(secured: SecuredCluster) -> SecuredCluster:
    secured.cluster.flush()
    for node in secured.cluster.running():
        with node.client(socket_timeout=5) as c:
            c.acl_log_reset()
    return secured


def _config(settings: dict[str, Any], **sections: dict[str, Any]) -> Config:
    return load_config(env={}, overrides={"redis": settings, **sections})


def _master_ports(secured: SecuredCluster) -> dict[int, int]:
    """slot -> port of the master serving it (read as the admin user)."""
    out: dict[int, int] = {}
    with secured.admin_client() as c:
        for first, last, master, *_ in c.execute_command("CLUSTER SLOTS"):
            for slot in range(first, last + 1):
                out[slot] = int(master[1])
    return out


def _one_principal_per_master(secured: SecuredCluster) -> list[str]:
    """A principal whose keys live on each master (hash tag ``{principal}``), in master order."""
    slots = _master_ports(secured)
    by_port: dict[int, str] = {}
    for name in CANDIDATES:
        by_port.setdefault(slots[key_slot(f"{{{name}}}".encode())], name)
    assert len(by_port) == 3, by_port
    return [by_port[p] for p in sorted(by_port)]


def _denied(secured: SecuredCluster) -> list[str]:
    """What the ACL refused learnmesh on any node: ``command`` or ``command|subcommand``."""
    out = []
    for node in secured.cluster.running():
        with node.client(socket_timeout=5) as c:
            out += [f"{e['object']} ({e['reason']})" for e in c.acl_log() if e["username"] == "learnmesh"]
    return out


# ------------------------------------------------------------------------------ the refusals
def test_the_cluster_refuses_a_client_without_tls_or_credentials(secured: SecuredCluster) -> None:
    """Every node demands TLS, a client certificate and learnmesh's user (else the rest proves nothing)."""
    plain_url = secured.settings["url"].replace("rediss+cluster://", "redis+cluster://")
    assert check_access(_config({"url": plain_url}).redis, timeout_s=2) is False  # no TLS: no Redis answers
    with pytest.raises(RedisAccessError, match="requires a password"):
        check_access(_config({**secured.settings, "url": without_password(secured.settings["url"])[0]}).redis)
    for node in secured.cluster.nodes:
        with pytest.raises(redis_sync.ConnectionError):  # the bare default user over TLS: off
            redis_sync.Redis(host="127.0.0.1", port=node.port, ssl=True, ssl_ca_certs=str(secured.pki.ca),
                             ssl_certfile=str(secured.pki.client_cert), ssl_keyfile=str(secured.pki.client_key),
                             socket_timeout=2).ping()


def test_a_wrong_password_or_missing_ca_is_a_clear_error_without_secrets(secured: SecuredCluster,
                                                                       tmp_path: Path) -> None:
    wrong = secured.settings["url"].replace(secured.secret, "not-the-password-123")
    other_ca = make_pki(tmp_path / "other", "other").ca
    for settings, problem in [({**secured.settings, "url": wrong}, "wrong user name or password"),
                              ({k: v for k, v in secured.settings.items() if k != "tls_ca_file"},
                               "TLS certificate did not verify .* no redis.tls_ca_file is set"),
                              ({**secured.settings, "tls_ca_file": str(other_ca)}, "TLS certificate did not verify"),
                              ({k: v for k, v in secured.settings.items()
                                if k not in ("tls_cert_file", "tls_key_file")}, "TLS handshake failed")]:
        with pytest.raises(RedisAccessError, match=problem) as err:
            check_access(_config(settings).redis, timeout_s=5)
        message = str(err.value)
        assert secured.secret not in message and "not-the-password-123" not in message
        assert "rediss+cluster://learnmesh:***@" in message


@pytest.mark.parametrize("component", ["gateway", "trainer"])
@pytest.mark.parametrize("broken", ["password", "ca"])
def test_the_gateway_and_trainer_stop_at_start_with_one_clear_line(secured: SecuredCluster, tmp_path: Path,
                                                                   broken: str, component: str) -> None:
    """`learnmesh gateway` and `learnmesh trainer` as a user starts them (REDIS_URL and
    LEARNMESH_REDIS__* in the environment): exit status 2 and one line naming the problem, no
    traceback, no hang (the trainer's launcher stops before it starts any rank)."""
    url = secured.settings["url"]
    env = {"REDIS_URL": url.replace(secured.secret, "not-the-password-123") if broken == "password" else url,
           "LEARNMESH_REDIS__TLS_CERT_FILE": secured.settings["tls_cert_file"],
           "LEARNMESH_REDIS__TLS_KEY_FILE": secured.settings["tls_key_file"],
           "LEARNMESH_VAR": str(tmp_path / "var"),
           "LEARNMESH_SECURITY__DELTA_KEY_FILE": str(tmp_path / "var" / "keys" / "delta.key")}
    if broken == "password":
        env["LEARNMESH_REDIS__TLS_CA_FILE"] = secured.settings["tls_ca_file"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    command = ["gateway", "--port", str(free_port())] if component == "gateway" else ["trainer"]
    done = subprocess.run([sys.executable, "-m", "services.cli", *command],
                          cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    expected = ("wrong user name or password" if broken == "password" else
                "its TLS certificate did not verify (self-signed certificate in certificate chain) and no "
                "redis.tls_ca_file is set")
    assert f"refused this process: {expected}" in out, out
    assert "Traceback" not in out and secured.secret not in out and "not-the-password-123" not in out


# ------------------------------------------------------------------------------ the real path
async def test_store_reader_and_pubsub_on_every_master(flushed: SecuredCluster,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = _config(flushed.settings)
    assert check_access(cfg.redis) is True
    principals = _one_principal_per_master(flushed)
    redis = async_client(cfg.redis)
    try:
        store = ContextStore(redis, cfg.context, redis_cfg=cfg.redis)
        versions = {p: (await store.append(p, "notes", "text", "user", f"{p} over TLS".encode())).version
                    for p in principals}
        for p in principals:
            window = await store.get_window(p, "notes")
            assert [e.content for e in window.channels["text"]] == [f"{p} over TLS".encode()]
        assert sorted(await store.principals()) == sorted(principals)
        assert all(n > 0 for n in await for_each_primary(redis, lambda node: node.dbsize()))
        # the function library: on every master, each loaded through learnmesh's user
        libraries = await for_each_primary(redis, lambda node: node.function_list())
        assert len(libraries) == 3 and all(_has_library(libs) for libs in libraries), libraries

        # pub/sub: learnmesh's follower, on a node of the map, hears what the cluster client publishes
        heard: list[bytes] = []
        subscribed = asyncio.Event()

        async def on_subscribed() -> None:
            subscribed.set()

        async def heard_it() -> bool:  # PUBLISH counts only the receiving node's subscribers
            await redis.publish(keys.GATEWAY_CONTROL_CHANNEL, b"hello")
            return b"hello" in heard

        follower_redis = async_client(cfg.redis, socket_timeout=None)
        follower = asyncio.create_task(pubsub.follow(
            follower_redis, keys.GATEWAY_CONTROL_CHANNEL, heard.append, on_subscribed=on_subscribed,
            on_lost=lambda: None, what="test channel"))
        try:
            await asyncio.wait_for(subscribed.wait(), 10)
            await wait_for(heard_it, timeout_s=10, interval_s=0.2, what="the follower to hear a message")
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await follower_redis.aclose()
    finally:
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()

    reader = ContextReader(cfg)  # the trainer's reader of snapshots: its own client
    try:
        for p in principals:
            snapshot = reader.read(p, "notes", versions[p], ["text"])
            assert [e.content for e in snapshot.channels["text"]] == [f"{p} over TLS".encode()]
    finally:
        reader.close()
    assert _denied(flushed) == []
    assert flushed.secret not in caplog.text


def _has_library(libraries: list[Any]) -> bool:
    """Whether FUNCTION LIST's reply (RESP2: each library a flat name/value list) holds the
    context store's library."""
    return any(dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"].startswith(b"learnmesh_ctx_")
               for lib in libraries)


def _mcp(port: int, key: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    params = {"name": tool, "arguments": arguments,
              "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    headers = {"accept": "application/json, text/event-stream", "mcp-protocol-version": MODERN,
               "mcp-method": "tools/call", "mcp-name": tool, "authorization": f"Bearer {key}"}
    r = httpx.post(f"http://127.0.0.1:{port}/mcp", headers=headers, timeout=15,
                   json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
    assert r.status_code == 200, r.text
    body = orjson.loads(r.text)
    assert "error" not in body and not body["result"].get("isError"), body
    return dict(body["result"]["structuredContent"])


def _admin(port: int, method: str, path: str, status: int = 200) -> Any:
    r = httpx.request(method, f"http://127.0.0.1:{port}{path}", timeout=15,
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == status, r.text
    return r.json()


def _numsub(secured: SecuredCluster, channel: str) -> int:
    """Subscribers of ``channel`` over every node (a classic subscription lives on one node)."""
    total = 0
    for node in secured.cluster.running():
        with node.client(socket_timeout=5) as c:
            total += int(dict(c.pubsub_numsub(channel))[channel.encode()])
    return total


def _mesh_sections(secured: SecuredCluster, tmp_path: Path, teachers: list[str]) -> dict[str, Any]:
    """Settings for a gateway, a worker and a small, fast trainer (head-only training of the
    worker's tiny model, small batches) on the secured cluster."""
    return {
        # A TLS connect needs the handshake's round trips through both event loops: on a loaded
        # machine it can outlast the 2 s default, and uvloop then logs the abandoned handshake
        # with a traceback (redis-py connects again; docs/operations.md advises more with TLS).
        "redis": {**secured.settings, "socket_timeout_s": 10.0},
        "model": {**TINY_MODEL, "cache_dir": str(tmp_path / "model-cache"), "trainable": "head"},
        "worker": {"endpoints": [], "register_interval_ms": 200, "registration_ttl_ms": 1000,
                   "heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1500},
        "security": {"delta_key_file": str(tmp_path / "keys" / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "zmq": {"keys_dir": str(tmp_path / "keys" / "zmq")},
        # contexts are never copied into the sample log: the trainer reads them from the store
        "trainer": {"ranks": 1, "checkpoint_dir": str(tmp_path / "checkpoints"), "batch_size": 4,
                    "batch_wait_ms": 50, "checkpoint_every": 2, "samples_endpoint": f"tcp://127.0.0.1:{free_port()}",
                    "init_timeout_s": 60, "step_timeout_s": 20, "replay_passes": 1, "rehearsal_per_step": 0,
                    "max_context_copy_bytes": 0},
        "learning": {"teachers": teachers},
        "gateway": {"admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"}}},
        "metrics": {"worker_port": 0, "trainer_port": 0},
    }


def test_gateway_worker_and_trainer_through_the_secured_cluster(flushed: SecuredCluster, tmp_path: Path) -> None:
    principals = _one_principal_per_master(flushed)
    api_keys = {p: f"{p}-key-0123456789" for p in principals}
    worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
    sections = _mesh_sections(flushed, tmp_path, teachers=[principals[0]])
    samples_endpoint = sections["trainer"]["samples_endpoint"]
    config_path = tmp_path / "learnmesh.yaml"  # the worker's: the same settings, from a file
    config_path.write_text(yaml.safe_dump(sections))
    worker = spawn_worker(config_path, 0, worker_endpoint)

    port = free_port()
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as out:
        # the URL on the command line has no password: the real one travels in the environment
        gw = start_gateway(port, without_password(flushed.settings["url"])[0],
                           ",".join(f"{p}:{k}" for p, k in api_keys.items()),
                           overrides=sections, output=out, log_level="info")
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
            # context append and read over HTTP, principals whose keys sit on different masters
            for p in principals:
                appended = _mcp(port, api_keys[p], "context_append", {"context_id": "notes", "modality": "text",
                                                                        "text": f"{p} says hi"})
                got = _mcp(port, api_keys[p], "context_get", {"context_id": "notes"})
                assert got["version"] == appended["version"]
                assert [e["text"] for e in got["entries"]] == [f"{p} says hi"], got
            # learn: acknowledged into the sample log
            learned = _mcp(port, api_keys[principals[0]], "learn", {"input": "what guards the cluster?",
                                                                      "target": "TLS and an ACL user"})
            assert learned["seqs"] == [1]
            # admin listings span every master
            listed = _admin(port, "GET", "/admin/contexts")
            assert sorted(x["principal"] for x in listed["principals"]) == sorted(principals)
            assert all(x["bytes"] > 0 for x in listed["principals"])
            # the worker announced itself in the cluster; the gateway found it there
            wait_for_sync(lambda: _worker_listed(port, worker_endpoint), timeout_s=120, interval_s=0.2,
                          what="the gateway to discover the worker")
            # the control and tasks channels: this replica follows both, on some node of the cluster
            for channel in (keys.GATEWAY_CONTROL_CHANNEL, keys.TASKS_CHANNEL):
                assert _numsub(flushed, channel) == 1, channel
            # a revoke on the admin API reaches the permission check through the cluster
            _admin(port, "DELETE", f"/admin/teachers/{principals[0]}")
            assert _admin(port, "GET", f"/admin/teachers/{principals[0]}")["may_teach"] is False
        finally:
            stop(gw)
            worker_err = _stop_reading(worker)
    gateway_log = log_path.read_text(errors="replace")
    assert flushed.secret not in gateway_log and "Traceback" not in gateway_log, gateway_log[-3000:]
    assert " lost (" not in gateway_log, gateway_log[-3000:]  # pub/sub never dropped its subscription
    assert flushed.secret not in worker_err

    # the function library: on every master
    for node in flushed.cluster.primaries():
        with node.client(socket_timeout=5) as c:
            assert _has_library(c.function_list()), node.port

    # the trainer's sample source reads what the gateway logged
    cfg = _config(flushed.settings, trainer={"samples_endpoint": samples_endpoint})
    ctx = zmq.Context()
    trainer_redis = sync_client(cfg.redis, socket_timeout=5)
    source = SampleSource(cfg, trainer_redis, ctx, {}, partitions=sample_partitions(cfg))
    try:
        got = source.next_batch(8, 100, lambda: False)
        assert [(s.seq, s.principal, s.sample.input) for s in got] == [(1, principals[0], "what guards the cluster?")]
    finally:
        source.close()
        close_sync(trainer_redis)
        ctx.term()
    denied = _denied(flushed)
    assert set(denied) == {"config|get (command)"}, denied  # CONFIG is @dangerous: the policy check is skipped
    assert "-@dangerous" in LEARNMESH_ACL


def _stop_reading(proc: subprocess.Popen) -> str:
    """Stop ``proc`` (SIGTERM, then SIGKILL) and return what it wrote to stderr."""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=5)
    return (err or b"").decode(errors="replace")


def _worker_listed(port: int, endpoint: str) -> bool:
    workers = _admin(port, "GET", "/admin/workers")
    return any(w.get("endpoint") == endpoint and w.get("source") == "discovered"
               for w in workers.get("workers", workers if isinstance(workers, list) else []))


def test_the_trainer_trains_commits_and_publishes_through_the_secured_cluster(flushed: SecuredCluster,
                                                                            tmp_path: Path) -> None:
    """``learnmesh trainer`` (the torchrun launcher and its rank) as learnmesh's user over TLS,
    beside a gateway and a worker: samples taught with ``learn`` (contexts on every master, log
    partitions on more than one; the contexts read back from the store by the trainer) are
    trained and committed; the sealed deltas it publishes reach the worker, which serves the
    trainer's version; on the admin API a checkpoint is written and the delta key rotated, and
    the worker follows under the new key to bit-exactly the trainer's weights. The ACL refuses
    nothing new, and the password reaches no log."""
    principals = _one_principal_per_master(flushed)
    api_keys = {p: f"{p}-key-0123456789" for p in principals}
    worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
    sections = _mesh_sections(flushed, tmp_path, principals)
    config_path = tmp_path / "learnmesh.yaml"  # the worker's and the trainer's: the password in the URL
    config_path.write_text(yaml.safe_dump(sections))
    trainer_cfg = load_config(config_path, env={})
    partitions = sample_partitions(trainer_cfg)
    used = collections.Counter(partition_of(p, partitions) for p in principals for _ in range(4))
    masters = _master_ports(flushed)
    assert len({masters[key_slot(keys.sample_log(part).encode())] for part in used}) > 1

    worker = spawn_worker(config_path, 0, worker_endpoint)
    port = free_port()
    trainer: TrainerProc | None = None
    redis = sync_client(_config(flushed.settings).redis, socket_timeout=10)
    with (tmp_path / "gateway.log").open("wb") as out:
        gw = start_gateway(port, without_password(flushed.settings["url"])[0],
                           ",".join(f"{p}:{k}" for p, k in api_keys.items()), overrides=sections, output=out,
                           log_level="info")
        try:
            # the worker has built (and cached) the model before the trainer builds the same one
            wait_for_sync(lambda: _worker_listed(port, worker_endpoint), timeout_s=120, interval_s=0.2,
                          what="the gateway to discover the worker")
            trainer = running = TrainerProc(trainer_cfg, tmp_path)

            def progress() -> str:
                return running.output()[-3000:]

            acked = [i for p in principals for i in _teach_with_context(port, api_keys[p], p)]
            wait_for_sync(lambda: trained_total(_committed(redis)) == len(acked), timeout_s=180, interval_s=0.3,
                          what=lambda: f"every taught sample committed\n{progress()}")
            assert sorted(ledger.trained_ids(redis)) == sorted(acked)
            assert ledger.skipped_ids(redis) == {}  # every context was read from the store
            record = _committed(redis)
            assert {part: int(record[position_field("seq", part)]) for part in used} == dict(used)
            first = wait_for_sync(lambda: _worker_serves_latest(port, worker_endpoint), timeout_s=60,
                                  interval_s=0.3, what=lambda: f"the worker to apply the deltas\n{progress()}")
            assert isinstance(first, int)

            # the control plane: a checkpoint asked for on the admin API, written after the commits
            result = _trainer_command(port, "/admin/trainer/checkpoint", progress)
            assert result["ok"] is True, result
            state = load_bytes(Path(result["path"]).read_bytes())
            assert sum(seq for seq, _, _ in state["positions"].values()) == len(acked)
            # a rotated delta key: the worker follows the deltas sealed with the new one
            old_key = _admin(port, "GET", "/admin/delta-key")["key_ring"].get("key_id")
            _admin(port, "POST", "/admin/delta-key/rotate", status=202)
            wait_for_sync(lambda: _admin(port, "GET", "/admin/delta-key")["key_ring"].get("key_id") not in
                          (None, old_key), timeout_s=60, interval_s=0.3, what=lambda: f"the key rotated\n{progress()}")
            acked += _mcp(port, api_keys[principals[0]], "learn", {"samples": [
                {"kind": "example", "input": f"after the rotation {i}", "target": f" {i}"} for i in range(4)]})["ids"]
            wait_for_sync(lambda: trained_total(_committed(redis)) == len(acked), timeout_s=60, interval_s=0.3,
                          what=lambda: f"the later samples committed\n{progress()}")

            # once training pauses the trainer publishes what lossy deltas left out: the worker
            # then serves bit-exactly the trainer's weights, of a version after the rotation
            def serves_the_trainers_weights() -> bool:
                delta = {as_str(k): as_str(v) for k, v in redis.hgetall(keys.component_status("delta")).items()}
                latest = _worker_serves_latest(port, worker_endpoint)
                return (latest is not None and latest > first and str(latest) == delta.get("version")
                        and delta.get("weights_digest", "") != ""
                        and _worker_report(port, worker_endpoint).get("weights_digest") == delta["weights_digest"])

            wait_for_sync(serves_the_trainers_weights, timeout_s=60, interval_s=0.3,
                          what=lambda: f"the worker to serve the trainer's weights under the new key\n{progress()}")
            assert _admin(port, "GET", "/admin/trainer")["alive"] is True
            assert running.term() == 0, running.output()
        finally:
            if trainer is not None:
                trainer.close()
            close_sync(redis)
            stop(gw)
            worker_err = _stop_reading(worker)
    assert trainer is not None
    output = trainer.output()
    assert "Traceback" not in output and flushed.secret not in output, output[-3000:]
    assert "model version 0 -> " in worker_err and flushed.secret not in worker_err, worker_err[-3000:]
    assert flushed.secret not in (tmp_path / "gateway.log").read_text(errors="replace")
    denied = _denied(flushed)
    assert set(denied) <= {"config|get (command)"}, denied  # the gateway's policy check, as above


def _teach_with_context(port: int, key: str, principal: str) -> list[str]:
    """Four samples through ``learn``, the last one naming a context just written; their ids."""
    ctx = _mcp(port, key, "context_append", {"context_id": "notes", "modality": "text",
                                             "text": f"{principal} keeps notes"})
    return list(_mcp(port, key, "learn", {"samples": [
        *({"kind": "example", "input": f"{principal} asks {i}", "target": f" answer {i}"} for i in range(3)),
        {"kind": "example", "input": "and the notes?", "target": " kept", "context_id": "notes",
         "version": ctx["version"]}]})["ids"])


def _committed(redis: Any) -> dict[str, str]:
    """The trainer's commit record."""
    return {as_str(k): as_str(v) for k, v in redis.hgetall(keys.TRAINER_OFFSET).items()}


def _worker_serves_latest(port: int, endpoint: str) -> int | None:
    """The model version, once the worker at ``endpoint`` serves it (the gateway's view)."""
    listed = _admin(port, "GET", "/admin/workers")
    current = listed["model_version"]
    served = [w.get("version") for w in listed["workers"] if w.get("endpoint") == endpoint]
    return current if current and served == [current] else None


def _worker_report(port: int, endpoint: str) -> dict[str, Any]:
    """The worker at ``endpoint`` as /admin/workers shows it (its own report merged in)."""
    return next(w for w in _admin(port, "GET", "/admin/workers")["workers"] if w.get("endpoint") == endpoint)


def _trainer_command(port: int, path: str, progress: Callable[[], str]) -> dict[str, Any]:
    """POST a trainer command on the admin API and wait for the trainer's acknowledgement."""
    status_url = _admin(port, "POST", path, status=202)["status_url"]
    wait_for_sync(lambda: _admin(port, "GET", status_url)["state"] == "done", timeout_s=60, interval_s=0.3,
                  what=lambda: f"the trainer to handle {path}\n{progress()}")
    return dict(_admin(port, "GET", status_url)["result"])


async def test_a_master_that_joins_later_is_reached_with_the_same_credentials(tmp_path: Path) -> None:
    """After a slot moves to a master the clients have never heard of, MOVED leads every client
    there (the gateway's automatic pipeline, the store's script and library loading, a blocking
    client of the worker or trainer) with learnmesh's user and TLS, not redis-py's defaults.
    A cluster of its own (3 masters, no replicas: the move is the point, not the failover)."""
    secured = start_tls_cluster(tmp_path, replicas=0)
    try:
        cfg = _config(secured.settings)
        principal = _one_principal_per_master(secured)[0]
        redis, blocking = async_client(cfg.redis), sync_client(cfg.redis, socket_timeout=5)
        store = ContextStore(redis, cfg.context, redis_cfg=cfg.redis)
        try:
            await store.append(principal, "notes", "text", "user", b"before the move")
            blocking.set(keys.teacher_grant(principal), "1")

            newcomer = await asyncio.to_thread(secured.cluster.add_master)
            await asyncio.to_thread(secured.cluster.move_slot, key_slot(f"{{{principal}}}".encode()), newcomer)

            await store.append(principal, "notes", "text", "user", b"after the move")
            window = await store.get_window(principal, "notes")
            assert [e.content for e in window.channels["text"]] == [b"before the move", b"after the move"]
            assert blocking.get(keys.teacher_grant(principal)) == b"1"
            with newcomer.client(socket_timeout=5) as admin:
                users = {c["user"] for c in admin.client_list() if c["user"] != "root"}
                assert users == {"learnmesh"}, users  # the clients that followed MOVED, as learnmesh
                assert _has_library(admin.function_list())  # loaded there on "function not found"
        finally:
            await store.aclose()  # its batches before the client (ContextStore.aclose)
            await redis.aclose()
            close_sync(blocking)
        assert _denied(secured) == []
    finally:
        secured.stop()


async def test_a_killed_master_fails_over_with_tls_and_acl_users(flushed: SecuredCluster, tmp_path: Path) -> None:
    """The failover drill (tests/failover_drill.py) on the secured cluster: the replica that
    replicates over TLS as its replication user is promoted by the cluster itself, the gateway
    (learnmesh's ACL user over TLS) keeps serving, no acknowledged append is lost. Last in this
    module: it leaves the module's cluster healthy (the killed node is back, as a replica) but
    with its roles swapped."""
    # as in the gateway test above: TLS handshakes can outlast the 1 s of the plain drill
    report = await failover_drill(flushed.cluster, without_password(flushed.settings["url"])[0], tmp_path,
                                  redis_settings={**flushed.settings, "socket_timeout_s": 5.0})
    print(report.line())
    assert set(_denied(flushed)) <= {"config|get (command)"}  # as in the gateway test: @dangerous, skipped
    replicas_as = set()
    for node in flushed.cluster.primaries():  # the promoted master's replica is the node brought back
        with node.client(socket_timeout=5) as c:
            replicas_as |= {conn["user"] for conn in c.client_list(_type="replica")}
    assert replicas_as == {"replicator"}, replicas_as
