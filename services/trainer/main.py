"""``learnmesh trainer``: start ``trainer.ranks`` ranks on this machine under torchrun
(services/trainer/launcher.py), or run as one rank of a torchrun group (``--as-rank``).

:func:`build_trainer` is the one place a rank's loop is assembled: the model and its
stepper on every rank, and on rank 0 the leader with its sample source, ledger, replays,
publisher and control plane, all positioned at the latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import FrameType
from typing import Any, NoReturn, cast

import zmq
from redis import Redis

from services.trainer import checkpoint
from services.trainer.data import ContextReader, SampleSource
from services.trainer.dist import (
    LeaderBeat,
    RankEnv,
    RankGroup,
    await_leader,
    init_distributed,
    leader_ready,
    leave,
    start_store,
    teardown,
    tell_torchrun,
)
from services.trainer.leader import Leader
from services.trainer.ledger import Ledger, Offset, Position
from services.trainer.loop import StepObserver, Trainer
from services.trainer.operations import TrainerOps
from services.trainer.publisher import DeltaPublisher
from services.trainer.replay import ReplayBuffer
from services.trainer.stepper import Stepper, build_model
from services.trainer.version_floor import VersionFloor
from shared import metrics as m
from shared.config import CONFIG_ERROR_EXIT, Config, ConfigError, log_level
from shared.control import start_metrics_server
from shared.lifetime import die_with_parent
from shared.redis_client import check_access, redact_url, sync_client, url_of
from shared.samples import sample_partitions
from shared.secret_files import check_private

log = logging.getLogger("learnmesh.trainer")


def main(cfg: Config, args: argparse.Namespace) -> int:
    if args.ranks:
        cfg.trainer.ranks = int(args.ranks)
    if args.as_rank:
        rank_main(cfg)
    from services.trainer.launcher import launch

    configure_logging("launcher")
    preflight(cfg)
    # Ended like a rank (dist.leave): the launcher's interpreter and C++ teardown, with
    # torchrun's store and its threads, can abort a stopped trainer with SIGABRT
    # ("terminate called without an active exception") after its ranks stopped cleanly.
    leave(launch(cfg, ready=lambda: wait_for_redis(cfg)))


REDIS_WAIT_TURN_S = 5.0  # the longest pause between two asks of a Redis that does not answer
REDIS_ASK_S = 2.0  # how long one ask may take


def wait_for_redis(cfg: Config, max_delay_s: float = REDIS_WAIT_TURN_S, beat: Callable[[], None] = lambda: None) -> bool:
    """A trainer started before its Redis answers (compose, a Kubernetes pod, `learnmesh up`
    beside a server still starting) waits for it here, saying so once, rather than starting
    ranks that fail at their first read of the sample log and spend torchrun's restarts on it.
    False when SIGTERM or SIGINT came first. Credentials Redis refuses raise ConfigError.
    ``beat`` is called at each turn of the wait (rank 0 tells the other ranks it is alive)."""
    if check_access(cfg.redis, timeout_s=REDIS_ASK_S):
        return True
    log.warning("Redis at %s does not answer; the trainer waits for it before it starts its ranks",
                redact_url(url_of(cfg.redis)))

    told = [False]  # a flag, not an Event: a handler must not take a lock its own thread may hold

    def on_term(signum: int, frame: FrameType | None) -> NoReturn:
        told[0] = True  # the raise is dropped where the signal lands in a finalizer; the loop sees this
        raise StoppedWhileStarting

    previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        delay = 0.5
        while True:
            beat()
            time.sleep(delay)
            if told[0]:
                raise StoppedWhileStarting
            if check_access(cfg.redis, timeout_s=REDIS_ASK_S):
                log.info("Redis answers; starting the ranks")
                return True
            delay = min(2 * delay, max_delay_s)
    except StoppedWhileStarting:
        log.info("stopped while it waited for Redis")
        return False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def preflight(cfg: Config) -> None:
    """Settings no restart can fix stop the trainer with one clear message (ConfigError) before
    it waits for Redis or starts a rank: a delta key file others can read. (Redis refusing our
    credentials is found as it answers: :func:`wait_for_redis`.)"""
    if os.path.exists(cfg.security.delta_key_file):
        check_private(cfg.security.delta_key_file, "security.delta_key_file")


def rank_main(cfg: Config, observers: Sequence[StepObserver] = ()) -> NoReturn:
    """Run this process as one rank and exit with its status."""
    configure_logging(os.environ.get("RANK", "?"))
    leave(run_rank(cfg, observers))  # checkpointed, committed and torn down by now


def configure_logging(who: str) -> None:
    """Log lines name the process: ``trainer[launcher]`` or ``trainer[<rank>]``."""
    logging.basicConfig(level=log_level(),
                        format=f"%(asctime)s trainer[{who}] %(levelname)s %(message)s")


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT before the rank's loop exists (a first start pre-trains the base model
    for a minute or more): nothing is trained or checkpointed yet, so the start just ends.
    Raised by the signal handler wherever the rank is, so a BaseException, as KeyboardInterrupt
    is: an ``except Exception`` on the way must not swallow it — logging's does, for a signal
    that lands inside a log call, and the rank would go on into a group its peers have left."""


def run_rank(cfg: Config, observers: Sequence[StepObserver] = ()) -> int:
    env = RankEnv.from_environ()
    _die_with_launcher()
    stop = threading.Event()
    starting = [True]

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()  # once the loop runs, it stops at the next step boundary and checkpoints
        if starting[0]:
            starting[0] = False
            raise StoppedWhileStarting

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    start_metrics_server(cfg, "trainer", env.local_rank)  # ports count per host: one node, one rank each
    m.TRAINER_RESTARTS.inc(env.restarts)
    if env.restarts and env.rank == 0:
        log.warning("the rank group was restarted (restart %d of %s): resuming from the latest checkpoint",
                    env.restarts, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))
    holder: list[Trainer] = []
    code = 1
    try:
        code = _run(cfg, env, stop, starting, observers, holder)
    except StoppedWhileStarting:  # the signal landed after _run's own handler, before the line below
        code = 0
    finally:
        starting[0] = False  # from here a SIGTERM only sets stop: the close below is bounded
        close_within(close_limit_s(cfg), holder[0] if holder else None, env.rank, code)
    return code


def _run(cfg: Config, env: RankEnv, stop: threading.Event, starting: list[bool],
         observers: Sequence[StepObserver], holder: list[Trainer]) -> int:
    try:
        try:
            # Under plain torchrun (a Kubernetes pod) nothing waited for Redis before the ranks
            # started. Only rank 0 uses Redis; the others wait for it before they join.
            store = start_store(env, timedelta(seconds=cfg.trainer.init_timeout_s))
            if env.rank == 0:
                preflight(cfg)
                if not wait_for_redis(cfg, beat=LeaderBeat(store)):
                    return 0
                leader_ready(store)
            else:  # rank 0 beats at least once per turn of its wait
                await_leader(store, env.rank, limit_s=cfg.trainer.init_timeout_s + REDIS_WAIT_TURN_S + REDIS_ASK_S)
            trainer = build_trainer(cfg, init_distributed(cfg, env, store), stop.is_set, observers)
            holder.append(trainer)
            starting[0] = False
        except (ConfigError, checkpoint.CheckpointError) as exc:  # settings, keys, checkpoints to mend
            # `learnmesh trainer` restarts nothing for this status; plain torchrun has no such
            # setting and restarts the group until --max-restarts is spent
            log.error("rank %d cannot start: %s; a restart would fail the same way: mend it and start the "
                      "trainer again", env.rank, exc)
            tell_torchrun(f"rank {env.rank} cannot start: {exc}")
            return CONFIG_ERROR_EXIT
        trainer.run()
        log.info("rank %d stopped cleanly at step %d", env.rank, trainer.step)
        return 0
    except StoppedWhileStarting:
        log.info("rank %d stopped before it started", env.rank)
        return 0
    except Exception as exc:
        if stop.is_set() and not holder:
            # The stop's raise can be dropped (a signal landing in a finalizer: Python reports
            # "Exception ignored" and goes on); the rank then fails in its group because its
            # peers stopped as told. That is the stop it was given, not a failure.
            log.info("rank %d stopped before it started (%s: %s)", env.rank, type(exc).__name__, exc)
            return 0
        log.error("rank %d failed: %s: %s", env.rank, type(exc).__name__, exc,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


def close_limit_s(cfg: Config) -> float:
    """A quarter of ``trainer.step_timeout_s``, the time the launcher gives a stop: the rest is
    for the last step and its checkpoint."""
    return max(1.0, cfg.trainer.step_timeout_s / 4)


def close_within(limit_s: float, trainer: Trainer | None, rank: int, code: int) -> None:
    """Close the rank's sockets, Redis connections and process group, or leave with ``code``
    after ``limit_s``: a close that stalls (gloo waiting on a peer already gone, a socket
    ZeroMQ does not let go) holds nothing to save (checkpoints and commits come before it),
    and would otherwise hold the whole trainer's stop until the launcher kills the rank."""
    stage = ["its sockets and Redis connections"]

    def overdue() -> None:
        log.warning("rank %d: closing %s took over %.0f s; the rank leaves without it", rank, stage[0], limit_s)
        leave(code)

    timer = threading.Timer(limit_s, overdue)
    timer.daemon = True
    timer.start()
    try:
        if trainer is not None:
            trainer.close()
        stage[0] = "its process group"
        teardown()
    finally:
        timer.cancel()


def _die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a kill -9 of the launcher (or of
    its process group) would leave the ranks running, holding the sample endpoint and the
    publisher's ports: the kernel kills a rank when the process that started it dies. (A rank
    whose launcher died before this call cannot join its group and fails at
    ``trainer.init_timeout_s``.)"""
    die_with_parent(signal.SIGKILL)


# ---------------------------------------------------------------- assembling a rank


def build_trainer(cfg: Config, group: RankGroup, stop: Callable[[], bool],
                  observers: Sequence[StepObserver] = ()) -> Trainer:
    """A rank's loop at the latest checkpoint (every rank calls it: it broadcasts)."""
    stepper = Stepper(cfg, group, build_model(cfg).to(group.device))
    found = checkpoint.latest(cfg.trainer.checkpoint_dir) if group.rank == 0 else None
    data = group.broadcast_bytes(found[1] if found is not None else None)
    state = checkpoint.load_bytes(data) if data else None
    if state is not None:
        _restore(cfg, stepper, state, str(found[0]) if found is not None else "the checkpoint rank 0 sent")
    step = int(state["step"]) if state is not None else 0
    leader = _build_leader(cfg, group, stepper, _checkpointed_offset(state),
                           checkpoint.recall_bytes(state)) if group.rank == 0 else None
    stepper.distribute(step)
    return Trainer(cfg, group, stepper, leader, stop, step=step, observers=observers)


def _restore(cfg: Config, stepper: Stepper, state: dict[str, Any], source: str) -> None:
    """Load a checkpoint into the model this configuration builds; :class:`~services.trainer.checkpoint.
    CheckpointError` naming the file when it was written for another model (size or trainable part)."""
    try:
        stepper.restore(state)
    except (RuntimeError, ValueError, KeyError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0] if lines else ""
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 and lines[0].startswith("Error(s) in loading") else ""
        theirs = state.get("model_id") or "unknown"
        ours = getattr(stepper.model, "model_id", "") or "unknown"
        raise checkpoint.CheckpointError(
            f"checkpoint {source} does not fit the model this configuration builds (checkpoint's model "
            f"{theirs}, configured {ours}): {type(exc).__name__}: {detail}{more}. Start with the model and "
            f"trainer settings it was written with, or set trainer.checkpoint_dir (now "
            f"{cfg.trainer.checkpoint_dir}) to an empty directory to train this model from its start") from None


def _checkpointed_offset(state: dict[str, Any] | None) -> Offset:
    if state is None:
        return Offset()
    positions = {int(part): Position(int(seq), str(eid), str(log_id))
                 for part, (seq, eid, log_id) in state.get("positions", {}).items()}
    if not positions:  # a checkpoint of a log with one partition, from before partitions were recorded
        positions = {0: Position(int(state["seq"]), str(state["id"]), str(state.get("log", "")))}
    return Offset(int(state["step"]), int(state["version"]), 0, positions)


def _build_leader(cfg: Config, group: RankGroup, stepper: Stepper, checkpointed: Offset, recall: bytes = b"") -> Leader:
    redis = cast(Redis, sync_client(cfg.redis, socket_timeout=30))  # see gateway.app._redis_clients
    partitions = sample_partitions(cfg)
    ledger = Ledger(redis, partitions, cfg.redis)
    floor = VersionFloor(cfg.trainer.checkpoint_dir)
    offset, rolled = ledger.resume(checkpointed, floor.reserved)
    floor.reserve(offset.version)  # the publisher hands it out in snapshots from the start
    log.info("trainer resumed at step %d (seq %d, epoch %d); %d uncheckpointed step(s) rolled back and "
             "will be replayed from the log", checkpointed.step, offset.seq, offset.epoch, rolled)
    zmq_ctx = zmq.Context()
    contexts = ContextReader(cfg)
    source = SampleSource(cfg, redis, zmq_ctx, offset.positions, contexts, partitions)
    # The restored lineage becomes a version newer than anything served before: the
    # publisher's snapshot (what joining/re-syncing workers fetch) starts at it.
    publisher = DeltaPublisher(cfg, zmq_ctx, stepper.named_params(), offset.version,
                               getattr(stepper.model, "model_id", "model"), redis_client=redis)
    leader = Leader(cfg, weights=stepper, world=group.world, offset=offset, redis=redis, ledger=ledger,
                    source=source, contexts=contexts,
                    replay=ReplayBuffer(cfg.trainer.replay_passes, cfg.trainer.replay_buffer, seed=cfg.model.seed,
                                        answer_passes=cfg.trainer.answer_passes,
                                        answer_max_bytes=cfg.trainer.answer_max_bytes,
                                        recall_per_step=cfg.trainer.recall_per_step,
                                        recall_facts=cfg.trainer.recall_facts),
                    publisher=publisher, ops=TrainerOps(cfg, redis, publisher), zmq_ctx=zmq_ctx,
                    version_floor=floor)
    leader.replay.restore_memory(recall)
    if leader.replay.remembered:
        log.info("recalling %d answered fact(s) the checkpoint kept (trainer.recall_per_step)", leader.replay.remembered)
    leader.resumed()
    source.check_log()  # the checkpoint's offsets count in its log; is that the log found now?
    m.TRAINER_VERSION.set(offset.version)
    return leader
