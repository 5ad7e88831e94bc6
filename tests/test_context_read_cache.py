"""The context store's read cache against a real Redis: a store keeps the entries of its
last read of a context and the next read fetches only what it lacks. Every read must still
equal what a store without the cache reads, whoever changed the context in between (another
replica, an eviction, a Redis that lost its data), on a single server and on a cluster."""

from __future__ import annotations

import asyncio
import logging
import random
import tracemalloc

import orjson
import pytest
from prometheus_client import REGISTRY

from shared import keys
from shared.config import ConfigError, ContextConfig
from shared.context import ContextNotFound, ContextStore, read_cache
from shared.context.read_cache import _HELD_ENTRY_OVERHEAD
from shared.redis_client import for_each_primary
from shared.types import ContextWindow


@pytest.fixture
async def r(redis_target):  # a single server and a cluster
    client = redis_target.async_client()
    yield client
    for store in _made.pop(id(client), []):  # before the client: see ContextStore.aclose
        await store.aclose()
    await client.aclose()


def read_entries(source: str) -> float:
    return REGISTRY.get_sample_value("learnmesh_context_read_entries_total", {"source": source}) or 0.0


def make(r, **cfg) -> ContextStore:
    cfg.setdefault("read_cache_bytes", 1 << 20)
    cfg.setdefault("read_cache_admit_reads", 1)  # every read keeps: admission has a test of its own
    store = ContextStore(r, ContextConfig(**cfg))
    _made.setdefault(id(r), []).append(store)
    return store


_made: dict[int, list[ContextStore]] = {}  # client -> the stores made on it (closed by ``r``)


def view(win: ContextWindow) -> tuple:
    """Everything a reader sees of a window."""
    return win.version, {m: [(e.id, e.modality, e.role, e.content, e.mime, e.tokens, e.size_bytes, e.ts_ms, e.links)
                             for e in ents] for m, ents in win.channels.items()}


def check_held_bytes(s: ContextStore) -> None:
    """The read cache's byte count is what its entries hold (counted incrementally when a
    read adds new entries to held ones: see _assemble)."""
    for held in s._cache.held.values():
        for _first, ents, nbytes in held.channels.values():
            assert nbytes == sum(len(e.content) for e in ents) + _HELD_ENTRY_OVERHEAD * len(ents)
        assert held.nbytes == sum(ch[2] for ch in held.channels.values())
    assert s._cache.nbytes == sum(h.nbytes for h in s._cache.held.values())


def _on_node(r, principal: str) -> dict:
    """Where a command about ``principal``'s keys runs: on a cluster, the master of its slot."""
    return {"target_nodes": r.get_node_from_key("{" + principal + "}")} if hasattr(r, "get_node_from_key") else {}


async def resetstat(r, principal: str = "erin") -> None:
    await r.config_resetstat(**_on_node(r, principal))


async def commandstats(r, principal: str = "erin") -> dict[str, int]:
    stats = await r.info("commandstats", **_on_node(r, principal))
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


_NOT_SCRIPT_WORK = frozenset({"config|resetstat", "config", "info", "hincrby", "eval", "replconf", "hello", "auth",
                               "select", "ping", "readonly"})


async def script_commands(r, principal: str = "erin") -> tuple[int, dict[str, int]]:
    """Since the last CONFIG RESETSTAT (INFO commandstats) on the principal's master: the
    script calls made (FCALL, or EVALSHA on Redis < 7) and the Redis commands run, by name,
    inside them (the global accounting's HINCRBY left out: inside the calls on one server,
    posted beside them on a cluster, in an EVAL per shard)."""
    calls = await commandstats(r, principal)
    outer = calls.pop("fcall", 0) + calls.pop("evalsha", 0)
    # A client's connection setup (HELLO, CLIENT SETINFO, AUTH, ...) on that master is no script's work.
    return outer, {k: n for k, n in calls.items()
                   if k not in _NOT_SCRIPT_WORK and not k.startswith(("client|", "cluster|"))}


async def fill(s: ContextStore, p: str, cid: str, n: int, tag: str = "t") -> None:
    for i in range(n):
        await s.append(p, cid, "text", "user", f"{tag}{i}".encode())


async def test_a_second_read_fetches_only_the_new_entries(r):
    s, ref = make(r), make(r, read_cache_bytes=0)
    await fill(s, "alice", "c", 30)
    first = await s.get_window("alice", "c", last_n=20)
    assert (s.entries_fetched, s.entries_reused) == (20, 0)
    await s.append("alice", "c", "text", "assistant", b"new-1")
    await s.append("alice", "c", "text", "user", b"new-2")
    before = {src: read_entries(src) for src in ("redis", "cache")}
    second = await s.get_window("alice", "c", last_n=20)
    assert (s.entries_fetched, s.entries_reused) == (22, 18)
    assert {src: read_entries(src) - before[src] for src in before} == {"redis": 2, "cache": 18}  # exported
    assert view(second) == view(await ref.get_window("alice", "c", last_n=20))
    assert [e.text for e in second.channels["text"][-2:]] == ["new-1", "new-2"]
    assert second.channels["text"][0].id == "text:13" and first.channels["text"][0].id == "text:11"
    third = await s.get_window("alice", "c", last_n=20)  # nothing changed: nothing fetched
    assert s.entries_fetched == 22 and view(third) == view(second)
    assert ref.entries_reused == 0


async def test_a_warm_read_is_two_redis_commands_inside_one_call(r):
    """What a read of an unchanged, cached context costs Redis: one FCALL running one HMGET
    (state and meta) and one HSET (its last use and the clock) — no entry read, no write to
    the context LRU (lazy: see lru_head in context.lua), no global stamp within
    global_lru_resolution_ms of the last, no idle check while none can be idle (counted with
    INFO commandstats)."""
    s = make(r)
    await fill(s, "erin", "c", 30)
    await s.get_window("erin", "c", last_n=20)
    await resetstat(r)
    for _ in range(10):
        await s.get_window("erin", "c", last_n=20)
    outer, inner = await script_commands(r)
    assert outer == 10
    assert inner == {"hmget": 10, "hset": 10}, inner


async def test_an_append_to_a_full_window_is_ten_redis_commands_inside_one_call(r):
    """What an append costs Redis once the window and the retained versions are full: the
    state HMGET; the entry HSET; the HSTRLEN of the entry leaving the window; the version's
    HSET, the HDEL of the version no longer retained and the HGET of the oldest one kept;
    the HSTRLEN and HDEL of the entry no version sees any more; one HSET of the meta with the
    principal's state (save() stages the meta for finish()); the audit XADD (counted with
    INFO commandstats). The global byte count is not among them: its two HINCRBY (inside the
    call on one server, in an EVAL riding along in the pipelined batch on a cluster) are left out."""
    s = make(r, channel_max_entries=20, versions_retained=4, global_lru_resolution_ms=3_600_000)
    await fill(s, "erin", "c", 40)
    await resetstat(r)
    for i in range(10):
        await s.append("erin", "c", "text", "user", f"x{i}".encode())
    outer, inner = await script_commands(r)
    assert outer == 10
    per_append = {"hmget": 1, "hset": 3, "hstrlen": 2, "hdel": 2, "hget": 1, "xadd": 1}
    assert inner == {k: 10 * n for k, n in per_append.items()}, inner
    # ... and what they wrote is whole: the meta and the state of the one HSET, read back.
    win = await s.get_window("erin", "c")
    assert [e.text for e in win.channels["text"]][-3:] == ["x7", "x8", "x9"] and len(win.channels["text"]) == 20
    assert await s.version("erin", "c") == 50
    assert (await s.list_contexts("erin"))[0].version == 50


async def test_a_read_after_an_append_fetches_its_entries_without_decoding_the_meta(r):
    """A read of a context that changed since the last one: the state HMGET also brings the
    context's VER field, which carries its channel ranges, so the script reads only the new
    entries (one more HMGET) — no HGET of the meta, no JSON decode."""
    s = make(r)
    await fill(s, "erin", "c", 30)
    await s.get_window("erin", "c", last_n=20)
    f0 = s.entries_fetched
    for i in range(5):
        await s.append("erin", "c", "text", "user", f"n{i}".encode())
        await resetstat(r)
        win = await s.get_window("erin", "c", last_n=20)
        assert win.channels["text"][-1].text == f"n{i}" and len(win.channels["text"]) == 20
        inner = {k: n for k, n in (await commandstats(r)).items()
                 if k not in ("fcall", "evalsha", "config|resetstat", "hincrby", "eval")}
        assert inner == {"hmget": 2, "hset": 1}, inner  # state + VER, the new entry; the use
    assert s.entries_fetched - f0 == 5


async def test_a_context_written_by_the_older_script_is_still_read(r):
    """VER fields of the short form ("<version>;<epoch>", without channel ranges) make the
    script decode the meta instead; the "unchanged" answer still works with them."""
    s, ref = make(r), make(r, read_cache_bytes=0)
    await fill(s, "erin", "c", 6)
    m = keys.ctx_meta("erin")
    meta = orjson.loads(await r.hget(m, "c"))
    await r.hset(m, "\x00vc", f"{meta['v']};{meta['e']}")
    assert view(await s.get_window("erin", "c")) == view(await ref.get_window("erin", "c"))
    calls = []
    real = s._cache.unchanged
    s._cache.unchanged = lambda *a: calls.append(a[0][1]) or real(*a)  # type: ignore[method-assign,func-returns-value]
    assert view(await s.get_window("erin", "c")) == view(await ref.get_window("erin", "c"))
    assert calls == ["c"]
    await s.append("erin", "c", "text", "user", b"new")  # writes the new form
    assert (await r.hget(m, "\x00vc")).endswith(b";text:1:7")
    assert [e.text for e in (await s.get_window("erin", "c")).channels["text"]][-1] == "new"


async def test_windows_handed_out_are_the_callers_own(r):
    s = make(r)
    await fill(s, "alice", "c", 3)
    a = await s.get_window("alice", "c")
    a.channels["text"].clear()  # a caller changing its list changes nothing for the next reader
    b = await s.get_window("alice", "c")
    assert [e.text for e in b.channels["text"]] == ["t0", "t1", "t2"] and s.entries_reused == 3


async def test_another_replica_appending_and_clearing_is_seen(r):
    a, b = make(r), make(r)  # two gateway replicas on one Redis
    await fill(b, "alice", "c", 5)
    assert [e.text for e in (await a.get_window("alice", "c")).channels["text"]] == [f"t{i}" for i in range(5)]
    await b.append("alice", "c", "text", "user", b"from-b")
    win = await a.get_window("alice", "c")
    assert [e.text for e in win.channels["text"]][-2:] == ["t4", "from-b"] and win.version == 6
    assert await b.clear("alice", "c") == 7
    await b.append("alice", "c", "text", "user", b"after-clear")
    win = await a.get_window("alice", "c")
    assert view(win) == view(await b.get_window("alice", "c"))
    assert [e.id for e in win.channels["text"]] == ["text:7"] and win.version == 8


async def test_an_evicted_and_recreated_context_is_never_served_from_its_old_life(r):
    a, b = make(r), make(r)
    await fill(b, "alice", "c", 4, tag="old")
    assert len((await a.get_window("alice", "c")).channels["text"]) == 4
    assert ("alice", "c") in a._cache.held
    # Another replica evicts it and starts it again: the same id and the same sequence
    # numbers text:1..4 now name other content (a new life of the context).
    assert await b.evict("alice", "c")
    await fill(b, "alice", "c", 4, tag="new")
    win = await a.get_window("alice", "c")
    assert [e.text for e in win.channels["text"]] == [f"new{i}" for i in range(4)]
    assert a.entries_reused == 0
    assert await b.evict("alice", "c")
    with pytest.raises(ContextNotFound):
        await a.get_window("alice", "c")
    assert ("alice", "c") not in a._cache.held


async def test_redis_losing_its_data_does_not_resurrect_cached_entries(r):
    s = make(r)
    await fill(s, "alice", "c", 3, tag="before")
    assert len((await s.get_window("alice", "c")).channels["text"]) == 3
    await for_each_primary(r, lambda node: node.flushdb())  # Redis restarted without persistence: versions start at 1
    await fill(make(r), "alice", "c", 3, tag="after")
    win = await s.get_window("alice", "c")
    assert [e.text for e in win.channels["text"]] == ["after0", "after1", "after2"] and win.version == 3


async def test_reads_with_and_without_the_cache_agree_on_random_histories(r, caplog):
    """Differential: one store with the cache, one without, random appends (text and image,
    with links), clears, forks, evictions and reads (last_n, max_tokens, subsets of
    modalities, resolve_links) from both; every read must be identical."""
    rnd = random.Random(1234)
    cached, plain = make(r, channel_max_entries=12), make(r, channel_max_entries=12, read_cache_bytes=0)
    writers = [cached, plain]
    contexts = ["c1", "c2"]
    hi: dict[tuple[str, str], int] = {}
    for step in range(400):
        w = rnd.choice(writers)
        cid = rnd.choice(contexts)
        roll = rnd.random()
        if roll < 0.45:
            mod = rnd.choice(["text", "text", "image"])
            links = []
            other = "image" if mod == "text" else "text"
            if hi.get((cid, other)) and rnd.random() < 0.3:
                links = [f"{other}:{hi[(cid, other)]}"]
            res = await w.append("bob", cid, mod, "user", f"{step}-{mod}".encode() * rnd.randint(1, 4),
                                 tokens=rnd.randint(1, 9), links=links)
            hi[(cid, mod)] = int(res.entry_id.split(":")[1])
        elif roll < 0.50:
            try:
                await w.clear("bob", cid)
            except ContextNotFound:
                pass
            hi = {k: v for k, v in hi.items() if k[0] != cid}  # nothing left to link to
        elif roll < 0.53:
            await w.evict("bob", cid)
            hi = {k: v for k, v in hi.items() if k[0] != cid}
        elif roll < 0.55:
            src, dst = contexts
            await w.evict("bob", dst)
            try:
                await w.fork("bob", src, dst)
                for mod in ("text", "image"):
                    if (src, mod) in hi:
                        hi[(dst, mod)] = hi[(src, mod)]
                    else:
                        hi.pop((dst, mod), None)
            except ContextNotFound:
                hi = {k: v for k, v in hi.items() if k[0] != dst}
        else:
            kw: dict = {}
            if rnd.random() < 0.5:
                kw["last_n"] = rnd.randint(1, 15)
            if rnd.random() < 0.3:
                kw["max_tokens"] = rnd.randint(1, 40)
            if rnd.random() < 0.4:
                kw["modalities"] = rnd.sample(["text", "image", "audio"], rnd.randint(1, 2))
            if rnd.random() < 0.15:
                kw["resolve_links"] = True
            try:
                got = view(await cached.get_window("bob", cid, **kw))
            except ContextNotFound:
                with pytest.raises(ContextNotFound):
                    await plain.get_window("bob", cid, **kw)
                continue
            assert got == view(await plain.get_window("bob", cid, **kw)), (step, cid, kw)
            check_held_bytes(cached)
    assert cached.entries_reused > 100  # the cache was exercised, not bypassed
    assert "out of step" not in caplog.text  # and never needed the whole-read fallback


async def test_the_cache_stays_within_its_byte_budget(r):
    s = make(r, read_cache_bytes=64 * 1024)
    for c in range(20):
        await s.append("carol", f"c{c}", "text", "user", b"x" * 4000)  # 20 x 4,200 counted > 64 KiB
        await s.get_window("carol", f"c{c}")
    assert 0 < s._cache.nbytes <= 64 * 1024
    assert sum(h.nbytes for h in s._cache.held.values()) == s._cache.nbytes
    assert ("carol", "c19") in s._cache.held and ("carol", "c0") not in s._cache.held  # least recently read left
    await s.append("carol", "big", "text", "user", b"y" * 9000)  # over 1/8 of the budget: not kept
    await s.get_window("carol", "big")
    assert ("carol", "big") not in s._cache.held


async def test_a_cache_out_of_step_is_detected_and_the_read_is_whole(r, caplog):
    s, ref = make(r), make(r, read_cache_bytes=0)
    await fill(s, "dave", "c", 6)
    await s.get_window("dave", "c")
    # Break the store's record: it claims text:1..6 but holds only 1..3, so Redis leaves
    # out entries the store cannot supply. The gap must be seen, never papered over.
    held = s._cache.held[("dave", "c")]
    first, ents, nbytes = held.channels["text"]
    held.channels["text"] = (first, ents[:3], nbytes)
    held.held_arg = held.epoch + ";text:1:6"
    held.sig = ""  # (no "unchanged" answer: that trusts the record, which this test breaks)
    with caplog.at_level(logging.WARNING, logger="shared.context.store"):
        win = await s.get_window("dave", "c")
    assert view(win) == view(await ref.get_window("dave", "c"))
    assert "out of step" in caplog.text


async def test_an_unchanged_context_is_answered_without_its_window(r):
    """A read with the same arguments as the last one sends the version it saw; while the
    context is still at that version, Redis answers "unchanged" (no window, no meta decoded)
    and the store hands out what it holds. Any change, another channel's included, or a new
    life of the context (evicted and recreated: versions continue, the epoch differs), or
    other arguments, and the read is a normal one again."""
    s, ref = make(r), make(r, read_cache_bytes=0)
    await fill(s, "erin", "c", 5)
    calls = []
    real = s._cache.unchanged
    s._cache.unchanged = lambda *a: calls.append(a[0][1]) or real(*a)  # type: ignore[method-assign,func-returns-value]

    async def same() -> None:
        assert view(await s.get_window("erin", "c", modalities=["text"])) == \
            view(await ref.get_window("erin", "c", modalities=["text"]))

    await same()  # first read with these arguments
    await same()
    await same()
    assert calls == ["c", "c"]
    await s.append("erin", "c", "image", "user", b"\x89PNG", mime="image/png")  # text window unchanged
    await same()  # new version: a normal read
    await same()
    assert calls == ["c", "c", "c"]
    await same()
    assert len(calls) == 4
    await s.get_window("erin", "c", modalities=["text"], last_n=2)  # other arguments
    await same()
    assert len(calls) == 4  # the last read with these arguments was not the last read
    await same()
    assert len(calls) == 5
    assert await s.evict("erin", "c")
    await fill(s, "erin", "c", 5)  # same entries again, a new life
    await same()
    assert len(calls) == 5
    await same()
    assert len(calls) == 6


async def test_concurrent_reads_with_mixed_arguments_each_match_their_version(r):
    """Readers sharing one store's cache, with different arguments, while another replica
    appends: every window handed out (cached, "unchanged" or fetched) is exactly the window
    of the version it carries."""
    s = make(r, versions_retained=1000)
    w = make(r, read_cache_bytes=0, versions_retained=1000)  # another gateway replica
    await fill(w, "zed", "c", 5)
    rnd = random.Random(7)
    checked = []

    async def reader() -> None:
        for _ in range(50):
            n = rnd.choice([None, 2, 4])
            win = await s.get_window("zed", "c", last_n=n)
            full = (await w.read_at_version("zed", "c", win.version)).channels.get("text", [])
            want = full if n is None else full[-n:]
            assert [(e.id, e.content) for e in win.channels.get("text", [])] == [(e.id, e.content) for e in want]
            checked.append(win.version)

    async def writer() -> None:
        for i in range(40):
            await w.append("zed", "c", "text", "user", f"w{i}".encode())
            await asyncio.sleep(0)

    await asyncio.gather(*(reader() for _ in range(6)), writer())
    assert len(checked) == 300 and len(set(checked)) > 5  # reads saw many versions
    assert s.entries_reused > 0
    # and every read fitted the reply to what it held: never the "out of step" second call
    assert s.round_trips == 300


def test_read_cache_bytes_is_validated():
    with pytest.raises(ConfigError, match="read_cache_bytes"):
        ContextConfig(read_cache_bytes=-1)
    assert ContextConfig(read_cache_bytes=0).read_cache_bytes == 0


async def test_the_read_cache_counts_what_an_entry_takes(r):
    """The bytes the read cache counts per held entry are what a read's entries take in
    memory (tracemalloc), within a quarter: the cache's budget is a real bound."""
    s = make(r)
    await fill(s, "alice", "c", 200)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        win = await s.get_window("alice", "c")
        for _ in range(3):  # the pipeline's batch (the raw reply) is let go of on the next loop turns
            await asyncio.sleep(0)
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    ents = win.channels["text"]
    assert len(ents) == 200
    per_entry = (taken - sum(len(e.content) for e in ents)) / len(ents)
    assert 0.75 * _HELD_ENTRY_OVERHEAD <= per_entry <= 1.25 * _HELD_ENTRY_OVERHEAD, per_entry


async def test_a_context_is_kept_from_its_second_read(r, monkeypatch):
    """read_cache_admit_reads (default 2): a first read of a context only notes it — it keeps
    nothing, so contexts read once do not crowd out the rest; the second read keeps what it
    read and the next fetches only what changed. The notes are bounded (_SEEN_MAX)."""
    s, ref = ContextStore(r, ContextConfig(read_cache_bytes=1 << 20)), make(r, read_cache_bytes=0)
    assert s.cfg.read_cache_admit_reads == 2
    await fill(s, "alice", "c", 30)
    first = await s.get_window("alice", "c", last_n=20)
    assert (s.entries_fetched, s.entries_reused, len(s._cache.held), s._cache.nbytes) == (20, 0, 0, 0)
    second = await s.get_window("alice", "c", last_n=20)  # fetched again, and kept
    assert (s.entries_fetched, s.entries_reused, len(s._cache.held)) == (40, 0, 1) and view(second) == view(first)
    check_held_bytes(s)
    await s.append("alice", "c", "text", "user", b"new")
    third = await s.get_window("alice", "c", last_n=20)
    assert (s.entries_fetched, s.entries_reused) == (41, 19)
    assert view(third) == view(await ref.get_window("alice", "c", last_n=20))
    assert ("alice", "c") not in s._cache.seen
    monkeypatch.setattr(read_cache, "_SEEN_MAX", 4)
    for i in range(10):
        await s.append("bob", f"c{i}", "text", "user", b"x")
        await s.get_window("bob", f"c{i}")
    assert list(s._cache.seen) == [("bob", f"c{i}") for i in range(6, 10)] and len(s._cache.held) == 1
    await s.get_window("bob", "c0")  # forgotten: a first read again
    await s.get_window("bob", "c9")  # a second read: kept
    assert set(s._cache.held) == {("alice", "c"), ("bob", "c9")}
    with pytest.raises(ConfigError):
        ContextConfig(read_cache_admit_reads=0)


async def test_an_entry_missing_from_redis_is_reported_not_decoded_around(r):
    """An entry deleted behind the store's back (never by the store: a range's entries are
    written and deleted together) comes back as a hole in its run: the client splits the run
    there, sees the window is not whole and says so — no decoding of what is not there."""
    s = make(r, read_cache_bytes=0)
    await fill(s, "fay", "c", 5)
    await r.hdel(keys.ctx_entries("fay"), "c|text|3")
    with pytest.raises(RuntimeError, match="does not match its ranges"):
        await s.get_window("fay", "c")
    await s.append("fay", "c", "text", "user", b"t5")  # the window from text:4 on is whole again
    assert [e.text for e in (await s.get_window("fay", "c", last_n=3)).channels["text"]] == ["t3", "t4", "t5"]
