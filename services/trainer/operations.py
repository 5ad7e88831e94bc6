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
* delta key rotation — a fresh key is added to the key file and made active without
  stopping; receivers reload the file when a packet names a key id they do not know.

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
from pathlib import Path
from typing import Any

from services.trainer import checkpoint
from shared import control
from shared import metrics as m
from shared.crypto import STREAM_DELTA, KeyFileError, rotate_key_file

log = logging.getLogger("learnmesh.trainer")

_PUBLISH_TIMES_KEPT = 1024
_FIXED_COMPRESSION = ("block_size", "chunk_elements")  # size the encoder's buffers: restart to change


def find_version_checkpoint(directory: str, version: int) -> Path | None:
    """The newest retained checkpoint whose weights are exactly published ``version``."""
    for path in sorted(Path(directory).glob("ckpt-*.pt"), reverse=True):
        try:
            state = checkpoint.load_bytes(path.read_bytes())
        except Exception:
            continue
        if state.get("published_version") == version:
            return path
    return None


class TrainerOps:
    """Rank 0's control-plane poller; ``trainer`` is the :class:`services.trainer.loop.Trainer`."""

    def __init__(self, trainer: Any) -> None:
        self.tr = trainer
        self.redis = trainer.redis
        self.ctl = control.TrainerControl(self.redis)
        self.cfg_watch = control.RuntimeConfigWatcher(self.redis, trainer.cfg)
        self.rotations = control.KeyRotationWatcher(self.redis)
        self.pending: dict[str, control.Command] = {}
        self.paused = False
        self._published_at: OrderedDict[int, float] = OrderedDict()
        self._acked: dict[str, int] = {}
        self._ack_lock = threading.Lock()
        self._sync_latency_ms: float | None = None
        self._next_report = 0.0
        pub = trainer.publisher
        if pub is not None and hasattr(type(pub), "ack_listener"):
            pub.ack_listener = self._on_ack

    # ---------------------------------------------------------------- per iteration (rank 0)
    def poll(self) -> list[dict[str, Any]]:
        """Apply what only rank 0 needs; return the commands every rank must run (maybe [])."""
        try:
            self.paused = self.ctl.paused()
            new = self.cfg_watch.poll()
            if new is not None:
                self.apply_config(new)
            for rid in self.rotations.pending():
                self.rotate_key(rid)
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
            path = find_version_checkpoint(self.tr.t.checkpoint_dir, version)
            if path is None:
                self.ctl.ack(cmd, ok=False, error=f"version {version} is not retained: no checkpoint holds its "
                             f"exact weights (trainer.checkpoint_keep={self.tr.t.checkpoint_keep})")
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

    def wait_paused(self, stop: Any, wait_s: float) -> None:
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
        self._next_report = now + self.tr.cfg.metrics.status_interval_s
        from shared import keys

        try:
            self.redis.hset(keys.TRAINER_STATUS, mapping={"paused": int(self.paused),
                                                          "updated_ms": control.now_ms()})
        except Exception as exc:
            log.debug("status report failed: %s", exc)

    # ---------------------------------------------------------------- runtime config
    def apply_config(self, new: Any) -> None:
        tr = self.tr
        old = tr.cfg.compression
        comp = new.compression
        kept = {f: getattr(old, f) for f in _FIXED_COMPRESSION if getattr(comp, f) != getattr(old, f)}
        if kept:
            log.warning("compression.%s cannot change at runtime (restart the trainer); kept", ", ".join(kept))
            comp = dataclasses.replace(comp, **kept)
        tr.cfg = dataclasses.replace(tr.cfg, compression=comp, consistency=new.consistency,
                                     scheduling=new.scheduling)
        pub = tr.publisher
        if pub is not None:
            with pub._lock:
                pub.cfg = tr.cfg
                enc = pub.encoder
                if comp.zstd_level != enc.cfg.zstd_level:
                    import zstandard

                    enc._zc = zstandard.ZstdCompressor(level=comp.zstd_level)
                enc.cfg = comp
                enc.density = comp.density
                enc.threshold = comp.threshold
                enc.priority_mode = new.scheduling.priority_mode
        log.info("runtime config applied: compression %s density %g, sync_interval %d, priority %s",
                 comp.algorithm, comp.density, new.consistency.sync_interval, new.scheduling.priority_mode)

    # ---------------------------------------------------------------- delta key ring
    def rotate_key(self, request_id: str) -> None:
        path = self.tr.cfg.security.delta_key_file
        pub = self.tr.publisher
        try:
            if pub is not None:
                with pub._lock:  # no packet is sealed half-way through the switch
                    kid = rotate_key_file(path)
                    pub.ring.reload_if_changed()
                    epoch = pub.sealer.next_seq(STREAM_DELTA) // pub.sealer.rekey_after
            else:
                kid, epoch = rotate_key_file(path), 0
        except (KeyFileError, OSError) as exc:
            log.error("delta key rotation failed: %s", exc)
            self.rotations.done(request_id, error=type(exc).__name__)
            return
        self.rotations.done(request_id, key_id=kid, epoch=epoch)
        log.info("delta key rotated (active key id %s)", kid)

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

    def published(self, stats: Any, step: int, loss: float | None, rollback_of: int | None = None) -> None:
        pub = self.tr.publisher
        dense = (getattr(pub.encoder, "last_stats", {}) or {}).get("dense_fp32_bytes") if pub else None
        ratio = round(dense / max(1, stats.bytes), 2) if dense else None
        if ratio is not None:
            m.DELTA_COMPRESSION_RATIO.set(ratio)
        extra: dict[str, Any] = {"rollback_of": rollback_of} if rollback_of is not None else {}
        try:
            control.record_version(self.redis, stats.version, step=step,
                                   loss=None if loss is None or loss != loss else round(loss, 6),
                                   anchor=stats.kind == "anchor", kind=stats.kind, bytes=stats.bytes, **extra)
            comp = self.tr.cfg.compression
            control.report_status(self.redis, "delta", compression_ratio=ratio,
                                  sync_latency_ms=self._sync_latency_ms, version=stats.version, kind=stats.kind,
                                  bytes=stats.bytes, density=round(stats.density, 6),
                                  density_target=getattr(pub.encoder, "density", comp.density) if pub else None,
                                  algorithm=comp.algorithm, encode_ms=round(stats.encode_s * 1000, 3),
                                  sync_interval=self.tr.cfg.consistency.sync_interval,
                                  served_gap=stats.extra.get("served_gap"),
                                  weights_digest=stats.extra.get("weights_digest"),
                                  key_id=pub.ring.active if pub else None)
        except Exception as exc:
            log.warning("could not record version %d: %s", stats.version, type(exc).__name__)


def allreduce_bytes(trainer: Any) -> tuple[str, int]:
    """Gradient bytes one synchronising step all-reduces on this rank, from the tensor shapes
    and the comm hook (fp16/bf16: 2 bytes per element; PowerSGD: P and Q factors of each
    matrix, vectors uncompressed, full precision before its start iteration)."""
    hook = trainer.cfg.trainer.comm_hook
    numel = sum(p.numel() for p in trainer.params)
    if hook in ("fp16", "bf16"):
        return hook, 2 * numel
    if hook == "powersgd":
        state = trainer.hook_state
        if state is None or getattr(state, "iter", 0) < getattr(state, "start_powerSGD_iter", 0):
            return hook, 4 * numel
        rank = trainer.cfg.trainer.powersgd_rank
        total = 0
        for p in trainer.params:
            if p.dim() <= 1:
                total += p.numel()
            else:
                n = p.shape[0]
                mm = p.numel() // n
                total += (n + mm) * min(rank, n, mm)
        return hook, 4 * total
    return "none", 4 * numel
