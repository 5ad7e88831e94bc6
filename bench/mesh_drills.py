"""Mixed MCP load and fault drills against a running :class:`bench.mesh_support.Mesh`.

Used by tests/test_drills.py (short, in CI), bench/drills.py (longer, prints a table) and
bench/bench_mesh.py (the load generator). Each drill returns a :class:`DrillReport`:
requests failed (and how), samples lost (acknowledged but never trained; must be 0),
and time to recover from the fault.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq

from bench.mesh_support import ROOT, McpError, McpHttp, McpWs, Mesh, RedisServer, free_port, wait_until
from services.trainer import ledger
from shared.config import ContextConfig, ZmqConfig
from shared.crypto import MAX_SEALED_FRAME_BYTES
from shared.curve import CurveKeys
from shared.redis_client import close_sync
from shared.redis_local_cluster import LocalCluster
from shared.zmq_util import make_socket


@dataclass
class DrillReport:
    name: str
    requests: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    samples_acked: int = 0
    samples_lost: int = 0
    duplicates: int = 0
    recover_s: float = 0.0
    notes: str = ""

    def line(self) -> str:
        fails = ", ".join(f"{k}={v}" for k, v in sorted(self.failures.items())) or "-"
        return (f"drill {self.name}: requests {self.requests} failed {self.failed} ({fails}); samples acked "
                f"{self.samples_acked} lost {self.samples_lost} duplicated {self.duplicates}; recovered in "
                f"{self.recover_s:.1f}s{'; ' + self.notes if self.notes else ''}")


class Load:
    """Concurrent MCP clients doing context_append / generate / learn until stopped."""

    def __init__(self, mesh: Mesh, clients: int = 6, kinds: tuple[str, ...] = ("legacy", "modern", "ws"),
                 learn_every: int = 2, max_tokens: int = 4, bases: list[str] | None = None) -> None:
        self.mesh, self.n, self.kinds = mesh, clients, kinds
        self.learn_every, self.max_tokens = learn_every, max_tokens
        self.bases = bases or [mesh.base]
        self.acked: list[str] = []
        self.written: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.ok_at: dict[str, float] = {}
        self.failures: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.n)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        self.tasks = []

    async def _op(self, name: str, call: Any) -> Any:
        t0 = time.monotonic()
        self.requests += 1
        try:
            out = await call
        except McpError as exc:
            code = exc.body.get("code") if isinstance(exc.body, dict) else None
            self.failures[f"{name}:{exc.status if exc.status != 200 else code}"] += 1
            return None
        except (TimeoutError, httpx.HTTPError, OSError) as exc:
            self.failures[f"{name}:{type(exc).__name__}"] += 1
            return None
        now = time.monotonic()
        self.latency[name].append(now - t0)
        self.ok_at[name] = now
        return out

    async def _connect(self, i: int) -> Any:
        kind = self.kinds[i % len(self.kinds)]
        principal = list(self.mesh.api_keys)[i % len(self.mesh.api_keys)]
        key = self.mesh.api_keys[principal]
        base = self.bases[i % len(self.bases)]
        while not self.stop.is_set():
            try:
                if kind == "ws":
                    return principal, await McpWs(base, key).open()
                return principal, await McpHttp(base, key, legacy=kind == "legacy").open()
            except Exception:
                self.failures["connect"] += 1
                await asyncio.sleep(0.2)
        return principal, None

    async def _client(self, i: int) -> None:
        principal, client = await self._connect(i)
        if client is None:
            return
        ctx = f"load-{i}-{os.getpid()}"
        n = 0
        try:
            while not self.stop.is_set():
                n += 1
                text = f"{principal}:{ctx}:{n}"
                r = await self._op("context", client.call("context_append", {
                    "context_id": ctx, "modality": "text", "role": "user", "text": text}))
                if r is not None:
                    self.written[(principal, ctx)].append(text)
                await self._op("generate", client.call("generate", {
                    "prompt": "The capital of Zorbland is", "max_tokens": self.max_tokens, "temperature": 0.0,
                    "append": False}))
                if n % self.learn_every == 0:
                    ack = await self._op("learn", client.call("learn", {"samples": [
                        {"kind": "example", "input": f"{principal} note {n}", "target": f" {ctx}"}]}))
                    if ack is not None:
                        self.acked.extend(ack["ids"])
                if getattr(client, "ws", None) is not None and client.reader is not None and client.reader.done():
                    await client.close()  # the socket died (gateway restart): reconnect
                    principal, client = await self._connect(i)
                    if client is None:
                        return
                await asyncio.sleep(0)
        finally:
            if client is not None:
                await client.close()

    def report(self, name: str) -> DrillReport:
        return DrillReport(name, requests=self.requests, failed=sum(self.failures.values()),
                           failures=dict(self.failures), samples_acked=len(self.acked))


def settle(mesh: Mesh, acked: list[str], timeout_s: float = 180) -> tuple[int, int]:
    """Wait until every acknowledged sample is trained; returns (lost, duplicated)."""
    r = mesh.redis()
    try:
        want = set(acked)
        try:
            wait_until(lambda: want <= set(ledger.trained_ids(r)), timeout_s, "acked samples in the ledger", 0.5)
        except AssertionError:
            pass
        trained = collections.Counter(ledger.trained_ids(r))
        lost = len(want - set(trained))
        dup = sum(1 for i in want if trained[i] > 1)
        return lost, dup
    finally:
        close_sync(r)


async def _timed_load(mesh: Mesh, load_s: float, fault: Any, recovered: Any, name: str,
                      **load_kw: Any) -> DrillReport:
    load = Load(mesh, **load_kw)
    load.start()
    await asyncio.sleep(load_s / 3)
    t_fault = time.monotonic()
    notes = await asyncio.to_thread(fault) or ""
    await asyncio.to_thread(wait_until, recovered, 120, f"{name}: recovery", 0.1)
    recover_s = time.monotonic() - t_fault
    await asyncio.sleep(load_s * 2 / 3)
    await load.finish()
    rep = load.report(name)
    rep.recover_s, rep.notes = recover_s, notes
    rep.samples_lost, rep.duplicates = await asyncio.to_thread(settle, mesh, load.acked)
    bad = _context_mismatches(mesh, load)
    if bad:
        rep.notes += f"; {bad} contexts differ from what was acknowledged"
    rep.context_mismatches = bad  # type: ignore[attr-defined]
    return rep


def _context_mismatches(mesh: Mesh, load: Load) -> int:
    """Contexts whose stored text entries are not exactly the acknowledged appends (in order)."""
    cap = ContextConfig(**mesh.cfg.get("context", {})).channel_max_entries

    async def check() -> int:
        bad = 0
        for (principal, ctx), written in load.written.items():
            c = await McpHttp(mesh.base, mesh.api_keys[principal]).open()
            try:
                got = await c.call("context_get", {"context_id": ctx})
            finally:
                await c.close()
            texts = [e.get("text") for e in got["entries"]]
            # an append whose reply was lost in an outage may have been stored: allow extras only
            # if they are this client's own texts, never another's, and never lose an acked one
            if any(not t.startswith(f"{principal}:{ctx}:") for t in texts):
                bad += 1
            elif not set(_in_window(written, texts, cap)) <= set(texts):
                bad += 1
        return bad
    return asyncio.run(check()) if not _in_loop() else _run_in_thread(check)


def _in_window(written: list[str], texts: list[str], cap: int) -> list[str]:
    """The acknowledged appends the channel must still hold: all of them, unless it is full
    (``context.channel_max_entries``), when the oldest gave way and those from its oldest
    entry on remain (a long drill appends more than a window)."""
    if len(texts) < cap:
        return written
    oldest = min(int(t.rsplit(":", 1)[1]) for t in texts)
    return [w for w in written if int(w.rsplit(":", 1)[1]) >= oldest]


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _run_in_thread(coro_fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(asyncio.run(coro_fn())))
    t.start()
    t.join()
    return out[0]


# --------------------------------------------------------------------------- drills


async def drill_worker_kill(mesh: Mesh, load_s: float = 12) -> DrillReport:
    starts = mesh.starts("worker-0")

    def fault() -> str:
        mesh.kill9("worker-0")
        return ""

    def recovered() -> bool:
        return mesh.starts("worker-0") > starts and len(mesh.live_workers()) >= mesh.workers and mesh.converged()
    return await _timed_load(mesh, load_s, fault, recovered, "kill -9 worker")


async def drill_trainer_kill(mesh: Mesh, load_s: float = 15) -> DrillReport:
    starts = mesh.starts("trainer")
    before = mesh.trainer_version()

    def fault() -> str:
        wait_until(lambda: mesh.trainer_version() > before, 60, "a trained step before the kill", 0.2)
        mesh.kill9("trainer")  # the launcher's process group; every rank dies with the launcher
        return ""

    def recovered() -> bool:
        return mesh.starts("trainer") > starts and _trainer_resumed(mesh) and mesh.trainer_version() > before
    return await _timed_load(mesh, load_s, fault, recovered, "kill -9 trainer", learn_every=1)


def _trainer_resumed(mesh: Mesh) -> bool:
    return mesh.child_log("trainer").count("resumed at step") >= mesh.starts("trainer")


async def drill_redis_restart(mesh: Mesh, redis: RedisServer, load_s: float = 12, outage_s: float = 3) -> DrillReport:
    gateway_pid = mesh.child_pid("gateway")
    seen_503: list[int] = []

    def fault() -> str:
        redis.stop()
        t_end = time.monotonic() + outage_s
        while time.monotonic() < t_end:
            try:
                code = httpx.get(mesh.base + "/readyz", timeout=2).status_code
            except httpx.HTTPError:
                code = 0
            seen_503.append(code)
            time.sleep(0.2)
        redis.start()
        return ""

    rep = await _timed_load(mesh, load_s, fault, lambda: _serving(mesh), "restart redis")
    assert 503 in seen_503, f"gateway did not answer 503 during the Redis outage: {set(seen_503)}"
    rep.notes = (f"readyz during outage: {collections.Counter(seen_503)}; gateway restarted: "
                 f"{mesh.child_pid('gateway') != gateway_pid}")
    rep.gateway_restarted = mesh.child_pid("gateway") != gateway_pid  # type: ignore[attr-defined]
    return rep


async def drill_rolling_failover(mesh: Mesh, cluster: LocalCluster, load_s: float = 12) -> DrillReport:
    """Rolling maintenance of a Redis Cluster: every master in turn handed to its replica with
    ``CLUSTER FAILOVER`` (graceful: no write lost) under load, the sample log's partitions, the
    trainer's commit record and ledger among them. Every acknowledged sample is still trained
    exactly once; the gateway and the trainer go on without a restart."""
    gateway_pid, trainer_pid = mesh.child_pid("gateway"), mesh.child_pid("trainer")

    def fault() -> str:
        handed = 0
        for master in cluster.primaries():
            with cluster.replica_of(master).client(socket_timeout=10) as c:
                c.execute_command("CLUSTER", "FAILOVER")
            wait_until(lambda m=master: m.port not in {n.port for n in cluster.primaries()}, 30,
                       f"the replica of {master.address} to take over", 0.05)
            cluster.wait_ok(30)
            handed += 1
        return f"{handed} masters handed over"

    rep = await _timed_load(mesh, load_s, fault, lambda: _serving(mesh), "rolling failover")
    restarted = [name for name, pid in (("gateway", gateway_pid), ("trainer", trainer_pid))
                 if mesh.child_pid(name) != pid]
    rep.notes += f"; restarted: {', '.join(restarted) or 'none'}"
    rep.restarted = restarted  # type: ignore[attr-defined]
    return rep


def _serving(mesh: Mesh) -> bool:
    """The gateway is ready and stores a context append."""
    try:
        return httpx.get(mesh.base + "/readyz", timeout=2).status_code == 200 and _learn_ok(mesh)
    except httpx.HTTPError:
        return False


def _learn_ok(mesh: Mesh) -> bool:
    async def go() -> bool:
        c = McpHttp(mesh.base, next(iter(mesh.api_keys.values())))
        try:
            await c.call("context_append", {"context_id": "probe", "modality": "text", "text": "probe"})
            return True
        except (McpError, httpx.HTTPError):
            return False
        finally:
            await c.close()
    return _run_in_thread(go)


async def drill_gateway_replica(mesh: Mesh, load_s: float = 10) -> DrillReport:
    """A legacy session lives across two replicas; replica B stops and comes back."""
    steps = int(load_s * 5)
    if steps <= _B_RESTART_STEP:
        raise ValueError(f"load_s={load_s}: replica B comes back after {_B_RESTART_STEP / 5}s of load")
    port_b = free_port()
    proc_b = mesh.start_gateway(port_b)
    principal = next(iter(mesh.api_keys))
    session = await McpHttp(mesh.base, mesh.api_keys[principal], legacy=True).open()
    load = Load(mesh, clients=3, kinds=("legacy", "modern"), bases=[mesh.base])
    load.start()
    writes = _SessionWrites(session, principal, mesh.base, f"http://127.0.0.1:{port_b}")
    try:
        await _stop_and_resume_b(mesh, port_b, proc_b, writes, steps=steps)
        got = await session.call("context_get", {"context_id": "shared-session"}, base=writes.base_b)
    finally:
        await load.finish()
        await session.close()
    return await _replica_report(mesh, load, writes, got)


_B_STOP_STEP, _B_RESTART_STEP = 5, 15  # steps are 0.2 s apart


@dataclass
class _SessionWrites:
    """One legacy session's appends to replica A (stays up) and replica B (stops, comes back)."""

    session: McpHttp
    principal: str
    base_a: str
    base_b: str
    texts: list[str] = field(default_factory=list)  # acknowledged, in order
    fails_a: int = 0
    fails_b: int = 0
    requests: int = 0
    t_fault: float = 0.0
    recover_s: float = 0.0

    async def append_to_both(self, step: int) -> None:
        for base in (self.base_a, self.base_b):
            text = f"{self.principal}:session:{step}:{base[-5:]}"
            self.requests += 1
            try:
                await self.session.call("context_append", {"context_id": "shared-session", "modality": "text",
                                                           "text": text}, base=base)
                self.texts.append(text)
                if base == self.base_b and self.t_fault and not self.recover_s and step >= _B_RESTART_STEP:
                    self.recover_s = time.monotonic() - self.t_fault
            except (McpError, httpx.HTTPError):
                if base == self.base_a:
                    self.fails_a += 1
                else:
                    self.fails_b += 1


async def _stop_and_resume_b(mesh: Mesh, port_b: int, proc_b: subprocess.Popen, writes: _SessionWrites,
                             steps: int) -> None:
    for step in range(steps):
        if step == _B_STOP_STEP:
            proc_b.terminate()
            proc_b.wait(20)
            writes.t_fault = time.monotonic()
        if step == _B_RESTART_STEP:
            proc_b = await asyncio.to_thread(mesh.start_gateway, port_b)
        await writes.append_to_both(step)
        await asyncio.sleep(0.2)


async def _replica_report(mesh: Mesh, load: Load, writes: _SessionWrites, got: dict[str, Any]) -> DrillReport:
    rep = load.report("gateway replica stop/resume")
    rep.requests += writes.requests
    rep.failed += writes.fails_a
    rep.failures["session@A"] = writes.fails_a
    rep.failures["session@B(while down)"] = writes.fails_b
    rep.recover_s = writes.recover_s
    stored = [e.get("text") for e in got["entries"]]
    assert stored == writes.texts, "the session's context differs from what was acknowledged"
    assert writes.fails_a == 0, "the session failed on the replica that stayed up"
    rep.samples_lost, rep.duplicates = await asyncio.to_thread(settle, mesh, load.acked)
    rep.notes = f"legacy session kept {len(writes.texts)} writes across the replica restart"
    return rep


async def drill_tampered_deltas(mesh: Mesh, load_s: float = 10) -> DrillReport:
    """A man-in-the-middle on the delta path of an extra worker: every real packet is forwarded,
    and with it a bit-flipped copy, a replay of an older packet and a garbage frame."""
    mitm = f"tcp://127.0.0.1:{free_port()}"
    worker_ep = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    proxy = _TamperingProxy(mesh.cfg["security"]["delta_pub_endpoint"], mitm, ZmqConfig(**mesh.cfg["zmq"]))
    proxy.start()
    worker = _start_mitm_worker(mesh, mitm, worker_ep, metrics_port)
    load = Load(mesh, clients=3, learn_every=1)
    load.start()
    try:
        await asyncio.to_thread(wait_until, lambda: "version" in _scrape(metrics_port), 90, "the extra worker", 0.2)
        proxy.armed.set()
        await asyncio.sleep(load_s)
        await load.finish()
        lost_dup = await asyncio.to_thread(settle, mesh, load.acked)
        latest, m = await _caught_up(mesh, metrics_port)
    finally:
        await load.finish()
        proxy.stop()
        _stop_worker(worker)
        proxy.ctx.term()
    rep = load.report("tampered deltas")
    rep.samples_lost, rep.duplicates = lost_dup
    rep.notes = (f"injected {dict(proxy.injected)}; worker rejected {m['rejected_by']} and serves v{m['version']} "
                 f"(trainer v{latest})")
    rep.rejected = m["rejected"]  # type: ignore[attr-defined]
    rep.injected = sum(proxy.injected.values())  # type: ignore[attr-defined]
    return rep


class _TamperingProxy:
    """Forwards every delta packet from ``upstream`` to ``endpoint``; once armed, sends with each
    a bit-flipped copy, a garbage frame and a replay of the packet before it."""

    def __init__(self, upstream: str, endpoint: str, zmq_cfg: ZmqConfig) -> None:
        self.upstream, self.endpoint, self.zmq_cfg = upstream, endpoint, zmq_cfg
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self.armed = threading.Event()  # inject only once the worker is up, so every injected packet reaches it
        self.injected: collections.Counter[str] = collections.Counter()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)

    def _run(self) -> None:
        # It holds the worker's and the trainer's CURVE keys: what is drilled is the envelope.
        worker_keys = CurveKeys.load(self.zmq_cfg, "worker")
        trainer_keys = CurveKeys.load(self.zmq_cfg, "trainer")
        sub = make_socket(self.ctx, zmq.SUB, connect=self.upstream, max_frame_bytes=MAX_SEALED_FRAME_BYTES,
                          curve=worker_keys.client("trainer") if worker_keys else None)
        pub = make_socket(self.ctx, zmq.PUB, bind=self.endpoint,
                          curve=trainer_keys.server("deltas") if trainer_keys else None)
        previous: list[bytes] | None = None
        while not self.stopping.is_set():
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            if not self.armed.is_set():
                pub.send_multipart(frames)
                continue
            self._tamper(pub, frames, previous)
            previous = frames
        sub.close()
        pub.close()

    def _tamper(self, pub: zmq.Socket, frames: list[bytes], previous: list[bytes] | None) -> None:
        flipped = list(frames)
        last = bytearray(flipped[-1])
        last[len(last) // 2] ^= 0x40
        flipped[-1] = bytes(last)
        pub.send_multipart(flipped)
        self.injected["bitflip"] += 1
        pub.send_multipart([b"\x07", b"not a delta"])
        self.injected["garbage"] += 1
        pub.send_multipart(frames)
        if previous is not None:
            pub.send_multipart(previous)
            self.injected["replay"] += 1


def _start_mitm_worker(mesh: Mesh, delta_endpoint: str, worker_ep: str, metrics_port: int) -> subprocess.Popen:
    """An extra worker that takes its deltas from ``delta_endpoint`` and serves metrics on ``metrics_port``."""
    env = {**mesh.env(), "LEARNMESH_SECURITY__DELTA_PUB_ENDPOINT": delta_endpoint,
           "LEARNMESH_METRICS__WORKER_PORT": str(metrics_port - 2)}
    with open(mesh.workdir / "worker-mitm.log", "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "services.cli", "worker", "--index", "2",
                                 "--endpoint", worker_ep], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop_worker(worker: subprocess.Popen) -> None:
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(15)
    except subprocess.TimeoutExpired:
        worker.kill()


async def _caught_up(mesh: Mesh, metrics_port: int) -> tuple[int, dict[str, Any]]:
    """Wait until the tampered worker serves the trainer's version, having rejected packets;
    (the trainer's version, the worker's metrics)."""
    def worker_caught_up() -> bool:
        m = _scrape(metrics_port)
        return m.get("version", -1) == mesh.trainer_version() and m.get("rejected", 0) > 0
    await asyncio.to_thread(wait_until, worker_caught_up, 60, "the tampered worker at the trainer's version", 0.2)
    return mesh.trainer_version(), _scrape(metrics_port)


def _scrape(port: int) -> dict[str, Any]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    out: dict[str, Any] = {"rejected": 0, "rejected_by": {}}
    for line in text.splitlines():
        if line.startswith("learnmesh_delta_rejected_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            n = float(line.rsplit(" ", 1)[1])
            out["rejected"] += n
            out["rejected_by"][reason] = n
        elif line.startswith("learnmesh_worker_model_version{"):
            out["version"] = int(float(line.rsplit(" ", 1)[1]))
    return out
