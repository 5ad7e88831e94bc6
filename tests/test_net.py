"""shared/net.py: the ports a process picks, alone or beside others picking at the same time."""

from __future__ import annotations

import socket

import pytest

from shared import net


@pytest.fixture
def slice_of_two(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    monkeypatch.setattr(net, "_share", net._share)  # restored after the test
    net.share_ports(1, 2)
    return net._span(min(net._ephemeral_low(), 32768))


def test_a_process_given_a_slice_picks_only_there_and_each_port_once(slice_of_two: tuple[int, int]) -> None:
    low, high = slice_of_two
    assert net._LOWEST_PORT < low < high <= 32768
    picked = [net.free_port() for _ in range(50)]
    assert all(low <= p < high for p in picked) and len(set(picked)) == len(picked)
    pair_low, pair_high = net._span(min(net._ephemeral_low(), 32768) - 1000)  # room for the partner port
    assert pair_low < pair_high <= high
    assert pair_low <= net.free_port_pair(1000) < pair_high
    with socket.socket() as s:  # free when given: the caller can bind it
        s.bind(("127.0.0.1", picked[0]))


def test_a_slice_that_does_not_exist_is_refused() -> None:
    for index, count in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="does not exist"):
            net.share_ports(index, count)
