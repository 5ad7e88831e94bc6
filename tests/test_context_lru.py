"""Property-based proof of the eviction rules: a hypothesis state machine drives the real
store (real Redis: a single server, and a cluster whose principals sit on different masters
and global shards) and a plain-Python reference model side by side, and after every step the
set of contexts, their LRU order, byte totals and the LRU order over principals must agree.
Rules modelled: exact LRU over a principal's contexts under its byte budget (the context
just written goes last; alone over budget it drops its oldest entries, never the newest),
per slot; the global budget as the evictor enforces it — a sweep evicts the least recently
stamped principals whole until their reports cover the excess, clearing their reports (on a
cluster, reads and failed calls that expire idle contexts report nothing, so a report can run
high until then; on one server the script reports every call's change: reports are exact) —
where every call stamps its principal if its last stamp is global_lru_resolution_ms old (run
with 0: every use, and 1000), failed calls included; reads and writes count as use of a context, failed
operations do not; and the idle TTL on a fake clock: a context unused for idle_ttl is gone
at the next operation of its principal (whatever it is, even a failing one), and until
then it still counts."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from redis.asyncio import RedisCluster

from shared.config import ContextConfig
from shared.context import ContextNotFound, ContextStore, pack_entry
from tests.conftest import RedisTarget

PRINCIPALS = ["p1", "p2", "p3"]  # three masters of the test cluster, three global shards
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

    def __init__(self, global_res_ms: int, exact_reports: bool) -> None:
        self.ctx: dict[str, OrderedDict[str, list[int]]] = {p: OrderedDict() for p in PRINCIPALS}
        self.now = 1_000_000_000
        self.used: dict[tuple[str, str], int] = {}  # last use (ms) of each context
        self.global_res = global_res_ms
        self.stamped: dict[str, int] = {}  # principal -> its stamp in the global LRU (absent: not in it)
        self.reported = dict.fromkeys(PRINCIPALS, 0)  # bytes as the global accounting has them
        self.exact_reports = exact_reports  # one server: every call reports (see module docstring)

    def principal_lru(self) -> list[str]:
        """The global LRU, oldest first (stamp, then name: the evictor's order)."""
        return sorted(self.stamped, key=lambda q: (self.stamped[q], q))

    def stamp(self, p: str) -> None:
        """Every script call of `p` (failed ones too) stamps it, at most once per resolution."""
        if p not in self.stamped or self.now - self.stamped[p] >= self.global_res:
            self.stamped[p] = self.now

    def report(self, p: str, before: int) -> None:
        """A call that reports its byte change (all but reads and failed calls on a cluster)."""
        self.reported[p] += self.total(p) - before

    def report_if_exact(self, p: str, before: int) -> None:
        """A read or a failed call: it reports only where reports are exact."""
        if self.exact_reports:
            self.report(p, before)

    def sweep(self) -> list[str]:
        """What one evictor sweep does (shared/context/budget.py): the least recently stamped
        principals whose reports cover the excess are evicted whole, their reports cleared."""
        total, out = sum(self.reported.values()), []
        while total > G_BUDGET and self.stamped:
            excess, chosen = total - G_BUDGET, []
            for q in self.principal_lru():
                if excess <= 0:
                    break
                chosen.append(q)
                excess -= self.reported[q]
            for q in chosen:
                total -= self.reported[q]
                if self.ctx[q]:
                    out.append(q)
                self.ctx[q].clear()
                self.reported[q] = 0
                del self.stamped[q]  # its next use stamps it again
        return out

    def expire(self, p: str) -> None:
        """What every operation of `p` does first: drop its contexts idle for IDLE_MS."""
        for c in [c for c in self.ctx[p] if self.now - self.used[(p, c)] >= IDLE_MS]:
            del self.ctx[p][c]

    def total(self, p: str) -> int:
        return sum(sum(e) for e in self.ctx[p].values())

    def touch(self, p: str, c: str) -> None:
        self.ctx[p].move_to_end(c)
        self.used[(p, c)] = self.now

    def enforce(self, p: str, keep: str) -> None:
        ctxs = self.ctx[p]
        while self.total(p) > P_BUDGET and any(c != keep for c in ctxs):
            victim = next(c for c in ctxs if c != keep)
            del ctxs[victim]
        while self.total(p) > P_BUDGET and len(ctxs[keep]) > 1:
            ctxs[keep].pop(0)


class StoreMachine(RuleBasedStateMachine):
    target: RedisTarget | None = None
    global_res_ms = 0

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        assert self.target is not None
        self.target.flush()
        self.r = self.target.async_client()
        self.model = Model(self.global_res_ms, exact_reports=not isinstance(self.r, RedisCluster))
        self.store = ContextStore(self.r, config(self.global_res_ms), clock_ms=lambda: self.model.now)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.aclose())  # its batches first, or a re-read of the slot map outlives the client
        self.run(self.r.aclose())
        self.loop.close()

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS), n=st.sampled_from(SIZES))
    def append(self, p, c, n):
        before = self.model.total(p)
        self.model.stamp(p)
        self.model.expire(p)
        self.run(self.store.append(p, c, "text", "user", b"x" * n))
        self.model.ctx[p].setdefault(c, []).append(packed(n))
        self.model.touch(p, c)
        self.model.enforce(p, c)
        self.model.report(p, before)

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS))
    def read(self, p, c):
        before = self.model.total(p)
        self.model.stamp(p)
        self.model.expire(p)
        self.model.report_if_exact(p, before)  # on a cluster reads tell the global accounting nothing
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
        before = self.model.total(p)
        self.model.stamp(p)
        self.model.expire(p)
        try:
            self.run(self.store.clear(p, c))
        except ContextNotFound:
            assert c not in self.model.ctx[p]
            self.model.report_if_exact(p, before)  # on a cluster its idle expiry stays unreported
            return
        self.model.ctx[p][c] = []
        self.model.touch(p, c)
        self.model.report(p, before)

    @rule(p=st.sampled_from(PRINCIPALS), src=st.sampled_from(CONTEXTS), dst=st.sampled_from(CONTEXTS))
    def fork(self, p, src, dst):
        before = self.model.total(p)
        if src != dst:  # (the store refuses src == dst before calling Redis)
            self.model.stamp(p)
            self.model.expire(p)
        ctxs = self.model.ctx[p]
        ok = src in ctxs and dst not in ctxs and src != dst
        try:
            self.run(self.store.fork(p, src, dst))
        except ValueError:
            assert not ok
            self.model.report_if_exact(p, before)
            return
        assert ok
        ctxs[dst] = list(ctxs[src])
        self.model.touch(p, src)
        self.model.touch(p, dst)
        self.model.enforce(p, dst)
        self.model.report(p, before)

    @rule(p=st.sampled_from(PRINCIPALS), c=st.sampled_from(CONTEXTS))
    def evict(self, p, c):
        before = self.model.total(p)
        self.model.stamp(p)
        self.model.expire(p)
        assert self.run(self.store.evict(p, c)) == (c in self.model.ctx[p])
        self.model.ctx[p].pop(c, None)
        self.model.report(p, before)

    @rule()
    def evictor_sweeps(self):
        assert self.run(self.store.enforce_global_budget()) == self.model.sweep()
        assert sum(self.model.total(q) for q in PRINCIPALS) <= G_BUDGET

    @rule(ms=st.sampled_from([0, 1, 999, 40_000, IDLE_MS - 1, IDLE_MS, 3 * IDLE_MS]))
    def time_passes(self, ms):
        self.model.now += ms

    @invariant()
    def agrees_with_model(self):
        for p in PRINCIPALS:
            lru = self.run(self.store.lru_order(p))
            assert lru == list(self.model.ctx[p]), (p, lru, self.model.ctx[p])
            assert self.run(self.store.principal_bytes(p)) == self.model.total(p)
        assert self.run(self.store.global_bytes()) == sum(self.model.reported.values())
        assert list(reversed(self.run(self.store.principals()))) == self.model.principal_lru()
        for p in PRINCIPALS:
            assert self.model.total(p) <= P_BUDGET
            assert self.model.reported[p] >= self.model.total(p)  # reports may lag, only upwards


@pytest.mark.timeout(600)  # room for hypothesis's own 5-minute shrink limit, so a failure prints its steps
@pytest.mark.parametrize("global_res_ms", [0, 1000])
def test_lru_semantics_match_reference_model(redis_target, global_res_ms):
    StoreMachine.target, StoreMachine.global_res_ms = redis_target, global_res_ms
    run_state_machine_as_test(StoreMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
