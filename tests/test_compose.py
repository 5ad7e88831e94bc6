"""compose/ is checked structurally (no Docker engine here): commands exist in the
learnmesh CLI, environment validates against the config schema, ports and endpoints
agree between binders and connectors, Prometheus scrapes every service by name, and
Grafana's provisioned dashboard only queries metrics that exist."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from services.cli import _parser
from shared import metrics
from shared.config import load_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
LEARNMESH_SERVICES = {"gateway", "worker-0", "worker-1", "trainer", "trainer-cpu"}
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


def _env(service: dict, dotenv: dict[str, str]) -> dict[str, str]:
    """The service's environment with ${VAR...} substituted from compose/.env."""
    def sub(v: str) -> str:
        return re.sub(r"\$\{([A-Z_]+)[^}]*\}", lambda m: dotenv[m.group(1)], str(v))
    return {k: sub(v) for k, v in (service.get("environment") or {}).items()}


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


def test_environment_validates_against_the_config_schema(compose, dotenv):
    for name in LEARNMESH_SERVICES:
        env = _env(compose["services"][name], dotenv)
        assert all(k.startswith("LEARNMESH_") or k == "REDIS_URL" for k in env), name
        cfg = load_config(None, env=env)  # ConfigError on unknown keys or bad values
        assert cfg.redis.url == "redis://redis:6379/0"
        assert urlsplit(cfg.redis.url).hostname in compose["services"]


def test_bind_and_connect_endpoints_agree(compose, dotenv):
    hosts = _hosts(compose)
    gw_cfg = load_config(None, env=_env(compose["services"]["gateway"], dotenv))
    # gateway -> workers: each configured endpoint is a worker service binding that port
    for i, ep in enumerate(gw_cfg.worker.endpoints):
        u = urlsplit(ep)
        svc = compose["services"][u.hostname]
        cmd = svc["command"]
        assert int(cmd[cmd.index("--index") + 1]) == i
        assert urlsplit(cmd[cmd.index("--endpoint") + 1]).port == u.port
    # the trainer binds on 0.0.0.0 exactly the ports every other process connects to as "trainer"
    for trainer in ("trainer", "trainer-cpu"):
        t_cfg = load_config(None, env=_env(compose["services"][trainer], dotenv))
        for name in ("gateway", "worker-0", "worker-1"):
            c_cfg = load_config(None, env=_env(compose["services"][name], dotenv))
            for bind, conn in ((t_cfg.trainer.samples_endpoint, c_cfg.trainer.samples_endpoint),
                               (t_cfg.security.delta_pub_endpoint, c_cfg.security.delta_pub_endpoint),
                               (t_cfg.security.snapshot_endpoint, c_cfg.security.snapshot_endpoint),
                               (t_cfg.security.ack_endpoint, c_cfg.security.ack_endpoint)):
                assert urlsplit(bind).hostname == "0.0.0.0" and urlsplit(bind).port == urlsplit(conn).port
                assert urlsplit(conn).hostname == "trainer" and "trainer" in hosts


def test_trainer_gpu_reservation_and_cpu_profile(compose, dotenv):
    gpu = compose["services"]["trainer"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert gpu["profiles"] == ["gpu"]
    cpu = compose["services"]["trainer-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert "trainer" in cpu["networks"]["default"]["aliases"]
    assert load_config(None, env=_env(cpu, dotenv)).trainer.backend == "gloo"
    assert dotenv["COMPOSE_PROFILES"] == "cpu"


def test_gateway_port_published_and_keys_required(compose, dotenv):
    gw = compose["services"]["gateway"]
    port = int(gw["command"][gw["command"].index("--port") + 1])
    assert f"{port}:{port}" in gw["ports"]
    assert "0.0.0.0" in gw["command"]  # non-loopback bind: the gateway refuses to start without keys
    cfg = load_config(None, env=_env(gw, dotenv))
    assert cfg.gateway.api_keys and cfg.gateway.admin_keys
    assert ":?" in str(gw["environment"]["LEARNMESH_API_KEYS"])


def _targets() -> dict[str, list[str]]:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in prom["scrape_configs"]}


def test_prometheus_scrapes_every_service_by_name(compose, dotenv):
    targets = _targets()
    hosts = _hosts(compose)
    for job, tlist in targets.items():
        for t in tlist:
            assert t.split(":")[0] in hosts, f"{job}: {t} is not a compose service"
    gw = compose["services"]["gateway"]
    assert targets["gateway"] == [f"gateway:{gw['command'][gw['command'].index('--port') + 1]}"]
    for name in ("worker-0", "worker-1"):
        svc = compose["services"][name]
        cfg = load_config(None, env=_env(svc, dotenv))
        index = int(svc["command"][svc["command"].index("--index") + 1])
        assert f"{name}:{cfg.metrics.worker_port + index}" in targets["worker"]
        assert cfg.metrics.bind_host == "0.0.0.0"
    t_cfg = load_config(None, env=_env(compose["services"]["trainer-cpu"], dotenv))
    assert targets["trainer"] == [f"trainer:{t_cfg.metrics.trainer_port}"]
    assert any(t.startswith("redis-exporter:") for t in targets["redis"])
    scraped = {t.split(":")[0] for tl in targets.values() for t in tl}
    for name in set(compose["services"]) - {"grafana", "redis", "trainer-cpu"}:
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
