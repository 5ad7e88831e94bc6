"""Property-based proof of the eviction rules: a hypothesis state machine drives the real
store (real Redis) and a plain-Python reference model side by side, and after every step
the set of contexts, their LRU order, byte totals and the LRU order over principals must
agree. Rules modelled: exact LRU over a principal's contexts under its byte budget (the
context just written goes last; alone over budget it drops its oldest entries, never the
newest), LRU over principals under the global budget (never the caller) — a use stamps its
principal only if its last stamp is global_lru_resolution_ms old (run with 0: every use, and
1000) —, reads and writes count as use, failed operations do not; and the idle TTL on a fake clock: a context unused for
idle_ttl is gone at the next operation of its principal (whatever it is, even a failing
one), and until then it still counts."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from shared.config import ContextConfig
from shared.context import ContextNotFound, ContextStore, pack_entry

PRINCIPALS = ["p1", "p2", "p3"]
CONTEXTS = ["c1", "c2", "c3", "c4"]
SIZES = [10, 60, 150]


def packed(n: int) -> int:
    return len(pack_entry("user", b"x" * n, tokens=n, ts_ms=0))


P_BUDGET = packed(150) * 3
G_BUDGET = packed(150) * 5
IDLE_MS = 100_000


def config(global_res_ms: int) -> ContextConfig:
    return ContextConfig(max_entry_bytes=150, channel_max_bytes=10_000, channel_max_entries=1000,
                         principal_budget_bytes=P_BUDGET, global_budget_bytes=G_BUDGET, versions_retained=1,
                         idle_ttl_s=IDLE_MS // 1000, global_lru_resolution_ms=global_res_ms)


class Model:
    """Reference: principal -> OrderedDict(context -> [entry sizes]) in LRU order (oldest first)."""

    def __init__(self, global_res_ms: int) -> None:
        self.ctx: dict[str, OrderedDict[str, list[int]]] = {p: OrderedDict() for p in PRINCIPALS}
        self.principal_lru: OrderedDict[str, None] = OrderedDict()
        self.now = 1_000_000_000
        self.used: dict[tuple[str, str], int] = {}  # last use (ms) of each context
        self.global_res = global_res_ms
        self.stamped: dict[str, int] = {}  # when each principal last moved in principal_lru

    def expire(self, p: str) -> None:
        """What every operation of `p` does first: drop its contexts idle for IDLE_MS."""
        for c in [c for c in self.ctx[p] if self.now - self.used[(p, c)] >= IDLE_MS]:
            del self.ctx[p][c]

    def total(self, p: str) -> int:
        return sum(sum(e) for e in self.ctx[p].values())

    def touch(self, p: str, c: str) -> None:
        self.ctx[p].move_to_end(c)
        self.used[(p, c)] = self.now
        if p not in self.stamped or self.now - self.stamped[p] >= self.global_res:
            self.principal_lru.pop(p, None)
            self.principal_lru[p] = None
            self.stamped[p] = self.now

    def enforce(self, p: str, keep: str) -> None:
        ctxs = self.ctx[p]
        while self.total(p) > P_BUDGET and any(c != keep for c in ctxs):
            victim = next(c for c in ctxs if c != keep)
            del ctxs[victim]
        while self.total(p) > P_BUDGET and len(ctxs[keep]) > 1:
            ctxs[keep].pop(0)
        grand = sum(self.total(q) for q in PRINCIPALS)
        for q in list(self.principal_lru):
            if grand <= G_BUDGET:
                break
            if q == p:
                continue
            grand -= self.total(q)
            self.ctx[q].clear()
            del self.principal_lru[q]
            del self.stamped[q]  # its state went with it: its next use stamps it again


class StoreMachine(RuleBasedStateMachine):
    url = ""
    global_res_ms = 0

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.r = aioredis.Redis.from_url(self.url)
        self.run(self.r.flushdb())
        self.model = Model(self.global_res_ms)
        self.store = ContextStore(self.r, config(self.global_res_ms), clock_ms=lambda: self.model.now)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.r.aclose())
        self.loop.close()

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS), n=st.sampled_from(SIZES))
    def append(self, p, c, n):
        self.model.expire(p)
        self.run(self.store.append(p, c, "text", "user", b"x" * n))
        self.model.ctx[p].setdefault(c, []).append(packed(n))
        self.model.touch(p, c)
        self.model.enforce(p, c)

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS))
    def read(self, p, c):
        self.model.expire(p)
        exists = c in self.model.ctx[p]
        try:
            win = self.run(self.store.get_window(p, c))
        except ContextNotFound:
            assert not exists
            return
        assert exists
        assert [packed(e.size_bytes) for e in win.channels.get("text", [])] == self.model.ctx[p][c]
        self.model.touch(p, c)

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS))
    def clear(self, p, c):
        self.model.expire(p)
        try:
            self.run(self.store.clear(p, c))
        except ContextNotFound:
            assert c not in self.model.ctx[p]
            return
        self.model.ctx[p][c] = []
        self.model.touch(p, c)

    @rule(p=st.sampled_from(PRINCIPALS), src=st.sampled_from(CONTEXTS), dst=st.sampled_from(CONTEXTS))
    def fork(self, p, src, dst):
        if src != dst:  # (the store refuses src == dst before calling Redis)
            self.model.expire(p)
        ctxs = self.model.ctx[p]
        ok = src in ctxs and dst not in ctxs and src != dst
        try:
            self.run(self.store.fork(p, src, dst))
        except ValueError:
            assert not ok
            return
        assert ok
        ctxs[dst] = list(ctxs[src])
        self.model.touch(p, src)
        self.model.touch(p, dst)
        self.model.enforce(p, dst)

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS))
    def evict(self, p, c):
        self.model.expire(p)
        assert self.run(self.store.evict(p, c)) == (c in self.model.ctx[p])
        self.model.ctx[p].pop(c, None)

    @rule(ms=st.sampled_from([0, 1, 999, 40_000, IDLE_MS - 1, IDLE_MS, 3 * IDLE_MS]))
    def time_passes(self, ms):
        self.model.now += ms

    @invariant()
    def agrees_with_model(self):
        for p in PRINCIPALS:
            lru = self.run(self.store.lru_order(p))
            assert lru == list(self.model.ctx[p]), (p, lru, self.model.ctx[p])
            assert self.run(self.store.principal_bytes(p)) == self.model.total(p)
        assert self.run(self.store.global_bytes()) == sum(self.model.total(q) for q in PRINCIPALS)
        assert list(reversed(self.run(self.store.principals()))) == list(self.model.principal_lru)
        for p in PRINCIPALS:
            assert self.model.total(p) <= P_BUDGET
        assert sum(self.model.total(q) for q in PRINCIPALS) <= G_BUDGET


@pytest.mark.timeout(600)  # room for hypothesis's own 5-minute shrink limit, so a failure prints its steps
@pytest.mark.parametrize("global_res_ms", [0, 1000])
def test_lru_semantics_match_reference_model(redis_url, global_res_ms):
    StoreMachine.url, StoreMachine.global_res_ms = redis_url, global_res_ms
    run_state_machine_as_test(StoreMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
