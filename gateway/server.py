"""``learnmesh gateway``: run one gateway replica under uvicorn (uvloop + httptools, one write
per response and read deadlines: see gateway/transports/http_protocol.py).

Binds 127.0.0.1 unless told otherwise; refuses a non-loopback bind without API keys
(or OAuth), and warns when it serves an open gateway on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import subprocess
import sys
from types import FrameType
from typing import Any

from gateway.auth import is_loopback
from shared.config import Config, ConfigError, log_level, var_dir
from shared.net import listened_on

log = logging.getLogger("learnmesh.gateway")


def check_bind(cfg: Config) -> None:
    gw = cfg.gateway
    secured = bool(gw.api_keys) or gw.oauth.enabled
    if not is_loopback(gw.host) and not secured:
        raise ConfigError(f"refusing to bind {gw.host} without API keys: set LEARNMESH_API_KEYS=principal:key,... "
                          "(or gateway.api_keys / gateway.oauth), or bind 127.0.0.1")
    if listened_on(gw.host, gw.port):  # before Redis and workers are reached: uvicorn would find it only then
        raise ConfigError(f"gateway.port: another process listens on {gw.host}:{gw.port}; stop it, or give this "
                          "gateway another port (--port, LEARNMESH_GATEWAY__PORT)")
    if not secured:
        log.warning("gateway on %s:%d is OPEN (no API keys): anyone on this machine is principal 'local'",
                    gw.host, gw.port)


def uvicorn_options(cfg: Config) -> dict[str, Any]:
    """How uvicorn serves the gateway: our HTTP protocol with the configured read deadlines, our
    WebSocket protocol with messages bounded by the body limit. No access log and no
    X-Forwarded-* rewriting on the hot path: the gateway identifies callers by their
    credentials; only the failed-attempt throttle reads the client address, and believes
    X-Forwarded-For from ``gateway.auth_throttle.trusted_proxies`` alone. WebSocket keepalive pings on the
    configured interval drop a peer that stopped answering (gateway/transports/ws_protocol.py)."""
    from gateway.transports.http_protocol import http_protocol
    from gateway.transports.ws_protocol import GatewayWebSocketProtocol

    return {"loop": "uvloop", "http": http_protocol(cfg.gateway), "ws": GatewayWebSocketProtocol,
            "ws_max_size": cfg.gateway.max_body_bytes, "ws_ping_interval": cfg.gateway.ws_ping_interval_s,
            "ws_ping_timeout": cfg.gateway.ws_ping_timeout_s, "access_log": False, "proxy_headers": False}


class _Stopped(Exception):
    """SIGTERM or SIGINT: the replica stops (see main)."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def uvicorn_settings(cfg: Config) -> dict[str, Any]:
    """``uvicorn.run``'s keyword arguments for a replica: where it listens, plus
    :func:`uvicorn_options`. tests/test_gateway_http_protocol.py serves the gateway with them
    in-process and fails if a response leaves in more than one write (the HTTP protocol leans
    on uvicorn internals)."""
    return {"host": cfg.gateway.host, "port": cfg.gateway.port, "log_level": "warning",
            "timeout_graceful_shutdown": 5, "lifespan": "on", **uvicorn_options(cfg)}


def main(cfg: Config, args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT. ``args``: ``host``, ``port`` and ``fixtures`` (None: the config's)."""
    import uvicorn

    from gateway.app import create_app
    from shared.redis_client import check_access
    from shared.redis_embed import resolve_redis

    logging.basicConfig(level=log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host:
        cfg.gateway.host = args.host
    if args.port:
        cfg.gateway.port = args.port
    check_bind(cfg)
    app = create_app(cfg, fixtures=args.fixtures)  # before Redis: a bad setting starts nothing
    proc = resolve_redis(cfg.redis, var_dir())
    try:
        check_access(cfg.redis)  # wrong credentials: one clear line now, not 503s for ever
    except ConfigError:
        _stop_redis(proc)
        raise
    # uvicorn drains on SIGTERM / SIGINT and then raises the signal again under the handlers
    # it found: with the default ones the process would die there, exit code -15, without
    # the `finally` below (an embedded Redis this replica started would outlive it). These
    # end the replica here instead, exit code 0.
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    freeze_startup_heap()

    class Server(uvicorn.Server):
        """Tells the app when the drain begins (``GatewayApp.stopping``), not when it ends."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                with contextlib.suppress(RuntimeError):  # a signal before the loop runs: nothing waits yet
                    asyncio.get_running_loop().call_soon_threadsafe(app.stopping)
            super().handle_exit(sig, frame)

    try:
        Server(uvicorn.Config(app, **uvicorn_settings(cfg))).run()
    except _Stopped as stop:
        log.info("gateway stopped (%s)", signal.Signals(stop.args[0]).name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_redis(proc)
    return 0


def freeze_startup_heap() -> None:
    """Move what exists before serving (modules, config, registry, app: ~90,000 objects that live
    as long as the process) out of the cyclic collector's scans. Without it every full collection
    walks all of them (~50 ms each, ~3 % of a proxied call's CPU under load); with it, only what
    requests allocated."""
    gc.collect()
    gc.freeze()


def _stop_redis(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":  # pragma: no cover - `learnmesh gateway` is the entry point
    from shared.config import load_config

    sys.exit(main(load_config(), argparse.Namespace(host=None, port=None, fixtures=None)))
