"""Upstream MCP servers for the proxy tests and benches, on the official SDK (``mcp`` 2.3.0).

``server.build_server`` builds the SDK server; ``conformance/http_guards.py`` holds the ASGI
guards that make an HTTP upstream speak one protocol revision only and demand a bearer token;
``python -m tests.proxy.upstreams`` runs one (HTTP on a port, or stdio). ``tests/proxy/harness.py``
starts them as processes (``tests/proxy_support.py``: the fixtures).
"""
