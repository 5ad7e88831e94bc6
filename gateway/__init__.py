"""The learnmesh gateway: MCP over Streamable HTTP and WebSocket, admin API, metrics."""
