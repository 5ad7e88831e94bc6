"""The baseline of ``bench/bench_proxy.py``: FastMCP's proxy (``fastmcp.server.create_proxy``,
FastMCP 4.x) in front of one upstream, served over Streamable HTTP.

Runs under its own interpreter (``make bench-proxy`` builds ``.venv-bench-proxy`` with
``fastmcp==4.2.3`` and ``mcp==2.3.0``), never the test venv:

    .venv-bench-proxy/bin/python bench/fastmcp_proxy.py --upstream http://127.0.0.1:9000/mcp --port 9100

``--session fresh`` (the default of ``create_proxy(url)``) opens a new backend session for
every request, which keeps callers apart; ``--session shared`` hands ``create_proxy`` an
already connected client, which FastMCP then reuses for every request (its documented opt-in,
with the warning that concurrent callers share that session's context). Served like the
other servers of the bench: one process under uvicorn, uvloop and httptools when installed,
no access log, JSON responses.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from typing import Any

FAST = all(importlib.util.find_spec(m) for m in ("uvloop", "httptools"))


async def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from fastmcp import Client
    from fastmcp.server import create_proxy

    async def run(target: Any) -> None:
        app = create_proxy(target, name="fastmcp-proxy").http_app(path="/mcp", json_response=True)
        options = {"http": "httptools"} if FAST else {}
        config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                                **options)
        await uvicorn.Server(config).serve()

    if args.session == "fresh":
        await run(args.upstream)
        return
    async with Client(args.upstream) as client:
        await run(client)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--session", choices=["fresh", "shared"], default="fresh")
    args = ap.parse_args()
    if FAST:
        import uvloop

        uvloop.run(serve(args))
    else:
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
