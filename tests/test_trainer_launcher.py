"""``learnmesh trainer`` hands its settings to torchrun, and a rank reads torchrun's restart count."""

from __future__ import annotations

import pytest

from services.trainer.dist import RankEnv
from services.trainer.launcher import launch_config
from shared.config import load_config


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
