"""Run a whole mesh (``learnmesh up``) for the mesh benchmarks and drills, and for the
end-to-end tests that reuse them, and talk to it over MCP.

* :class:`RedisServer` — a private ``redis-server`` (optionally with AOF persistence) that
  can be stopped and restarted on the same port.
* :func:`write_mesh_config` — a tiny-model ``learnmesh.yaml`` where every port is free.
* :class:`Mesh` — ``learnmesh up`` as a subprocess (own process group), with readiness
  waits, the children's pids (from the supervisor's log) and admin API helpers.
* :class:`McpHttp` / :class:`McpWs` — lean raw JSON-RPC clients for the 2026-07-28
  (stateless) and 2025-11-25 (session) revisions over HTTP, and over WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis as redis_sync
import yaml

from shared.config import RedisConfig
from shared.net import free_port
from shared.redis_client import SyncRedis, close_sync, is_cluster, sync_client
from tests.waiting import wait_for_sync

ROOT = Path(__file__).resolve().parents[1]
MODERN = "2026-07-28"
LEGACY = "2025-11-25"


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll ``cond`` until it returns something true (returned) or ``timeout_s`` passes."""
    return wait_for_sync(cond, timeout_s, interval_s, what)


# --------------------------------------------------------------------------- redis


class RedisServer:
    """A private redis-server in a temp dir; ``persist`` turns on appendonly (fsync always)."""

    def __init__(self, persist: bool = False, port: int | None = None) -> None:
        from shared.redis_embed import redis_server_binary

        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server not found")
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="lm-mesh-redis-")
        self.persist = persist
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                                      "--save", "", *persist, "--maxmemory-policy", "noeviction"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ping, 15, "redis-server to answer", 0.05)

    def ping(self) -> bool:
        try:
            c = redis_sync.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                return bool(c.ping())
            finally:
                c.close()
        except (redis_sync.RedisError, OSError):
            return False

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def client(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.url, decode_responses=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- config


def write_mesh_config(path: Path, var_dir: Path, workers: int = 2, **sections: dict[str, Any]) -> dict[str, Any]:
    """A tiny-model config with every port free; ``sections`` are merged on top."""
    p = free_port
    cfg: dict[str, Any] = {
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "max_seq": 128, "pretrain_steps": 20,
                  "cache_dir": str(var_dir / "model")},
        "gateway": {"port": p(), "request_state_keys": [os.urandom(32).hex()]},
        "worker": {"endpoints": [f"tcp://127.0.0.1:{p()}" for _ in range(workers)], "heartbeat_interval_ms": 200,
                   "heartbeat_timeout_ms": 1000},
        "trainer": {"ranks": 2, "samples_endpoint": f"tcp://127.0.0.1:{p()}", "master_port": p(),
                    "checkpoint_dir": str(var_dir / "checkpoints"), "batch_size": 8, "batch_wait_ms": 100,
                    "checkpoint_every": 5, "init_timeout_s": 120, "step_timeout_s": 30},
        "security": {"delta_key_file": str(var_dir / "keys" / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{p()}", "snapshot_endpoint": f"tcp://127.0.0.1:{p()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{p()}"},
        "consistency": {"delta_heartbeat_ms": 200},
        "zmq": {"keys_dir": str(var_dir / "keys" / "zmq")},
        "metrics": {"worker_port": 0, "trainer_port": 0, "status_interval_s": 0.5},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return cfg


# --------------------------------------------------------------------------- the mesh


class Mesh:
    """``learnmesh up`` in its own process group, against ``redis_url``."""

    def __init__(self, workdir: Path, redis_url: str, principals: list[str], workers: int = 2,
                 ranks: int = 2, **sections: dict[str, Any]) -> None:
        self.workdir = Path(workdir)
        self.var = self.workdir / "var"
        self.var.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "learnmesh.yaml"
        sections.setdefault("learning", {"teachers": list(principals)})  # every client here teaches
        self.cfg = write_mesh_config(self.config_path, self.var, workers, **sections)
        self.redis_url = redis_url
        self.workers, self.ranks = workers, ranks
        self.api_keys = {p: f"key-{p}-{os.urandom(6).hex()}" for p in principals}
        self.admin_key = "admin-" + os.urandom(12).hex()
        self.port = int(self.cfg["gateway"]["port"])
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "up.log"
        self.extra: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
        env.update({"REDIS_URL": self.redis_url, "LEARNMESH_VAR": str(self.var), "PYTHONUNBUFFERED": "1",
                    "LEARNMESH_API_KEYS": ",".join(f"{p}:{k}" for p, k in self.api_keys.items()),
                    "LEARNMESH_ADMIN_KEY": self.admin_key, "LEARNMESH_CONFIG": str(self.config_path),
                    "PYTHONPATH": str(ROOT)})
        return env

    def start(self, timeout_s: float = 240) -> Mesh:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--workers", str(self.workers),
                                          "--ranks", str(self.ranks)], cwd=ROOT, env=self.env(), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(timeout_s)
        return self

    # ------------------------------------------------------------------ readiness
    def admin(self, path: str, method: str = "GET", base: str | None = None, **kw: Any) -> httpx.Response:
        return httpx.request(method, (base or self.base) + path, headers={"Authorization": f"Bearer {self.admin_key}"},
                             timeout=10, **kw)

    def workers_status(self) -> dict[str, Any]:
        try:
            r = self.admin("/admin/workers")
        except httpx.HTTPError:
            return {}
        return r.json() if r.status_code == 200 else {}

    def live_workers(self) -> list[dict[str, Any]]:
        return [w for w in self.workers_status().get("workers", []) if w.get("live", True)
                and w.get("state", "live") in ("live", "ready", None)]

    def wait_ready(self, timeout_s: float = 240) -> None:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"learnmesh up exited with {self.proc.returncode}:\n{self.tail()}")
            return len(self.live_workers()) >= self.workers and self.trainer_ready()
        wait_until(ready, timeout_s, "mesh: gateway, workers and trainer ready", 0.25)

    def trainer_ready(self) -> bool:
        return "rank 0/" in self.child_log("trainer") and "resumed at step" in self.child_log("trainer")

    # ------------------------------------------------------------------ processes
    def child_log(self, name: str) -> str:
        path = self.var / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def tail(self, n: int = 4000) -> str:
        parts = [self.log_path.read_text(errors="replace")[-n:]] if self.log_path.is_file() else []
        for path in sorted((self.var / "logs").glob("*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-n:])
        return "\n".join(parts)

    def child_pid(self, name: str) -> int:
        """The pid of the newest start of child ``name`` (trainer, worker-0, gateway)."""
        text = self.log_path.read_text(errors="replace")
        found = re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", text)
        if not found:
            raise AssertionError(f"no pid for {name}")
        return int(found[-1])

    def starts(self, name: str) -> int:
        return len(re.findall(rf"started {re.escape(name)} \(pid", self.log_path.read_text(errors="replace")))

    def kill9(self, name: str) -> None:
        """SIGKILL a child's whole process group (the trainer's ranks die with their launcher)."""
        os.killpg(self.child_pid(name), signal.SIGKILL)

    def stop(self, timeout_s: float = 60) -> int | None:
        for p in self.extra:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    @contextlib.contextmanager
    def running(self) -> Iterator[Mesh]:
        """Start the mesh for a fixture; on failure print its logs; on exit it must stop with 0."""
        try:
            self.start()
            yield self
        except BaseException:
            print(self.tail())
            raise
        finally:
            code = self.stop()
            assert code == 0, f"learnmesh up exited with {code} on SIGTERM\n{self.tail()}"

    def start_gateway(self, port: int) -> subprocess.Popen:
        """An extra gateway replica on the same Redis and workers (``learnmesh gateway``)."""
        with open(self.workdir / f"gateway-{port}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--port", str(port)], cwd=ROOT,
                                    env={**self.env(), "LEARNMESH_WORKER__ENDPOINTS":
                                         "[" + ",".join(self.cfg["worker"]["endpoints"]) + "]"},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.extra.append(proc)

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, 60, f"gateway on {port}")
        return proc

    # ------------------------------------------------------------------ state
    def redis(self) -> SyncRedis:
        """A client of the mesh's Redis (a ``RedisCluster`` for a ``redis+cluster://`` URL);
        close it with shared.redis_client.close_sync."""
        return sync_client(RedisConfig(url=self.redis_url), decode_responses=True)

    @property
    def on_cluster(self) -> bool:
        """Whether the mesh's Redis is a Redis Cluster."""
        return is_cluster(RedisConfig(url=self.redis_url))

    def trainer_version(self) -> int:
        from shared import keys

        r = self.redis()
        try:
            return int(r.get(keys.MODEL_VERSION) or 0)
        finally:
            close_sync(r)

    def worker_versions(self) -> list[int]:
        return [int(w.get("version") or 0) for w in self.workers_status().get("workers", [])]

    def converged(self) -> bool:
        v = self.trainer_version()
        versions = self.worker_versions()
        return len(versions) >= self.workers and all(x == v for x in versions)


# --------------------------------------------------------------------------- MCP clients


class McpError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


def tool_result(resp: dict[str, Any]) -> dict[str, Any]:
    if "error" in resp:
        raise McpError(200, resp["error"])
    res = resp["result"]
    if res.get("isError"):
        raise McpError(200, res.get("content"))
    if res.get("structuredContent") is not None:
        return res["structuredContent"]
    return orjson.loads(res["content"][0]["text"])


class McpHttp:
    """One MCP client over Streamable HTTP; ``legacy`` opens a 2025-11-25 session."""

    def __init__(self, base: str, key: str, legacy: bool = False, client: httpx.AsyncClient | None = None) -> None:
        self.base, self.key, self.legacy = base, key, legacy
        self.http = client or httpx.AsyncClient(timeout=60)
        self.own = client is None
        self.session: str | None = None
        self.ids = itertools.count(1)

    async def open(self) -> McpHttp:
        if self.legacy:
            r = await self._post({"jsonrpc": "2.0", "id": next(self.ids), "method": "initialize", "params": {
                "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "mesh-test", "version": "1"}}})
            self.session = r.headers["mcp-session-id"]
            await self._post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    async def _post(self, body: dict[str, Any], base: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}", "Accept": "application/json, text/event-stream",
                   "Content-Type": "application/json"}
        if self.legacy:
            if self.session:
                headers["Mcp-Session-Id"] = self.session
                headers["MCP-Protocol-Version"] = LEGACY
        else:
            headers["Mcp-Method"] = body["method"]
            if body["method"] == "tools/call":
                headers["Mcp-Name"] = body["params"]["name"]
            headers["MCP-Protocol-Version"] = MODERN
        r = await self.http.post((base or self.base) + "/mcp", content=orjson.dumps(body), headers=headers)
        if r.status_code >= 400:
            raise McpError(r.status_code, r.text[:300])
        return r

    async def request(self, method: str, params: dict[str, Any], base: str | None = None) -> dict[str, Any]:
        if not self.legacy:
            params = {**params, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                          "io.modelcontextprotocol/clientCapabilities": {}}}
        r = await self._post({"jsonrpc": "2.0", "id": next(self.ids), "method": method, "params": params}, base)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            for line in r.text.splitlines():
                if line.startswith("data:"):
                    msg = orjson.loads(line[5:])
                    if "id" in msg and ("result" in msg or "error" in msg):
                        return msg
            raise McpError(r.status_code, "no response in SSE stream")
        return orjson.loads(r.content)

    async def call(self, name: str, args: dict[str, Any], base: str | None = None) -> dict[str, Any]:
        return tool_result(await self.request("tools/call", {"name": name, "arguments": args}, base))

    async def close(self) -> None:
        if self.own:
            await self.http.aclose()


class McpWs:
    """One MCP client over WebSocket (/mcp/ws, subprotocol ``mcp``), stateless 2026-07-28 messages."""

    def __init__(self, base: str, key: str) -> None:
        self.url = base.replace("http://", "ws://") + "/mcp/ws"
        self.key = key
        self.ids = itertools.count(1)
        self.ws: Any = None
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    async def open(self) -> McpWs:
        import websockets
        from websockets.typing import Subprotocol

        self.ws = await websockets.connect(self.url, subprotocols=[Subprotocol("mcp")],
                                           additional_headers={"Authorization": f"Bearer {self.key}"})
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                msg = orjson.loads(frame)
                fut = self.pending.pop(msg.get("id"), None) if "id" in msg else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except Exception as exc:  # the socket died: fail every waiter
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(McpError(0, f"websocket closed: {exc!r}"))

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        params = {**params, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                      "io.modelcontextprotocol/clientCapabilities": {}}}
        await self.ws.send(orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).decode())
        return await asyncio.wait_for(fut, 60)

    async def call(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        return tool_result(await self.request("tools/call", {"name": name, "arguments": args}))

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            self.reader.cancel()
