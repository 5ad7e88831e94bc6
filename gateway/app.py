"""The gateway's FastAPI application.

:func:`create_app` registers the MCP tools into one registry (and, for the conformance
suite, its fixtures from a source checkout) and includes the admin routers. Its lifespan
builds the replica's :class:`~gateway.state.Gateway` once with :func:`open_gateway`, which
owns every resource — Redis clients, the ZeroMQ context, background tasks — and releases
them in reverse order on shutdown. ``/mcp`` is served by a raw ASGI app ahead of FastAPI's
routing (see :class:`GatewayApp`); everything else is FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from gateway.admin.auth import AdminKeyring
from gateway.admin.routes import ROUTERS
from gateway.admin.stats import LocalStats, run_stats_publisher, withdraw_stats
from gateway.auth import PROTECTED_RESOURCE_PATH
from gateway.errors import install_http_errors, is_outage
from gateway.limits import Limits
from gateway.proxy import store as proxy_store
from gateway.registry import Registry
from gateway.state import Gateway, gateway_of
from gateway.tasks import TaskManager
from gateway.tools import context, inference, learning
from gateway.transports.edge import HttpEdge, head_as_get
from gateway.transports.streamable_http import McpHttpTransport
from gateway.transports.websocket import websocket_endpoint, ws_ticket_endpoint
from gateway.workers import WorkerPool
from shared import audit, keys
from shared import metrics as m
from shared.aio import pause
from shared.audit import AUDIT_INFLIGHT
from shared.config import Config, ConfigError
from shared.context import ContextStore
from shared.redis_batch import MAX_INFLIGHT
from shared.redis_client import async_client, for_each_primary
from shared.text import as_str

log = logging.getLogger(__name__)

# Test scaffolding stays out of the package: the fixture sets live in the source checkout.
FIXTURES = {"conformance": Path(__file__).resolve().parents[1] / "conformance" / "fixtures.py"}
SHUTDOWN_TIMEOUT_S = 10.0  # per component
# A background task still running this long after its cancel swallowed it (see _cancel) and is
# cancelled again; shorter would interrupt the cleanup of one that is ending (closing a TLS link).
CANCEL_RETRY_S = 2.0
CONTROL_CONNECT_TIMEOUT_S = 2.0
PREPARE_FIRST_BACKOFF_S = 0.1  # a gateway started while Redis is away tries its start steps again
PREPARE_MAX_BACKOFF_S = 2.0


class GatewayApp(FastAPI):
    """FastAPI app whose HTTP requests pass the edge (body limit, admin key: gateway/transports/edge.py)
    before routing, and whose ``/mcp`` HTTP path then bypasses routing and middleware for speed.

    ``registry`` takes extra tools, resources and prompts until the app starts (tests, embedding)."""

    registry: Registry
    mcp: McpHttpTransport | None = None
    edge: HttpEdge | None = None

    def stopping(self) -> None:
        """The server began to drain (gateway/server.py): waits that poll end now with an
        answer (503, retry) and listen streams close, within the drain, rather than being
        cancelled when it runs out (a 500 without a JSON-RPC error)."""
        gateway = getattr(self.state, "gateway", None)
        if gateway is not None:
            _signal_shutdown(gateway)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.edge is not None:
            admitted = await self.edge.admit(scope, receive, send)
            if admitted is None:
                return
            receive, send = admitted
            if scope["path"] == "/mcp" and self.mcp is not None:
                await self.mcp(scope, receive, send)
                return
            as_get = head_as_get(scope, send)
            if as_get is not None:
                scope, send = as_get
        await super().__call__(scope, receive, send)


def register_fixtures(registry: Registry, name: str) -> None:
    """Register fixture set ``name`` from the source checkout; a clear error where it is absent
    (an installed wheel ships no fixtures)."""
    path = FIXTURES.get(name)
    if path is None:
        raise ConfigError(f"unknown fixtures {name!r} (available: {', '.join(FIXTURES)})")
    if not path.is_file():
        raise ConfigError(f"the {name} fixtures ({path}) are not here: they ship with the learnmesh source "
                          "checkout, not with the installed package; run the gateway from a checkout")
    spec = importlib.util.spec_from_file_location(f"learnmesh_fixtures_{name}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"the {name} fixtures ({path}) cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.register(registry)


SUBSCRIBER_CONNECTIONS = 4  # the control and tasks channels, and a resubscription of each under way
# What a replica keeps or takes beside its requests on the request client: the automatic pipelines
# keep their connections between batches (the context store's and the limits', MAX_INFLIGHT each;
# the proxy's audit, AUDIT_INFLIGHT), and each of its background loops (worker announcements and
# drains, task heartbeats, the global budget's lease and evictor, the control plane) takes one
# at a time. ``redis.max_connections`` is what its requests may hold on top of these.
OWN_CONNECTIONS = 2 * MAX_INFLIGHT + AUDIT_INFLIGHT + 8


def _redis_clients(cfg: Config) -> tuple[aioredis.Redis, aioredis.Redis, aioredis.Redis]:
    """The request client (socket timeout), the blocking one (none: the blocking reads of event
    streams and server->client requests, at most ``redis.max_connections`` of them, which
    ``Limits.stream_slot`` counts) and the subscriber (none: the pub/sub channels). Each has a
    pool of its own, so streams that fill theirs stop neither requests nor the channels, and the
    replica's own pipelines and background work have theirs beside the requests' (OWN_CONNECTIONS)."""
    common: dict[str, Any] = {"socket_connect_timeout": cfg.redis.socket_timeout_s,
                              "max_connections": cfg.redis.max_connections, "health_check_interval": 30}
    requests = {**common, "max_connections": cfg.redis.max_connections + OWN_CONNECTIONS}
    # Typed as one server's client: the components below are written against its API, and
    # RedisCluster answers the same commands for keys of one slot.
    return (cast(aioredis.Redis, async_client(cfg.redis, socket_timeout=cfg.redis.socket_timeout_s, **requests)),
            cast(aioredis.Redis, async_client(cfg.redis, socket_timeout=None, **common)),
            cast(aioredis.Redis, async_client(cfg.redis, socket_timeout=None,
                                              **{**common, "max_connections": SUBSCRIBER_CONNECTIONS})))


async def _warn_unless_noeviction(redis: aioredis.Redis) -> None:
    try:
        for policy in await for_each_primary(redis, _eviction_policy):
            if policy != "noeviction":
                log.warning("redis maxmemory-policy is %r: Redis may evict part of a context's keys; learnmesh "
                            "enforces its own exact budgets and needs 'noeviction'", policy)
                return
    except Exception as exc:  # noqa: BLE001 - CONFIG may be disabled (managed Redis); not fatal
        log.warning("could not read redis maxmemory-policy (%s); make sure it is 'noeviction'", type(exc).__name__)


async def _eviction_policy(node: aioredis.Redis) -> str:
    conf: dict[Any, Any] = await node.config_get("maxmemory-policy")
    return as_str(conf.get("maxmemory-policy") or conf.get(b"maxmemory-policy"))


async def _adopt_renamed_keys(redis: aioredis.Redis) -> None:
    """Keys that gained a hash tag keep their data (keys.RENAMED); what is already under the
    new name is kept, and so is the old key then."""
    cluster = isinstance(redis, aioredis.RedisCluster)
    for old, new in keys.RENAMED.items():
        if cluster:
            await _move_across_slots(redis, old, new)
        elif await redis.exists(old):
            await redis.renamenx(old, new)


async def _move_across_slots(redis: aioredis.Redis, old: str, new: str) -> None:
    """RENAMENX on a cluster (a single server's data imported into it), where the two names are
    in different slots and RENAME is refused: DUMP, RESTORE (refused when the new name exists),
    then DEL. Replicas starting together are safe: one RESTORE wins, the others find the new
    name taken or the old one gone. The renamed keys never carry a TTL."""
    payload = await redis.dump(old)
    if payload is None:
        return
    try:
        await redis.restore(new, 0, payload)
    except ResponseError as exc:
        if not str(exc).startswith("BUSYKEY"):
            raise
        return
    await redis.delete(old)


async def _bounded(what: str, stop: Callable[[], Awaitable[Any]], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Run one shutdown step; a step that fails or hangs is logged and the others still run."""
    try:
        await asyncio.wait_for(stop(), timeout_s)
    except Exception:
        log.exception("%s did not stop cleanly", what)


async def _cancel(task: asyncio.Task[Any]) -> None:
    # Cancelled again until it ends: on Python 3.11 a cancel that lands while a connect's
    # wait_for completes is swallowed (redis-py connecting on a first command), and the task
    # would carry on with its loop.
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=CANCEL_RETRY_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close_all(closing: list[ContextStore | Limits]) -> None:
    await asyncio.gather(*(c.aclose() for c in closing))


def _signal_shutdown(gateway: Gateway) -> None:
    gateway.shutting_down.set()
    gateway.close_listeners()


@contextlib.asynccontextmanager
async def open_gateway(cfg: Config, registry: Registry) -> AsyncIterator[Gateway]:
    """Build one replica's components, start their background work, and on exit stop all of
    it in reverse order: listen streams end first, Redis clients close last."""
    async with contextlib.AsyncExitStack() as stack:
        redis, blocking, subscriber = _redis_clients(cfg)
        stack.push_async_callback(subscriber.aclose)
        stack.push_async_callback(blocking.aclose)
        stack.push_async_callback(redis.aclose)
        # closed after everything else, just before the clients: they give back their connections
        batched: list[ContextStore | Limits] = []
        stack.push_async_callback(_bounded, "the redis batches", lambda: _close_all(batched))
        keyring = AdminKeyring.from_config(cfg.gateway.admin_keys, redis, cfg.gateway.api_keys)
        zmq_ctx = zmq.asyncio.Context()
        stack.callback(zmq_ctx.destroy, 0)  # runs after the pool and the ingest closed their sockets
        audit.configure(cfg.context.audit_maxlen)
        store = ContextStore(redis, cfg.context, redis_cfg=cfg.redis)
        workers = WorkerPool(cfg, zmq_ctx=zmq_ctx, redis=redis)
        stack.push_async_callback(_bounded, "the worker pool", workers.close)
        samples = learning.SampleIngest(redis, cfg, store, zmq.Context.shadow(zmq_ctx))
        stack.callback(samples.close)
        trainer_link = asyncio.create_task(samples.follow_trainer_link(), name="trainer-link")
        stack.push_async_callback(_cancel, trainer_link)
        replica_id = uuid.uuid4().hex
        limits = Limits(redis, cfg)
        batched.extend((store, limits))
        gateway = Gateway(config=cfg, redis=redis, blocking_redis=blocking, subscriber_redis=subscriber,
                          registry=registry,
                          replica_id=replica_id, zmq_ctx=zmq_ctx, store=store, workers=workers, samples=samples,
                          tasks=TaskManager(redis, subscriber, replica_id, limits=limits), limits=limits,
                          admin_keyring=keyring, admin_stats=LocalStats())
        store.on_evicted = context.eviction_notices(gateway)

        control = asyncio.create_task(gateway.run_control_listener(), name="gateway-control")
        stack.push_async_callback(_cancel, control)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gateway.control_connected.wait(), CONTROL_CONNECT_TIMEOUT_S)
        stack.push_async_callback(_bounded, "the proxy's upstreams", gateway.proxy.close)
        try:
            await _prepare_redis(gateway)
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.warning("redis unreachable at start (%s): requests are answered 503 until it answers, and the "
                        "start finishes then", type(exc).__name__)
            prepare = asyncio.create_task(_prepare_when_redis_answers(gateway), name="gateway-prepare-redis")
            stack.push_async_callback(_cancel, prepare)
        await workers.start()
        await gateway.tasks.start()
        stack.push_async_callback(_bounded, "the task manager", gateway.tasks.stop)
        stats = asyncio.create_task(run_stats_publisher(gateway, cfg.metrics.status_interval_s), name="admin-stats")
        stack.push_async_callback(_bounded, "the dashboard snapshot", lambda: withdraw_stats(gateway), 2.0)
        stack.push_async_callback(_bounded, "the stats publisher", lambda: _cancel(stats), 2.0)
        evictor = asyncio.create_task(store.evictor(owner=replica_id).run(on_evicted=gateway.contexts_evicted),
                                      name="context-global-budget")
        stack.push_async_callback(_cancel, evictor)
        stack.callback(_signal_shutdown, gateway)
        yield gateway


async def _prepare_redis(gateway: Gateway) -> None:
    """The start's one-time steps on Redis: renamed keys adopted, the config file's upstreams
    seeded and the served set loaded, the eviction policy checked; ``gateway.prepared`` then."""
    await _adopt_renamed_keys(gateway.redis)
    await open_proxy(gateway)
    await _warn_unless_noeviction(gateway.redis)
    gateway.prepared.set()


async def _prepare_when_redis_answers(gateway: Gateway) -> None:
    """:func:`_prepare_redis` again, with backoff, until Redis answers (it was away at start)."""
    backoff_s = PREPARE_FIRST_BACKOFF_S
    while True:
        await pause(backoff_s)
        backoff_s = min(backoff_s * 2, PREPARE_MAX_BACKOFF_S)
        try:
            await _prepare_redis(gateway)
        except Exception as exc:
            if is_outage(exc):
                continue
            log.exception("the gateway's start steps on redis failed; /readyz stays 503")
            return
        log.info("redis answers: the gateway's start is complete")
        return


async def open_proxy(gateway: Gateway) -> None:
    """The config file's upstreams are the initial set; the set in Redis is what is served."""
    await proxy_store.seed(gateway.redis, gateway.config.proxy.upstreams)
    await gateway.reload_proxy()


def create_app(cfg: Config, fixtures: str | None = None) -> GatewayApp:
    registry = _registry(fixtures or cfg.gateway.fixtures)
    app = GatewayApp(title="learnmesh gateway", lifespan=_lifespan(cfg, registry), docs_url=None, redoc_url=None)
    app.registry = registry
    install_http_errors(app, cfg)
    _add_probes(app, cfg)
    _add_mcp_routes(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _registry(fixtures: str | None) -> Registry:
    registry = Registry()
    if fixtures:  # first: suites probe the first listed tool/resource with no arguments
        register_fixtures(registry, fixtures)
    for tools in (context, inference, learning):
        tools.register(registry)
    return registry


def _lifespan(cfg: Config, registry: Registry) -> Callable[[GatewayApp], contextlib.AbstractAsyncContextManager[None]]:
    """Opens the replica's gateway for the app's life and hands its transports to the app."""
    @contextlib.asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        async with open_gateway(cfg, registry) as gateway:
            app.state.gateway = gateway
            app.mcp = McpHttpTransport(gateway)
            app.edge = HttpEdge(gateway)
            try:
                yield
            finally:
                app.mcp = None
    return lifespan


def _add_probes(app: GatewayApp, cfg: Config) -> None:
    """Liveness, readiness (Redis reachable) and Prometheus metrics."""
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        gateway = gateway_of(request)
        try:
            await gateway.redis.ping()
            if not gateway.prepared.is_set():
                raise RedisError("the start's steps on redis are not done yet")
        except (RedisError, RedisClusterException, OSError):
            return JSONResponse({"status": "unavailable", "redis": "unreachable"}, status_code=503,
                                headers={"Retry-After": str(cfg.redis.retry_after_s)})
        return JSONResponse({"status": "ready"})

    exposed = m.Without(REGISTRY, ("learnmesh_trainer_",))  # the trainer's exporters count those

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)  # type: ignore[arg-type]


def _add_mcp_routes(app: GatewayApp) -> None:
    """OAuth protected-resource metadata and the WebSocket transport (HTTP ``/mcp`` is :class:`GatewayApp`'s)."""
    async def protected_resource(request: Request) -> Response:
        doc = gateway_of(request).auth.protected_resource_metadata()
        if doc is None:
            return JSONResponse({"error": "OAuth is not enabled"}, status_code=404)
        return JSONResponse(doc)

    app.add_api_route(PROTECTED_RESOURCE_PATH, protected_resource, methods=["GET"])
    app.add_api_route(PROTECTED_RESOURCE_PATH + "/mcp", protected_resource, methods=["GET"])
    app.add_api_websocket_route("/mcp/ws", websocket_endpoint)
    app.add_api_route("/mcp/ws-ticket", ws_ticket_endpoint, methods=["POST"], include_in_schema=False)
