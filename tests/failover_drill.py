"""The failover drill of a real Redis Cluster (3 masters + 3 replicas): a master is killed with
SIGKILL while a real gateway serves context appends and legacy-session requests.

What must hold: the cluster fails over by itself (its replica takes the slots), the gateway keeps
serving without a restart, no append it acknowledged is lost, and while the slots have no master
clients see 503 with a Retry-After, never a redirect (MOVED/ASK), a TLS error or a 500. The gateway
runs with ``redis.wait_replicas: 1``: every context append is acknowledged only once a replica holds
it, so the promoted master (which has no replica) refuses its principals' appends with 503 until the
killed node is back, as its replica. Run on a plain cluster (tests/test_redis_cluster_failover.py),
on one with TLS and ACL users (tests/security/test_redis_cluster_tls.py), and in the long drills
(``bench/drills.py --cluster``), so nothing here imports pytest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from shared import keys
from shared.net import free_port
from shared.redis_local_cluster import LocalCluster, Node
from tests.gateway_support import start_gateway, stop
from tests.waiting import wait_for

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
ACCEPT = "application/json, text/event-stream"
PRINCIPALS = [f"p{i}" for i in range(6)]
KEYS = {p: f"{p}-key-0123456789" for p in PRINCIPALS}
AFTER_FAILOVER = 5  # acknowledged appends each principal must get once the replica took over


@dataclasses.dataclass
class Tally:
    """What the clients saw, per principal: acknowledged texts, and every other answer."""

    acked: dict[str, list[str]] = dataclasses.field(default_factory=lambda: {p: [] for p in PRINCIPALS})
    acked_after_kill: dict[str, int] = dataclasses.field(default_factory=lambda: {p: 0 for p in PRINCIPALS})
    acked_sent_at: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {p: [] for p in PRINCIPALS})
    unavailable: int = 0  # 503 with Retry-After
    session_ok_after_kill: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)  # anything else: must stay empty
    killed_at: float | None = None
    answers: int = 0  # every answer the clients got (appends and session calls)


@dataclasses.dataclass
class FailoverReport:
    """What a drill that held saw: answers, of which ``unavailable`` were 503 (with Retry-After)
    while the killed master's slots had no master or its successor no replica; ``acked``
    appends, all still stored; seconds from the kill until the cluster was ok again."""

    answers: int
    unavailable: int
    acked: int
    failed_over_s: float

    def line(self) -> str:
        return (f"failover drill: cluster ok again {self.failed_over_s:.1f}s after the kill; {self.unavailable} "
                f"answer(s) 503 meanwhile; {self.acked} appends acknowledged, 0 lost")


def _headers(principal: str, method: str, name: str | None = None) -> dict[str, str]:
    h = {"accept": ACCEPT, "mcp-protocol-version": MODERN, "mcp-method": method,
         "authorization": f"Bearer {KEYS[principal]}"}
    if name:
        h["mcp-name"] = name
    return h


def _body(resp: httpx.Response) -> dict[str, Any]:
    text = resp.text.strip()
    if text.startswith("{"):
        return orjson.loads(text)
    msgs = [orjson.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
    return [m for m in msgs if "id" in m][-1]


async def _tool(client: httpx.AsyncClient, principal: str, name: str, args: dict[str, Any]) -> httpx.Response:
    params = {"name": name, "arguments": args, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                                         "io.modelcontextprotocol/clientCapabilities": {}}}
    return await client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params},
                             headers=_headers(principal, "tools/call", name))


def _judge(tally: Tally, resp: httpx.Response, what: str) -> dict[str, Any] | None:
    """The JSON-RPC result of a 200 answer; a 503 is counted (it must carry Retry-After);
    anything else is recorded as wrong."""
    tally.answers += 1
    if "MOVED" in resp.text or "ASK " in resp.text:
        tally.wrong.append(f"{what}: a redirect reached the client: {resp.text[:200]}")
        return None
    if any(word in resp.text for word in ("SSL", "TLS", "certificate")):
        tally.wrong.append(f"{what}: a TLS error reached the client: {resp.text[:200]}")
        return None
    if resp.status_code == 503:
        if not resp.headers.get("retry-after"):
            tally.wrong.append(f"{what}: 503 without Retry-After")
        tally.unavailable += 1
        return None
    if resp.status_code != 200:
        tally.wrong.append(f"{what}: HTTP {resp.status_code}: {resp.text[:200]}")
        return None
    body = _body(resp)
    if "error" in body:
        if body["error"].get("code") != -32050:  # SERVICE_UNAVAILABLE over a 200 (legacy SSE answers)
            tally.wrong.append(f"{what}: {body['error']}")
        else:
            tally.unavailable += 1
        return None
    if body["result"].get("isError"):
        tally.wrong.append(f"{what}: tool error {body['result']}")
        return None
    return body["result"]


async def _appender(client: httpx.AsyncClient, principal: str, tally: Tally, stop_at: asyncio.Event) -> None:
    i = 0
    while not stop_at.is_set():
        text = f"{principal}-{i}"
        i += 1
        sent = time.monotonic()
        try:
            resp = await _tool(client, principal, "context_append",
                               {"context_id": "drill", "modality": "text", "text": text})
        except httpx.HTTPError as exc:
            tally.wrong.append(f"append {text}: {type(exc).__name__}")
            continue
        if _judge(tally, resp, f"append {text}") is not None:
            tally.acked[principal].append(text)
            tally.acked_sent_at[principal].append(sent)
            if tally.killed_at is not None:
                tally.acked_after_kill[principal] += 1
        elif resp.status_code == 503:
            await asyncio.sleep(0.05)


async def _legacy_session(client: httpx.AsyncClient, principal: str) -> str:
    resp = await client.post("/mcp", json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "drill", "version": "1"}}},
        headers={"accept": ACCEPT, "authorization": f"Bearer {KEYS[principal]}"})
    assert resp.status_code == 200, resp.text
    return resp.headers["mcp-session-id"]


async def _session_user(client: httpx.AsyncClient, principal: str, sid: str, tally: Tally,
                        stop_at: asyncio.Event) -> None:
    """A legacy session in use across the failover: its state lives in its principal's slot."""
    headers = {"accept": ACCEPT, "authorization": f"Bearer {KEYS[principal]}", "mcp-session-id": sid,
               "mcp-protocol-version": LEGACY}
    while not stop_at.is_set():
        try:
            resp = await client.post("/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                     headers=headers)
        except httpx.HTTPError as exc:
            tally.wrong.append(f"session {principal}: {type(exc).__name__}")
            continue
        if _judge(tally, resp, f"session {principal} tools/list") is not None and tally.killed_at is not None:
            tally.session_ok_after_kill += 1
        await asyncio.sleep(0.02)


def _master_of(cluster: LocalCluster, key: str) -> Node:
    """The node that serves ``key``'s slot now."""
    seed = cluster.running()[0]
    with seed.client(socket_timeout=2) as c:
        slot = c.cluster("keyslot", key)
        for start, end, master, *_ in c.cluster("slots"):
            if start <= slot <= end:
                port = int(master[1])
                return next(n for n in cluster.nodes if n.port == port)
    raise AssertionError(f"no master serves slot {slot}")


def _stored_texts(principal: str, port: int) -> set[str]:
    resp = httpx.post(f"http://127.0.0.1:{port}/mcp", json={
        "jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "context_get", "arguments": {"context_id": "drill", "last_n": 100_000},
            "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                      "io.modelcontextprotocol/clientCapabilities": {}}}},
        headers=_headers(principal, "tools/call", "context_get"), timeout=10)
    assert resp.status_code == 200, resp.text
    return {e["text"] for e in _body(resp)["result"]["structuredContent"]["entries"]}


async def failover_drill(cluster: LocalCluster, redis_url: str, tmp_path: Path,
                         redis_settings: dict[str, Any] | None = None) -> FailoverReport:
    """Kill -9 the master of a principal's slot under load, check what must hold (see the module's
    docstring; AssertionError where it does not) and report what the clients saw.
    ``redis_settings``: more ``redis.*`` of the gateway (TLS files, a longer socket timeout), on
    top of the drill's own."""
    port = free_port()
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as out:
        gw = start_gateway(port, redis_url, api_keys=",".join(f"{p}:{k}" for p, k in KEYS.items()),
                           overrides={"redis": {"wait_replicas": 1, "wait_timeout_ms": 1000, "retry_after_s": 1,
                                                "socket_timeout_s": 1.0, **(redis_settings or {})},
                                      # principals on the surviving masters append all along: keep every entry
                                      "context": {"channel_max_entries": 1_000_000}},
                           output=out)
        tally, stop_at = Tally(), asyncio.Event()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                sessions = {p: await _legacy_session(client, p) for p in PRINCIPALS[:3]}
                victim = _master_of(cluster, keys.ctx_meta(PRINCIPALS[0]))
                doomed = [p for p in PRINCIPALS if _master_of(cluster, keys.ctx_meta(p)) is victim]
                load = [asyncio.create_task(_appender(client, p, tally, stop_at)) for p in PRINCIPALS]
                load += [asyncio.create_task(_session_user(client, p, sid, tally, stop_at))
                         for p, sid in sessions.items()]
                await wait_for(lambda: all(len(v) >= 5 for v in tally.acked.values()), timeout_s=60,
                               what="appends before the kill")
                tally.killed_at = time.monotonic()
                cluster.kill(victim)
                await asyncio.to_thread(cluster.wait_ok, 60)  # the replica was promoted by the cluster itself
                failed_over_s = time.monotonic() - tally.killed_at
                # The promoted master has no replica: its principals' writes are refused (503), not
                # acknowledged, until the killed node is back — as a replica of the new master.
                refused, since = tally.unavailable, time.monotonic()
                await wait_for(lambda: tally.unavailable >= refused + 3, timeout_s=30,
                               what="writes refused while the new master has no replica")
                # none sent since then was acknowledged (one sent before the kill may be answered late)
                assert {p: [t for t in tally.acked_sent_at[p] if t >= since] for p in doomed} == {p: [] for p in doomed}
                cluster.restart(victim)
                await asyncio.to_thread(cluster.wait_ok, 60)
                await wait_for(lambda: all(n >= AFTER_FAILOVER for n in tally.acked_after_kill.values()),
                               timeout_s=60, what=lambda: f"appends after the failover: {tally.acked_after_kill}, "
                                                          f"wrong: {tally.wrong[:3]}")
                await wait_for(lambda: tally.session_ok_after_kill >= 3, timeout_s=30,
                               what="legacy sessions served after the failover")
                stop_at.set()
                await asyncio.gather(*load)
            assert gw.poll() is None, "the gateway must keep running"
            lost = {p: sorted(set(tally.acked[p]) - _stored_texts(p, port)) for p in PRINCIPALS}
        finally:
            stop_at.set()
            stop(gw)
    gateway_log = log_path.read_text(errors="replace")
    assert doomed, "the killed master served at least one principal under load"
    assert tally.wrong == [], (tally.wrong[:10], gateway_log[-6000:])
    assert all(not v for v in lost.values()), f"acknowledged appends lost: {lost}"
    assert victim in cluster.running() and victim.port not in {n.port for n in cluster.primaries()}
    assert "Traceback" not in gateway_log, gateway_log[-3000:]
    return FailoverReport(tally.answers, tally.unavailable, sum(map(len, tally.acked.values())), failed_over_s)
