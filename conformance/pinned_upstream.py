"""A learnmesh gateway with the conformance fixtures that speaks one protocol revision only:
the upstream of the conformance runs through the proxy (``THROUGH_PROXY=<revision>
bash scripts/conformance.sh``).

    python -m conformance.pinned_upstream --port 8100 --revision 2025-11-25

It is the gateway ``learnmesh gateway --fixtures conformance`` serves, behind
:class:`conformance.http_guards.RevisionPin`, so a proxy that spoke the other revision to it
would be refused rather than served. Redis comes from the configuration (``$REDIS_URL``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from conformance.http_guards import REVISIONS, RevisionPin


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import uvicorn_settings
    from shared.config import load_config

    parser = argparse.ArgumentParser(prog="python -m conformance.pinned_upstream")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--revision", choices=REVISIONS, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config()
    cfg.gateway.host, cfg.gateway.port = "127.0.0.1", args.port
    app = create_app(cfg, fixtures="conformance")
    uvicorn.run(RevisionPin(app, args.revision), **uvicorn_settings(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
