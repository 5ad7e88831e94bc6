"""Fixtures of the security tests that run replicas on both Redis kinds (``redis_target_module``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.redis_client import SyncRedis
from tests.conftest import RedisTarget


@pytest.fixture
def store(redis_target_module: RedisTarget) -> Iterator[SyncRedis]:
    """The Redis the module's replicas use (a server or a cluster), flushed for this test."""
    with redis_target_module.flushed() as client:
        yield client
