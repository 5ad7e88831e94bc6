"""deploy/kubernetes/ rendered by kustomize (``kubectl kustomize``) for both overlays and
checked: what each workload runs and how (probes, resources, security context, Secrets
mounted, never inlined), that the pods' configuration loads and agrees across services, that
make-secrets.sh builds exactly the Secrets the pods mount, then the real tools: the
Kubernetes schema validator (kubernetes-validate) and the misconfiguration scanner (checkov)
from ``.venv-deploy`` (``make deploy-tools``; CI makes it and sets
LEARNMESH_REQUIRE_DEPLOY_TOOLS=1, so these never skip there)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import redis.asyncio as aioredis
import yaml

from gateway.server import uvicorn_settings
from gateway.tools.learning import SampleIngest
from services import compose_secrets
from services.cli import _parser
from services.trainer.dist import cpu_threads
from shared import keys
from shared.config import Config, load_config
from shared.crypto import KeyFileError, KeyRing, SigningKey, trainer_keys
from shared.curve import CurveKeys
from shared.net import free_port_pair
from shared.redis_local_cluster import BUS_OFFSET, LocalCluster
from shared.samples import Example
from shared.worker_registry import advertised_endpoint
from shared.zmq_util import bind_address
from tests.conftest import free_port, wait_for, wait_for_sync
from tests.deploy_support import headroom_bytes, redis_bytes
from tests.trainer_support import committed, trainer_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
REQUIRED = os.environ.get("LEARNMESH_REQUIRE_DEPLOY_TOOLS") == "1"
DEPLOY_VENV = Path(os.environ.get("LEARNMESH_DEPLOY_VENV", ROOT / ".venv-deploy"))
KUBERNETES_VERSION = "1.32.0"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
ROLE_SECRETS = {"gateway": "learnmesh-gateway", "worker": "learnmesh-worker", "trainer": "learnmesh-trainer"}
POD_IP = "10.1.2.3"


def _tool(path: str | Path | None, what: str) -> str:
    """The tool's path; missing: a failure where CI promised it, else a skip naming the fix."""
    if path is not None and Path(path).exists():
        return str(path)
    message = f"{what} is not installed (make deploy-tools)"
    if REQUIRED:
        pytest.fail(message)
    pytest.skip(message)


def _kubectl() -> str:
    return _tool(shutil.which("kubectl"), "kubectl (its kustomize renders the overlays)")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    kubectl = _kubectl()
    out = {}
    for overlay in OVERLAYS:
        text = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True,
                              capture_output=True, text=True).stdout
        out[overlay] = [d for d in yaml.safe_load_all(text) if d]
    return out


def _find(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _containers(workload: dict) -> list[dict]:
    pod = _pod(workload)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _env(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_both_overlays_render_the_whole_mesh(rendered):
    for overlay, docs in rendered.items():
        kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
        assert {("Deployment", "gateway"), ("Service", "gateway"), ("HorizontalPodAutoscaler", "gateway"),
                ("PodDisruptionBudget", "gateway"), ("Deployment", "worker"), ("StatefulSet", "trainer"),
                ("Service", "trainer"), ("StatefulSet", "redis"), ("Service", "redis"),
                ("Job", "redis-cluster-create")} <= kinds, overlay
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == "learnmesh", (overlay, doc["kind"], doc["metadata"]["name"])
        gateway = _find(docs, "Deployment", "gateway")
        hpa = _find(docs, "HorizontalPodAutoscaler", "gateway")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
        assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
        for selector in (_find(docs, "PodDisruptionBudget", "gateway")["spec"]["selector"]["matchLabels"],
                         _find(docs, "Service", "gateway")["spec"]["selector"]):
            assert selector.items() <= pod_labels.items()
        for name in ("trainer", "redis"):  # stable per-pod names through a headless Service
            assert _find(docs, "Service", name)["spec"]["clusterIP"] == "None"
            assert _find(docs, "StatefulSet", name)["spec"]["serviceName"] == name


def test_the_autoscaler_alone_sets_the_gateway_count(rendered):
    """A Deployment an HPA scales names no replicas (each `kubectl apply` would reset the count
    the HPA chose, stopping the replicas above it); its disruption budget leaves one to evict."""
    for overlay, docs in rendered.items():
        for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
            target = _find(docs, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
            assert "replicas" not in target["spec"], (overlay, target["metadata"]["name"])
            labels = target["spec"]["template"]["metadata"]["labels"]
            [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"
                     and d["spec"]["selector"]["matchLabels"].items() <= labels.items()]
            assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"], overlay


def test_a_stopping_gateway_serves_until_its_endpoint_is_gone_then_drains_in_its_grace_period(rendered):
    """SIGTERM and the endpoint's removal from the Service race: the gateway pod waits (preStop)
    before its SIGTERM, and that wait plus uvicorn's drain fit in the grace period."""
    drain_s = uvicorn_settings(load_config(env={}))["timeout_graceful_shutdown"]
    for overlay, docs in rendered.items():
        pod = _pod(_find(docs, "Deployment", "gateway"))
        [c] = pod["containers"]
        wait_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 1 <= wait_s and wait_s + drain_s < pod["terminationGracePeriodSeconds"], overlay


def test_every_workload_has_probes_resources_and_a_locked_down_security_context(rendered):
    for overlay, docs in rendered.items():
        for workload in (d for d in docs if d["kind"] in WORKLOADS):
            where = (overlay, workload["metadata"]["name"])
            pod = _pod(workload)
            assert pod["automountServiceAccountToken"] is False, where
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 10000
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            for c in _containers(workload):
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"][kind]), (where, c["name"], kind)
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
                assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], where
            if workload["kind"] != "Job":
                for c in pod["containers"]:
                    assert c.get("livenessProbe") and c.get("readinessProbe"), (where, c["name"])
        [gateway] = _pod(_find(docs, "Deployment", "gateway"))["containers"]
        assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert gateway["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_secrets_are_mounted_never_inlined(rendered):
    for overlay, docs in rendered.items():
        assert not [d for d in docs if d["kind"] == "Secret"], f"{overlay}: a Secret is committed"
        for workload in (d for d in docs if d["kind"] in WORKLOADS):
            for c in _containers(workload):
                for e in c.get("env", []):
                    assert "secretKeyRef" not in (e.get("valueFrom") or {}), (overlay, c["name"], e["name"])
                    assert not re.search(r"(?i)password|secret|token", str(e.get("value", ""))), e
        mounted = _mounted_items(docs)
        # least privilege: only the trainer holds the signing key, only the gateway the client keys
        assert "delta-sign.key" in mounted["learnmesh-trainer"]
        assert not {"delta.key", "delta-sign.key"} & mounted["learnmesh-gateway"]
        assert not {"delta-sign.key", "api_keys", "admin_key", "request_state_keys"} & mounted["learnmesh-worker"]
        assert not {"api_keys", "admin_key", "request_state_keys"} & mounted["learnmesh-trainer"]
        assert mounted["learnmesh-redis"] == {"redis_password"}


def _mounted_items(docs: list[dict]) -> dict[str, set[str]]:
    """Secret name -> the keys pods mount from it."""
    out: dict[str, set[str]] = {}
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        for volume in _pod(workload).get("volumes", []):
            secret = volume.get("secret")
            if secret:
                keys = {i["key"] for i in secret.get("items", [])} or {"redis_password"}
                out.setdefault(secret["secretName"], set()).update(keys)
    return out


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """What make-secrets.sh makes from a fresh `learnmesh compose-secrets` file: name -> files."""
    kubectl = _kubectl()
    work = tmp_path_factory.mktemp("k8s-secrets")
    env_file = work / "k8s-secrets.env"
    args = argparse.Namespace(out=str(env_file), api_keys=None, force=False)
    assert compose_secrets.main(load_config(env={}), args) == 0
    run = subprocess.run(["sh", str(K8S / "make-secrets.sh"), str(env_file)], capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{Path(kubectl).parent}:{os.environ['PATH']}"})
    assert run.returncode == 0, run.stderr
    docs = [d for d in yaml.safe_load_all(run.stdout) if d]
    assert {d["kind"] for d in docs} == {"Secret"}
    return {d["metadata"]["name"]: {k: base64.b64decode(v) for k, v in d["data"].items()} for d in docs}


def test_the_files_the_instructions_write_keys_to_stay_private():
    """Every file docs/operations.md, the Makefile or make-secrets.sh has `learnmesh
    compose-secrets` write every key to is git-ignored, and a shell redirect writing one runs
    under umask 077 (the file is never readable by others, not even until a chmod)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a checkout")
    texts = {name: (ROOT / name).read_text() for name in ("docs/operations.md", "Makefile",
                                                            "deploy/kubernetes/make-secrets.sh")}
    written = set()
    for name, text in texts.items():
        text = " ".join(text.replace("\\\n", " ").split())  # wrapped lines and continuations joined
        for m in re.finditer(r"compose-secrets --out (\S+)(?: > (\S+))?", text):
            path = (m.group(2) or m.group(1)).strip("`)")
            if path != "-":
                written.add(path)
            if m.group(2):  # the command, from the quote (or line) it starts in
                command = text[text.rfind("`", 0, m.start()) + 1:m.start()]
                assert "umask 077" in command, (name, command)
    assert {"k8s-secrets.env", "compose/secrets.env"} <= written
    for path in written:
        run = subprocess.run([git, "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert run.returncode == 0, f"{path} (every key of the mesh) is not git-ignored"


def _pod_root(docs: list[dict], workload: dict, secrets: dict[str, dict[str, bytes]], root: Path) -> Path:
    """``root`` standing for the pod's /run/keys as its init container leaves it: each mounted
    Secret item at its path, 0400; nothing else."""
    for volume in _pod(workload)["volumes"]:
        secret = volume.get("secret")
        if not secret or secret["secretName"] == "learnmesh-redis":
            continue
        for item in secret["items"]:
            path = root / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(secrets[secret["secretName"]][item["key"]])
            os.chmod(path, 0o400)
    return root


def _pod_config(docs: list[dict], name: str, kind: str, secrets: dict[str, dict[str, bytes]], root: Path):
    """The configuration a pod's main container loads, its keys under ``root``."""
    workload = _find(docs, kind, name)
    _pod_root(docs, workload, secrets, root)
    config = _find(docs, "ConfigMap", next(v["configMap"]["name"] for v in _pod(workload)["volumes"]
                                           if v["name"] == "config"))
    path = root.parent / f"{name}.yaml"
    path.write_text(config["data"]["learnmesh.yaml"].replace("/run/keys", str(root)))
    env = {"LEARNMESH_CONFIG": str(path)}
    for key, value in _env(_pod(workload)["containers"][0]).items():
        if key.startswith("LEARNMESH_") and key != "LEARNMESH_CONFIG":
            env[key] = str(value).replace("/run/keys", str(root)).replace("$(POD_IP)", POD_IP)
    return load_config(None, env=env)


def test_make_secrets_builds_what_the_pods_mount(rendered, secrets, tmp_path):
    for overlay, docs in rendered.items():
        for name, items in _mounted_items(docs).items():
            assert items <= set(secrets[name]), (overlay, name, items - set(secrets[name]))
    assert set(secrets["learnmesh-worker"]) == {"redis_password", "delta.key", "worker.key_secret", "gateway.key",
                                               "trainer.key"}
    docs = rendered["cpu"]
    cfgs = {role: _pod_config(docs, role, "StatefulSet" if role == "trainer" else "Deployment", secrets,
                              tmp_path / role / "keys") for role in ROLE_SECRETS}
    peers = {"gateway": ("worker", "trainer"), "worker": ("gateway", "trainer"), "trainer": ("gateway", "worker")}
    for role, cfg in cfgs.items():
        curve = CurveKeys.load(cfg.zmq, role)
        assert curve is not None and all(curve.server_key(p) for p in peers[role])
    ring, signing = trainer_keys(cfgs["trainer"].security.delta_key_file, cfgs["trainer"].security.signing_key_path)
    assert signing is not None and signing.id == ring.signer
    worker_ring = KeyRing.load(cfgs["worker"].security.delta_key_file)
    assert worker_ring.to_dict() == ring.to_dict()
    with pytest.raises(KeyFileError):
        SigningKey.load(cfgs["worker"].security.signing_key_path)
    gateway = cfgs["gateway"]
    assert gateway.gateway.api_keys and gateway.gateway.admin_keys
    # the one key every replica seals and opens requestState with
    assert gateway.gateway.request_state_keys == [secrets["learnmesh-gateway"]["request_state_keys"].decode()]


def test_the_pods_configuration_agrees_across_services(rendered, secrets, tmp_path):
    for overlay, docs in rendered.items():
        cfgs = {role: _pod_config(docs, role, "StatefulSet" if role == "trainer" else "Deployment", secrets,
                                  tmp_path / overlay / role / "keys") for role in ROLE_SECRETS}
        gateway, worker, trainer = cfgs["gateway"], cfgs["worker"], cfgs["trainer"]
        assert gateway.redis.url is not None and gateway.redis.url.startswith("redis+cluster://redis-0.redis:")
        assert gateway.worker.endpoints == [] and gateway.worker.discovery and worker.worker.register
        [w] = _pod(_find(docs, "Deployment", "worker"))["containers"]
        bound = bind_address(w["command"][w["command"].index("--endpoint") + 1], worker.zmq.bind_host)
        assert advertised_endpoint(bound, worker.worker.advertise, "redis-0.redis") == f"tcp://{POD_IP}:5601"
        assert {"infer": 5601} == {p["name"]: p["containerPort"] for p in w["ports"] if p["name"] == "infer"}
        service_ports = {p["port"] for p in _find(docs, "Service", "trainer")["spec"]["ports"]}
        for endpoint in (trainer.trainer.samples_endpoint, trainer.security.delta_pub_endpoint,
                         trainer.security.snapshot_endpoint, trainer.security.ack_endpoint):
            host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
            assert host == "trainer-0.trainer" and int(port) in service_ports, endpoint
            assert bind_address(endpoint, trainer.zmq.bind_host) == f"tcp://0.0.0.0:{port}"
        assert trainer.trainer.backend == ("nccl" if overlay == "gpu" else "gloo")
        for role, cfg in cfgs.items():  # what another role's process would also read
            assert cfg.trainer.samples_endpoint == trainer.trainer.samples_endpoint, role


def test_the_trainer_is_a_torchrun_group_with_rank_0_on_trainer_0(rendered):
    for docs in rendered.values():
        trainer = _find(docs, "StatefulSet", "trainer")
        [c] = _pod(trainer)["containers"]
        env = _env(c)
        assert c["command"] == ["python", "-m", "torch.distributed.run"]
        args = c["args"]
        assert "--rdzv-backend=static" in args and "--master-addr=trainer-0.trainer" in args
        assert "--node-rank=$(POD_INDEX)" in args and "--nnodes=$(TRAINER_NODES)" in args
        assert env["POD_INDEX"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
        assert int(env["TRAINER_NODES"]) == trainer["spec"]["replicas"]
        module = args[args.index("-m") + 1:]
        assert module[0] == "services.cli" and _parser().parse_args(module[1:]).as_rank
        port = int(next(a for a in args if a.startswith("--master-port=")).split("=")[1])
        assert port in {p["port"] for p in _find(docs, "Service", "trainer")["spec"]["ports"]}
        assert _find(docs, "Service", "trainer")["spec"]["publishNotReadyAddresses"] is True


def test_cpu_ranks_use_no_more_threads_than_the_pod_has_cpus(rendered, secrets, tmp_path, monkeypatch):
    """A gloo rank's intra-op threads (services/trainer/dist.py), on a node with many more cores
    than the pod's CPU limit: together the pod's ranks stay within that limit."""
    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    for overlay, docs in rendered.items():
        cfg = _pod_config(docs, "trainer", "StatefulSet", secrets, tmp_path / overlay / "keys")
        if cfg.trainer.backend == "nccl":
            continue
        [c] = _pod(_find(docs, "StatefulSet", "trainer"))["containers"]
        procs = int(_env(c)["TRAINER_PROCS_PER_NODE"])
        limit = c["resources"]["limits"]["cpu"]
        cpus = int(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)
        assert procs * cpu_threads(cfg.trainer.torch_threads, procs) <= cpus, (overlay, cfg.trainer.torch_threads)


def test_only_the_gpu_overlay_asks_for_gpus_and_nccl(rendered):
    gpu = _find(rendered["gpu"], "StatefulSet", "trainer")
    [c] = _pod(gpu)["containers"]
    env = _env(c)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == int(env["TRAINER_PROCS_PER_NODE"]) >= 1
    assert env["LEARNMESH_TRAINER__BACKEND"] == "nccl" and env["NCCL_SOCKET_IFNAME"]
    assert c["image"].startswith("learnmesh-gpu:")
    assert any(t["key"] == "nvidia.com/gpu" for t in _pod(gpu)["tolerations"])
    cpu = _find(rendered["cpu"], "StatefulSet", "trainer")
    assert "nvidia.com/gpu" not in json.dumps(rendered["cpu"])
    assert _env(_pod(cpu)["containers"][0])["LEARNMESH_TRAINER__BACKEND"] == "gloo"
    for doc in rendered["gpu"]:  # the workers and gateways stay on CPUs, with the CPU image
        if doc["kind"] == "Deployment":
            assert "nvidia.com/gpu" not in json.dumps(doc)
            cpu_twin = _find(rendered["cpu"], "Deployment", doc["metadata"]["name"])
            assert [c["image"] for c in _containers(doc)] == [c["image"] for c in _containers(cpu_twin)]
            assert not any(c["image"].startswith("learnmesh-gpu") for c in _containers(doc)), doc["metadata"]
    assert {c["image"].split(":")[0] for c in _containers(gpu)} == {"learnmesh-gpu"}  # its init container too



def test_redis_cluster_nodes_have_headroom_above_the_context_budget(rendered):
    docs = rendered["cpu"]
    conf = dict(line.split(None, 1) for line in _find(docs, "ConfigMap", _redis_config_name(docs))["data"]
                ["redis.conf"].splitlines() if line.strip() and not line.startswith("#"))
    assert conf["cluster-enabled"] == "yes" and conf["maxmemory-policy"] == "noeviction"
    # what tests/test_redis_cluster_failover.py runs a cluster with when it loses a master for good
    assert conf["cluster-require-full-coverage"] == "no"
    maxmemory = redis_bytes(conf["maxmemory"])
    budget = load_config(env={}).context.global_budget_bytes
    assert maxmemory >= headroom_bytes(budget)  # even with every slot on one master
    [redis] = _pod(_find(docs, "StatefulSet", "redis"))["containers"]
    limit = redis["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) * 1024**3 > maxmemory
    assert _find(docs, "StatefulSet", "redis")["spec"]["replicas"] == 6
    [spread] = _pod(_find(docs, "StatefulSet", "redis"))["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == _find(docs, "StatefulSet", "redis")["spec"]["selector"]["matchLabels"]
    script = _pod(_find(docs, "Job", "redis-cluster-create"))["containers"][0]["args"][0]
    assert "redis-cli --cluster create" in script and "--cluster-replicas 1" in script
    assert "for i in 0 1 2 3 4 5" in script
    # the nodes announce their pod names, and each pod's init container puts the IPs those names
    # have now in nodes.conf before Redis reads it (run in
    # test_redis_pods_that_all_come_back_on_new_ips_find_each_other_again)
    assert conf["cluster-preferred-endpoint-type"] == "hostname"
    assert '--cluster-announce-hostname "$(POD_NAME).redis.' in redis["args"][0]
    for overlay in OVERLAYS:
        statefulset = _find(rendered[overlay], "StatefulSet", "redis")
        assert _peer_addresses(statefulset) == _peer_addresses(_redis_manifest("StatefulSet", "redis")), overlay


def _redis_config_name(docs: list[dict]) -> str:
    return next(d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap" and "redis.conf" in d["data"])


def test_network_policies_select_real_pods(rendered):
    docs = rendered["cpu"]
    labels = [w["spec"]["template"]["metadata"]["labels"] for w in docs if w["kind"] in WORKLOADS]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} for p in policies)  # default deny
    for policy in policies:
        selectors = [policy["spec"]["podSelector"].get("matchLabels", {})]
        for rule in policy["spec"].get("ingress", []):
            selectors += [peer["podSelector"].get("matchLabels", {}) for peer in rule.get("from", [])]
        for selector in selectors:
            assert any(selector.items() <= pod.items() for pod in labels), (policy["metadata"]["name"], selector)


# --------------------------------------------------------------------------- the registry tools

def _write(rendered: dict[str, list[dict]], root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for overlay, docs in rendered.items():
        out[overlay] = root / f"{overlay}.yaml"
        out[overlay].write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return out


def test_kubernetes_validate_accepts_both_overlays(rendered, tmp_path):
    tool = _tool(DEPLOY_VENV / "bin" / "kubernetes-validate", "kubernetes-validate")
    for overlay, path in _write(rendered, tmp_path).items():
        run = subprocess.run([tool, "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)],
                             capture_output=True, text=True)
        assert run.returncode == 0, (overlay, run.stdout, run.stderr)
    broken = [dict(d) for d in rendered["cpu"]]
    trainer = next(d for d in broken if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "trainer")
    trainer["spec"] = {**trainer["spec"], "serviceNam": "trainer"}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(broken, sort_keys=False))
    run = subprocess.run([tool, "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "serviceNam" in run.stdout + run.stderr  # the schema is really applied


def _checkov(tool: str, directory: Path) -> dict[str, Any]:
    run = subprocess.run([tool, "-d", str(directory), "--framework", "kubernetes", "--skip-download",
                          "--compact", "-o", "json"], capture_output=True, text=True, env={**os.environ,
                          "BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_OUTPUT_CACHE": "1"})
    assert run.returncode in (0, 1), run.stderr[-2000:]
    report = json.loads(run.stdout)
    return report[0] if isinstance(report, list) else report


def test_checkov_finds_no_misconfiguration(rendered, tmp_path):
    """Every finding is fixed or skipped on its resource with a written reason (annotations
    ``checkov.io/skip<n>: CHECK=reason``); a privileged container is caught."""
    tool = _tool(DEPLOY_VENV / "bin" / "checkov", "checkov")
    _write(rendered, tmp_path / "ok")
    report = _checkov(tool, tmp_path / "ok")
    failed = report["results"]["failed_checks"]
    assert failed == [], [(f["check_id"], f["resource"]) for f in failed]
    assert report["summary"]["passed"] > 100
    for skipped in report["results"]["skipped_checks"]:
        reason = skipped["check_result"]["suppress_comment"]
        assert skipped["check_id"] == "CKV_K8S_43" and len(reason) > 40, (skipped["resource"], reason)
    assert report["summary"]["skipped"] == 2 * 5  # the four workloads and the Job, in each overlay
    broken = yaml.safe_load(yaml.safe_dump(rendered["cpu"]))
    gateway = next(d for d in broken if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
    gateway["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = True
    _write({"cpu": broken}, tmp_path / "broken")
    caught = {f["check_id"] for f in _checkov(tool, tmp_path / "broken")["results"]["failed_checks"]}
    assert "CKV_K8S_16" in caught  # "Container should not be privileged"


@contextlib.asynccontextmanager
async def _pod_trainer(c: dict, cfg: Config, tmp_path: Path,
                       module: list[str] | None = None) -> AsyncIterator[tuple[subprocess.Popen, SampleIngest]]:
    """The trainer container's command line as the StatefulSet renders it, on this machine: one
    node, its ranks; the pod's names swapped for loopback, a free rendezvous port, ``cfg`` as
    the configuration, and the ranks' module and arguments (after ``-m``) ``module`` if given.
    Yields the process (its own session, killed at the end) and an ingest into ``cfg``'s Redis."""
    env = _env(c)
    path = tmp_path / "learnmesh.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    port = free_port()
    values = {"TRAINER_NODES": env["TRAINER_NODES"], "TRAINER_PROCS_PER_NODE": env["TRAINER_PROCS_PER_NODE"],
              "POD_INDEX": "0"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in c["args"]]
    args = [a.replace("trainer-0.trainer", "127.0.0.1").replace("=29511", f"={port}") for a in args]
    if module is not None:
        args = [*args[:args.index("-m") + 1], *module]
    assert c["command"][0] == "python"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    child_env.update({"LEARNMESH_CONFIG": str(path), "OMP_NUM_THREADS": "1"})
    redis = aioredis.Redis.from_url(cfg.redis.url)
    ingest = SampleIngest(redis, cfg)
    with open(tmp_path / "trainer.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, *c["command"][1:], *args], cwd=ROOT, env=child_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc, ingest
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            ingest.close()
            await redis.aclose()


async def test_the_trainer_pods_torchrun_command_trains_a_real_gloo_group(rendered, redis_url, tmp_path):
    """The trainer container's command line as the StatefulSet renders it (one node, two
    ranks, static rendezvous at the master address; the pod's names swapped for loopback)
    forms a gloo group that trains what the gateway logs, and stops cleanly on SIGTERM."""
    [c] = _pod(_find(rendered["cpu"], "StatefulSet", "trainer"))["containers"]
    env = _env(c)
    cfg = trainer_config(redis_url, tmp_path, free_port(), backend=env["LEARNMESH_TRAINER__BACKEND"])
    async with _pod_trainer(c, cfg, tmp_path) as (proc, ingest):
        out = await ingest.submit("alice", [Example(input=f"k{i}", target=f"v{i}") for i in range(8)])
        await wait_for(lambda: int(committed(redis_url).get("seq", 0)) == 8 or proc.poll() is not None,
                       timeout_s=240, what="the torchrun group to train the samples")
        assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
        sync = redis_sync.Redis.from_url(redis_url)
        try:  # every rank of the pod is in the group
            await wait_for(lambda: sync.hget(keys.TRAINER_STATUS, "world"), what="the trainer's status report")
            assert sync.hget(keys.TRAINER_STATUS, "world") == env["TRAINER_PROCS_PER_NODE"].encode()
        finally:
            sync.close()
        assert len(out["ids"]) == 8
        # what Kubernetes sends a pod it stops: torchrun hands SIGTERM to every rank, which
        # checkpoints and stops (torchrun itself then exits with its SignalException status)
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 120)
        output = (tmp_path / "trainer.log").read_text()
        assert "rank 0 stopped cleanly" in output and "rank 1 stopped cleanly" in output, output[-3000:]
        assert list(Path(cfg.trainer.checkpoint_dir).glob("ckpt-*.pt"))


async def test_the_trainer_pods_torchrun_group_restarts_after_a_rank_dies(rendered, redis_url, tmp_path):
    """The pod's torchrun command line (--max-restarts) when a rank is killed (-9) after a step:
    torchrun starts the group again, from the checkpoint, and it trains what comes next."""
    [c] = _pod(_find(rendered["cpu"], "StatefulSet", "trainer"))["containers"]
    cfg = trainer_config(redis_url, tmp_path, free_port(), backend=_env(c)["LEARNMESH_TRAINER__BACKEND"],
                         checkpoint_every=1, init_timeout_s=30, step_timeout_s=10)
    marker = tmp_path / "killed"  # the ranks run through tests/trainer_entry.py, which kills rank 1 once
    entry = ["tests.trainer_entry", "--config", str(tmp_path / "learnmesh.yaml"), "--as-rank", "--kill", f"1:1:{marker}"]
    async with _pod_trainer(c, cfg, tmp_path, entry) as (proc, ingest):
        await ingest.submit("alice", [Example(input=f"k{i}", target=f"v{i}") for i in range(8)])
        await wait_for(lambda: marker.exists() or proc.poll() is not None, timeout_s=240, what="rank 1 to be killed")
        await ingest.submit("alice", [Example(input=f"n{i}", target=f"w{i}") for i in range(8)])
        await wait_for(lambda: int(committed(redis_url).get("seq", 0)) == 16 or proc.poll() is not None,
                       timeout_s=240, what="the restarted group to train the samples")
        output = (tmp_path / "trainer.log").read_text()
        assert proc.poll() is None, output[-4000:]
        # one restart: the restarted ranks met at once (none took a dead rank's address)
        assert "restart 1 of 3" in output and "restart 2 of" not in output, output[-4000:]


def test_the_cluster_create_job_leaves_a_formed_cluster_alone_even_when_it_is_degraded(tmp_path):
    """The Job that forms the Redis Cluster, re-run (a re-apply, a Job deleted and created again)
    while the cluster is formed but not ``ok`` (here: a slot without an owner), says so and
    exits 0 instead of trying ``--cluster create`` on nodes that already hold a cluster. Run
    as written in the manifest, against a real local cluster: ``redis-cli`` and ``getent`` are
    shims that turn the pods' names into that cluster's ports."""
    job = _redis_manifest("Job", "redis-cluster-create")
    secret = tmp_path / "redis_password"
    secret.write_text("unused-here")
    script = _pod(job)["containers"][0]["args"][0].replace("/run/secrets/redis/redis_password", str(secret))
    cluster = LocalCluster(masters=3, replicas=0).start()
    try:
        ports = [str(n.port) for n in cluster.nodes]
        owner = next(n for n in cluster.nodes if 0 in n.client().cluster("SLOTS")[0][:2])
        owner.client().execute_command("CLUSTER", "DELSLOTS", "0")
        bindir, calls = tmp_path / "bin", tmp_path / "calls"
        bindir.mkdir()
        (bindir / "getent").write_text('#!/bin/sh\necho "127.0.0.1 $2"\n')
        (bindir / "redis-cli").write_text(f"""#!/bin/bash
echo "$*" >> {calls}
ports=({' '.join(ports)})
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h) i="${{2#redis-}}"; i="${{i%%.*}}"; args+=(-h 127.0.0.1 -p "${{ports[$((i % 3))]}}"); shift 2 ;;
    --cluster) echo "not in this test: redis-cli $*" >&2; exit 1 ;;
    *) args+=("$1"); shift ;;
  esac
done
exec {shutil.which("redis-cli")} "${{args[@]}}"
""")
        for f in ("getent", "redis-cli"):
            (bindir / f).chmod(0o755)
        env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
        done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert "cluster_state:fail" in owner.client().execute_command("CLUSTER", "INFO").decode()
    finally:
        cluster.stop()
    assert done.returncode == 0, done.stderr
    assert "already formed" in done.stdout
    assert not any("--cluster" in line for line in calls.read_text().splitlines())


def _redis_manifest(kind: str, name: str) -> dict:
    """A workload of deploy/kubernetes/base/redis.yaml as written (what kustomize renders from it)."""
    return next(d for d in yaml.safe_load_all((K8S / "base" / "redis.yaml").read_text())
                if d and d["kind"] == kind and d["metadata"]["name"] == name)


def _peer_addresses(statefulset: dict) -> dict:
    """The Redis pods' init container that puts the peers' new IPs in nodes.conf."""
    [init] = [c for c in _pod(statefulset)["initContainers"] if c["name"] == "peer-addresses"]
    return init


def _peer_addresses_script(conf: Path) -> str:
    """The script of the ``peer-addresses`` init container, on ``conf`` for /data/nodes.conf."""
    init = _peer_addresses(_redis_manifest("StatefulSet", "redis"))
    assert init["command"] == ["sh", "-c"] and {"name": "data", "mountPath": "/data"} in init["volumeMounts"]
    return init["args"][0].replace("/data/nodes.conf", str(conf))


def _resolver(bindir: Path, hosts: dict[str, str]) -> dict[str, str]:
    """An environment whose ``getent hosts NAME`` answers from ``hosts`` (name -> IP) alone, as
    the cluster's DNS answers the pods' names through the headless Service."""
    bindir.mkdir(parents=True, exist_ok=True)
    table = bindir / "hosts"
    table.write_text("".join(f"{ip} {name}\n" for name, ip in hosts.items()))
    (bindir / "getent").write_text(f'#!/bin/sh\n[ "$1" = hosts ] && awk -v h="$2" \'$2 == h\' {table} | grep .\n')
    (bindir / "getent").chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


class _RedisPods:
    """Redis Cluster nodes started as the StatefulSet starts its pods, on loopback: the ConfigMap's
    redis.conf, pod ``i`` announcing the hostname the container's command line gives it, its
    nodes.conf on its own volume (a directory), and one address per pod (``--bind`` and
    ``--bind-source-addr``: the peers see it at that address alone, as they see a pod's IP)."""

    def __init__(self, root: Path, count: int) -> None:
        [main] = _pod(_redis_manifest("StatefulSet", "redis"))["containers"]
        announce = re.search(r'--cluster-announce-hostname "([^"]+)"', main["args"][0])
        assert announce is not None, main["args"]
        self.names = [announce.group(1).replace("$(POD_NAME)", f"redis-{i}").replace("$(POD_NAMESPACE)", "learnmesh")
                      for i in range(count)]
        self.data = [root / f"redis-{i}" for i in range(count)]
        for d in self.data:
            d.mkdir(parents=True)
        self.port = free_port_pair(BUS_OFFSET)
        self.ips: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def start(self, ips: list[str]) -> None:
        self.ips = ips
        for ip, name, data in zip(ips, self.names, self.data, strict=True):
            conf = data / "redis.conf"  # the pod's volume at /data
            conf.write_text((K8S / "base" / "redis.conf").read_text().replace("/data", str(data)))
            with open(data / "redis.log", "ab") as log:
                self.procs.append(subprocess.Popen(
                    ["redis-server", str(conf), "--port", str(self.port), "--bind", ip, "--bind-source-addr", ip,
                     "--cluster-announce-hostname", name], stdout=log, stderr=subprocess.STDOUT))
        for ip in ips:
            wait_for_sync(lambda ip=ip: self._answers(ip), timeout_s=30, what=f"redis-server on {ip}")

    def _answers(self, ip: str) -> bool:
        for proc in self.procs:
            assert proc.poll() is None, [(d / "redis.log").read_text()[-2000:] for d in self.data]
        try:
            with redis_sync.Redis(host=ip, port=self.port, socket_timeout=2) as c:
                return bool(c.ping())
        except redis_sync.RedisError:
            return False

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(30)
        self.procs = []

    def met(self) -> bool:
        """Whether every node is in an ``ok`` cluster with every slot served and lists every
        other node, connected, at the address it has now (right after a restart a node still
        says ``ok`` about peers it cannot reach, until its node timeout marks them failing)."""
        for ip in self.ips:
            try:
                with redis_sync.Redis(host=ip, port=self.port, socket_timeout=2) as c:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    nodes = c.execute_command("CLUSTER", "NODES").decode()
            except redis_sync.RedisError:
                return False
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return False
            peers = {f"{other}:{self.port}" for other in self.ips if other != ip}
            connected = {line.split()[1].split("@")[0] for line in nodes.splitlines()
                         if "myself" not in line.split()[2] and line.split()[7] == "connected"}
            if connected != peers:
                return False
        return True

    def client(self) -> redis_sync.RedisCluster:
        """A cluster client that starts at the first node and reaches each node by the name the
        cluster gives out (``cluster-preferred-endpoint-type hostname``), as a pod resolves it."""
        where = dict(zip(self.names, self.ips, strict=True))
        return redis_sync.RedisCluster(host=self.ips[0], port=self.port,
                                       address_remap=lambda a: (where.get(a[0], a[0]), a[1]))


def test_redis_pods_that_all_come_back_on_new_ips_find_each_other_again(tmp_path):
    """Every Redis pod rescheduled at once (new pod IPs, the same volumes): each pod's
    ``peer-addresses`` init container, run as the manifest writes it, puts the IP each peer's
    name resolves to now in nodes.conf, and the nodes form the cluster again with their data.
    The DNS of the first pod does not know the last pod yet (it is still being scheduled):
    that line keeps its old IP and the last pod, which finds the first by name, corrects it."""
    pods = _RedisPods(tmp_path, 3)
    old, new = [f"127.0.0.{11 + i}" for i in range(3)], [f"127.0.0.{21 + i}" for i in range(3)]
    try:
        pods.start(old)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"{ip}:{pods.port}" for ip in old], "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        wait_for_sync(pods.met, timeout_s=60, interval_s=0.2, what="the cluster to form")
        with pods.client() as cluster:
            for i in range(30):
                cluster.set(f"k{i}", f"v{i}")
        pods.stop()
        moved = dict(zip(pods.names, new, strict=True))
        for i, data in enumerate(pods.data):
            hosts = {name: ip for name, ip in moved.items() if not (i == 0 and name == pods.names[2])}
            run = subprocess.run(["sh", "-c", _peer_addresses_script(data / "nodes.conf")], capture_output=True,
                                 text=True, timeout=30, env={**_resolver(tmp_path / f"dns-{i}", hosts),
                                                             "PEER_DNS_WAIT_S": "0"})
            assert run.returncode == 0, run.stderr
            conf = (data / "nodes.conf").read_text()
            assert not (data / "nodes.conf.peer-addresses.tmp").exists()
            for name, ip in hosts.items():
                assert f"{ip}:{pods.port}@{pods.port + BUS_OFFSET},{name} " in conf, (name, conf)
                assert f"{name}: {old[pods.names.index(name)]} -> {ip}" in run.stderr
        assert f"127.0.0.13:{pods.port}@" in (pods.data[0] / "nodes.conf").read_text()
        pods.start(new)
        wait_for_sync(pods.met, timeout_s=60, interval_s=0.2, what="the cluster to form again on the new addresses")
        with pods.client() as cluster:
            assert [cluster.get(f"k{i}") for i in range(30)] == [f"v{i}".encode() for i in range(30)]
    finally:
        pods.stop()


def test_the_peer_addresses_init_container_changes_only_the_ip_of_peers_it_resolves(tmp_path):
    """Only the IP before a resolved hostname changes: the ports, Redis 7.2+'s aux fields after
    the hostname, IPv6 addresses, lines without a hostname and the vars line stay as they were.
    No nodes.conf (a new pod): nothing written. Nothing to change: the file is not rewritten."""
    conf = tmp_path / "nodes.conf"
    dns = {"redis-0.redis": "10.0.0.7", "redis-1.redis": "10.0.0.8", "redis-2.redis": "fd00::9"}
    env = {**_resolver(tmp_path / "dns", dns), "PEER_DNS_WAIT_S": "0"}

    def run_script() -> subprocess.CompletedProcess:
        run = subprocess.run(["sh", "-c", _peer_addresses_script(conf)], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr
        return run

    assert "nothing to update" in run_script().stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "dns"]
    lines = ["a" * 40 + " {}:6379@16379,redis-0.redis myself,master - 0 0 1 connected 0-5460",
             "b" * 40 + " {}:6379@16379,redis-1.redis,tls-port=0,shard-id=" + "c" * 40
             + " master - 0 1700000000000 2 connected 5461-10922",
             "d" * 40 + " {}:6379@16379,redis-2.redis slave " + "b" * 40 + " 0 1700000000000 2 connected",
             "e" * 40 + " 10.0.0.99:6379@16379,,tls-port=0 master - 0 1700000000000 3 connected 10923-16383",
             "f" * 40 + " 10.0.0.98:6379@16379,redis-5.redis master,fail - 0 1700000000000 4 disconnected",
             "vars currentEpoch 4 lastVoteEpoch 0"]
    conf.write_text("\n".join(lines).format("10.0.0.5", "10.0.0.6", "fd00::3") + "\n")
    run = run_script()
    assert conf.read_text() == "\n".join(lines).format("10.0.0.7", "10.0.0.8", "fd00::9") + "\n"
    assert "redis-2.redis: fd00::3 -> fd00::9" in run.stderr
    assert "redis-5.redis does not resolve: its old address stays" in run.stdout
    before = conf.stat().st_ino
    assert "every peer is where" in run_script().stdout
    assert conf.stat().st_ino == before and not (tmp_path / "nodes.conf.peer-addresses.tmp").exists()
