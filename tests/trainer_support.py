"""Helpers shared by the trainer tests: a config for a tiny, fast trainer, a trainer process
handle, and Redis clients and readings of the commit record that work alike on one server and
on a Redis Cluster (give them ``redis_target.url``: a ``redis+cluster://`` url makes cluster
clients through shared.redis_client, and the trainer then splits its sample log into
partitions, so a test counts what was trained over all of them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from shared import keys
from shared.config import Config, RedisConfig, load_config
from shared.redis_client import SyncRedis, async_client, close_sync, sync_client
from shared.samples import partition_of, position_field, sample_partitions
from shared.text import as_str
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def trainer_config(redis_url: str, tmp_path: Path, samples_port: int, model: dict[str, Any] | None = None,
                   **trainer: Any) -> Config:
    over: dict[str, Any] = {
        "model": model or {},
        "redis": {"url": redis_url},
        "trainer": {"ranks": 1, "model_factory": "services.trainer.tiny:build_tiny_model",
                    "checkpoint_dir": str(tmp_path / "ckpt"), "batch_size": 4, "batch_wait_ms": 50,
                    "checkpoint_every": 5, "samples_endpoint": f"tcp://127.0.0.1:{samples_port}",
                    "init_timeout_s": 60, "step_timeout_s": 20, "lr": 0.01,
                    # one pass, no rehearsal unless a test asks: each test counts its own steps
                    "replay_passes": 1, "rehearsal_per_step": 0, **trainer},
    }
    over["security"] = {"delta_key_file": str(tmp_path / "keys" / "delta.key"),
                        "delta_pub_endpoint": f"tcp://127.0.0.1:{free_port()}",
                        "snapshot_endpoint": f"tcp://127.0.0.1:{free_port()}",
                        "ack_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    over["metrics"] = {"trainer_port": 0}
    over["zmq"] = {"keys_dir": str(tmp_path / "keys" / "zmq")}
    return load_config(env={}, overrides=over)


class TrainerProc:
    """``learnmesh trainer`` as a subprocess in its own process group (a kill -9 of the group
    takes the ranks with it). ``kill`` (RANK:STEP:MARKER) and ``dump_dir`` start it through
    tests/trainer_entry.py, which installs those observers on every rank."""

    def __init__(self, cfg: Config, tmp_path: Path, *, kill: str | None = None, dump_dir: Path | None = None,
                 max_file_bytes: int | None = None) -> None:
        self.path = tmp_path / f"trainer-{os.getpid()}-{id(self)}.yaml"
        self.path.write_text(yaml.safe_dump(cfg.to_dict()))
        self.log = open(tmp_path / f"trainer-{id(self)}.log", "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
        observers = [*(["--kill", kill] if kill else []), *(["--dump-dir", str(dump_dir)] if dump_dir else [])]
        entry = ["-m", "tests.trainer_entry", "--config", str(self.path), *observers] if observers else \
            ["-m", "services.cli", "--config", str(self.path), "trainer"]
        self.proc = subprocess.Popen([sys.executable, *entry], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_file_size_limit(max_file_bytes) if max_file_bytes else None)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def term(self, timeout_s: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self.log.close()

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")


def _file_size_limit(max_bytes: int) -> Any:
    """A full disk, as the trainer sees it: a write past ``max_bytes`` fails (EFBIG) instead of
    ending the process (SIGXFSZ ignored); the ranks inherit both."""
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def sync_redis(redis_url: str) -> Any:
    """A blocking client of ``redis_url`` (a redis+cluster:// url gives a cluster client)."""
    return sync_client(RedisConfig(url=redis_url))


@contextlib.contextmanager
def sync_redis_open(redis_url: str) -> Iterator[SyncRedis]:
    """:func:`sync_redis`, closed (every node's connections too) when the block ends."""
    r = sync_redis(redis_url)
    try:
        yield r
    finally:
        close_sync(r)


def async_redis(redis_url: str) -> Any:
    """An asyncio client of ``redis_url`` (a redis+cluster:// url gives a cluster client)."""
    return async_client(RedisConfig(url=redis_url))


def ledger_outcomes(redis_url: str) -> tuple[list[str], dict[str, str]]:
    """(ids in the ledger of trained samples, {id: reason} of those consumed without training)."""
    from services.trainer import ledger

    with sync_redis_open(redis_url) as r:
        return ledger.trained_ids(r), ledger.skipped_ids(r)


def trained_total(record: dict[str, str]) -> int:
    """Samples a commit record (``committed``) says were trained, over every log partition."""
    return sum(int(v) for k, v in record.items() if k == "seq" or k.startswith("seq."))


def trained(redis_url: str) -> int:
    """Samples the trainer has committed, over every log partition."""
    return trained_total(committed(redis_url))


def position(record: dict[str, str], cfg: Config, principal: str) -> tuple[int, str]:
    """(seq, log identity) the commit record holds for the log partition of ``principal``'s samples."""
    part = partition_of(principal, sample_partitions(cfg))
    return int(record.get(position_field("seq", part), 0)), record.get(position_field("log", part), "")


def log_entries(redis: Any, partitions: int) -> int:
    """Entries left in every partition of the sample log."""
    return sum(redis.xlen(keys.sample_log(p)) for p in range(partitions))


def committed(redis_url: str) -> dict[str, str]:
    with sync_redis_open(redis_url) as r:
        return {as_str(k): as_str(v) for k, v in r.hgetall(keys.TRAINER_OFFSET).items()}


def wide_tiny_model(model_cfg: Any = None, pretrained: bool = True) -> Any:
    """``trainer.model_factory`` of a model of another size than the tiny one (checkpoints of
    either do not fit the other)."""
    from services.trainer.tiny import TinyLM

    return TinyLM(width=48)
