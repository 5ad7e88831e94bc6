"""The baseline of ``bench/bench_proxy.py``: FastMCP's proxy (``fastmcp.server.create_proxy``,
FastMCP 4.x) in front of one upstream, served over Streamable HTTP.

Runs under its own interpreter (``make bench-proxy`` builds ``.venv-bench-proxy`` with
``fastmcp==4.2.3`` and ``mcp==2.3.0``), never the test venv:

    .venv-bench-proxy/bin/python bench/fastmcp_proxy.py --upstream http://127.0.0.1:9000/mcp --port 9100

Served like the other servers of the bench: one process under uvicorn, uvloop and httptools
when installed, no access log, JSON responses.
"""

from __future__ import annotations

import argparse
import importlib.util


def main() -> None:
    import uvicorn
    from fastmcp.server import create_proxy

    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    proxy = create_proxy(args.upstream, name="fastmcp-proxy")
    app = proxy.http_app(path="/mcp", json_response=True)
    fast = {"loop": "uvloop", "http": "httptools"} if all(
        importlib.util.find_spec(m) for m in ("uvloop", "httptools")) else {}
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, **fast)


if __name__ == "__main__":
    main()
