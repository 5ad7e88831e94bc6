"""Fixtures of the proxy tests; a test module loads them with
``pytest_plugins = ("tests.proxy_front_fixtures",)``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.proxy_front import TOKEN_ENV, UPSTREAM_SECRET, upstream_gateway


@pytest.fixture(autouse=True)
def front_upstream_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front gateway reads the upstream's credential from the environment. Named apart from
    tests/proxy_support.py's ``upstream_token``: plugins are global, and one fixture of that name
    would replace the other in every module of a run that loads both."""
    monkeypatch.setenv(TOKEN_ENV, f"Bearer {UPSTREAM_SECRET}")


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """One upstream gateway (test tools) for a test module."""
    with upstream_gateway() as (url, _):
        yield url


@pytest.fixture(scope="module")
def fixtures_upstream() -> Iterator[str]:
    """One upstream gateway serving the conformance suite's fixtures, for a test module."""
    with upstream_gateway(fixtures="conformance") as (url, _):
        yield url
