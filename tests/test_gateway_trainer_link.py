"""The gateway's link to the trainer while the trainer is away (stopped, crashed for good, not
started yet) and nobody teaches: a real gateway replica (its lifespan, real Redis, real ZeroMQ)."""

from __future__ import annotations

from pathlib import Path

from gateway.app import _registry, open_gateway
from shared.config import load_config
from shared.net import free_port
from tests.conftest import wait_for


async def test_the_trainer_link_reports_are_read_while_no_one_teaches(redis_url: str, tmp_path: Path) -> None:
    """libzmq tells the link's watch of every failed attempt to reach the trainer (ten a second)
    through an in-process queue, and its one I/O thread blocks once that queue is full: every
    ZeroMQ socket of the replica stops, its workers miss heartbeats and inference answers "no
    inference worker is available" until a `learn` call reads the queue. Read only by `learn`,
    the queue filled within minutes of the trainer going away; the replica reads it by itself."""
    cfg = load_config(env={}, overrides={
        "redis": {"url": redis_url},
        "gateway": {"api_keys": {"alice": "alice-key-0123456789"}},
        "worker": {"endpoints": [], "discovery": False},
        "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}"},  # no trainer there
        "zmq": {"curve": False, "keys_dir": str(tmp_path / "zmq")},
        "security": {"delta_key_file": str(tmp_path / "delta.key")},
    })
    async with open_gateway(cfg, _registry(None)) as gateway:
        watch = gateway.samples.watch
        assert watch is not None
        await wait_for(lambda: watch.mon.poll(0), timeout_s=10, what="libzmq to report its attempts to reach the trainer")
        await wait_for(lambda: not watch.mon.poll(0), timeout_s=10,
                       what="the reports read without a learn call")
