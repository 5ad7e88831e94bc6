"""Helpers for tests that run real ``learnmesh worker`` processes over ZeroMQ."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import yaml

from shared.config import Config, load_config
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent

TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq": 128, "pretrain_steps": 3,
              "pretrain_batch": 2, "pretrain_seq": 32, "image_patch": 4, "image_grid": 2, "audio_frame": 16}


def write_config(tmp_path: Path, n_workers: int = 1, *, worker: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, redis_url: str | None = None) -> tuple[Path, Config]:
    data: dict[str, Any] = {
        "model": {**TINY_MODEL, "cache_dir": str(tmp_path / "model-cache")},
        "worker": {"endpoints": [f"tcp://127.0.0.1:{free_port()}" for _ in range(n_workers)],
                   "heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1500, "max_wait_ms": 5.0,
                   "request_timeout_s": 30.0, **(worker or {})},
        "security": {"delta_key_file": str(tmp_path / "keys" / "delta.key"),
                     "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                     "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "trainer": {"checkpoint_dir": str(tmp_path / "checkpoints")},
        "zmq": {"keys_dir": str(tmp_path / "keys" / "zmq")},
        "metrics": {"worker_port": 0},
    }
    if redis_url:
        data["redis"] = {"url": redis_url}
    for section, values in (extra or {}).items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / "learnmesh.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_config(path, env={})


def spawn_worker(config_path: Path, index: int, endpoint: str | None = None, log: IO[bytes] | None = None
                 ) -> subprocess.Popen:
    """``learnmesh worker --index index`` (binding ``endpoint`` instead of worker.endpoints[index]).
    Its stderr is a pipe for the caller to read, or the open file ``log`` where nothing reads
    it: a pipe nobody reads fills up and blocks the worker at its next log line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_")}
    env["OMP_NUM_THREADS"] = "1"
    bind = ["--endpoint", endpoint] if endpoint else []
    return subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(config_path), "worker",
                             "--index", str(index), *bind], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log or subprocess.PIPE)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stderr is not None:
        proc.stderr.close()


class FakeWorker:
    """A real ZeroMQ ROUTER playing a worker with the workers' CURVE keys of ``cfg``: it answers
    HELLO with a HEARTBEAT as ``worker_id`` (``instance``: the process it claims to be), and
    INFER with a RESULT naming it when ``answers(header)``, else keeps the request unanswered;
    the ids of the requests the gateway cancels (CANCEL) go to ``cancelled``, every INFER's header
    and content frames to ``received``; :meth:`answer` and :meth:`fail` end a request it holds. ``tokens``: TOKEN
    messages it streams for each request first; ``silent``: it answers nothing (a dead worker)."""

    def __init__(self, ctx: Any, cfg: Config, endpoint: str, worker_id: str, instance: str = "first") -> None:
        import asyncio

        import zmq

        from shared.curve import CurveKeys
        from shared.zmq_util import make_socket

        keys = CurveKeys.load(cfg.zmq, "worker")
        from shared.inference import max_frame_bytes

        self.sock = make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=keys.server("infer") if keys else None,
                                max_frame_bytes=max_frame_bytes(cfg))  # what a worker reads
        self.worker_id, self.instance = worker_id, instance
        self.load = 0  # what its heartbeats report
        self.answers: Any = lambda header: True
        self.unanswered: list[str] = []
        self._peers: dict[str, bytes] = {}  # request id -> the gateway connection that sent it
        self.cancelled: list[str] = []
        self.received: list[tuple[dict, list[bytes]]] = []
        self.tokens = 0
        self.silent = False
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        from shared import wire
        from shared.wire import MsgType

        while True:
            peer, *frames = await self.sock.recv_multipart()
            msg_type, header, payload = wire.decode(frames)
            if self.silent:
                continue
            if msg_type == MsgType.INFER:
                self.received.append((header, [bytes(f) for f in payload]))
                for _ in range(self.tokens):
                    await self.sock.send_multipart([peer, *wire.encode(MsgType.TOKEN, {"id": header["id"], "text": "t",
                                                                                        "version": 0})])
            if msg_type == MsgType.HELLO:
                reply = wire.encode(MsgType.HEARTBEAT, {"worker": self.worker_id, "instance": self.instance,
                                                         "version": 0, "load": self.load, "lag": 0})
            elif msg_type == MsgType.INFER and self.answers(header):
                reply = wire.encode(MsgType.RESULT, {"id": header["id"], "version": 0, "worker": self.worker_id,
                                                      "text": "ok", "tokens": 1, "finish_reason": "stop"})
            else:
                if msg_type == MsgType.INFER:
                    self.unanswered.append(str(header["id"]))
                    self._peers[str(header["id"])] = peer
                elif msg_type == MsgType.CANCEL:
                    self.cancelled.append(str(header["id"]))
                continue
            await self.sock.send_multipart([peer, *reply])

    async def answer(self, request_id: str) -> None:
        """Answer a request it held (a generation's shape)."""
        await self._end(request_id, "RESULT", {"version": 0, "worker": self.worker_id, "text": "ok", "tokens": 1,
                                                "finish_reason": "stop"})

    async def fail(self, request_id: str) -> None:
        """End a request it held with the error a failing worker sends."""
        await self._end(request_id, "ERROR", {"version": 0, "code": "internal", "message": "the model failed"})

    async def _end(self, request_id: str, kind: str, header: dict) -> None:
        from shared import wire
        from shared.wire import MsgType

        await self.sock.send_multipart([self._peers.pop(request_id),
                                        *wire.encode(MsgType[kind], {"id": request_id, **header})])

    async def close(self) -> None:
        import asyncio
        import contextlib

        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close(linger=0)
