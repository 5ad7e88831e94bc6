"""``learnmesh trainer`` hands its settings to torchrun, and a rank reads torchrun's restart count."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from services.trainer.dist import RankEnv
from services.trainer.launcher import launch_config
from shared.config import Config, load_config
from shared.net import free_port
from tests.waiting import wait_for_sync

ROOT = Path(__file__).resolve().parent.parent


def test_torchrun_gets_the_rendezvous_address_restarts_and_grace_period_from_the_config():
    cfg = load_config(env={}, overrides={"trainer": {"ranks": 3, "backend": "gloo", "master_addr": "127.0.0.2",
                                                     "max_restarts": 5, "step_timeout_s": 17}})
    launch = launch_config(cfg)
    assert launch.local_addr == "127.0.0.2"  # MASTER_ADDR of the ranks
    assert launch.rdzv_endpoint == "127.0.0.2:0" and launch.min_nodes == launch.max_nodes == 1
    assert (launch.nproc_per_node, launch.max_restarts, launch.shutdown_timeout) == (3, 5, 17)


def test_a_rank_knows_how_often_its_group_was_restarted(monkeypatch: pytest.MonkeyPatch):
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert RankEnv.from_environ().restarts == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert RankEnv.from_environ().restarts == 2


_RANK = """
import torch
from services.trainer.dist import RankEnv, init_distributed, teardown
from shared.config import load_config
cfg = load_config(env={}, overrides={"trainer": {"backend": "gloo", "init_timeout_s": 15, "torch_threads": 1}})
group = init_distributed(cfg, RankEnv.from_environ())
total = torch.ones(1)
group.sum(total)
print("sum", int(total.item()), flush=True)
teardown()
"""


def test_a_restarted_group_meets_in_fresh_keys_of_the_torchrun_agents_store():
    """torchrun --rdzv-backend=static (the Kubernetes trainer) hands its ranks the agent's own
    store (TORCHELASTIC_USE_AGENT_STORE), which outlives a restart of the group. The restarted
    ranks must not take the dead ranks' addresses from it: here rank 1 of the second start
    comes up first, its peer only once rank 1 has written to the store, and both still meet."""
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)

    def rank(r: int, restarts: int) -> subprocess.Popen:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(restarts)}
        return subprocess.Popen([sys.executable, "-c", _RANK], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish(procs: list[subprocess.Popen]) -> None:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        for p, out in zip(procs, outputs, strict=True):
            assert p.returncode == 0 and "sum 2" in out, out[-2000:]

    finish([rank(0, 0), rank(1, 0)])  # the first start; its ranks are gone now
    keys = agent.num_keys()
    first = rank(1, 1)
    try:
        wait_for_sync(lambda: agent.num_keys() > keys or first.poll() is not None, timeout_s=60,
                      what="rank 1 of the restarted group to write to the store")
    except BaseException:
        first.kill()
        raise
    finish([first, rank(0, 1)])


def test_a_stop_signal_that_torchrun_turns_into_another_error_is_still_a_clean_stop(monkeypatch: pytest.MonkeyPatch):
    """SIGTERM raises where torchrun's agent happens to be. Inside its metrics wrapper before the
    wrapper's start time is set, the wrapper's ``finally`` turns the stop into an UnboundLocalError;
    the agent still stopped the ranks, so ``learnmesh trainer`` exits 0, not 1 with a traceback. A
    stand-in agent does what that wrapper does, with a real signal."""
    import signal
    import time

    from services.trainer import launcher

    def agent(config: object, entrypoint: str):
        def run(*argv: str) -> None:
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler raises on the next bytecode
                start = time.time()
            finally:
                _ = time.time() - start  # unbound when the signal came first, as in torch

        return run

    def failing_agent(config: object, entrypoint: str):
        def run(*argv: str) -> None:
            raise UnboundLocalError("not a stop")

        return run

    cfg = load_config(env={}, overrides={"trainer": {"ranks": 1, "backend": "gloo"}})
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setattr(launcher, "elastic_launch", agent)
    assert launcher._run(cfg, ["-c", "pass"]) == 0
    assert signal.getsignal(signal.SIGTERM) is previous  # the stop handler is removed again
    # torch's switch is the launch's own: a torchrun started later in this process shares its store
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    monkeypatch.setattr(launcher, "elastic_launch", failing_agent)
    with pytest.raises(UnboundLocalError, match="not a stop"):  # without a stop signal it is an error
        launcher._run(cfg, ["-c", "pass"])


def test_the_ranks_configuration_lives_beside_the_checkpoints_only_while_they_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Not a temporary file of its own per start: a launcher killed with -9 would leave each one
    behind, each a copy of the whole configuration. One private file in the checkpoint directory,
    replaced by the next start, removed by a clean stop."""
    import stat

    from services.trainer import launcher

    seen: list[tuple[Path, int, Config]] = []

    def agent(config: object, entrypoint: str):
        def run(*argv: str) -> None:
            path = Path(argv[argv.index("--config") + 1])
            seen.append((path, stat.S_IMODE(path.stat().st_mode), load_config(path, env={})))

        return run

    ckpt = tmp_path / "ckpt"
    cfg = load_config(env={}, overrides={"trainer": {"ranks": 1, "backend": "gloo", "checkpoint_dir": str(ckpt)}})
    monkeypatch.setattr(launcher, "elastic_launch", agent)
    assert launcher.launch(cfg) == 0
    assert seen == [(ckpt / "launch-config.yaml", 0o600, cfg)]
    assert list(ckpt.iterdir()) == [], "removed once the ranks stopped"


def _trainer_run(cfg: Config, tmp_path: Path) -> tuple[int, str]:
    """``learnmesh trainer`` until it exits by itself: its exit status and its output."""
    from trainer_support import TrainerProc

    proc = TrainerProc(cfg, tmp_path)
    try:
        return proc.proc.wait(180), proc.output()
    finally:
        proc.close()


def test_a_rank_that_cannot_start_for_a_reason_a_restart_keeps_stops_the_trainer_at_once(
        redis_url: str, tmp_path: Path):
    """No checkpoint of trainer.checkpoint_dir reads: every restart of the group would fail the
    same way, each after loading the model and meeting the group again. The first failure stops
    ``learnmesh trainer`` (2 ranks, torchrun with restarts left) with exit 2, which `learnmesh up`
    does not restart either, and the reason in its log once."""
    from trainer_support import trainer_config

    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, max_restarts=3)
    ckpt = Path(cfg.trainer.checkpoint_dir)
    ckpt.mkdir(parents=True)
    (ckpt / "ckpt-0000000004.pt").write_bytes(b"not a checkpoint")
    code, out = _trainer_run(cfg, tmp_path)
    assert code == 2, out
    assert out.count(f"no checkpoint in {ckpt} (trainer.checkpoint_dir) can be read") == 1, out
    assert "will restart worker group" not in out and "the rank group was restarted" not in out, out
    assert "a restart would fail the same way" in out, out


def test_a_trainer_told_to_stop_while_its_ranks_start_stops_at_once(redis_url: str, tmp_path: Path):
    """SIGTERM (Ctrl-C on `learnmesh up`) while the ranks build the model, on a first start a
    pre-training of the base model: nothing is trained or checkpointed yet, so the ranks stop
    then, not once pre-training is done or torchrun's grace (step_timeout_s) has run out."""
    from trainer_support import TrainerProc, trainer_config

    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, model_factory="", step_timeout_s=600,
                         model={"pretrain_steps": 1_000_000, "cache_dir": str(tmp_path / "model")})
    proc = TrainerProc(cfg, tmp_path)
    try:
        wait_for_sync(lambda: proc.output().count("pre-training base model") >= 1 or proc.proc.poll() is not None,
                      timeout_s=120, what="a rank to pre-train the base model")
        assert proc.term(timeout_s=90) == 0, proc.output()
    finally:
        proc.close()
    out = proc.output()
    assert "rank 0 stopped before it started" in out and "rank 1 stopped before it started" in out, out


def test_a_checkpoint_directory_the_trainer_cannot_write_is_a_setting_to_mend(redis_url: str, tmp_path: Path):
    """trainer.checkpoint_dir under a file: no start of the trainer can work, so `learnmesh
    trainer` exits 2 naming the setting (which `learnmesh up` does not restart), not 1."""
    from trainer_support import trainer_config

    (tmp_path / "file").write_text("")
    cfg = trainer_config(redis_url, tmp_path, free_port(), checkpoint_dir=str(tmp_path / "file" / "ckpt"))
    code, out = _trainer_run(cfg, tmp_path)
    assert code == 2, out
    assert out.strip().splitlines()[-1] == (
        f"learnmesh: configuration error: trainer.checkpoint_dir: cannot write {tmp_path / 'file' / 'ckpt'} "
        "(Not a directory); give it a directory the trainer can write"), out


_FAILS_THREE_TIMES = """
import pathlib, sys, time
starts = pathlib.Path(sys.argv[1])
n = int(starts.read_text()) if starts.exists() else 0
starts.write_text(str(n + 1))
if n < 3:
    time.sleep(1.5)  # healthy a while, then dies as a rank does when its Redis master fails over
    sys.exit(1)
"""


def test_a_group_that_ran_healthy_gets_its_restarts_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """max_restarts bounds a run of failures, not the trainer's life: a group that ran healthy
    between failures is restarted again (three failures here, one restart allowed)."""
    from services.trainer import launcher

    monkeypatch.setattr(launcher, "HEALTHY_RUN_S", 0.5)
    starts = tmp_path / "starts"
    cfg = load_config(env={}, overrides={"trainer": {"ranks": 1, "backend": "gloo", "max_restarts": 1,
                                                     "checkpoint_dir": str(tmp_path / "ckpt")}})
    assert launcher.launch(cfg, lambda _path: ["-c", _FAILS_THREE_TIMES, str(starts)]) == 0
    assert starts.read_text() == "4"


_WAITS_FOR_A_STOP = """
import pathlib, signal, sys, time
marks = pathlib.Path(sys.argv[1])
def stopped(*_):
    (marks / "stopped").write_text("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
(marks / "started").write_text("1")
time.sleep(30)  # a rank that is never told to stop runs to here and leaves no mark
"""


def test_a_stop_whose_raise_the_launcher_dropped_still_stops_the_ranks(tmp_path: Path):
    """The launcher's stop handler raises into torchrun's agent wherever it is; a raise that is
    dropped (the signal landing in a finalizer, which Python reports and goes on from) left the
    agent monitoring ranks that were never told to stop. Here the handler is called as a
    finalizer would call it, its exception swallowed: the ranks must still get the stop."""
    import contextlib
    import signal
    import threading

    from services.trainer import launcher

    cfg = load_config(env={}, overrides={"trainer": {"ranks": 1, "backend": "gloo",
                                                     "checkpoint_dir": str(tmp_path / "ckpt")}})

    def stop_dropped() -> None:
        wait_for_sync(lambda: (tmp_path / "started").exists(), timeout_s=60, what="the rank to start")
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with contextlib.suppress(BaseException):  # what Python does with an exception in __del__
            handler(signal.SIGTERM, None)

    stopper = threading.Thread(target=stop_dropped)
    stopper.start()
    try:
        assert launcher.launch(cfg, lambda _path: ["-c", _WAITS_FOR_A_STOP, str(tmp_path)]) == 0
    finally:
        stopper.join()
    assert (tmp_path / "stopped").exists(), "the rank was told to stop"


def test_under_plain_torchrun_a_rank_that_cannot_start_hands_torchrun_its_reason(redis_url: str, tmp_path: Path):
    """Plain torchrun (across machines, docs/trainer.md) restarts the group for any failure, exit
    2 too, and has no setting against it: each start fails the same way until --max-restarts is
    spent. The rank's reason reaches torchrun's failure summary then (its error file), which
    otherwise says only "exitcode: 2" and where to read about tracebacks."""
    import yaml
    from trainer_support import trainer_config

    cfg = trainer_config(redis_url, tmp_path, free_port())
    ckpt = Path(cfg.trainer.checkpoint_dir)
    ckpt.mkdir(parents=True)
    (ckpt / "ckpt-0000000004.pt").write_bytes(b"not a checkpoint")
    path = tmp_path / "rank.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "--max-restarts", "1", "--monitor-interval", "0.2",
                           "-m", "services.cli", "--config", str(path), "trainer", "--as-rank"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    reason = f"no checkpoint in {ckpt} (trainer.checkpoint_dir) can be read"
    assert done.returncode == 1, done.stderr
    assert done.stderr.count(f"ERROR rank 0 cannot start: {reason}") == 2, "logged at each of the 1 + 1 starts"
    summary = done.stderr.partition("Root Cause (first observed failure)")[2]
    assert "exitcode  : 2" in summary and reason in summary, done.stderr


def test_under_plain_torchrun_a_rank_started_before_its_redis_waits_for_it(tmp_path: Path):
    """A trainer pod starts its ranks with torchrun before the Redis it needs may answer: rank 0
    waits for it, saying so once, the other ranks wait for rank 0 without the group init's
    limit (Redis is away here for longer than trainer.init_timeout_s), and all start once Redis
    answers, with no failure and no restart spent."""
    import signal
    import time

    import yaml
    from trainer_support import trainer_config

    from shared.redis_embed import start_redis

    port = free_port()
    init_timeout_s = 3
    cfg = trainer_config(f"redis://127.0.0.1:{port}/0", tmp_path, free_port(), init_timeout_s=init_timeout_s,
                         ranks=2)
    path = tmp_path / "rank.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                                "-m", "services.cli", "--config", str(path), "trainer", "--as-rank"],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    server = None
    try:
        for line in ("the trainer waits for it before it starts its ranks", "rank 1 waits for rank 0"):
            wait_for_sync(lambda line=line: line in log.read_text() or run.poll() is not None, timeout_s=120,
                          what=f"the log to say {line!r}")
            assert run.poll() is None, log.read_text()
        waiting_since = time.monotonic()
        # Redis stays away past the group init's limit: what a rank waiting inside the init hits
        wait_for_sync(lambda: time.monotonic() - waiting_since > init_timeout_s + 2 or run.poll() is not None,
                      timeout_s=60, what="the group init's limit to pass")
        assert run.poll() is None, log.read_text()
        _, server = start_redis(tmp_path / "redis", port)
        wait_for_sync(lambda: ("rank 0/2 up" in log.read_text() and "rank 1/2 up" in log.read_text())
                      or run.poll() is not None, timeout_s=120, what="the ranks to start once Redis answers")
        assert run.poll() is None, log.read_text()
        text = log.read_text()
        assert "Redis answers; starting the ranks" in text, text
        assert "failed" not in text and "restarted" not in text and "Traceback" not in text, text
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if server is not None:
            server.terminate()
            server.wait(10)


_STALLED_CLOSE = """
import sys, threading
from services.trainer.main import close_within, configure_logging

class Closing:
    def close(self):
        if sys.argv[1] == "stalls":
            threading.Event().wait()

configure_logging("0")
close_within(1.0, Closing(), 0, 3)
print("closed")
"""


@pytest.mark.parametrize("close", ["stalls", "returns"])
def test_a_rank_whose_close_stalls_leaves_with_its_status_instead_of_holding_the_stop(close: str):
    """Everything is checkpointed and committed before a rank closes its sockets, Redis
    connections and process group: a close that does not return ends the rank with the status
    it had, after the limit, rather than holding the trainer's stop until torchrun kills it."""
    proc = subprocess.run([sys.executable, "-c", _STALLED_CLOSE, close], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    if close == "stalls":
        assert proc.returncode == 3, proc.stderr
        assert "rank 0: closing its sockets and Redis connections took over 1 s; the rank leaves without it" \
            in proc.stderr
        assert "closed" not in proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "closed"
        assert "leaves without it" not in proc.stderr


def test_a_stop_signal_landing_inside_a_log_call_still_stops_a_starting_rank():
    """The rank's signal handler raises StoppedWhileStarting wherever the rank is; one that lands
    inside a log line (the rank logs as it joins its group) must leave the call, not be reported
    by logging as a failed emit and dropped: the rank would go on into a group its peers left."""
    import io
    import logging

    from services.trainer.main import StoppedWhileStarting

    class SignalledWhileFormatting(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            raise StoppedWhileStarting

    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(SignalledWhileFormatting())
    logger = logging.getLogger("tests.a_starting_rank")
    logger.addHandler(handler)
    try:
        with pytest.raises(StoppedWhileStarting):
            logger.warning("rank %d/%d up", 1, 2)
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("stopped", [True, False], ids=["told-to-stop", "not-told"])
def test_a_starting_rank_whose_peers_left_on_a_stop_it_was_given_too_stops_cleanly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stopped: bool):
    """The stop's raise can be dropped (a signal that lands in a finalizer: Python prints
    "Exception ignored" and goes on), so the rank goes on joining its group and fails there,
    because its peers stopped as told. With the stop set, that is the stop, not a failure; a
    rank that was not told to stop still reports its failure."""
    import logging
    import threading

    from services.trainer import main as trainer_main

    def peers_left(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:56483")

    monkeypatch.setattr(trainer_main, "init_distributed", lambda cfg, env: None)
    monkeypatch.setattr(trainer_main, "build_trainer", peers_left)
    stop = threading.Event()
    if stopped:
        stop.set()
    env = RankEnv(rank=1, world=2, local_rank=1, local_world=2)
    with caplog.at_level(logging.INFO, logger=trainer_main.log.name):
        code = trainer_main._run(load_config(None), env, stop, [False], (), [])
    assert code == (0 if stopped else 1)
    logged = caplog.text
    assert ("rank 1 stopped before it started" in logged) is stopped, logged
    assert ("rank 1 failed" in logged) is not stopped, logged


def test_a_stop_whose_raise_is_dropped_still_ends_the_wait_for_redis(monkeypatch: pytest.MonkeyPatch):
    """A stop signal that lands in a finalizer has its raise dropped ("Exception ignored");
    the wait for Redis must still end as a stop at its next turn, not wait on until Redis
    answers and then start ranks nobody wants."""
    import contextlib
    import signal

    from services.trainer import main as trainer_main

    asked = [0]

    def check_access(*args: object, **kwargs: object) -> bool:
        asked[0] += 1
        if asked[0] == 2:  # the signal arrives while a finalizer runs: its exception goes nowhere
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler)
            with contextlib.suppress(BaseException):  # what Python does with an exception in __del__
                handler(signal.SIGTERM, None)
        return asked[0] >= 4  # Redis answers later: a wait that missed the stop would start

    monkeypatch.setattr(trainer_main, "check_access", check_access)
    before = signal.getsignal(signal.SIGTERM)
    assert trainer_main.wait_for_redis(load_config(None), max_delay_s=0.1) is False
    assert asked[0] == 2, "the wait ended at its next turn"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_rank_waits_for_rank_0_while_it_beats_and_gives_up_once_it_stops():
    """Under plain torchrun the ranks other than 0 wait, in the agent's real store, for rank 0
    while it waits for Redis: past their limit as long as rank 0 beats, and no longer once it
    stops beating (a rank 0 that died, or restarted apart from them, never joins)."""
    import threading
    import time

    from services.trainer.dist import LEADER_READY, LeaderBeat, await_leader

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    leader = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))
    other = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))
    beat = LeaderBeat(dist.PrefixStore("learnmesh/start-0", leader))

    def waits_then_joins() -> None:
        end = time.monotonic() + 1.5  # three times the other rank's limit
        while time.monotonic() < end:
            beat()
            time.sleep(0.1)
        leader.set(f"learnmesh/start-0/{LEADER_READY}", "1")

    rank0 = threading.Thread(target=waits_then_joins)
    rank0.start()
    started = time.monotonic()
    await_leader(dist.PrefixStore("learnmesh/start-0", other), 1, limit_s=0.5, turn_s=0.05)
    assert time.monotonic() - started > 1.0, "it waited past its limit while rank 0 beat"
    rank0.join()
    assert beat.turns > 5
    # the next start's keys: rank 0 beat there once and then died
    LeaderBeat(dist.PrefixStore("learnmesh/start-1", leader))()
    with pytest.raises(TimeoutError, match="rank 0 neither joined nor said it waits for Redis"):
        await_leader(dist.PrefixStore("learnmesh/start-1", other), 1, limit_s=0.5, turn_s=0.05)
