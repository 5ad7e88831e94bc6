"""Prometheus metrics of every learnmesh process, defined in one module so names stay
consistent. Each component adds its metrics in its own block below."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# ---------------------------------------------------------------- gateway / MCP
MCP_REQUESTS = Counter("learnmesh_mcp_requests_total", "MCP requests", ["method", "revision", "transport"])
MCP_LATENCY = Histogram("learnmesh_mcp_request_seconds", "MCP request latency", ["method", "revision"],
                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
MCP_ERRORS = Counter("learnmesh_mcp_errors_total", "MCP error responses", ["code"])
MCP_SESSIONS_OPEN = Gauge("learnmesh_mcp_sessions_open", "Legacy MCP sessions cached on this replica")
