"""compose/ is checked structurally (no Docker engine here): commands exist in the
learnmesh CLI, environment validates against the config schema (with the secrets that
``learnmesh compose-secrets`` generates, mounted where compose mounts them), ports and
endpoints agree between binders and connectors, Prometheus scrapes every service by name,
Grafana's provisioned dashboard only queries metrics that exist; the repository holds no
working key, each secret reaches only the services that need it, and Redis's ACL rules
hold against a real redis-server."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis as redis_sync
import yaml
import zmq.auth
from prometheus_client.metrics import MetricWrapperBase

from services import compose_secrets
from services.cli import _parser
from shared import metrics
from shared.config import Config, load_config
from shared.crypto import KeyFileError, KeyRing, SigningKey, trainer_keys
from shared.curve import CurveKeys
from shared.redis_client import client_kwargs
from shared.secret_files import write_private
from shared.worker_registry import advertised_endpoint
from shared.zmq_util import bind_address
from tests.conftest import free_port, wait_for_sync
from tests.deploy_support import headroom_bytes, redis_bytes

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
LEARNMESH_SERVICES = {"gateway", "worker", "trainer", "trainer-cpu"}
SCALED_SERVICES = ("gateway", "worker")  # `docker compose up --scale gateway=N --scale worker=M`
DISPATCH = {"gateway": "gateway.server", "worker": "services.worker.main", "trainer": "services.trainer.main",
            "up": "services.supervisor"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def dotenv() -> dict[str, str]:
    out = {}
    for line in (COMPOSE / ".env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    """What `learnmesh compose-secrets` writes to compose/secrets.env."""
    return compose_secrets.generate()


def _target(mount: dict) -> str:
    """Where compose mounts a secret in the container: ``target``, else /run/secrets/<source>."""
    return mount.get("target") or f"/run/secrets/{mount['source']}"


@pytest.fixture(scope="module")
def mounts(compose, generated, tmp_path_factory) -> dict[str, Path]:
    """Service -> a directory standing for its container's root: each secret it mounts, at its
    target, 0400, as compose mounts it; nothing else."""
    roots = {}
    for name, service in compose["services"].items():
        root = roots[name] = tmp_path_factory.mktemp(f"root-{name}")
        for mount in service.get("secrets") or []:
            path = root / _target(mount).lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(generated[compose["secrets"][mount["source"]]["environment"]])
            os.chmod(path, 0o400)
    return roots


def _env(service: dict, dotenv: dict[str, str], root: Path | None = None) -> dict[str, str]:
    """The service's environment with ${VAR...} substituted from compose/.env and /run/ paths
    pointing into ``root`` (the service's entry of ``mounts``)."""
    def sub(v: str) -> str:
        v = re.sub(r"\$\{([A-Z_]+)[^}]*\}", lambda m: dotenv[m.group(1)], str(v))
        return v.replace("/run/", f"{root}/run/") if root is not None else v
    return {k: sub(v) for k, v in (service.get("environment") or {}).items()}


def _cfg(compose: dict, dotenv: dict[str, str], mounts: dict[str, Path], name: str) -> Config:
    """The configuration service ``name`` starts with, its secrets mounted."""
    return load_config(None, env=_env(compose["services"][name], dotenv, mounts[name]))


def _hosts(compose: dict) -> set[str]:
    names = set(compose["services"])
    for svc in compose["services"].values():
        for net in (svc.get("networks") or {}).values() if isinstance(svc.get("networks"), dict) else []:
            names |= set((net or {}).get("aliases", []))
    return names


def test_services_present(compose):
    assert LEARNMESH_SERVICES | {"redis", "prometheus", "grafana"} <= set(compose["services"])


def test_redis_persistent_and_noeviction(compose):
    cmd = compose["services"]["redis"]["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/data") for v in compose["services"]["redis"]["volumes"])


def test_every_command_exists_in_the_cli(compose):
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^learnmesh = "services\.cli:main"', pyproject, re.M)
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"^RUN pip install \.", dockerfile, re.M), "the image must install the learnmesh command"
    assert 'torch==2.13.0' in dockerfile
    for name in LEARNMESH_SERVICES:
        cmd = compose["services"][name]["command"]
        assert cmd[0] == "learnmesh", name
        args = _parser().parse_args(cmd[1:])  # SystemExit on an unknown command or flag
        module = importlib.import_module(DISPATCH[args.command])
        assert callable(getattr(module, "main", None)), f"{DISPATCH[args.command]}.main missing"


def test_environment_validates_against_the_config_schema(compose, dotenv, mounts):
    for name in LEARNMESH_SERVICES:
        env = _env(compose["services"][name], dotenv, mounts[name])
        assert all(k.startswith("LEARNMESH_") or k == "REDIS_URL" for k in env), name
        cfg = load_config(None, env=env)  # ConfigError on unknown keys or bad values
        assert cfg.redis.url == "redis://redis:6379/0"
        assert urlsplit(cfg.redis.url).hostname in compose["services"]


def test_bind_and_connect_endpoints_agree(compose, dotenv, mounts):
    hosts = _hosts(compose)
    gw_cfg = _cfg(compose, dotenv, mounts, "gateway")
    # gateway -> workers: no fixed list; every worker replica binds all its interfaces and
    # announces its own address (worker discovery), with an id of its own
    assert gw_cfg.worker.endpoints == [] and gw_cfg.worker.discovery
    w_cfg = _cfg(compose, dotenv, mounts, "worker")
    cmd = compose["services"]["worker"]["command"]
    bound = bind_address(cmd[cmd.index("--endpoint") + 1], w_cfg.zmq.bind_host)
    assert "--index" not in cmd and urlsplit(bound).hostname == "0.0.0.0"
    assert w_cfg.worker.register and w_cfg.worker.advertise == "" and "{host}" in w_cfg.worker.id
    assert advertised_endpoint(bound, w_cfg.worker.advertise, "127.0.0.1") == f"tcp://127.0.0.1:{urlsplit(bound).port}"
    # the trainer binds on 0.0.0.0 exactly the ports every other process connects to as "trainer"
    for trainer in ("trainer", "trainer-cpu"):
        t_cfg = _cfg(compose, dotenv, mounts, trainer)
        for name in ("gateway", "worker"):
            c_cfg = _cfg(compose, dotenv, mounts, name)
            for bind, conn in ((t_cfg.trainer.samples_endpoint, c_cfg.trainer.samples_endpoint),
                               (t_cfg.security.delta_pub_endpoint, c_cfg.security.delta_pub_endpoint),
                               (t_cfg.security.snapshot_endpoint, c_cfg.security.snapshot_endpoint),
                               (t_cfg.security.ack_endpoint, c_cfg.security.ack_endpoint)):
                bound = urlsplit(bind_address(bind, t_cfg.zmq.bind_host))
                assert bound.hostname == "0.0.0.0" and bound.port == urlsplit(conn).port
                assert urlsplit(conn).hostname == "trainer" and "trainer" in hosts


def test_trainer_gpu_reservation_and_cpu_profile(compose, dotenv, mounts):
    gpu = compose["services"]["trainer"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert gpu["profiles"] == ["gpu"]
    cpu = compose["services"]["trainer-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert "trainer" in cpu["networks"]["default"]["aliases"]
    assert _cfg(compose, dotenv, mounts, "trainer-cpu").trainer.backend == "gloo"
    assert dotenv["COMPOSE_PROFILES"] == "cpu"


def test_gateway_reached_through_the_load_balancer_and_keys_required(compose, dotenv, mounts):
    gw = compose["services"]["gateway"]
    port = int(gw["command"][gw["command"].index("--port") + 1])
    assert "ports" not in gw and gw["expose"] == [str(port)]
    assert compose["services"]["lb"]["ports"] == [f"{port}:8000"]
    nginx = (COMPOSE / "nginx.conf").read_text()
    assert re.search(r"^\s*listen 8000;", nginx, re.M)
    assert f"set $gateway http://gateway:{port};" in nginx and "proxy_pass $gateway;" in nginx
    assert "resolver 127.0.0.11" in nginx  # re-resolved: replicas added by --scale get traffic
    assert "proxy_set_header Upgrade $http_upgrade;" in nginx and "proxy_buffering off;" in nginx
    assert ["./nginx.conf:/etc/nginx/nginx.conf:ro"] == compose["services"]["lb"]["volumes"]
    assert "0.0.0.0" in gw["command"]  # non-loopback bind: the gateway refuses to start without keys
    cfg = _cfg(compose, dotenv, mounts, "gateway")  # keys from its mounted secrets
    assert cfg.gateway.api_keys and cfg.gateway.admin_keys



def test_the_gateway_believes_x_forwarded_for_from_the_load_balancer_alone(compose, dotenv, mounts):
    """The failed-attempt throttle counts per client address, which the gateway takes from
    ``X-Forwarded-For`` when the peer is a trusted proxy. Only ``lb`` is: it has a fixed address
    on a network of its own with the gateways, outside the range Docker hands out, so no worker,
    trainer or other container (nor a gateway replica) can name a client address of its choosing,
    and the whole network is not trusted either."""
    import ipaddress

    trusted = _cfg(compose, dotenv, mounts, "gateway").gateway.auth_throttle.trusted_proxies
    assert [ipaddress.ip_network(net).num_addresses for net in trusted] == [1], trusted
    lb, gateway = compose["services"]["lb"], compose["services"]["gateway"]
    assert set(lb["networks"]) == {"edge"}, "lb reaches the gateways on the edge network alone"
    address = lb["networks"]["edge"]["ipv4_address"]
    assert trusted == [address]
    assert "edge" in gateway["networks"] and "default" in gateway["networks"]  # Redis, workers, trainer
    on_edge = {name for name, svc in compose["services"].items() if "edge" in (svc.get("networks") or {})}
    assert on_edge == {"lb", "gateway"}
    (ipam,) = compose["networks"]["edge"]["ipam"]["config"]
    subnet, pool = ipaddress.ip_network(ipam["subnet"]), ipaddress.ip_network(ipam["ip_range"])
    assert ipaddress.ip_address(address) in subnet and pool.subnet_of(subnet)
    assert ipaddress.ip_address(address) not in pool, "Docker could give lb's address to a gateway replica"
    assert pool.num_addresses >= 64  # room for `--scale gateway=N`
    nginx = (COMPOSE / "nginx.conf").read_text()
    assert "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;" in nginx

def _targets() -> dict[str, list[str]]:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    out: dict[str, list[str]] = {}
    for job in prom["scrape_configs"]:
        found = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        found += [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        out[job["job_name"]] = found
    return out


def test_prometheus_scrapes_every_service_by_name(compose, dotenv, mounts):
    targets = _targets()
    hosts = _hosts(compose)
    for job, tlist in targets.items():
        for t in tlist:
            assert t.split(":")[0] in hosts, f"{job}: {t} is not a compose service"
    gw = compose["services"]["gateway"]
    assert targets["gateway"] == [f"gateway:{gw['command'][gw['command'].index('--port') + 1]}"]
    cfg = _cfg(compose, dotenv, mounts, "worker")
    assert targets["worker"] == [f"worker:{cfg.metrics.worker_port}"] and cfg.metrics.bind_host == "0.0.0.0"
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    for job in prom["scrape_configs"]:  # every replica of a scaled service, not one of them
        if job["job_name"] in SCALED_SERVICES:
            assert "static_configs" not in job and job["dns_sd_configs"][0]["type"] == "A", job
    t_cfg = _cfg(compose, dotenv, mounts, "trainer-cpu")
    assert targets["trainer"] == [f"trainer:{t_cfg.metrics.trainer_port}"]
    assert any(t.startswith("redis-exporter:") for t in targets["redis"])
    scraped = {t.split(":")[0] for tl in targets.values() for t in tl}
    for name in set(compose["services"]) - {"grafana", "redis", "trainer-cpu", "lb"}:
        assert name in scraped, f"{name} is not scraped"


def test_grafana_provisioned_dashboard_queries_real_metrics(compose):
    ds = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = ds["datasources"]
    assert urlsplit(source["url"]).hostname == "prometheus"
    assert urlsplit(source["url"]).port == int(_targets()["prometheus"][0].split(":")[1])
    prov = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/learnmesh.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + prov["providers"][0]["options"]["path"] + ":ro") for m in mounts)
    dash = json.loads((COMPOSE / "grafana/dashboards/learnmesh.json").read_text())
    known = set()
    for collector in vars(metrics).values():
        if isinstance(collector, MetricWrapperBase):
            known |= {fam.name for fam in collector.describe()}
    used = set()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        for t in panel["targets"]:
            used |= set(re.findall(r"learnmesh_[a-z_]+", t["expr"]))
    assert used
    for name in used:
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert base in known or name in known, f"dashboard queries undefined metric {name}"


# --------------------------------------------------------------------------- secrets

ZMQ_DIR = "/run/keys/zmq"
ZMQ_PEERS = {"gateway": ("worker", "trainer"), "worker": ("gateway", "trainer"), "trainer": ("gateway", "worker")}
"""Role -> the roles it speaks ZeroMQ with (shared/curve.py): their public keys it pins or admits."""
SERVICE_ROLES = {"gateway": "gateway", "worker": "worker", "trainer": "trainer",
                 "trainer-cpu": "trainer"}


def _zmq_secrets(role: str) -> dict[str, str]:
    """Secret -> target of a role's CURVE files: its own secret key and its peers' public keys."""
    return {f"zmq_{role}_secret": f"{ZMQ_DIR}/{role}.key_secret",
            **{f"zmq_{peer}_public": f"{ZMQ_DIR}/{peer}.key" for peer in ZMQ_PEERS[role]}}


DELTA_RING = {"delta_ring": "/run/keys/delta.key"}
SERVICE_SECRETS = {  # who may hold what, and where it is mounted
    "gateway": {"redis_password": "/run/secrets/redis_password", "api_keys": "/run/secrets/api_keys",
                "admin_key": "/run/secrets/admin_key", "request_state_keys": "/run/secrets/request_state_keys",
                **_zmq_secrets("gateway")},
    "worker": {"redis_password": "/run/secrets/redis_password", **DELTA_RING, **_zmq_secrets("worker")},
    "trainer": {"redis_password": "/run/secrets/redis_password", **DELTA_RING,
                "delta_sign_key": "/run/keys/delta-sign.key", **_zmq_secrets("trainer")},
    "trainer-cpu": {"redis_password": "/run/secrets/redis_password", **DELTA_RING,
                    "delta_sign_key": "/run/keys/delta-sign.key", **_zmq_secrets("trainer")},
    "redis-exporter": {"redis_exporter_passwords": "/run/secrets/redis_exporter_passwords"},
    "grafana": {"grafana_admin_password": "/run/secrets/grafana_admin_password"},
}
SERVICE_UIDS = {"redis-exporter": "59000", "grafana": "472"}  # the images' users; learnmesh's is 10001


def _mounted(service: dict) -> dict[str, dict]:
    return {m["source"]: m for m in service.get("secrets") or []}


def _interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message} (an unset or empty VAR fails)."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = variables.get(name, "")
        if op == ":?" and not value:
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return value or (arg if op == ":-" else "")
    return re.sub(r"\$\{([A-Z0-9_]+)(:[-?])?([^}]*)\}", one, text)


def test_the_repository_holds_no_working_key(compose, dotenv):
    """compose/.env and the compose file carry settings only: no key, no password, no default
    for one; the secrets' variables are left to compose/secrets.env."""
    secret_vars = {spec["environment"] for spec in compose["secrets"].values()}
    assert not secret_vars & set(dotenv), "compose/.env must not set a secret"
    raw = (COMPOSE / "docker-compose.yml").read_text() + (COMPOSE / ".env").read_text()
    assert "change-me" not in raw.lower() and "demo-" not in raw
    for name in secret_vars | {"LEARNMESH_REDIS_PASSWORD_SHA256", "REDIS_EXPORTER_PASSWORD_SHA256"}:
        assert not re.search(r"\$\{" + name + r":-", raw), f"{name} has a default"
    assert "compose/secrets.env" in (ROOT / ".gitignore").read_text().splitlines()


def test_every_compose_command_the_instructions_give_reads_the_generated_secrets():
    """A `docker compose ... up` or `build` in the instructions (README, docs, the compose
    files' comments, what `learnmesh compose-secrets` prints) names compose/.env and the
    generated secrets file: without the latter compose stops on the first secret variable."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), COMPOSE / "docker-compose.yml",
               COMPOSE / ".env", ROOT / "services" / "compose_secrets.py"]
    found = 0
    for source in sources:
        text = " ".join(source.read_text().split())  # wrapped lines joined
        for m in re.finditer(r"docker compose((?: -{1,2}[\w-]+(?: [^\s`-][^\s`]*)?)*) (up|build)\b", text):
            found += 1
            assert re.search(r"--env-file \.env --env-file (secrets\.env|\{out\.name\})", m.group(1)), \
                f"{source.relative_to(ROOT)}: {m.group(0)}"
    assert found >= 6


def test_the_stack_refuses_to_start_without_generated_secrets(compose, dotenv, generated):
    """Interpolating the file with compose/.env alone fails on the Redis ACL hashes, naming
    the command that makes them; with the generated file it goes through. Compose itself
    refuses to create a container whose environment-sourced secret is unset."""
    raw = (COMPOSE / "docker-compose.yml").read_text()
    with pytest.raises(ValueError, match="LEARNMESH_REDIS_PASSWORD_SHA256.*learnmesh compose-secrets"):
        _interpolate(raw, dotenv)
    _interpolate(raw, {**dotenv, **generated})
    for name, spec in compose["secrets"].items():
        assert set(spec) == {"environment"}, f"secret {name} must come from compose/secrets.env"
        assert spec["environment"] in generated


def test_each_secret_reaches_only_the_services_that_use_it(compose):
    for name, service in compose["services"].items():
        mounted = _mounted(service)
        assert {source: _target(m) for source, m in mounted.items()} == SERVICE_SECRETS.get(name, {}), name
        for mount in mounted.values():
            assert mount["uid"] == SERVICE_UIDS.get(name, "10001"), (name, mount)
            assert int(str(mount["mode"]).replace("0o", ""), 8) == 0o400, (name, mount)
        for key, value in (service.get("environment") or {}).items():
            assert key not in ("LEARNMESH_API_KEYS", "LEARNMESH_ADMIN_KEY", "GF_SECURITY_ADMIN_PASSWORD",
                               "REDIS_PASSWORD", "LEARNMESH_REDIS__PASSWORD"), f"{name} gets {key} in its environment"
            assert "@" not in str(value), f"{name}: {key} carries credentials"
    # no volume hands keys around: the gateway mounts none, only the trainer writes checkpoints
    assert "volumes" not in compose["services"]["gateway"]
    for name, service in compose["services"].items():
        for volume in service.get("volumes") or []:
            target = volume.split(":")[1]
            assert target != "/app/var" and "keys" not in target, (name, volume)
            assert not target.endswith("/checkpoints") or name in ("trainer", "trainer-cpu"), (name, volume)


def test_generated_secrets_give_each_service_what_it_needs_and_no_more(compose, dotenv, mounts, generated):
    rings = {}
    for name in LEARNMESH_SERVICES:
        cfg = _cfg(compose, dotenv, mounts, name)
        assert client_kwargs(cfg.redis) == {"username": "learnmesh", "password": generated["LEARNMESH_REDIS_PASSWORD"]}
        if name != "gateway":
            rings[name] = KeyRing.load(cfg.security.delta_key_file)
    # the trainer signs with the key the ring verifies; workers verify the same signatures and
    # open the same AES keys, and hold no file with a signing key
    for trainer in ("trainer", "trainer-cpu"):
        cfg = _cfg(compose, dotenv, mounts, trainer)
        ring, signing = trainer_keys(cfg.security.delta_key_file, cfg.security.signing_key_path)
        assert signing is not None and signing.id == ring.signer == rings[trainer].signer
    for worker in ("worker",):
        assert rings[worker].to_dict() == rings["trainer"].to_dict() and rings[worker].signer in rings[worker].verify_keys
        files = [p for p in mounts[worker].rglob("*") if p.is_file()]
        assert files and not any(b"sign_private" in p.read_bytes() for p in files), worker
        cfg = _cfg(compose, dotenv, mounts, worker)
        with pytest.raises(KeyFileError):
            SigningKey.load(cfg.security.signing_key_path)
    # every gateway replica seals and opens requestState with the one generated key
    gateway = _cfg(compose, dotenv, mounts, "gateway").gateway
    assert gateway.request_state_keys == [generated["LEARNMESH_REQUEST_STATE_KEYS"]]
    assert len(bytes.fromhex(gateway.request_state_keys[0])) == 32
    redis_cmd = compose["services"]["redis"]["command"]
    hashes = [a for a in redis_cmd if a.startswith("#")]
    assert _interpolate(hashes[0], generated) == "#" + hashlib.sha256(
        generated["LEARNMESH_REDIS_PASSWORD"].encode()).hexdigest()
    exporter = compose["services"]["redis-exporter"]["environment"]
    passwords = json.loads(generated["REDIS_EXPORTER_PASSWORDS"])
    assert list(passwords) == [exporter["REDIS_ADDR"]]  # the exporter looks its password up by address
    assert _interpolate(hashes[1], generated) == "#" + hashlib.sha256(passwords[exporter["REDIS_ADDR"]].encode()).hexdigest()
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"


def _redis_args(compose: dict, generated: dict[str, str]) -> list[str]:
    cmd = compose["services"]["redis"]["command"]
    assert cmd[0] == "redis-server"
    return [_interpolate(a, generated) for a in cmd[1:]]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary")
def test_redis_acl_rules_of_the_compose_file_hold_on_a_real_server(compose, generated, tmp_path):
    port = free_port()
    proc = subprocess.Popen(["redis-server", *_redis_args(compose, generated), "--port", str(port), "--bind",
                             "127.0.0.1", "--dir", str(tmp_path), "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        learnmesh = redis_sync.Redis(port=port, username="learnmesh", password=generated["LEARNMESH_REDIS_PASSWORD"])
        wait_for_sync(lambda: _pings(learnmesh), timeout_s=10, what="the compose redis-server")
        learnmesh.set("lm:probe", b"1")
        exporter_pw = next(iter(json.loads(generated["REDIS_EXPORTER_PASSWORDS"]).values()))
        exporter = redis_sync.Redis(port=port, username="exporter", password=exporter_pw)
        assert exporter.info("server")["tcp_port"] == port
        denied = [lambda: learnmesh.set("elsewhere", b"1"), learnmesh.flushall, lambda: exporter.get("lm:probe"),
                  lambda: redis_sync.Redis(port=port).get("lm:probe")]
        for attempt in denied:
            with pytest.raises((redis_sync.exceptions.NoPermissionError, redis_sync.exceptions.AuthenticationError)):
                attempt()
        health = compose["services"]["redis"]["healthcheck"]["test"][1].replace("redis-cli", f"redis-cli -p {port}")
        assert subprocess.run(["sh", "-c", health]).returncode == 0
        for client in (learnmesh, exporter):
            client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def _pings(client: redis_sync.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis_sync.RedisError, OSError):
        return False


def test_compose_secrets_writes_a_private_file_once(tmp_path, capsys):
    out = tmp_path / "secrets.env"
    args = argparse.Namespace(out=str(out), api_keys="alice:alice-key-0123456789", force=False)
    assert compose_secrets.main(load_config(env={}), args) == 0
    assert os.stat(out).st_mode & 0o777 == 0o600
    first = out.read_text()
    assert "LEARNMESH_API_KEYS='alice:alice-key-0123456789'" in first
    assert "docker compose" not in capsys.readouterr().out  # not beside a compose file: no compose hint
    # run again (after an upgrade that brought no key): kept, and not a failure for a script
    assert compose_secrets.main(load_config(env={}), args) == 0 and out.read_text() == first
    assert "holds every key this version needs: kept as it is (--force replaces" in capsys.readouterr().out


def test_compose_secrets_adds_what_an_earlier_file_lacks_and_rotates_nothing(tmp_path, capsys):
    """A secrets file of an earlier version (without the request-state key): the keys in it are
    kept, the one it lacks is added, and compose reads every variable of the file."""
    out = tmp_path / "secrets.env"
    args = argparse.Namespace(out=str(out), api_keys=None, force=False)
    assert compose_secrets.main(load_config(env={}), args) == 0
    earlier = _parse_env_file(out.read_text())
    del earlier["LEARNMESH_REQUEST_STATE_KEYS"]
    write_private(out, compose_secrets.render(earlier))
    capsys.readouterr()
    assert compose_secrets.main(load_config(env={}), args) == 0
    assert "added LEARNMESH_REQUEST_STATE_KEYS" in capsys.readouterr().out
    now = _parse_env_file(out.read_text())
    assert {k: v for k, v in now.items() if k in earlier} == earlier, "every key in the file is kept"
    assert set(now) == set(compose_secrets.generate()) and len(bytes.fromhex(now["LEARNMESH_REQUEST_STATE_KEYS"])) == 32
    assert os.stat(out).st_mode & 0o777 == 0o600
    assert compose_secrets.main(load_config(env={}), args) == 0 and _parse_env_file(out.read_text()) == now
    assert "holds every key this version needs" in capsys.readouterr().out  # nothing left to add

    # half of a pair (a password without its hash) is not mended: the pair must be made together
    del earlier["LEARNMESH_REDIS_PASSWORD_SHA256"]
    write_private(out, compose_secrets.render(earlier))
    assert compose_secrets.main(load_config(env={}), args) == 1
    err = capsys.readouterr().err
    assert "holds LEARNMESH_REDIS_PASSWORD without LEARNMESH_REDIS_PASSWORD_SHA256" in err and "--force" in err
    assert _parse_env_file(out.read_text()) == earlier


def test_compose_secrets_names_the_compose_start_only_beside_the_compose_file(tmp_path, capsys):
    (tmp_path / "docker-compose.yml").write_text("services: {}\n")
    args = argparse.Namespace(out=str(tmp_path / "secrets.env"), api_keys=None, force=False)
    assert compose_secrets.main(load_config(env={}), args) == 0
    assert f"start: cd {tmp_path} && docker compose --env-file .env --env-file secrets.env up --build" \
        in capsys.readouterr().out


def test_each_learnmesh_service_holds_its_curve_keys_and_its_peers_public_keys(compose, dotenv, mounts, generated,
                                                                              tmp_path):
    """Every ZeroMQ process loads its role's keypair from its keys dir and finds there the
    public key of every peer it pins or admits; the keys are the generated ones, and no
    service holds another role's secret key."""
    publics = {}
    for role in ZMQ_PEERS:
        (tmp_path / role).write_text(generated[compose_secrets.curve_variable(role, "public")])
        publics[role] = zmq.auth.load_certificate(tmp_path / role)[0]
    for name, role in SERVICE_ROLES.items():
        cfg = _cfg(compose, dotenv, mounts, name)
        assert cfg.zmq.curve and Path(cfg.zmq.keys_dir) == mounts[name] / ZMQ_DIR.lstrip("/")
        keys = CurveKeys.load(cfg.zmq, role)
        assert keys is not None and keys.own.public == publics[role]
        for peer in ZMQ_PEERS[role]:
            assert keys.server_key(peer) == publics[peer] and keys.allowed(peer) == {publics[peer]}
        assert sorted(p.name for p in Path(cfg.zmq.keys_dir).glob("*.key_secret")) == [f"{role}.key_secret"]


def test_compose_secrets_output_loads_as_key_files(tmp_path):
    """What `compose-secrets` writes, read back the way compose hands it over: the ring loads,
    the signing key loads and matches it, each CURVE certificate reads with zmq.auth."""
    out = tmp_path / "secrets.env"
    args = argparse.Namespace(out=str(out), api_keys=None, force=False)
    assert compose_secrets.main(load_config(env={}), args) == 0
    values = _parse_env_file(out.read_text())
    files = {}
    for name, value in values.items():
        files[name] = tmp_path / name
        files[name].write_text(value)
        os.chmod(files[name], 0o400)
    ring = KeyRing.load(files["LEARNMESH_DELTA_KEY_RING"])
    assert "sign_private" not in values["LEARNMESH_DELTA_KEY_RING"]
    assert SigningKey.load(files["LEARNMESH_DELTA_SIGN_KEY"]).id == ring.signer
    for role in ZMQ_PEERS:
        public, secret = zmq.auth.load_certificate(files[compose_secrets.curve_variable(role, "secret")])
        assert secret is not None and len(public) == len(secret) == 40
        assert zmq.auth.load_certificate(files[compose_secrets.curve_variable(role, "public")]) == (public, None)


def _parse_env_file(text: str) -> dict[str, str]:
    """compose's reading of single-quoted values (compose-go dotenv): literal up to the next
    quote, newlines included."""
    found = dict(re.findall(r"^([A-Z0-9_]+)='([^']*)'", text, re.M))
    assert len(found) == len(re.findall(r"^[A-Z0-9_]+=", text, re.M))
    return found


# --------------------------------------------------------------------------- scaling out

def test_the_compose_file_is_valid_against_the_compose_specification(compose, dotenv, generated):
    """The official Compose Specification schema (vendored in compose/schema/, no compose CLI
    here) accepts the file as `docker compose` sees it: variables interpolated, anchors and
    merge keys resolved."""
    import jsonschema

    schema = json.loads((COMPOSE / "schema" / "compose-spec.json").read_text())
    variables = {**dotenv, **generated}

    def interpolated(node):  # compose interpolates string values after parsing the YAML
        if isinstance(node, dict):
            return {k: interpolated(v) for k, v in node.items()}
        if isinstance(node, list):
            return [interpolated(v) for v in node]
        return _interpolate(node, variables) if isinstance(node, str) else node

    jsonschema.validate(interpolated(compose), schema)
    broken = interpolated(compose)
    broken["services"]["gateway"]["healthcheck"]["interval"] = ["5s"]
    with pytest.raises(jsonschema.ValidationError):  # the schema is really applied
        jsonschema.validate(broken, schema)


def test_scaled_services_have_no_fixed_names_or_host_ports(compose):
    for name in SCALED_SERVICES:
        service = compose["services"][name]
        assert "container_name" not in service and "ports" not in service and "hostname" not in service, name
        for value in (service.get("environment") or {}).values():
            assert not re.search(rf"\b{name}-\d\b", str(value)), f"{name}: a replica named in {value}"
    assert not any("container_name" in s for s in compose["services"].values())
    published = [p.split(":")[-2] for s in compose["services"].values() for p in s.get("ports") or []]
    assert len(published) == len(set(published)), "two services publish the same host port"


def test_every_service_has_a_healthcheck_and_a_restart_policy(compose):
    for name, service in compose["services"].items():
        check = service.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL") and not check.get("disable"), name
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
    # learnmesh's processes wait for a healthy Redis, the balancer for a healthy gateway
    for name in LEARNMESH_SERVICES:
        assert compose["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert compose["services"]["lb"]["depends_on"]["gateway"]["condition"] == "service_healthy"
    gw_check = " ".join(compose["services"]["gateway"]["healthcheck"]["test"])
    assert "/readyz" in gw_check



def test_redis_has_headroom_above_the_context_budget(compose, dotenv, mounts):
    """Redis must not refuse writes (noeviction OOM) before learnmesh's own global LRU has
    evicted down to context.global_budget_bytes: maxmemory is the budget plus room for
    sessions, the sample log, audit and the AOF rewrite buffer."""
    cmd = compose["services"]["redis"]["command"]
    maxmemory = redis_bytes(cmd[cmd.index("--maxmemory") + 1])
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    for name in LEARNMESH_SERVICES:
        budget = _cfg(compose, dotenv, mounts, name).context.global_budget_bytes
        assert maxmemory >= headroom_bytes(budget), (name, maxmemory, budget)
