"""The ``learnmesh`` command: one subcommand per process, plus ``up`` for all of them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from redis.exceptions import RedisClusterException

from shared.config import (
    CONFIG_ERROR_EXIT,
    ConfigError,
    check_zmq_endpoint,
    load_config,
    log_level,
    unknown_env_variables,
)
from shared.redis_embed import RedisStartError


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``least``."""
    def parse(text: str) -> int:
        value = _whole(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value
    return parse


def _port(text: str) -> int:
    value = _whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def _endpoint(text: str) -> str:
    """An argparse type: a ZeroMQ endpoint (shared.config.check_zmq_endpoint)."""
    try:
        return check_zmq_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is {exc}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="learnmesh", description=__doc__)
    p.add_argument("--config", help="path to learnmesh.yaml (default: $LEARNMESH_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("gateway", help="run one gateway replica (MCP + admin API)")
    g.add_argument("--host")
    g.add_argument("--port", type=_port)
    g.add_argument("--fixtures", choices=["conformance"],
                   help="register the MCP conformance suite's fixtures (test scaffolding, from a source checkout)")

    w = sub.add_parser("worker", help="run one inference worker")
    w.add_argument("--endpoint", type=_endpoint, help="ZeroMQ endpoint to bind (default: worker.endpoints[--index])")
    w.add_argument("--index", type=_count(0), default=0)

    t = sub.add_parser("trainer", help="run the trainer: --ranks ranks on this machine under torchrun")
    t.add_argument("--ranks", type=_count(1))
    t.add_argument("--as-rank", action="store_true", help="run as one rank of a torchrun group (env contract)")

    u = sub.add_parser("up", help="run everything on this machine: redis, gateway, workers, trainer")
    u.add_argument("--host")
    u.add_argument("--port", type=_port)
    u.add_argument("--workers", type=_count(0))  # 0: workers run elsewhere and join through Redis
    u.add_argument("--ranks", type=_count(1))
    u.add_argument("--fixtures", choices=["conformance"], help="passed on to the gateway (see gateway --help)")

    c = sub.add_parser("compose-secrets", help="generate every secret of the compose stack into a 0600 env file "
                                               "(an existing one keeps its keys and gets those it lacks)")
    c.add_argument("--out", default="compose/secrets.env", help="where to write (default: %(default)s; - for stdout)")
    c.add_argument("--api-keys", help="principal:key,... instead of one generated 'demo' key")
    c.add_argument("--force", action="store_true", help="replace an existing file (every key changes)")
    k = sub.add_parser("keys", help="make the mesh's missing keys (CURVE keypairs, delta ring and signing key, request-state key file)")
    k.add_argument("--rotate-zmq", choices=["gateway", "worker", "trainer"],
                   help="replace this role's CURVE keypair instead (the old public key stays allowed)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
        log_level()  # checked here, before any process starts: every command logs at it
    except ConfigError as exc:
        print(f"learnmesh: configuration error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    if not getattr(args, "as_rank", False):  # a rank's launcher has said it already
        for name, meant in unknown_env_variables(cfg):  # the names only: values may be secrets
            hint = f"did you mean {meant}?" if meant else "settings are LEARNMESH_<SECTION>__<KEY>"
            print(f"learnmesh: warning: {name} sets nothing and is ignored; {hint}", file=sys.stderr)
    if args.command == "gateway":
        from gateway.server import main as run
    elif args.command == "worker":
        from services.worker.main import main as run
    elif args.command == "trainer":
        from services.trainer.main import main as run
    elif args.command == "compose-secrets":
        from services.compose_secrets import main as run
    elif args.command == "keys":
        from services.key_files import main as run
    else:
        from services.supervisor import main as run
    try:
        return int(run(cfg, args) or 0)
    except ConfigError as exc:
        print(f"learnmesh: configuration error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except RedisStartError as exc:
        print(f"learnmesh: {exc}", file=sys.stderr)
        return 1
    except RedisClusterException as exc:  # as a cluster client is made: no node of the cluster answered
        print(f"learnmesh: {str(exc).rstrip('.')}; check redis.url and redis.cluster_nodes", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.filename is None:  # not about a path the operator gave or made: a fault worth its traceback
            raise
        print(f"learnmesh: cannot use {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
