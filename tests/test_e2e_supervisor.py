"""`learnmesh up` pieces that need no running mesh: generated keys and $LEARNMESH_VAR paths."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from services import supervisor
from services.supervisor import (
    Child,
    Supervisor,
    child_configs,
    hold_var,
    load_or_create_keys,
    ports_taken,
    wait_ready,
)
from shared.config import Config, load_config
from tests.conftest import RedisTarget, free_port, wait_for_sync

ROOT = Path(__file__).resolve().parents[1]


def test_keys_are_generated_once_private_and_config_keys_win(tmp_path: Path) -> None:
    cfg = load_config(env={})
    keys1, admin1 = load_or_create_keys(tmp_path, cfg)
    path = tmp_path / "keys" / "generated.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_keys(tmp_path, cfg) == (keys1, admin1)
    mine = load_config(env={"LEARNMESH_API_KEYS": "alice:alice-key-123", "LEARNMESH_ADMIN_KEY": "admin-key-123"})
    assert load_or_create_keys(tmp_path, mine) == ({"alice": "alice-key-123"}, "admin-key-123")
    assert "alice" not in path.read_text() and "admin-key-123" not in path.read_text(), \
        "keys an operator chose are never written to the generated keys file"
    assert load_or_create_keys(tmp_path, cfg) == (keys1, admin1), "the next start without them: the generated ones"
    teachers = load_config(child_configs(cfg, argparse.Namespace(workers=None), tmp_path, keys1, admin1)["gateway"],
                           env={}).learning.teachers
    assert set(teachers) == {*cfg.learning.teachers, *keys1}, "only the generated keys' principals may teach"


def test_default_var_paths_move_under_learnmesh_var(tmp_path: Path) -> None:
    args = argparse.Namespace(workers=None)
    paths = child_configs(load_config(env={}), args, tmp_path, {"demo": "demo-key-123"}, "admin-key-123")
    cfg = load_config(paths["trainer"], env={})  # what the child loads
    assert cfg.trainer.checkpoint_dir == str(tmp_path / "checkpoints")
    assert cfg.model.cache_dir == str(tmp_path / "model")
    assert cfg.security.delta_key_file == str(tmp_path / "keys" / "delta.key")
    assert cfg.zmq.keys_dir == str(tmp_path / "keys" / "zmq")
    explicit = load_config(env={}, overrides={"trainer": {"checkpoint_dir": "/elsewhere"}})
    paths = child_configs(explicit, args, tmp_path, {"demo": "demo-key-123"}, "admin-key-123")
    assert load_config(paths["trainer"], env={}).trainer.checkpoint_dir == "/elsewhere"


def test_workers_wait_for_the_restored_weights_where_the_trainer_holds_a_checkpoint(tmp_path: Path) -> None:
    """Beside a checkpoint the trainer will restore, `up` tells its workers to take the trainer's
    snapshot before they serve (worker.await_snapshot), as a Redis that lost the trainer's
    status would not; with none, a first start, they serve the base weights at once."""
    args = argparse.Namespace(workers=None)

    def told() -> bool:
        paths = child_configs(load_config(env={}), args, tmp_path, {"demo": "demo-key-123"}, "admin-key-123")
        return load_config(paths["worker"], env={}).worker.await_snapshot

    assert not told()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".ckpt-0000000010.pt.tmp").write_bytes(b"cut short")
    assert not told(), "a write a kill cut short is no checkpoint"
    (tmp_path / "checkpoints" / "ckpt-0000000010.pt").write_bytes(b"restored as the trainer starts")
    assert told()


def test_learnmesh_keys_writes_where_up_reads_them(tmp_path: Path) -> None:
    """`learnmesh keys` (and --rotate-zmq) with $LEARNMESH_VAR, run from any directory: the keys
    land under $LEARNMESH_VAR, where `up` reads them, not under ./var."""
    elsewhere, var = tmp_path / "elsewhere", tmp_path / "mesh-var"
    elsewhere.mkdir()
    env = {**os.environ, "LEARNMESH_VAR": str(var), "PYTHONPATH": str(ROOT)}
    for extra in ([], ["--rotate-zmq", "gateway"]):
        done = subprocess.run([sys.executable, "-m", "services.cli", "keys", *extra], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert (var / "keys" / "delta.key").is_file() and (var / "keys" / "zmq" / "gateway.previous.key").is_file()
    assert not (elsewhere / "var").exists()


def test_a_child_that_exits_on_a_configuration_error_stops_the_mesh_instead_of_restarting(tmp_path: Path) -> None:
    bad = Child("gateway", [sys.executable, "-c", "raise SystemExit(2)"], dict(os.environ), log_path=tmp_path / "g.log")
    other = Child("worker-0", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    sup = Supervisor([other, bad], stop_timeout_s=10)
    sup.start()
    sup.run(poll_s=0.05)  # returns: it stops everything by itself
    assert sup.exit_code == 2 and bad.restarts == 0
    assert not other.alive()


def _starts_then_exits(starts: Path, code: int, ran_s: float = 0.0) -> list[str]:
    """A child that notes each start in ``starts``, says why it fails, and exits with ``code``."""
    script = ("import sys, time\n"
              "with open(sys.argv[1], 'a') as f: f.write('started\\n')\n"
              "time.sleep(float(sys.argv[3]))\n"
              "print('worker.some_setting: not a value this machine can use', flush=True)\n"
              "raise SystemExit(int(sys.argv[2]))\n")
    return [sys.executable, "-c", script, str(starts), str(code), str(ran_s)]


def _supervise(sup: Supervisor) -> threading.Thread:
    thread = threading.Thread(target=sup.run, kwargs={"poll_s": 0.05}, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _restarting_past_the_bound(sup: Supervisor, starts: Path) -> Iterator[threading.Thread]:
    """``sup`` supervising, once its child has been restarted past MAX_QUICK_RESTARTS and the
    mesh still runs; stopped on the way out."""
    sup.start()
    thread = _supervise(sup)
    try:
        wait_for_sync(lambda: starts.is_file() and starts.read_text().count("started") > 2 * supervisor.MAX_QUICK_RESTARTS,
                      timeout_s=60, what="restarts past the bound")
        assert thread.is_alive() and sup.failed is None
        yield thread
    finally:
        sup.stop()
        thread.join(30)


def test_a_child_that_keeps_failing_after_its_start_stops_the_mesh_after_a_bounded_number_of_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that starts and exits 1 again and again (a setting only checked at runtime, a port
    taken): `up` stops the mesh after MAX_QUICK_RESTARTS restarts in a row and ends with one line
    naming the child, its exit status and its log, instead of restarting it for ever."""
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.01,))  # the bound, not the backoff, is tested
    starts = tmp_path / "starts"
    bad = Child("worker-0", _starts_then_exits(starts, 1), dict(os.environ), log_path=tmp_path / "worker-0.log")
    other = Child("gateway", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    sup = Supervisor([bad, other], stop_timeout_s=10)
    sup.start()
    thread = _supervise(sup)
    try:
        thread.join(60)
        assert not thread.is_alive(), f"still restarting after {starts.read_text().count('started')} starts"
    finally:
        sup.stop()
        thread.join(30)
    assert starts.read_text().count("started") == 1 + supervisor.MAX_QUICK_RESTARTS
    assert sup.exit_code == 1 and not other.alive()
    assert sup.failed == (f"worker-0 exited with status 1 again after {supervisor.MAX_QUICK_RESTARTS} restarts in a "
                          f"row, each within {supervisor.HEALTHY_RUN_S:.0f}s of its start: worker.some_setting: not "
                          f"a value this machine can use (see {tmp_path / 'worker-0.log'})")


def test_a_child_that_fails_while_redis_is_away_is_restarted_until_redis_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """Children exit while Redis is away (a rank cannot read the sample log); `up` waits for
    Redis rather than stopping the mesh: past the bound it goes on restarting while Redis does
    not answer, and stops the mesh only once Redis answers and the child still fails."""
    from services.supervisor import _redis_answers
    from shared.config import RedisConfig

    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.01,))
    away = Config(redis=RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0"))
    back = Config(redis=RedisConfig(url=redis_url))
    assert not _redis_answers(away) and _redis_answers(back)  # what main() hands the supervisor
    redis = [away]
    starts = tmp_path / "starts"
    child = Child("trainer", _starts_then_exits(starts, 1), dict(os.environ))
    sup = Supervisor([child], stop_timeout_s=10, redis_answers=lambda: _redis_answers(redis[0]))
    with _restarting_past_the_bound(sup, starts) as thread:
        redis[0] = back
        thread.join(60)
        assert not thread.is_alive(), "still restarting with Redis back"
    assert sup.exit_code == 1 and sup.failed is not None and sup.failed.startswith("trainer exited with status 1")


def test_a_child_that_ran_healthy_before_it_failed_is_restarted_past_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is for a run of quick failures, not for the mesh's life: a start that ran
    HEALTHY_RUN_S counts the restarts afresh."""
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.01,))
    monkeypatch.setattr(supervisor, "HEALTHY_RUN_S", 0.2)
    starts = tmp_path / "starts"
    child = Child("worker-0", _starts_then_exits(starts, 1, ran_s=0.5), dict(os.environ))
    sup = Supervisor([child], stop_timeout_s=10)
    with _restarting_past_the_bound(sup, starts):
        pass
    assert sup.exit_code == 0 and not child.alive()


def test_a_child_that_exits_on_a_configuration_error_after_its_start_is_not_restarted(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    bad = Child("worker-0", _starts_then_exits(starts, 2, ran_s=0.3), dict(os.environ), log_path=tmp_path / "w.log")
    sup = Supervisor([bad], stop_timeout_s=10)
    sup.start()
    sup.run(poll_s=0.05)
    assert sup.exit_code == 2 and starts.read_text().count("started") == 1
    assert sup.failed is not None and sup.failed.startswith("worker-0 exited with status 2 (a failure a restart would "
                                                            "meet again): worker.some_setting")


def test_a_second_stop_kills_children_that_are_still_stopping(tmp_path: Path) -> None:
    """A second Ctrl-C while the children finish (a trainer's last checkpoint, a gateway's
    drain) ends their grace: what still runs is killed then, not after ``stop_timeout_s``."""
    slow = ("import pathlib, signal, sys, time\n"
            "out = pathlib.Path(sys.argv[1])\n"
            "signal.signal(signal.SIGTERM, lambda *_: out.write_text('asked'))\n"
            "out.write_text('running')\n"
            "while True: time.sleep(1)\n")
    children = [Child(f"slow-{i}", [sys.executable, "-c", slow, str(tmp_path / f"slow-{i}")], dict(os.environ))
                for i in range(2)]
    sup = Supervisor(children, stop_timeout_s=600)
    sup.start()
    stopper = threading.Thread(target=sup.run, kwargs={"poll_s": 0.05})
    stopper.start()
    try:
        def said(word: str) -> bool:
            return all((tmp_path / f"slow-{i}").is_file() and (tmp_path / f"slow-{i}").read_text() == word
                       for i in range(2))

        wait_for_sync(lambda: said("running"), timeout_s=30, what="the children to run")
        sup.stop()
        wait_for_sync(lambda: said("asked"), timeout_s=30, what="both children to be asked to stop")
        assert all(c.alive() for c in children)  # they ignore it: only the grace would end them
        sup.stop()
        stopper.join(30)
        assert not stopper.is_alive() and not any(c.alive() for c in children)
        assert all(c.proc is not None and c.proc.returncode == -signal.SIGKILL for c in children)
    finally:
        for c in children:
            c.signal(signal.SIGKILL)
            c.wait(5)


def _own_ports_config(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """A configuration file giving every port of a mesh a free one; and the gateway's, the
    worker's and its metrics'."""
    ports = {"gateway": free_port(), "worker": free_port(), "metrics": free_port()}
    cfg = {"gateway": {"port": ports["gateway"]},
           "worker": {"endpoints": [f"tcp://127.0.0.1:{ports['worker']}"]},
           "metrics": {"worker_port": ports["metrics"], "trainer_port": 0},
           "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}", "master_port": free_port()},
           "security": {name: f"tcp://127.0.0.1:{free_port()}"
                        for name in ("delta_pub_endpoint", "snapshot_endpoint", "ack_endpoint")}}
    path = tmp_path / "learnmesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, ports


@pytest.mark.parametrize("taken", ["gateway", "worker", "metrics"])
def test_up_refuses_ports_another_process_listens_on(redis_url: str, tmp_path: Path, taken: str) -> None:
    """A second mesh (or an old one still running) on the same ports: one line naming the setting,
    before anything starts, instead of children failing to bind in a restart loop while the
    other process answers the readiness probe and the banner says "learnmesh is up"."""
    path, ports = _own_ports_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    with socket.create_server(("127.0.0.1", ports[taken])):
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "up"], cwd=ROOT,
                              env={**env, "REDIS_URL": redis_url, "LEARNMESH_VAR": str(tmp_path / "var")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.terminate()  # it started a mesh: SIGTERM stops its children too
            up.communicate(timeout=60)
            pytest.fail("learnmesh up started a mesh on ports another process listens on")
    setting = {"gateway": "gateway.port (--port)", "worker": "worker.endpoints[0]",
               "metrics": "metrics.worker_port (worker-0)"}[taken]
    assert up.returncode == 2
    lines = stderr.strip().splitlines()
    # one line; it may name more ports when another process took one of the free ports the test chose
    assert len(lines) == 1 and lines[0].startswith(
        "learnmesh: configuration error: another process listens where this mesh would: "), lines
    assert f"{setting} (127.0.0.1:{ports[taken]})" in lines[0], lines
    assert lines[0].endswith("; stop it, or give this mesh other ports (--port, --config)"), lines
    assert not (tmp_path / "var").exists()  # nothing started, nothing written


def test_up_refuses_a_var_directory_another_mesh_holds(redis_url: str, tmp_path: Path) -> None:
    """Another `learnmesh up` on the same $LEARNMESH_VAR, on ports of its own: refused in one line
    before anything starts (it would roll the first mesh's commit record back to its own
    checkpoints); once the holder is gone, the directory is free again."""
    var = tmp_path / "var"
    holder = hold_var(var)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    path, _ = _own_ports_config(tmp_path)
    up = subprocess.run([sys.executable, "-m", "services.cli", "--config", str(path), "up"], cwd=ROOT,
                        env={**env, "REDIS_URL": redis_url, "LEARNMESH_VAR": str(var)},
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 2, up.stderr
    assert up.stderr.strip().splitlines() == [
        f"learnmesh: configuration error: another learnmesh up (pid {os.getpid()}) uses {var.resolve()}; stop it, "
        f"or give this mesh a directory of its own (LEARNMESH_VAR)"]
    assert sorted(p.name for p in var.iterdir()) == ["up.lock"], "nothing else started or written"
    holder.close()
    hold_var(var).close()


def test_the_trainer_master_port_is_no_port_of_the_mesh() -> None:
    """The trainer's rendezvous binds a free port (services/trainer/launcher.py), so a process on
    ``trainer.master_port`` keeps no mesh from starting; one on a port the mesh binds does."""
    def free_endpoint() -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    master_port, gateway_port = free_port(), free_port()
    cfg = load_config(env={}, overrides={
        "gateway": {"port": gateway_port}, "worker": {"endpoints": [free_endpoint()]},
        "metrics": {"worker_port": 0, "trainer_port": 0},
        "trainer": {"samples_endpoint": free_endpoint(), "master_port": master_port},
        "security": {name: free_endpoint() for name in ("delta_pub_endpoint", "snapshot_endpoint", "ack_endpoint")}})
    args = argparse.Namespace(workers=None, ranks=None)
    with socket.create_server(("127.0.0.1", master_port)):
        assert ports_taken(cfg, args) == []
        with socket.create_server(("127.0.0.1", gateway_port)):
            assert ports_taken(cfg, args) == [f"gateway.port (--port) (127.0.0.1:{gateway_port})"]


def test_wait_ready_gives_up_on_a_gateway_that_never_answers() -> None:
    sup = Supervisor([Child("none", ["true"], {})])
    assert wait_ready(f"http://127.0.0.1:{free_port()}", 0.5, sup) is False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_gateway_told_to_stop_drains_and_exits_0(redis_target: RedisTarget, tmp_path: Path,
                                                   sig: signal.Signals) -> None:
    """`learnmesh gateway` on SIGTERM (what the supervisor sends) or Ctrl-C: uvicorn drains,
    then raises the signal again; the replica must end in its own code (which stops an
    embedded Redis it started, and closes its cluster client), exit code 0 — not die of the
    signal (-15)."""
    port = free_port()
    log = (tmp_path / "gateway.log").open("wb")
    env = dict(os.environ, REDIS_URL=redis_target.url)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for_sync(healthy, timeout_s=30)
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert f"gateway stopped ({sig.name})" in (tmp_path / "gateway.log").read_text()


def test_a_gateway_on_a_port_another_process_listens_on_stops_before_it_reaches_redis(tmp_path: Path) -> None:
    """One line naming the setting, before Redis or workers are reached: the Redis URL here
    answers nothing, and that is not what the gateway reports."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    with socket.create_server(("127.0.0.1", port)):
        done = subprocess.run([sys.executable, "-m", "services.cli", "gateway", "--port", str(port)], cwd=ROOT,
                              env={**env, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
                                   "LEARNMESH_VAR": str(tmp_path / "var")},
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"learnmesh: configuration error: gateway.port: another process listens on 127.0.0.1:{port}; stop it, "
        "or give this gateway another port (--port, LEARNMESH_GATEWAY__PORT)"]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its new parent to reap it counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_children_and_a_private_redis_stop_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    """kill -9 of `learnmesh up`: its children (each in a session of its own) must not stay behind
    holding the mesh's ports, nor its private redis-server beside the next start's. A child is
    told with SIGTERM, so it stops as on Ctrl-C (the gateway drains, the trainer checkpoints)."""
    child = ("import pathlib, signal, sys, time\n"
             f"out = pathlib.Path({str(tmp_path / 'child')!r})\n"
             "signal.signal(signal.SIGTERM, lambda *_: (out.write_text('SIGTERM'), sys.exit(0)))\n"
             "out.write_text('running')\n"
             "time.sleep(120)\n")
    up = ("import os, sys\n"
          "from services.supervisor import Child, Supervisor\n"
          "from shared.redis_embed import start_redis\n"
          f"_, redis = start_redis({str(tmp_path / 'redis')!r})\n"
          f"sup = Supervisor([Child('worker-0', [sys.executable, '-c', {child!r}], dict(os.environ))])\n"
          "sup.start()\n"
          "print(sup.children[0].proc.pid, redis.pid, flush=True)\n"
          "sup.run()\n")
    proc = subprocess.Popen([sys.executable, "-c", up], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        wait_for_sync(lambda: (tmp_path / "child").is_file(), timeout_s=30, what="the child to run")
        proc.kill()
        proc.wait(10)
        for pid in pids:
            wait_for_sync(lambda pid=pid: _gone(pid), timeout_s=15, what=f"process {pid} to stop with its supervisor")
        assert (tmp_path / "child").read_text() == "SIGTERM"
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_children_reach_the_cluster_while_the_url_node_is_down(tmp_path: Path) -> None:
    """`learnmesh up` on a cluster named by one node: a child restarted after that node died
    (a master killed and failed over; the trainer's rank group restarts then) must reach the
    cluster through the nodes the supervisor saw at start, not fail until the node returns."""
    from services.supervisor import seed_more_nodes
    from shared.redis_client import ClusterUnreachable, close_sync, cluster_addresses, sync_client
    from shared.redis_local_cluster import LocalCluster

    cluster = LocalCluster(masters=3, replicas=1).start()
    try:
        cfg = load_config(env={}, overrides={"redis": {"url": cluster.url}})
        # a replica is in the slot map once its master's node has heard it is one (gossip, soon after start)
        wait_for_sync(lambda: len(cluster_addresses(cfg.redis)) == 6, timeout_s=30,
                      what="every replica in the URL node's slot map")
        seed_more_nodes(cfg)
        assert sorted(cfg.redis.cluster_nodes) == sorted(n.address for n in cluster.nodes[1:])
        paths = child_configs(cfg, argparse.Namespace(workers=None), tmp_path, {"demo": "demo-key-123"}, "admin-key")
        child = load_config(paths["trainer"], env={})  # what a restarted child loads
        cluster.kill(cluster.nodes[0])  # the URL's node, a master
        cluster.wait_ok()
        alone = load_config(env={}, overrides={"redis": {"url": cluster.url}})
        with pytest.raises(ClusterUnreachable):
            sync_client(alone.redis, socket_connect_timeout=2, socket_timeout=2)
        client = sync_client(child.redis, socket_connect_timeout=2, socket_timeout=2)
        try:
            for i in range(30):  # keys on every master's slots, the failed-over ones included
                client.set(f"k{i}", i)
                assert client.get(f"k{i}") == str(i).encode()
        finally:
            close_sync(client)
    finally:
        cluster.stop()


def _learnmesh(tmp_path: Path, *args: str, env: dict[str, str], timeout_s: float = 60) -> tuple[int, str, str]:
    """``learnmesh ARGS`` in a session of its own; one that is still running after ``timeout_s``
    (it started a mesh) is stopped with SIGTERM, which stops its children too, and fails the test."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env={**clean, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate(timeout=60)
        pytest.fail(f"learnmesh {' '.join(args)} still ran after {timeout_s}s")
    return proc.returncode, out, err


@pytest.mark.parametrize("args, message", [
    (["up", "--port", "70000"], "learnmesh up: error: argument --port: 70000 is not a TCP port (1-65535)"),
    (["up", "--port", "0"], "learnmesh up: error: argument --port: 0 is not a TCP port (1-65535)"),
    (["up", "--workers", "-1"], "learnmesh up: error: argument --workers: -1 is less than 0"),
    (["up", "--ranks", "0"], "learnmesh up: error: argument --ranks: 0 is less than 1"),
    (["up", "--ranks", "-1"], "learnmesh up: error: argument --ranks: -1 is less than 1"),
    (["gateway", "--port", "65536"], "learnmesh gateway: error: argument --port: 65536 is not a TCP port (1-65535)"),
    (["worker", "--index", "-1"], "learnmesh worker: error: argument --index: -1 is less than 0"),
    (["trainer", "--ranks", "two"], "learnmesh trainer: error: argument --ranks: 'two' is not a whole number"),
])
def test_a_flag_out_of_its_range_is_refused_before_anything_starts(tmp_path: Path, args: list[str],
                                                                   message: str) -> None:
    """Not a traceback (--port 70000), a trainer without ranks (--ranks 0), nor the
    configured port in place of the one given (--port 0)."""
    path, _ = _own_ports_config(tmp_path)
    code, _, err = _learnmesh(tmp_path, "--config", str(path), *args, env={
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "LEARNMESH_VAR": str(tmp_path / "var")})
    assert code == 2 and err.strip().splitlines()[-1] == message, err
    assert not (tmp_path / "var").exists()


@pytest.mark.parametrize("var", ["file", "file/var"])
def test_up_names_learnmesh_var_when_it_cannot_be_the_mesh_directory(redis_url: str, tmp_path: Path, var: str) -> None:
    """$LEARNMESH_VAR a file, or under one (read-only, not permitted: the same path): one line
    naming the variable, nothing started."""
    (tmp_path / "file").write_text("")
    path, _ = _own_ports_config(tmp_path)
    code, out, err = _learnmesh(tmp_path, "--config", str(path), "up",
                                env={"REDIS_URL": redis_url, "LEARNMESH_VAR": str(tmp_path / var)})
    assert code == 2, err
    reason = {"file": "File exists", "file/var": "Not a directory"}[var]
    assert err.strip().splitlines() == [
        f"learnmesh: configuration error: LEARNMESH_VAR: {tmp_path / var} is not a directory this mesh can write "
        f"to ({reason}: {tmp_path / var}); give it one that is"]
    code, out, err = _learnmesh(tmp_path, "keys", env={"LEARNMESH_VAR": str(tmp_path / var)})
    assert code == 1 and err.strip().splitlines() == [
        f"learnmesh: cannot use {tmp_path / var / 'keys' / 'zmq'}: Not a directory"], err


@pytest.mark.parametrize("content", ["- demo\n", "api_keys: [demo]\n", "api_keys: {demo: [1]}\n", "api_keys: {\n",
                                     "request_state_key: not-hex\n"])
def test_up_refuses_a_generated_keys_file_of_another_shape_and_keeps_it(redis_url: str, tmp_path: Path,
                                                                        content: str) -> None:
    """A var/keys/generated.yaml edited into another shape (or cut short): named, left as it is
    (the keys clients use may still be in it), nothing started."""
    keys = tmp_path / "var" / "keys" / "generated.yaml"
    keys.parent.mkdir(parents=True)
    keys.write_text(content)
    keys.chmod(0o600)
    path, _ = _own_ports_config(tmp_path)
    code, out, err = _learnmesh(tmp_path, "--config", str(path), "up",
                                env={"REDIS_URL": redis_url, "LEARNMESH_VAR": str(tmp_path / "var")})
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        f"learnmesh: configuration error: generated keys file {keys} is not what learnmesh up writes (api_keys: "
        "principal -> key, admin_key: key, request_state_key: 64 hex digits); mend it, or delete it to have new keys "
        "made")
    assert keys.read_text() == content and not (tmp_path / "var" / "logs").exists()


def test_a_mesh_stopped_while_it_starts_says_so_and_never_that_it_is_up(tmp_path: Path) -> None:
    """SIGTERM (Ctrl-C alike) before the gateway is ready: every child stops, exit 0, and no
    "learnmesh is up" banner with keys nor "not ready after 120s" for a start cut short. Redis
    here answers nothing, so the gateway is never ready; `up` says that it waits for it."""
    path, _ = _own_ports_config(tmp_path)
    var = tmp_path / "var"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "up"], cwd=ROOT,
                          env={**clean, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "LEARNMESH_VAR": str(var)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_sync(lambda: (var / "logs" / "gateway.log").is_file(), timeout_s=60, what="the gateway to start")
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, err
    assert "learnmesh is up" not in out and "admin key" not in out and "not ready after" not in err
    assert "does not answer; the mesh starts and waits for it" in err
    started = [int(line.rpartition("(pid ")[2].rstrip(")")) for line in err.splitlines() if "(pid " in line]
    assert len(started) == 3 and all(_gone(pid) for pid in started), err


def test_a_mesh_started_before_its_redis_waits_for_it_and_comes_up_when_it_answers(tmp_path: Path) -> None:
    """`up` says it waits for a Redis that does not answer as it starts, and so does every child:
    the trainer waits before it starts its ranks (no rank fails, no restart is spent), the
    gateway answers /readyz 503; once Redis answers, the mesh comes up."""
    from shared.redis_embed import start_redis

    path, _ = _own_ports_config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] = {"pretrain_steps": 0}
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    var = tmp_path / "var"
    out, err, trainer_log = tmp_path / "up.out", tmp_path / "up.err", var / "logs" / "trainer.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "up"], cwd=ROOT,
                              env={**clean, "REDIS_URL": f"redis://127.0.0.1:{port}/0", "LEARNMESH_VAR": str(var)},
                              stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    server = None
    try:
        waits = "does not answer; the trainer waits for it before it starts its ranks"
        wait_for_sync(lambda: (trainer_log.is_file() and waits in trainer_log.read_text()) or up.poll() is not None,
                      timeout_s=120, what="the trainer to wait for Redis")
        assert up.poll() is None, err.read_text()
        _, server = start_redis(tmp_path / "redis", port)
        wait_for_sync(lambda: "learnmesh is up" in out.read_text() or up.poll() is not None, timeout_s=150,
                      what="the mesh to come up once Redis answers")
        wait_for_sync(lambda: "rank 0/" in trainer_log.read_text(), timeout_s=120, what="the trainer's ranks")
        assert up.poll() is None, err.read_text()
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, err.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if server is not None:
            server.terminate()
            server.wait(10)
    logged, trained = err.read_text(), trainer_log.read_text()
    assert "does not answer; the mesh starts and waits for it" in logged
    assert "restarting" not in logged and "before the mesh was ready" not in logged, logged
    assert "Redis answers; starting the ranks" in trained and "failed" not in trained, trained


def test_a_child_that_dies_before_the_mesh_is_ready_is_restarted_while_redis_is_away(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """A child that exits before the mesh is ready stops the mesh at once (a port, a path, a
    setting), unless Redis does not answer: the mesh waits for Redis, so it is restarted."""
    from services.supervisor import _redis_answers
    from shared.config import RedisConfig

    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.01,))
    redis = [Config(redis=RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0"))]  # nothing answers there
    starts = tmp_path / "starts"
    child = Child("trainer", _starts_then_exits(starts, 1), dict(os.environ))
    sup = Supervisor([child], stop_timeout_s=10, redis_answers=lambda: _redis_answers(redis[0]))
    sup.start()
    try:
        wait_for_sync(lambda: not child.alive(), timeout_s=30, what="the child to exit")
        assert sup.mend_before_ready(child) and not sup.stopping, "restarted while Redis is away"
        wait_for_sync(lambda: starts.read_text().count("started") == 2, timeout_s=30, what="its restart")
        wait_for_sync(lambda: not child.alive(), timeout_s=30, what="the child to exit again")
        redis[0] = Config(redis=RedisConfig(url=redis_url))
        assert not sup.mend_before_ready(child) and sup.stopping, "Redis answers: the mesh stops for it"
        assert sup.failed is not None and "before the mesh was ready" in sup.failed
    finally:
        sup.shutdown()


def test_a_child_that_dies_while_the_mesh_starts_stops_the_mesh_at_once(redis_url: str, tmp_path: Path) -> None:
    """The gateway bound to an address of no interface of this machine (TEST-NET-1) passes every
    check before the start and dies as it binds. `up` must say which child died, with its exit
    status and its last words, stop the others and exit non-zero, instead of waiting out the
    readiness timeout and then restarting the gateway for ever."""
    path, _ = _own_ports_config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["gateway"]["host"] = "192.0.2.1"
    cfg["model"] = {"pretrain_steps": 0}  # nothing to wait for in the children that live
    path.write_text(yaml.safe_dump(cfg))
    code, out, err = _learnmesh(tmp_path, "--config", str(path), "up", timeout_s=90,
                                env={"REDIS_URL": redis_url, "LEARNMESH_VAR": str(tmp_path / "var"),
                                     "LEARNMESH_GATEWAY_HOST": "127.0.0.1"})
    assert code == 1, err
    assert "learnmesh is up" not in out and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("learnmesh: gateway exited with status 3 before the mesh was ready: "), err
    gateway_log = tmp_path / "var" / "logs" / "gateway.log"
    assert "cannot assign requested address" in last and str(gateway_log) in last
    # a mistyped variable is named by `up`, once, not again by each child
    assert err.count("LEARNMESH_GATEWAY_HOST sets nothing") == 1 and "LEARNMESH_GATEWAY_HOST" not in \
        gateway_log.read_text(), err
    started = [int(line.rpartition("(pid ")[2].rstrip(")")) for line in err.splitlines() if "(pid " in line]
    assert len(started) == 3 and all(_gone(pid) for pid in started), err


def test_a_learnmesh_variable_that_sets_nothing_is_named_with_the_one_meant_and_never_its_value(
        tmp_path: Path) -> None:
    """LEARNMESH_GATEWAY_PORT (one underscore) sets nothing: without a word the gateway would bind
    its default port. Each such variable is named once, with the setting it resembles; its value
    (it may be a secret) is never shown, and no variable learnmesh or its tools use is named."""
    config = tmp_path / "learnmesh.yaml"
    config.write_text(yaml.safe_dump({"proxy": {"upstreams": [
        {"name": "weather", "url": "https://weather.example/mcp",
         "headers_from_env": {"Authorization": "LEARNMESH_WEATHER_TOKEN"}}]}}))
    secret = "s3cret-value-never-shown"
    mistyped = {"LEARNMESH_GATEWAY_PORT": secret, "LEARNMESH_ADMINKEY": secret, "LEARNMESH_XYZZY": secret}
    used = {"LEARNMESH_WEATHER_TOKEN": secret, "LEARNMESH_DELTA_SIGN_KEY": secret, "LEARNMESH_ZMQ_WORKER_SECRET": secret,
            "LEARNMESH_REDIS_PASSWORD": secret, "LEARNMESH_KEY": secret, "LEARNMESH_LOG_LEVEL": "info"}
    code, _, err = _learnmesh(tmp_path, "--config", str(config), "keys",
                              env={**mistyped, **used, "LEARNMESH_VAR": str(tmp_path / "var")})
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("learnmesh: warning:")] == [
        "learnmesh: warning: LEARNMESH_ADMINKEY sets nothing and is ignored; did you mean LEARNMESH_ADMIN_KEY?",
        "learnmesh: warning: LEARNMESH_GATEWAY_PORT sets nothing and is ignored; did you mean "
        "LEARNMESH_GATEWAY__PORT?",
        "learnmesh: warning: LEARNMESH_XYZZY sets nothing and is ignored; settings are "
        "LEARNMESH_<SECTION>__<KEY>"], err
    assert secret not in err


def _own_network() -> list[str]:
    """A command prefix that runs a process in a network namespace of its own (loopback only),
    where no Redis answers on 127.0.0.1:6379: the embedded default then starts its private one."""
    prefix = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("needs unshare -n and ip (a network namespace of its own)")
    return prefix


def test_up_names_why_its_private_redis_does_not_start_on_a_damaged_var(tmp_path: Path) -> None:
    """var/redis left by a crash with an append-only file redis-server refuses to load: one line
    with redis-server's own reason and where its log is, exit 1, no traceback."""
    var = tmp_path / "var"
    aof = var / "redis" / "appendonlydir"
    aof.mkdir(parents=True)
    (aof / "appendonly.aof.manifest").write_text("file appendonly.aof.1.incr.aof seq 1 type i\n")
    (aof / "appendonly.aof.1.incr.aof").write_bytes(b"*2\r\n$6\r\nSELECT\r\n$1\r\n0\r\nnot a command\r\n")
    path, _ = _own_ports_config(tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    done = subprocess.run([*_own_network(), sys.executable, "-m", "services.cli", "--config", str(path), "up"],
                          cwd=ROOT, env={**clean, "LEARNMESH_VAR": str(var)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("learnmesh: the private redis-server in " + str(var / "redis") + " did not start: "), last
    assert "Bad file format reading the append only file" in last and str(var / "redis" / "redis.log") in last, last
    assert not (var / "logs").exists(), "no child started"


def test_a_child_that_stops_on_a_failure_a_restart_keeps_is_named_with_its_reason(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    """The trainer finds no readable checkpoint in var/checkpoints and exits 2 (whether the gateway
    was ready by then or not): `up` stops the mesh with 2, shows the trainer's last output (its
    reason) and ends with one line naming it, instead of a pointer to a log file alone."""
    path, _ = _own_ports_config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] = {"pretrain_steps": 0}
    path.write_text(yaml.safe_dump(cfg))
    ckpt = tmp_path / "var" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "ckpt-0000000004.pt").write_bytes(b"not a checkpoint")
    code, out, err = _learnmesh(tmp_path, "--config", str(path), "up", "--ranks", "1", timeout_s=240,
                                env={"REDIS_URL": redis_url, "LEARNMESH_VAR": str(tmp_path / "var")})
    assert code == 2, err
    assert f"no checkpoint in {ckpt} (trainer.checkpoint_dir) can be read" in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("learnmesh: trainer exited with status 2"), err
    started = [int(line.rpartition("(pid ")[2].rstrip(")")) for line in err.splitlines() if "(pid " in line]
    assert len(started) == 3 and all(_gone(pid) for pid in started), err


def test_a_second_up_on_a_running_mesh_names_that_mesh_not_its_ports(redis_url: str, tmp_path: Path) -> None:
    """`make run` while `make run` runs (the same var/, the same ports): one line naming the other
    `learnmesh up` and its pid, rather than a list of every port it holds."""
    var = tmp_path / "var"
    holder = hold_var(var)
    path, ports = _own_ports_config(tmp_path)
    try:
        with socket.create_server(("127.0.0.1", ports["gateway"])):
            code, _, err = _learnmesh(tmp_path, "--config", str(path), "up",
                                      env={"REDIS_URL": redis_url, "LEARNMESH_VAR": str(var)})
    finally:
        holder.close()
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"learnmesh: configuration error: another learnmesh up (pid {os.getpid()}) uses {var.resolve()}; stop it, "
        f"or give this mesh a directory of its own (LEARNMESH_VAR)"]


def test_up_on_an_ipv6_address_prints_urls_that_work(redis_url: str, tmp_path: Path) -> None:
    """`up --host ::1`: the banner's URLs carry the address in brackets (RFC 3986); written bare,
    http://::1:8000/mcp is no URL a client takes."""
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    path, ports = _own_ports_config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] = {"pretrain_steps": 0}
    path.write_text(yaml.safe_dump(cfg))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "up", "--host", "::1",
                           "--ranks", "1"], cwd=ROOT, env={**clean, "REDIS_URL": redis_url,
                                                           "LEARNMESH_VAR": str(tmp_path / "var")},
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert up.stdout is not None
        banner = [up.stdout.readline() for _ in range(10)]  # blocks until `up` prints it (or ends)
        endpoint = next(line.split()[2] for line in banner if line.strip().startswith("MCP endpoint"))
        assert endpoint == f"http://[::1]:{ports['gateway']}/mcp", banner
        assert httpx.get(endpoint.removesuffix("/mcp") + "/healthz", timeout=10).status_code == 200
    finally:
        up.terminate()
        up.communicate(timeout=60)
