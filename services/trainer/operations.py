"""The trainer's side of the operator control plane (docs/operations.md, shared/control.py).

Rank 0 polls Redis once per loop iteration through :class:`TrainerOps`:

* pause / resume — a paused trainer takes no steps; the loop keeps turning (idle), so the
  delta publisher still answers snapshot requests and SIGTERM still stops it;
* one-shot commands — ``checkpoint`` and ``rollback`` are resolved on rank 0 (a rollback
  target must be a retained checkpoint whose weights are exactly that published version,
  else the command is answered with an error) and then broadcast to every rank inside the
  batch header, so all ranks act in lockstep; rank 0 acknowledges once they are done;
* runtime config — compression / scheduling go to the publisher's encoder, consistency to
  the loop (``sync_interval``); only rank 0 uses them, so nothing is broadcast;
* delta key rotation — a fresh AES key and/or signing key replaces the current one without
  stopping; the previous one is accepted for ``security.delta_key_grace_s`` more seconds;
  receivers reload the ring when a packet names a key id they do not know.

It also publishes what the dashboard and ``/admin/models`` show: the version log
(:func:`shared.control.record_version`), the ``delta`` self-report (compression ratio,
step→serving latency from worker acks, density, key id) and the matching metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis import Redis

from services.trainer import checkpoint
from services.trainer.publisher import DeltaPublisher, PublishStats
from shared import control, keys
from shared import metrics as m
from shared.config import Config
from shared.crypto import STREAM_DELTA, KeyFileError, rotate_encryption_key, rotate_signing_key

log = logging.getLogger("learnmesh.trainer")

_PUBLISH_TIMES_KEPT = 1024
_FIXED_COMPRESSION = ("block_size", "chunk_elements")  # size the encoder's buffers: restart to change


def find_version_checkpoint(directory: str, version: int) -> Path | None:
    """The newest retained checkpoint whose weights are exactly published ``version``."""
    for path in sorted(Path(directory).glob("ckpt-*.pt"), reverse=True):
        try:
            state = checkpoint.load_bytes(path.read_bytes())
        except Exception:  # noqa: S112 - a corrupt or partial file: the next older one is tried
            continue
        if state.get("published_version") == version:
            return path
    return None


class TrainerOps:
    """Rank 0's control-plane poller. ``cfg`` is the configuration in effect: the operator's
    runtime changes (compression, consistency, scheduling) replace it."""

    def __init__(self, cfg: Config, redis: Redis, publisher: DeltaPublisher) -> None:
        self.cfg = cfg
        self.redis = redis
        self.publisher = publisher
        self.ctl = control.TrainerControl(redis)
        self.cfg_watch = control.RuntimeConfigWatcher(redis, cfg)
        self.rotations = control.KeyRotationWatcher(redis)
        self.pending: dict[str, control.Command] = {}
        self.paused = False
        self._published_at: OrderedDict[int, float] = OrderedDict()
        self._acked: dict[str, int] = {}
        self._ack_lock = threading.Lock()
        self._sync_latency_ms: float | None = None
        self._next_report = 0.0
        publisher.ack_listener = self._on_ack

    # ---------------------------------------------------------------- per iteration (rank 0)
    def poll(self) -> list[dict[str, Any]]:
        """Apply what only rank 0 needs; return the commands every rank must run (maybe [])."""
        try:
            self.paused = self.ctl.paused()
            new = self.cfg_watch.poll()
            if new is not None:
                self.apply_config(new)
            for rid, kind in self.rotations.pending():
                self.rotate_key(rid, kind)
            return [c for cmd in self.ctl.commands() if (c := self._resolve(cmd)) is not None]
        except Exception as exc:  # Redis hiccup: keep training, try again next iteration
            log.warning("control plane poll failed: %s: %s", type(exc).__name__, exc)
            return []

    def _resolve(self, cmd: control.Command) -> dict[str, Any] | None:
        if cmd.cmd == "checkpoint":
            self.pending[cmd.id] = cmd
            return {"id": cmd.id, "cmd": "checkpoint"}
        if cmd.cmd == "rollback":
            try:
                version = int(cmd.args.get("to_version", ""))
            except ValueError:
                self.ctl.ack(cmd, ok=False, error="rollback needs an integer to_version")
                return None
            path = find_version_checkpoint(self.cfg.trainer.checkpoint_dir, version)
            if path is None:
                self.ctl.ack(cmd, ok=False, error=f"version {version} is not retained: no checkpoint holds its "
                             f"exact weights (trainer.checkpoint_keep={self.cfg.trainer.checkpoint_keep})")
                return None
            self.pending[cmd.id] = cmd
            return {"id": cmd.id, "cmd": "rollback", "to_version": version, "path": str(path)}
        self.ctl.ack(cmd, ok=False, error=f"unknown command {cmd.cmd!r}")
        return None

    def ack(self, command_id: str, ok: bool = True, **result: Any) -> None:
        cmd = self.pending.pop(command_id, None)
        if cmd is not None:
            self.ctl.ack(cmd, ok=ok, **result)
            log.info("control command %s %s: %s", cmd.cmd, "done" if ok else "failed", result)

    def wait_paused(self, stop: Callable[[], bool], wait_s: float) -> None:
        """Idle a little while paused (stays responsive to the stop flag)."""
        self.report(force=False)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not stop():
            time.sleep(0.02)

    def report(self, force: bool = True) -> None:
        """Keep the trainer's status fresh (also while paused or idle)."""
        now = time.monotonic()
        if not force and now < self._next_report:
            return
        self._next_report = now + self.cfg.metrics.status_interval_s
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(keys.TRAINER_STATUS, mapping={"paused": int(self.paused), "updated_ms": control.now_ms()})
            # the last publish's report (digest, served gap) holds while no step runs: without
            # it an idle mesh could not show that workers serve the trainer's exact weights
            pipe.pexpire(keys.component_status("delta"), int(control.status_ttl_s(self.cfg) * 1000))
            pipe.execute()
        except Exception as exc:
            log.debug("status report failed: %s", exc)

    # ---------------------------------------------------------------- runtime config
    def apply_config(self, new: Config) -> None:
        old = self.cfg.compression
        comp = new.compression
        kept = {f: getattr(old, f) for f in _FIXED_COMPRESSION if getattr(comp, f) != getattr(old, f)}
        if kept:
            log.warning("compression.%s cannot change at runtime (restart the trainer); kept", ", ".join(kept))
            comp = dataclasses.replace(comp, **kept)
        self.cfg = dataclasses.replace(self.cfg, compression=comp, consistency=new.consistency,
                                       scheduling=new.scheduling)
        pub = self.publisher
        with pub._lock:
            pub.cfg = self.cfg
            pub.encoder.reconfigure(comp, new.scheduling.priority_mode)
        log.info("runtime config applied: compression %s density %g, sync_interval %d, priority %s",
                 comp.algorithm, comp.density, new.consistency.sync_interval, new.scheduling.priority_mode)

    # ---------------------------------------------------------------- delta key ring
    def rotate_key(self, request_id: str, kind: str = "encryption") -> None:
        """Replace the AES key, the signing key, or both (``kind``); the previous ones stay
        valid for ``security.delta_key_grace_s`` and are then refused by every receiver."""
        pub, sec = self.publisher, self.cfg.security
        report: dict[str, Any] = {"kind": kind}
        try:
            with pub._lock:  # no packet is sealed half-way through the switch
                if kind in ("encryption", "both"):
                    rotate_encryption_key(sec.delta_key_file, sec.delta_key_grace_s)
                if kind in ("signing", "both"):
                    if pub.sealer.signer is None:
                        raise KeyFileError("sign_deltas is off: there is no signing key to rotate")
                    signer = rotate_signing_key(sec.delta_key_file, sec.signing_key_path, sec.delta_key_grace_s)
                    pub.sealer.set_signer(signer)
                pub.ring.reload_if_changed()
                report["key_id"] = pub.ring.active
                report["signing_key_id"] = pub.ring.signer
                report["epoch"] = pub.sealer.next_seq(STREAM_DELTA) // pub.sealer.rekey_after
        except (KeyFileError, OSError) as exc:
            log.error("delta key rotation (%s) failed: %s", kind, exc)
            self.rotations.done(request_id, kind=kind, error=type(exc).__name__)
            return
        self.rotations.done(request_id, **report)
        log.info("delta %s key rotated (key id %s, signing key id %s; the previous ones are refused after %ds)",
                 kind, report["key_id"], report["signing_key_id"] or "-", sec.delta_key_grace_s)

    # ---------------------------------------------------------------- publishing and acks
    def before_publish(self, version: int) -> None:
        with self._ack_lock:
            self._published_at[version] = time.monotonic()
            while len(self._published_at) > _PUBLISH_TIMES_KEPT:
                self._published_at.popitem(last=False)

    def _on_ack(self, worker: str, version: int) -> None:
        """Called by the publisher's thread for every worker ACK: step→serving latency."""
        with self._ack_lock:
            if version <= self._acked.get(worker, -1):
                return
            self._acked[worker] = version
            t = self._published_at.get(version)
        if t is not None:
            seconds = time.monotonic() - t
            m.DELTA_STEP_TO_SERVING.observe(seconds)
            self._sync_latency_ms = round(seconds * 1000, 2)

    def published(self, stats: PublishStats, step: int, loss: float | None, rollback_of: int | None = None) -> None:
        """Record a publish in the version log and the ``delta`` self-report."""
        ratio = self._compression_ratio(stats)
        extra: dict[str, Any] = {"rollback_of": rollback_of} if rollback_of is not None else {}
        try:
            control.record_version(self.redis, stats.version, step=step,
                                   loss=None if loss is None or loss != loss else round(loss, 6),
                                   anchor=stats.kind == "anchor", kind=stats.kind, bytes=stats.bytes, **extra)
            self._report_delta(stats, ratio)
        except Exception as exc:
            log.warning("could not record version %d: %s", stats.version, type(exc).__name__)

    def _compression_ratio(self, stats: PublishStats) -> float | None:
        dense = self.publisher.encoder.last_stats.get("dense_fp32_bytes")
        ratio = round(dense / max(1, stats.bytes), 2) if dense else None
        if ratio is not None:
            m.DELTA_COMPRESSION_RATIO.set(ratio)
        return ratio

    def _report_delta(self, stats: PublishStats, ratio: float | None) -> None:
        comp = self.cfg.compression
        pub = self.publisher
        control.report_status(self.redis, "delta", ttl_s=control.status_ttl_s(self.cfg), compression_ratio=ratio,
                              sync_latency_ms=self._sync_latency_ms, version=stats.version, kind=stats.kind,
                              bytes=stats.bytes, density=round(stats.density, 6), density_target=pub.encoder.density,
                              algorithm=comp.algorithm, encode_ms=round(stats.encode_s * 1000, 3),
                              sync_interval=self.cfg.consistency.sync_interval,
                              served_gap=stats.extra.get("served_gap"),
                              weights_digest=stats.extra.get("weights_digest"), key_id=pub.ring.active,
                              signing_key_id=pub.ring.signer)
