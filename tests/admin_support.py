"""Helpers for the admin tests: a live gateway (uvicorn in a thread) with known keys."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from gateway.app import create_app
from shared.config import Config, load_config
from tests.conftest import free_port, wait_for_sync

ADMIN_KEY = "admin-key-0123456789"
OPERATOR_KEY = "operator-key-0123456789"
VIEWER_KEY = "viewer-key-0123456789"
MCP_KEY = "mcp-alice-key-0123456789"


def admin_config(redis_url: str, **overrides: Any) -> Config:
    base = {
        "redis": {"url": redis_url},
        "gateway": {
            "api_keys": {"alice": MCP_KEY},
            "admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"},
                           "ops": {"key": OPERATOR_KEY, "role": "operator"},
                           "watch": {"key": VIEWER_KEY, "role": "viewer"}},
            # these tests present refused keys on purpose, all from one address
            "auth_throttle": {"failures_per_source": 0, "failures_per_credential": 0},
        },
        "worker": {"endpoints": []},
    }
    for section, fields in overrides.items():
        base.setdefault(section, {}).update(fields)
    return load_config(None, env={}, overrides=base)


class LiveServer:
    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A stream a test leaves open (a GET /mcp stream read in a thread) would hold uvicorn's
        # graceful shutdown for ever: the server, its evictor and its other tasks would outlive the
        # test and act on the Redis of the tests after it. Cut off after a few seconds instead.
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", loop="asyncio", timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_for_sync(lambda: self.server.started or not self.thread.is_alive(), timeout_s=30,
                      what="gateway to start")
        assert self.server.started, "gateway failed to start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the gateway did not stop"


@contextlib.contextmanager
def live_gateway(redis_url: str, **overrides: Any) -> Iterator[LiveServer]:
    with LiveServer(create_app(admin_config(redis_url, **overrides))) as srv:
        yield srv


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
