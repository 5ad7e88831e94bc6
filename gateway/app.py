"""The gateway's FastAPI application and the plug-in contract its components follow.

``COMPONENTS`` are imported at build time (a module that does not exist yet is
skipped). Each may define ``register(registry)`` (tools/resources/prompts),
``async def startup(state)`` / ``async def shutdown(state)`` and ``router`` (an
APIRouter included in the app). The lifespan owns the Redis clients, the control
listener and every component's start/stop. ``/mcp`` is served by a raw ASGI app
ahead of FastAPI's routing (see :class:`GatewayApp`); everything else is FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from gateway.admin.auth import AdminKeyring
from gateway.auth import PROTECTED_RESOURCE_PATH
from gateway.dispatcher import Dispatcher
from gateway.registry import Registry
from gateway.state import GatewayState
from gateway.transport_http import McpHttpTransport
from shared.config import Config

log = logging.getLogger(__name__)

COMPONENTS = ("gateway.tools.context", "gateway.tools.inference", "gateway.tools.learning", "gateway.admin.api",
              "gateway.tasks")
FIXTURES = {"conformance": "gateway.fixtures.conformance"}
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SHUTDOWN_TIMEOUT_S = 10.0


def load_components(names: tuple[str, ...] | list[str] = COMPONENTS) -> list[ModuleType]:
    """Import the component modules that exist; a missing module is skipped, a broken one fails."""
    mods = []
    for name in names:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
            log.debug("component %s not present; skipped", name)
    return mods


class GatewayApp(FastAPI):
    """FastAPI app whose ``/mcp`` HTTP path bypasses routing and middleware for speed."""

    mcp: McpHttpTransport | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/mcp" and self.mcp is not None:
            await self.mcp(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(cfg: Config, fixtures: str | None = None) -> GatewayApp:
    registry = Registry()
    fixtures = fixtures or cfg.gateway.fixtures
    if fixtures:
        # Fixtures first: suites probe the first listed tool/resource with no arguments.
        if fixtures not in FIXTURES:
            raise ValueError(f"unknown fixtures {fixtures!r}")
        importlib.import_module(FIXTURES[fixtures]).register(registry)
    components = load_components()
    for mod in components:
        if hasattr(mod, "register"):
            mod.register(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        url = cfg.redis.url or DEFAULT_REDIS_URL
        common: dict[str, Any] = {"socket_connect_timeout": cfg.redis.socket_timeout_s,
                                  "max_connections": cfg.redis.max_connections, "health_check_interval": 30}
        redis = aioredis.Redis.from_url(url, socket_timeout=cfg.redis.socket_timeout_s, **common)
        blocking = aioredis.Redis.from_url(url, socket_timeout=None, **common)
        state = GatewayState(cfg, redis, blocking, registry)
        state.dispatcher = Dispatcher(registry, state)
        app.state.gateway = state
        app.state.admin_keyring = AdminKeyring.from_config(cfg.gateway.admin_keys)
        control = asyncio.create_task(state.run_control_listener(), name="gateway-control")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.control_connected.wait(), 2.0)
        started: list[ModuleType] = []
        try:
            for mod in components:
                if hasattr(mod, "startup"):
                    await mod.startup(state)
                started.append(mod)
            state.dispatcher.invalidate_lists()
            app.mcp = McpHttpTransport(state)
            yield
        finally:
            app.mcp = None
            state.shutting_down.set()
            for group in list(state.listeners.values()):
                for lis in list(group):
                    with contextlib.suppress(asyncio.QueueFull):
                        lis.queue.put_nowait({"method": "$shutdown"})
            for mod in reversed(started):
                if hasattr(mod, "shutdown"):
                    try:
                        await asyncio.wait_for(mod.shutdown(state), SHUTDOWN_TIMEOUT_S)
                    except Exception:
                        log.exception("component %s failed to shut down cleanly", mod.__name__)
            control.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await control
            await redis.aclose()
            await blocking.aclose()

    app = GatewayApp(title="learnmesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.registry = registry  # register extra tools here before the app starts (tests, embedding)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        try:
            await state.redis.ping()
        except (RedisError, OSError):
            return JSONResponse({"status": "unavailable", "redis": "unreachable"}, status_code=503,
                                headers={"Retry-After": str(cfg.redis.retry_after_s)})
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def protected_resource(request: Request) -> Response:
        doc = request.app.state.gateway.auth.protected_resource_metadata()
        if doc is None:
            return JSONResponse({"error": "OAuth is not enabled"}, status_code=404)
        return JSONResponse(doc)

    app.add_api_route(PROTECTED_RESOURCE_PATH, protected_resource, methods=["GET"])
    app.add_api_route(PROTECTED_RESOURCE_PATH + "/mcp", protected_resource, methods=["GET"])

    from gateway.transport_ws import websocket_endpoint

    app.add_api_websocket_route("/mcp/ws", websocket_endpoint)
    for mod in components:
        router = getattr(mod, "router", None)
        if router is not None:
            app.include_router(router)
    return app
