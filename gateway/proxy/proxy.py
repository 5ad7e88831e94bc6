"""The proxy: upstreams merged into the gateway's lists and their calls routed to them.

The dispatcher asks it for what it does not serve itself: list entries (after its own),
``tools/call`` and ``prompts/get`` of a name it does not know, ``resources/read`` of an
``upstream://`` URI. Each upstream's lists are fetched with the caller's session, kept for
``proxy.list_ttl_s`` (a stale copy is served while a fresh one is fetched; ``list_changed``
from the upstream drops it) and filtered by what the caller may use.

A forwarded call carries the client's ``_meta``; what the upstream sends during it is carried
back by :mod:`gateway.proxy.exchange`, and so are a 2026-07-28 upstream's ``input_required``
rounds. A 2026-07-28 client answers on its next request: the call is then sent to the upstream
again with the answers at hand, so an upstream tool that asks is run once per round trip. Every
call is measured, audited (batched) and, when the upstream opts in, captured
(:mod:`gateway.proxy.capture`). A 2026-07-28 upstream's tasks pass through; a 2025-11-25
upstream has none, so a tool it declares task-capable runs as the gateway's own task
(:meth:`gateway.tasks.TaskManager.run`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.errors import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    RESOURCE_NOT_FOUND,
    Forbidden,
    InvalidParams,
    McpError,
    NotFound,
)
from gateway.mcp import param_headers
from gateway.mcp.dispatcher import Call, InputRequired
from gateway.mcp.types import LEGACY_VERSION
from gateway.proxy import entries, names
from gateway.proxy.breaker import CLOSED, STATE_VALUE
from gateway.proxy.capture import capture
from gateway.proxy.client import UpstreamClient, header_value
from gateway.proxy.errors import StdioCapReached, UpstreamFailed
from gateway.proxy.exchange import CallHooks, changed_list, forwardable_capabilities, upstream_meta
from gateway.proxy.health import BreakerBoard
from gateway.proxy.resources import ResourceFollowers
from gateway.proxy.stdio_pool import CATALOG
from gateway.proxy.wire import Hooks, Message
from gateway.registry import TASK_SUPPORT
from gateway.tasks import TaskCall
from shared import keys, metrics
from shared.aio import pause, spawn
from shared.audit import BatchedAudit, record
from shared.config import ProxyAllow, UpstreamConfig
from shared.text import as_str

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger(__name__)

LISTS = {"tools": "tools/list", "resources": "resources/list", "resourceTemplates": "resources/templates/list",
         "prompts": "prompts/list"}
# What the gateway fetches of one list of one upstream: an upstream answering with endless pages,
# or pages of millions of entries, would hold the replica's memory (and the event loop, each entry
# checked and rewritten) and every client's list; what lies past either bound is left out, logged.
MAX_LIST_PAGES = 50
MAX_LIST_ENTRIES = 10_000
MAX_INPUT_ROUNDS = 8
LIST_CHANGED_GAP_S = 1.0
WATCH_RETRY_MIN_S, WATCH_RETRY_MAX_S = 1.0, 60.0
TASK_KEY_TTL_S = 86_400  # how long a task's upstream is remembered when the task names no ttlMs
TASK_KEY_SLACK_S = 60
TASK_KEY_MAX_S = 7 * 86_400  # an upstream's ttlMs is its own claim: a task's upstream is remembered this long at most
ALLOW_CACHE_MAX = 65_536
# The longest tool or prompt name clients see (MCP asks for at most 128 characters, to which the
# namespace adds): a longer one is not mounted, and a call naming one is refused before it is
# forwarded or kept (allow decisions are cached by name). Audit records keep this much of an item.
MAX_NAME_CHARS = 256


@dataclass
class Catalog:
    """One upstream's lists as the gateway's clients see them (names and URIs rewritten)."""

    fetched_at: float | None = None  # monotonic; None: never (a monotonic clock may start near 0 at boot)
    lists: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)    # exposed name -> upstream's name
    prompts: dict[str, str] = field(default_factory=dict)
    param_specs: dict[str, param_headers.Spec] = field(default_factory=dict)  # tools with x-mcp-header
    # Tools the upstream lists that clients are not shown (a malformed entry, x-mcp-header declarations
    # that break SEP-2243): calling one is refused as calling an unknown tool, before it is forwarded.
    unlisted: set[str] = field(default_factory=set)
    task_support: dict[str, str] = field(default_factory=dict)  # exposed tool name -> optional | required


@dataclass(eq=False)
class Upstream:
    cfg: UpstreamConfig
    client: UpstreamClient
    catalog: Catalog = field(default_factory=Catalog)
    changes: int = 0  # list changes announced so far: a fetch begun before the last one is stale on arrival
    refresh: asyncio.Task[None] | None = None
    wait_until: float = 0.0  # loop time: how long listings wait for ``refresh`` (its start + timeout_s), all together
    waited_out: bool = False  # a listing was answered without ``refresh``: its clients are told when it lands
    watcher: asyncio.Task[None] | None = None
    latency: Any = None  # its /metrics children, looked up once
    breaker_gauge: Any = None
    breaker_state: str = CLOSED  # what breaker_gauge shows
    calls: int = 0  # on this replica, for the dashboard (/metrics has the rest)
    errors: int = 0

    def __post_init__(self) -> None:
        self.latency = metrics.PROXY_LATENCY.labels(self.cfg.name)
        self.breaker_gauge = metrics.PROXY_BREAKER.labels(self.cfg.name)
        self.breaker_gauge.set(STATE_VALUE[CLOSED])  # a reopened upstream's new breaker, not the old one's state

    @property
    def name(self) -> str:
        return self.cfg.name


class Proxy:
    """The replica's upstreams (the set in Redis, see gateway/proxy/store.py) and what routes to them."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.config = gateway.config.proxy
        self.upstreams: dict[str, Upstream] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._apply_lock = asyncio.Lock()
        self.resources = ResourceFollowers(self)
        self._audit = BatchedAudit(gateway.redis)
        self._counters: dict[tuple[str, str, str], Any] = {}
        self._decisions: dict[tuple[str, str, str | None], bool] = {}  # see allowed()
        self._announced: dict[tuple[str, str, bool], float] = {}  # see _announce()
        self._held: set[tuple[str, str, bool]] = set()
        self.breakers = BreakerBoard(gateway.redis, gateway.replica_id, self.config.health_ttl_s,
                                     lambda: self.upstreams)

    @property
    def active(self) -> bool:
        return bool(self.upstreams)

    # ------------------------------------------------------------------ the set of upstreams
    async def apply(self, configs: list[UpstreamConfig]) -> None:
        """Make the replica's upstreams ``configs``: new ones opened, changed ones reopened,
        removed ones closed. An upstream whose credentials cannot be read is left out, logged."""
        async with self._apply_lock:
            await self._apply(configs)
            bare = self._bare()
            if bare is not None:  # which of its names another upstream's namespace holds may have changed
                self.catalog_changed(bare.name)
        self.gateway.dispatcher.invalidate_lists()
        self.breakers.changed()  # the mesh-wide view shows the new set without waiting a round

    async def _apply(self, configs: list[UpstreamConfig]) -> None:
        wanted = {c.name: c for c in configs}
        for name in list(self.upstreams):
            if name not in wanted or wanted[name] != self.upstreams[name].cfg:
                await self._close(self.upstreams.pop(name))
        for name, cfg in wanted.items():
            if name not in self.upstreams:
                try:
                    self.upstreams[name] = up = Upstream(cfg, self._client(cfg))
                except Exception as exc:  # noqa: BLE001 - one bad upstream must not take the others down
                    log.error("proxy upstream %s left out: %s", name, exc)
                    continue
                if cfg.enabled:
                    self._watch(up)

    def _watch(self, up: Upstream) -> None:
        """Follow what the upstream announces outside calls (list changes; a stdio process's
        resource updates, which are its principal's), on this replica."""
        if up.client.stdio is not None:
            up.client.stdio.notes = lambda key, msg: self._stdio_note(up, key, msg)
        else:
            hooks = Hooks(notify=lambda msg: self._standing_note(up, msg))
            up.watcher = asyncio.create_task(self._follow(up, hooks), name=f"proxy-watch-{up.name}")

    async def _follow(self, up: Upstream, hooks: Hooks) -> None:
        delay_s = WATCH_RETRY_MIN_S
        while True:
            try:
                status = await up.client.follow(hooks)
                # No standing stream offered (405), or none now: try again, less and less often.
                delay_s = WATCH_RETRY_MIN_S if status == 200 else min(delay_s * 2, WATCH_RETRY_MAX_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the upstream is away; calls report that themselves
                log.debug("proxy upstream %s: standing stream ended (%s)", up.name, type(exc).__name__)
                delay_s = min(delay_s * 2, WATCH_RETRY_MAX_S)
            await pause(delay_s)

    async def _standing_note(self, up: Upstream, msg: Message) -> None:
        kind = changed_list(msg)
        if kind is not None:
            self.catalog_changed(up.name)
            # Every replica follows the upstream itself: this one tells its own clients only.
            self._announce((up.name, kind, False), lambda: self.gateway.list_changed_here(kind, up.name))

    async def _stdio_note(self, up: Upstream, key: str, msg: Message) -> None:
        if key != CATALOG and msg.get("method") == "notifications/resources/updated":
            await self.resources.updated(key, up, msg)
        else:
            await self._standing_note(up, msg)

    def _client(self, cfg: UpstreamConfig) -> UpstreamClient:
        gw = self.gateway
        return UpstreamClient(cfg, gw.redis, self.config.breaker, gw.config.gateway.session_idle_ttl_s,
                              self.breakers.changed)

    async def _close(self, up: Upstream) -> None:
        self.resources.forget(up.name)
        tasks = [t for t in (up.refresh, up.watcher) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their connections closed before the pool's
        try:
            await up.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.warning("proxy upstream %s did not close cleanly", up.name)

    async def close(self) -> None:
        await self.breakers.close()
        self.resources.close()
        for up in list(self.upstreams.values()):
            await self._close(up)
        self.upstreams.clear()
        for task in list(self._background):
            task.cancel()
        await self._audit.close()

    # ------------------------------------------------------------------ who may use what
    def allowed(self, principal: str, upstream: str, item: str | None = None) -> bool:
        """Whether ``principal`` may use ``item`` (a tool or prompt) of ``upstream``, or the whole
        upstream when ``item`` is None. Allow-lists and roles come from the static config, so a
        decision is kept (bounded: the cache starts over past ``ALLOW_CACHE_MAX`` entries)."""
        key = (principal, upstream, item)
        decision = self._decisions.get(key)
        if decision is None:
            if len(self._decisions) >= ALLOW_CACHE_MAX:
                self._decisions.clear()
            decision = self._decisions[key] = any(
                g in ("*", upstream) or (item is not None and g == f"{upstream}.{item}") for g in self._grants(principal))
        return decision

    def _grants(self, principal: str) -> list[str]:
        allow: ProxyAllow | None = self.config.allow
        if allow is None:
            return ["*"]
        role = self.gateway.config.limits.principal_roles.get(principal)
        return [*allow.principals.get(principal, ()), *(allow.roles.get(role, ()) if role else ())]

    def _usable(self, principal: str) -> list[Upstream]:
        """Enabled upstreams of which the principal may use something."""
        grants = self._grants(principal)
        return [u for u in self.upstreams.values() if u.cfg.enabled
                and any(g in ("*", u.name) or g.startswith(u.name + ".") for g in grants)]

    def may_see(self, principal: str, upstream: str, kind: str) -> bool:
        """Whether list ``kind`` (tools | resources | prompts) of ``upstream`` shows the principal
        anything, as :meth:`listing` filters it: who may not is not told the list changed."""
        up = self.upstreams.get(upstream)
        if up is None or not up.cfg.enabled:
            return False
        if kind == "resources":  # resources need the whole upstream
            return self.allowed(principal, upstream)
        return up in self._usable(principal)

    @property
    def per_principal_lists(self) -> bool:
        """Lists differ by principal when allow-lists exist (2026-07-28 ``cacheScope: private``)."""
        return self.config.allow is not None

    # ------------------------------------------------------------------ lists
    async def listing(self, call: Call, kind: str) -> list[dict[str, Any]]:
        """The entries of list ``kind`` the caller may see, over every usable upstream. An
        upstream that fails is left out (its error logged); it never holds the others up beyond
        its own timeout, and an open breaker skips it at once."""
        ups = self._usable(call.principal)
        catalogs = await asyncio.gather(*(self._catalog(call.principal, u) for u in ups))
        out: list[dict[str, Any]] = []
        for up, catalog in zip(ups, catalogs, strict=True):
            if catalog is None:
                continue
            entries = catalog.lists.get(kind, [])
            if self.config.allow is not None:
                if kind in ("tools", "prompts"):
                    lookup = catalog.tools if kind == "tools" else catalog.prompts
                    entries = [e for e in entries if self.allowed(call.principal, up.name, lookup.get(e["name"]))]
                elif not self.allowed(call.principal, up.name):  # resources need the whole upstream
                    continue
            out.extend(entries)
        return out

    async def _catalog(self, principal: str, up: Upstream) -> Catalog | None:
        fetched_at = up.catalog.fetched_at
        if fetched_at is not None and time.monotonic() - fetched_at < self.config.list_ttl_s:
            return up.catalog
        if up.refresh is None or up.refresh.done():
            up.refresh = asyncio.create_task(self._refresh(principal, up), name=f"proxy-lists-{up.name}")
            up.wait_until = asyncio.get_running_loop().time() + up.cfg.timeout_s
            up.waited_out = False
        if fetched_at is not None:
            return up.catalog  # stale but usable while the fresh one comes
        try:
            # However many pages it has, and however many listings come meanwhile: they all wait until
            # the same moment, so a slow upstream holds the others' entries back once per fetch.
            async with asyncio.timeout_at(up.wait_until):
                await asyncio.shield(up.refresh)
        except TimeoutError:
            if not up.waited_out:
                up.waited_out = True
                log.warning("proxy upstream %s: lists not fetched within %g s; listed once they are", up.name,
                            up.cfg.timeout_s)
            return None
        except Exception as exc:  # noqa: BLE001 - reported, the upstream is left out of this list
            log.warning("proxy upstream %s: lists unavailable (%s)", up.name, getattr(exc, "message", type(exc).__name__))
            return None
        return up.catalog

    async def _refresh(self, principal: str, up: Upstream) -> None:
        """Fetch the upstream's lists, within ``proxy.list_fetch_s`` in all: what came by then is
        listed, what did not is logged (an upstream answering each page just within its timeout_s
        would otherwise hold the fetch for pages x lists x timeout_s)."""
        catalog = Catalog()
        changes = up.changes
        own = self.gateway.registry
        fetched: dict[str, list[dict[str, Any]]] = {}
        try:
            async with asyncio.timeout(self.config.list_fetch_s):
                for kind, method in LISTS.items():
                    fetched[kind] = []
                    try:
                        await self._fetch_all(principal, up, method, kind, fetched[kind])
                    except McpError as exc:
                        if isinstance(exc, UpstreamFailed):
                            raise
                        if exc.code != METHOD_NOT_FOUND:
                            log.warning("proxy upstream %s: %s failed (%s)", up.name, method, exc.message)
                        fetched[kind] = []
        except TimeoutError:
            cut = list(fetched)[-1]
            unfetched = [LISTS[k] for k in LISTS if k not in fetched]
            log.warning("proxy upstream %s: lists not all fetched within proxy.list_fetch_s (%g s); %s is listed up "
                        "to its %d entries fetched by then%s", up.name, self.config.list_fetch_s, LISTS[cut],
                        len(fetched[cut]), f", {', '.join(unfetched)} not at all" if unfetched else "")
        for kind, raw in fetched.items():
            rewritten = (self._rewrite(up, kind, e, catalog, own.tools, own.prompts) for e in raw)
            catalog.lists[kind] = [e for e in rewritten if e]
        catalog.fetched_at = time.monotonic() if up.changes == changes else None
        up.catalog = catalog
        if up.waited_out:
            self._spawn(self._tell_listed(up))

    async def _tell_listed(self, up: Upstream) -> None:
        """Listings went without the upstream's entries, which have come: the replica's clients are
        told its lists changed, to list them again. Telling drops the replica's copy (as any change
        of the upstream does): the copy just fetched is kept, unless the upstream changed meanwhile."""
        catalog, fetched_at, changes = up.catalog, up.catalog.fetched_at, up.changes
        kinds = ("tools", "resources", "prompts")
        for kind in kinds:
            await self.gateway.list_changed_here(kind, up.name)
        if up.catalog is catalog and up.changes == changes + len(kinds):
            catalog.fetched_at = fetched_at

    async def _fetch_all(self, principal: str, up: Upstream, method: str, kind: str,
                         entries: list[dict[str, Any]]) -> None:
        """Every page of one list into ``entries``, up to MAX_LIST_PAGES pages and MAX_LIST_ENTRIES
        entries; a cursor the upstream already gave ends it too (it would only send the same pages again)."""
        params: dict[str, Any] = {}
        cursors: set[str] = set()
        for _ in range(MAX_LIST_PAGES):
            result = await up.client.request(principal, method, params)
            page = result.get(kind)
            if isinstance(page, list):
                entries.extend(e for e in page[:MAX_LIST_ENTRIES + 1 - len(entries)] if isinstance(e, dict))
            if len(entries) > MAX_LIST_ENTRIES:
                log.warning("proxy upstream %s: %s has over %d entries; the first %d are listed", up.name, method,
                            MAX_LIST_ENTRIES, MAX_LIST_ENTRIES)
                del entries[MAX_LIST_ENTRIES:]
                return
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str) or not cursor:
                return
            if cursor in cursors:
                log.warning("proxy upstream %s: %s named a page it already sent; the %d entries so far are listed",
                            up.name, method, len(entries))
                return
            cursors.add(cursor)
            params = {"cursor": cursor}
        log.warning("proxy upstream %s: %s has over %d pages; the entries of the first %d are listed", up.name,
                    method, MAX_LIST_PAGES, MAX_LIST_PAGES)

    def _rewrite(self, up: Upstream, kind: str, entry: dict[str, Any], catalog: Catalog,
                 own_tools: dict[str, Any], own_prompts: dict[str, Any]) -> dict[str, Any]:
        """The entry as clients see it ({} when it cannot be mounted: a name clash, a malformed entry)."""
        problem = entries.malformed(kind, entry)
        if problem is not None:
            name = entry.get("name")
            exposed = names.exposed(up.cfg.prefix, name) if kind == "tools" and isinstance(name, str) and name else None
            if exposed is not None and exposed not in catalog.tools:
                catalog.unlisted.add(exposed)
            log.error("proxy upstream %s: a %s entry %r is not listed (not the shape MCP gives it: %s)",
                      up.name, kind, entry.get("name"), problem)
            return {}
        out = dict(entry)
        if kind in ("tools", "prompts"):
            name = entry.get("name")
            exposed = names.exposed(up.cfg.prefix, name) if isinstance(name, str) and name else None
            taken = own_tools if kind == "tools" else own_prompts
            mounted = catalog.tools if kind == "tools" else catalog.prompts
            if exposed in mounted:
                return {}  # listed twice (on two pages): once is enough
            if exposed is None or len(exposed) > MAX_NAME_CHARS or exposed in taken \
                    or self._namespace_of_another(up, exposed):
                log.error("proxy upstream %s: %s %r is not mounted (no name, one over %d characters, or one the "
                          "gateway or another upstream's namespace holds)", up.name, kind[:-1],
                          _clipped(str(name)), MAX_NAME_CHARS)
                return {}
            mounted[exposed] = str(name)
            catalog.unlisted.discard(exposed)
            if kind == "tools" and isinstance(entry.get("inputSchema"), dict):
                spec = param_headers.spec(entry["inputSchema"])
                if spec:
                    catalog.param_specs[exposed] = spec
            execution = entry.get("execution") if kind == "tools" else None
            support = execution.get("taskSupport") if isinstance(execution, dict) else None
            if isinstance(support, str) and support in TASK_SUPPORT:  # "forbidden" and None: a plain call
                catalog.task_support[exposed] = support
            out["name"] = exposed
        elif kind == "resources" and isinstance(entry.get("uri"), str):
            out["uri"] = self.uri_for_client(up, entry["uri"])
        elif kind == "resourceTemplates" and isinstance(entry.get("uriTemplate"), str) and up.cfg.prefix:
            out["uriTemplate"] = names.wrap_template(up.name, entry["uriTemplate"])
        return out

    def list_changed(self, up: Upstream, kind: str) -> None:
        """The upstream's list changed (it said so during a call on this replica): every replica
        drops its copy and tells its clients that may see the upstream."""
        self.catalog_changed(up.name)
        self._announce((up.name, kind, True), lambda: self.gateway.notify_list_changed(None, kind, up.name))

    def _announce(self, key: tuple[str, str, bool], tell: Callable[[], Awaitable[None]]) -> None:
        """Pass an upstream's list change on to the clients at most once per LIST_CHANGED_GAP_S:
        the changes it announces meanwhile are told once, at the end of the gap (each one told
        writes to Redis and to every session that may see the list, and an upstream may send
        thousands)."""
        if key in self._held:
            return  # the announcement already waiting covers this change too
        now = asyncio.get_running_loop().time()
        wait_s = self._announced.get(key, -LIST_CHANGED_GAP_S) + LIST_CHANGED_GAP_S - now
        if wait_s <= 0:
            self._announced[key] = now
            self._spawn(tell())
            return
        self._held.add(key)

        async def later() -> None:
            await pause(wait_s)
            self._held.discard(key)
            self._announced[key] = asyncio.get_running_loop().time()
            await tell()

        self._spawn(later())

    def catalog_changed(self, upstream: str) -> None:
        """Drop the replica's copy of ``upstream``'s lists: the next listing fetches them again."""
        up = self.upstreams.get(upstream)
        if up is not None:
            up.changes += 1
            up.catalog.fetched_at = None

    # ------------------------------------------------------------------ routing
    def _resolve(self, name: str) -> tuple[Upstream, str] | None:
        """The upstream a tool or prompt name routes to, and its name there: the upstream whose
        namespace the name starts with, else the one mounted with the empty namespace."""
        namespace, dot, rest = name.partition(".")
        if dot and namespace:
            for up in self.upstreams.values():
                if up.cfg.prefix == namespace:
                    return up, rest
        bare = self._bare()
        return (bare, name) if bare is not None else None

    def _namespace_of_another(self, up: Upstream, name: str) -> bool:
        """Whether a name of the upstream mounted with the empty namespace lies in another
        upstream's namespace (calls of it go to that one, see :meth:`_resolve`)."""
        namespace, dot, _ = name.partition(".")
        return up.cfg.prefix == "" and bool(dot and namespace) and any(
            u.cfg.prefix == namespace for u in self.upstreams.values())

    def _target(self, call: Call, name: str, what: str, method: str) -> tuple[Upstream, str]:
        if len(name) > MAX_NAME_CHARS:
            raise InvalidParams(f"{what} not found: {_clipped(name)} (a name over {MAX_NAME_CHARS} characters)")
        found = self._resolve(name)
        if found is None or not found[0].cfg.enabled:
            raise InvalidParams(f"{what} not found: {name}")
        up, original = found
        if not self.allowed(call.principal, up.name, original):
            self._audit_refusal(call, up, method, original)
            raise Forbidden(f"principal {call.principal!r} may not use {what.lower()} {name} "
                            f"of upstream {up.name!r}", f"proxy:{up.name}.{original}")
        return up, original

    def _audit_refusal(self, call: Call, up: Upstream, method: str, item: str) -> None:
        """A call refused to the principal is audited like one forwarded (outcome ``forbidden``);
        it reached no upstream, so it counts in none of the upstream's figures."""
        self._audit.add(record(principal=call.principal, action="proxy.call", upstream=up.name, method=method,
                               item=_clipped(item), outcome="forbidden"))

    def param_spec(self, name: str) -> param_headers.Spec:
        """The ``Mcp-Param-*`` headers of the upstream tool clients call ``name`` (none: not known,
        or it declares none)."""
        for up in self.upstreams.values():
            spec = up.catalog.param_specs.get(name)
            if spec is not None:
                return spec
        return ()

    def _bare(self) -> Upstream | None:
        """The upstream mounted with the empty namespace (at most one)."""
        return next((u for u in self.upstreams.values() if u.cfg.prefix == ""), None)

    @property
    def transparent(self) -> bool:
        """Whether an upstream is mounted with the empty namespace (its lists then come first)."""
        return self._bare() is not None

    def owns_uri(self, uri: str) -> bool:
        """Whether ``uri`` (not the gateway's own) names an upstream's resource."""
        found = names.unwrap_uri(uri)
        return (found is not None and found[0] in self.upstreams) or self._bare() is not None

    def resource_target(self, call: Call, uri: str, method: str | None) -> tuple[Upstream, str]:
        """The upstream serving ``uri`` (as clients see it) and the URI it knows; the caller
        must be allowed the upstream (a refusal is audited as one of ``method``, unless None)."""
        found = names.unwrap_uri(uri)
        up = self.upstreams.get(found[0]) if found is not None else self._bare()
        if up is None or not up.cfg.enabled:
            raise InvalidParams(f"Resource not found: {uri}", {"uri": uri})
        if not self.allowed(call.principal, up.name):
            if method is not None:
                self._audit_refusal(call, up, method, found[1] if found is not None else uri)
            raise Forbidden(f"principal {call.principal!r} may not use upstream {up.name!r}", f"proxy:{up.name}")
        return up, found[1] if found is not None else uri

    async def call_tool(self, call: Call, name: str, params: dict[str, Any]) -> dict[str, Any]:
        up, tool = self._target(call, name, "Tool", "tools/call")
        if not up.catalog.lists:
            # Which tools exist and the headers each takes are in the upstream's lists: a replica that
            # has not listed them yet does so first (once, as a listing does, within its timeout_s),
            # since a client may call a tool it learnt elsewhere first thing.
            await self._catalog(call.principal, up)
        if name in up.catalog.unlisted:
            raise InvalidParams(f"Tool not found: {name}")
        args = params.get("arguments")
        args = args if isinstance(args, dict) else {}
        spec = up.catalog.param_specs.get(name)
        headers = _param_headers(spec, args) if spec is not None else None
        support = self._hosted_task_support(up, name)
        if support is None:
            return await self._call_tool(call, up, tool, name, args, headers)
        return await self.gateway.tasks.run(call, name, support,
                                            lambda c: self._call_tool(c, up, tool, name, args, headers))

    def _hosted_task_support(self, up: Upstream, name: str) -> str | None:
        """A 2025-11-25 upstream has no tasks (SEP-2663 is of 2026-07-28): a tool it declares
        task-capable (``execution.taskSupport``) runs as the gateway's own task. A 2026-07-28
        upstream's tasks are its own and pass through (see :meth:`task_request`). What the upstream
        declares is in its lists (fetched by :meth:`call_tool` first)."""
        if up.client.revision != LEGACY_VERSION:
            return None
        return up.catalog.task_support.get(name)

    async def _call_tool(self, call: Call, up: Upstream, tool: str, name: str, args: dict[str, Any],
                         headers: dict[str, str] | None) -> dict[str, Any]:
        """Forward one ``tools/call``. A call hosted as a task becomes one before the upstream is
        asked (what the upstream asks then parks the task as ``input_required``; tasks/cancel
        cancels the upstream request) and may take as long as the task lives."""
        timeout_s = None
        if isinstance(call, TaskCall):
            await call.escalate()
            timeout_s = call.manager.ttl_ms / 1000
        result = await self._observed(call, up, "tools/call", tool, {"name": tool, "arguments": args}, headers,
                                      timeout_s)
        if up.cfg.captures(tool):
            await capture(self.gateway.store, call, up.name, name, args, result,
                          max_image_pixels=self.gateway.config.model.max_image_pixels)
        return result

    async def get_prompt(self, call: Call, name: str, params: dict[str, Any]) -> dict[str, Any]:
        up, prompt = self._target(call, name, "Prompt", "prompts/get")
        forwarded = {"name": prompt, "arguments": params.get("arguments") or {}}
        return await self._observed(call, up, "prompts/get", prompt, forwarded)

    async def read_resource(self, call: Call, uri: str) -> dict[str, Any]:
        up, original = self.resource_target(call, uri, "resources/read")
        try:
            result = await self._observed(call, up, "resources/read", original, {"uri": original})
        except McpError as exc:
            raise _resource_error(call, exc, uri, original) from None
        for item in result.get("contents") or ():
            if isinstance(item, dict) and isinstance(item.get("uri"), str):
                item["uri"] = self.uri_for_client(up, item["uri"])
        return result

    async def complete(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        """completion/complete for an upstream's prompt or resource template."""
        ref = dict(params["ref"])
        if ref.get("type") == "ref/prompt":
            up, ref["name"] = self._target(call, str(ref.get("name")), "Prompt", "completion/complete")
        else:
            up, ref["uri"] = self.resource_target(call, str(ref.get("uri")), "completion/complete")
        forwarded = {k: v for k, v in params.items() if k not in ("_meta", "ref")}
        return await self._observed(call, up, "completion/complete", str(ref.get("name") or ref.get("uri")),
                                    {**forwarded, "ref": ref})

    async def _observed(self, call: Call, up: Upstream, method: str, item: str, params: dict[str, Any],
                        headers: dict[str, str] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """Forward with metrics, breaker gauge and one audit record, whatever the outcome."""
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            result = await self._forward(call, up, method, params, headers, timeout_s)
            if result.get("isError") is True:
                outcome = "tool_error"
            return result
        except InputRequired:
            outcome = "input_required"
            raise
        except UpstreamFailed as exc:
            outcome = exc.reason
            raise
        except StdioCapReached:
            outcome = "busy"
            raise
        except McpError:
            outcome = "rpc_error"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._record(call.principal, up, method, item, outcome, time.perf_counter() - t0)

    def _record(self, principal: str, up: Upstream, method: str, item: str, outcome: str, latency_s: float) -> None:
        up.calls += 1
        up.errors += outcome not in ("ok", "tool_error", "input_required")
        counter = self._counters.get((up.name, method, outcome))
        if counter is None:  # label sets are bounded: upstreams x methods x outcomes
            counter = self._counters[(up.name, method, outcome)] = metrics.PROXY_CALLS.labels(up.name, method, outcome)
        counter.inc()
        up.latency.observe(latency_s)
        state = up.client.breaker.state
        if state != up.breaker_state:  # the gauge's lock is taken when the state moves, not per call
            up.breaker_state = state
            up.breaker_gauge.set(STATE_VALUE[state])
        entry = record(principal=principal, action="proxy.call", upstream=up.name, method=method, item=_clipped(item),
                       outcome=outcome, latency_ms=f"{latency_s * 1000:.2f}")
        self._audit.add(entry)  # written with the other calls' records of the next few ms

    def _spawn(self, coro: Any) -> None:
        spawn(coro, self._background, "a proxy background write")

    async def _forward(self, call: Call, up: Upstream, method: str, params: dict[str, Any],
                       headers: dict[str, str] | None, timeout_s: float | None = None) -> dict[str, Any]:
        params["_meta"] = upstream_meta(call)
        side = CallHooks(self, call, up)
        for _ in range(MAX_INPUT_ROUNDS):
            try:
                result = await up.client.request(call.principal, method, params, side.hooks, headers,
                                                 forwardable_capabilities(call), timeout_s)
            except McpError:
                if side.stopped is None:
                    raise
            if side.stopped is not None:  # whatever the upstream made of the request the client cannot answer
                raise side.stopped
            kind = result.get("resultType")
            if kind == "task" or method.startswith("tasks/"):  # the tasks extension's results pass whole
                await self._remember_task(call, up, result)
                return result
            if kind != "input_required":
                return _for_client(result)
            params = {**params, "inputResponses": await side.answers(result.get("inputRequests")),
                      "requestState": result.get("requestState")}
            if params["requestState"] is None:
                del params["requestState"]
        raise McpError(INTERNAL_ERROR, f"upstream {up.name!r} kept asking for input")

    @staticmethod
    def uri_for_client(up: Upstream, uri: str) -> str:
        return names.wrap_uri(up.name, uri) if up.cfg.prefix else uri

    # ------------------------------------------------------------------ tasks extension
    async def _remember_task(self, call: Call, up: Upstream, result: dict[str, Any]) -> None:
        """Which upstream answers for the task. A task id is the upstream's own: one the principal
        already holds a task of another upstream under, or a task of the gateway's own (one it
        hosts, which the client may have named to the upstream in its ``_meta``), fails the call,
        so that no upstream is sent another's tasks/get, update or cancel, nor answers them for
        the gateway's."""
        task_id = result.get("taskId")
        if result.get("resultType") != "task" or not isinstance(task_id, str):
            return
        ttl_ms = result.get("ttlMs")
        ttl_s = int(ttl_ms) // 1000 + TASK_KEY_SLACK_S if isinstance(ttl_ms, int) and ttl_ms > 0 else TASK_KEY_TTL_S
        ttl_s = min(ttl_s, TASK_KEY_MAX_S)
        key, redis = keys.proxy_task(call.principal, task_id), self.gateway.redis
        if await redis.exists(keys.task(call.principal, task_id)):
            raise UpstreamFailed(up.name, "protocol", f"upstream {up.name!r} named a task {_clipped(task_id)!r}, the "
                                 "id of a task of the gateway's own this principal holds")
        if await redis.set(key, up.name, ex=ttl_s, nx=True):
            return
        owner = await redis.get(key)
        if owner is not None and as_str(owner) != up.name:
            raise UpstreamFailed(up.name, "protocol", f"upstream {up.name!r} named a task {task_id!r}, the id of a "
                                 "task of another upstream this principal holds")
        await redis.set(key, up.name, ex=ttl_s)

    async def task_request(self, call: Call, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """tasks/get|update|cancel of a task an upstream created, answered by that upstream;
        None for a task that is not an upstream's."""
        task_id = params.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            return None
        name = await self.gateway.redis.get(keys.proxy_task(call.principal, task_id))
        up = self.upstreams.get(as_str(name)) if name else None
        if up is None:
            return None
        forwarded = {k: v for k, v in params.items() if k != "_meta"}
        return await self._observed(call, up, method, task_id, forwarded)

    # ------------------------------------------------------------------ admin reads
    def health(self, name: str) -> dict[str, Any]:
        """The upstream on this replica (the mesh's breakers: ``self.breakers``)."""
        up = self.upstreams[name]
        breaker = up.client.breaker
        return {"name": name, "enabled": up.cfg.enabled, "revision": up.client.revision or "unknown",
                "breaker": breaker.state, "consecutive_failures": breaker.failures,
                "lists_age_s": None if up.catalog.fetched_at is None else round(time.monotonic() - up.catalog.fetched_at, 1),
                "tools": len(up.catalog.tools), "transport": "http" if up.cfg.url else "stdio",
                "calls": up.calls, "errors": up.errors,
                **({"processes": up.client.stdio.running} if up.client.stdio is not None else {})}


def _param_headers(spec: param_headers.Spec, args: dict[str, Any]) -> dict[str, str] | None:
    """SEP-2243: the ``Mcp-Param-*`` headers a 2026-07-28 upstream expects for these arguments."""
    return {header: header_value(value) for header, value in param_headers.values(spec, args).items()} or None


def _clipped(item: str) -> str:
    """``item`` as an audit record or a message keeps it: at most MAX_NAME_CHARS characters."""
    return item if len(item) <= MAX_NAME_CHARS else item[:MAX_NAME_CHARS] + "…"


def _for_client(result: dict[str, Any]) -> dict[str, Any]:
    """The upstream's result without what belongs to its own revision (the dispatcher adds the
    client revision's fields)."""
    for key in ("resultType", "ttlMs", "cacheScope"):
        result.pop(key, None)
    return result


def _resource_error(call: Call, exc: McpError, uri: str, original: str) -> McpError:
    """An upstream's "no such resource" as the client's revision says it — -32002 on 2025-11-25,
    -32602 on 2026-07-28 (SEP-2164), recognised there by its ``data.uri`` — naming the URI the
    client asked for, not the upstream's own; any other error as it came."""
    data = exc.data if isinstance(exc.data, dict) else {}
    if not (exc.code == RESOURCE_NOT_FOUND or (exc.code == INVALID_PARAMS and data.get("uri") == original)):
        return exc
    message, data = exc.message.replace(original, uri), {**data, "uri": uri}
    return InvalidParams(message, data) if call.modern else NotFound(message, data)
