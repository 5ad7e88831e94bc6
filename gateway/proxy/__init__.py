"""MCP-Proxy: upstream MCP servers (Streamable HTTP or stdio, either revision) behind the
gateway's one endpoint. :mod:`.http1` and :mod:`.wire` move bytes (:mod:`.stdio_pool` keeps a
stdio upstream's process per principal), :mod:`.client` speaks MCP to
one upstream (revision, sessions, breaker, timeout), :mod:`.names` maps names and URIs,
:mod:`.proxy` merges lists and routes calls, :mod:`.exchange` carries a call's side traffic,
:mod:`.resources` resource subscriptions, :mod:`.capture` calls into contexts, :mod:`.store` the
runtime set of upstreams in Redis, :mod:`.health` every replica's breakers in Redis. docs/gateway.md, "MCP-Proxy: upstreams"."""
