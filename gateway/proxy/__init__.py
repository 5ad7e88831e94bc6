"""MCP-Proxy: upstream MCP servers (Streamable HTTP or stdio, either revision) behind the
gateway's one endpoint. :mod:`.wire` moves bytes, :mod:`.client` speaks MCP to one upstream,
:mod:`.names` maps names and URIs, :mod:`.proxy` merges lists and routes calls, :mod:`.store`
keeps the runtime set of upstreams in Redis. docs/gateway.md, "MCP-Proxy: upstreams"."""
