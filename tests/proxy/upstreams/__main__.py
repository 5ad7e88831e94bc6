"""Run an upstream test server: ``python -m tests.proxy.upstreams http --port N --revision R``
or ``python -m tests.proxy.upstreams stdio``.

The bearer token, when one is wanted, comes from the environment variable named by
``--token-env`` so it never appears on a command line or in ``ps``.
"""

from __future__ import annotations

import argparse
import os
import sys

from conformance.http_guards import REVISIONS, BearerCheck, RevisionPin
from tests.proxy.upstreams.server import MARK_DIR_ENV, build_server


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.proxy.upstreams")
    parser.add_argument("transport", choices=["http", "stdio"])
    parser.add_argument("--name", default="upstream")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--revision", choices=["both", *REVISIONS], default="both",
                        help="serve one protocol revision only (HTTP)")
    parser.add_argument("--token-env", default="",
                        help="environment variable holding the bearer token every request must carry (HTTP)")
    parser.add_argument("--mark-dir", default="", help="where calls of `slow` leave a mark (else $UPSTREAM_MARK_DIR)")
    return parser.parse_args(argv)


def serve_http(args: argparse.Namespace) -> None:
    import uvicorn

    server = build_server(args.name)
    app = server.streamable_http_app(stateless_http=False)
    if args.revision != "both":
        app = RevisionPin(app, args.revision)
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise SystemExit(f"--token-env {args.token_env}: the variable is empty")
        app = BearerCheck(app, token)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=1)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.mark_dir:  # a stdio upstream's runner may not pass the environment on
        os.environ[MARK_DIR_ENV] = args.mark_dir
    if args.transport == "stdio":
        build_server(args.name).run("stdio")
    else:
        serve_http(args)


if __name__ == "__main__":
    main()
