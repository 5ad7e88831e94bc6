"""shared/net.py: the ports a process picks, alone or beside others picking at the same time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared import net

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def slice_of_two(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    monkeypatch.setattr(net, "_share", net._share)  # restored after the test
    net.share_ports(1, 2)
    return net._span(min(net._ephemeral_low(), net._PARTNERS_FROM))


def test_a_process_given_a_slice_picks_only_there_and_each_port_once(slice_of_two: tuple[int, int]) -> None:
    low, high = slice_of_two
    assert net._LOWEST_PORT < low < high <= 32768
    picked = [net.free_port() for _ in range(50)]
    assert all(low <= p < high for p in picked) and len(set(picked)) == len(picked)
    pair_low, pair_high = net._span(min(net._ephemeral_low(), 32768) - 10_000)  # room for the partner port
    assert net._PARTNERS_FROM <= pair_low + 10_000 < pair_high + 10_000 <= 32768  # partners above every single port
    base = net.free_port_pair(10_000)
    assert pair_low <= base < pair_high and base + 10_000 >= net._PARTNERS_FROM
    with socket.socket() as s:  # free when given: the caller can bind it
        s.bind(("127.0.0.1", picked[0]))


def test_a_slice_that_does_not_exist_is_refused() -> None:
    for index, count in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="does not exist"):
            net.share_ports(index, count)
    with pytest.raises(ValueError, match="does not exist"):
        net.share_ports(0, 2, children=2)


def _child_picks(env_slice: str) -> subprocess.CompletedProcess[str]:
    code = "from shared import net; print(net._share, *[net.free_port() for _ in range(20)])"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, net.PORT_SLICE_ENV: env_slice}, check=False)


def test_the_processes_a_runner_starts_pick_from_the_slice_it_gives_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "_share", net._share)
    monkeypatch.setenv(net.PORT_SLICE_ENV, "")  # restored after the test
    net.share_ports(2, 4, children=3)
    assert os.environ[net.PORT_SLICE_ENV] == "3/4"
    mine = net._span(min(net._ephemeral_low(), net._PARTNERS_FROM))
    child = _child_picks(os.environ[net.PORT_SLICE_ENV])
    assert child.returncode == 0, child.stderr
    share, *ports = child.stdout.split(") ")
    assert share == "(3, 4"
    picked = [int(p) for p in ports[0].split()]
    low, high = mine
    assert picked and all(p >= high for p in picked), (mine, picked)  # the next slice up, never this one's


def test_a_malformed_slice_in_the_environment_is_named() -> None:
    child = _child_picks("3/3")
    assert child.returncode != 0 and "LEARNMESH_PORT_SLICE='3/3'" in child.stderr
