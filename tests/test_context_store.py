"""Context store against a real Redis, single server and cluster (``redis_target``): data
model, windows, versions, fork, budgets, the global budget's evictor, audit."""

from __future__ import annotations

import sys
from typing import Any

import hiredis
import msgspec
import pytest
import redis.asyncio as aioredis

from shared import audit, keys
from shared.config import ConfigError, ContextConfig
from shared.context import (
    ContextError,
    ContextExists,
    ContextNotFound,
    ContextStore,
    EntryTooLarge,
    InvalidModality,
    VersionUnavailable,
    pack_entry,
    stored_entry,
)
from shared.context.entries import array_header
from shared.context.scripts import script_keys
from shared.redis_batch import pack_bulk
from shared.types import Entry


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
async def r(redis_target):
    client = redis_target.async_client()
    yield client
    for store in _made.pop(id(client), []):  # before the client: see ContextStore.aclose
        await store.aclose()
    await client.aclose()


_made: dict[int, list[ContextStore]] = {}  # client -> the stores made on it (closed by ``r``)


def make(r, clock=None, **cfg) -> ContextStore:
    store = ContextStore(r, ContextConfig(**cfg), clock_ms=clock)
    _made.setdefault(id(r), []).append(store)
    return store


def size(content: bytes, role: str = "user", **kw) -> int:
    return len(pack_entry(role, content, tokens=kw.pop("tokens", len(content)), ts_ms=0, **kw))


async def test_append_and_window_roundtrip_binary_raw(r):
    s = make(r)
    png = bytes(range(256)) * 4
    a = await s.append("alice", "c1", "text", "user", "héllo".encode())
    b = await s.append("alice", "c1", "image", "user", png, mime="image/png")
    c = await s.append("alice", "c1", "text", "assistant", b"see it", links=[b.entry_id])
    assert (a.entry_id, a.version, b.entry_id, b.version, c.version) == ("text:1", 1, "image:1", 2, 3)
    win = await s.get_window("alice", "c1")
    assert win.version == 3
    assert [e.text for e in win.channels["text"]] == ["héllo", "see it"]
    img = win.channels["image"][0]
    assert img.content == png and img.mime == "image/png" and img.tokens == len(png)
    assert win.channels["text"][1].links == ("image:1",) and win.channels["text"][1].role == "assistant"
    # binary stored as raw bytes (MessagePack bin, no base64): the stored value is the entry
    raw = await r.hget(keys.ctx_entries("alice"), "c1|image|1")
    assert png in raw and msgspec.msgpack.decode(raw, type=Entry) == img
    assert len(raw) == size(png, mime="image/png") + len(b"\x99\xa7image:1\xa5image")  # its name is not counted
    assert await s.version("alice", "c1") == 3
    assert s.round_trips == 5


async def test_window_last_n_tokens_modalities_and_links(r):
    s = make(r)
    img = await s.append("a", "c", "image", "user", b"\x89PNG....")
    for i in range(5):
        await s.append("a", "c", "text", "user", b"x" * 10, links=[img.entry_id] if i == 0 else ())
    w = await s.get_window("a", "c", modalities=["text"], last_n=2)
    assert list(w.channels) == ["text"] and [e.id for e in w.channels["text"]] == ["text:4", "text:5"]
    w = await s.get_window("a", "c", modalities=["text"], max_tokens=25)
    assert [e.id for e in w.channels["text"]] == ["text:4", "text:5"]
    w = await s.get_window("a", "c", modalities=["text"], max_tokens=3)  # always at least the newest
    assert [e.id for e in w.channels["text"]] == ["text:5"]
    # links resolved only for requested modalities
    w = await s.get_window("a", "c", modalities=["text"], resolve_links=True)
    assert "image" not in w.channels
    w = await s.get_window("a", "c", modalities=["text", "image"], last_n=5, resolve_links=True)
    assert [e.id for e in w.channels["image"]] == ["image:1"]
    await s.append("a", "c", "image", "user", b"second")
    w = await s.get_window("a", "c", modalities=["text", "image"], last_n=1, resolve_links=True)
    assert [e.id for e in w.channels["image"]] == ["image:2"]  # text:1 not in window, so no link
    w = await s.get_window("a", "c", modalities=["text", "image"], last_n=5, resolve_links=True)
    assert [e.id for e in w.channels["image"]] == ["image:1", "image:2"]


async def test_the_script_reads_stored_entries_of_every_length(r):
    """The script walks stored entries (token budgets, links) over every MessagePack length
    form: contents of 0 to 70,000 bytes (bin 8/16/32), roles and mimes of str 5/8."""
    s = make(r, max_entry_bytes=100_000, channel_max_bytes=1_000_000)
    img = await s.append("a", "c", "image", "user", b"\x89PNG", mime="image/" + "p" * 40)
    sizes = [0, 31, 255, 256, 65_535, 65_536, 70_000]
    for i, n in enumerate(sizes):
        await s.append("a", "c", "text", "r" * (1 if i % 2 else 40), b"x" * n, tokens=i + 1,
                       links=[img.entry_id] if i == 0 else ())
    w = await s.get_window("a", "c", modalities=["text"], max_tokens=7 + 6 + 5)  # the newest three
    assert [e.size_bytes for e in w.channels["text"]] == sizes[-3:]
    w = await s.get_window("a", "c", modalities=["text", "image"], resolve_links=True, last_n=len(sizes))
    assert [e.id for e in w.channels["image"]] == ["image:1"] and (w.channels["image"][0].mime or "").endswith("p" * 40)
    assert [e.tokens for e in w.channels["text"]] == list(range(1, len(sizes) + 1))
    assert [len(e.role) for e in w.channels["text"]] == [40, 1] * 3 + [40]
    assert w.channels["text"][0].links == ("image:1",)
    assert await s.principal_bytes("a") == (size(b"\x89PNG", mime="image/" + "p" * 40) + sum(
        size(b"x" * n, role="r" * (1 if i % 2 else 40), links=["image:1"] if i == 0 else [])
        for i, n in enumerate(sizes)))
    # the longest modality name (32): its str and the id are str 8 (>= 32 bytes): names, trimming, budgets
    long = "m" * 32
    s = make(r, lambda: 1234, modalities=["text", long], channel_max_entries=2, versions_retained=1)
    for i in range(4):
        await s.append("b", "c", long, "user", b"%d" % i, links=["text:1"] if i == 3 else ())
        if i == 1:
            await s.append("b", "c", "text", "user", b"t")
    w = await s.get_window("b", "c", resolve_links=True)
    assert [(e.id, e.modality, e.text) for e in w.channels[long]] == [(f"{long}:3", long, "2"), (f"{long}:4", long, "3")]
    assert [e.id for e in w.channels["text"]] == ["text:1"]
    assert await s.principal_bytes("b") == size(b"2") + size(b"3", links=["text:1"]) + size(b"t")
    # what the script stores is what stored_entry (the bench's bulk loader) builds
    assert await r.hget(keys.ctx_entries("b"), f"c|{long}|3") == stored_entry(
        long, 3, pack_entry("user", b"2", tokens=1, ts_ms=1234))


async def test_a_stored_value_that_is_not_an_entry_is_an_error(r):
    """Only the MessagePack form is ever written: any other stored value (here the 19-byte
    header form of before 0.1.0) is not decoded around but fails the read."""
    s = make(r, read_cache_bytes=0)
    await s.append("a", "c", "text", "user", b"t1")
    await r.hset(keys.ctx_entries("a"), "c|text|1", b"\x01" + b"\x00" * 18 + b"usert1")
    with pytest.raises(msgspec.DecodeError):
        await s.get_window("a", "c")


async def test_the_call_header_is_the_packed_command(r):
    """_head builds a principal's FCALL header from a template: with the arguments after it,
    the same bytes as hiredis packing the whole command, for any principal name (UTF-8, '%'),
    and a working call."""
    s = make(r)
    script = s._script
    for p in ("alice", "Ünïcode-π", "a%b%%c%d", "x" * 200):
        ks = script_keys(p, script.inline)  # on one server with its shard of the global accounting
        tail = (123, "x", b"y", 4, "", "z")  # now, then five arguments
        want = hiredis.pack_command(("FCALL", script.fn, len(ks), *ks, "some-op", p, script.cfg_arg, *tail))  # type: ignore[arg-type]  # its stub types a 1-tuple
        assert script._head("some-op", p, 6 + len(ks) + len(tail)) + pack_bulk(tail) == want
        await s.append(p, "c", "text", "user", b"hi")
        assert [e.text for e in (await s.get_window(p, "c")).channels["text"]] == ["hi"]


async def test_bad_input_is_rejected_before_any_write(r):
    s = make(r, max_entry_bytes=1024, channel_max_bytes=4096, principal_budget_bytes=8192,
             global_budget_bytes=16384)
    with pytest.raises(InvalidModality):
        await s.append("a", "c", "video", "user", b"x")
    with pytest.raises(EntryTooLarge):
        await s.append("a", "c", "text", "user", b"x" * 1025)
    with pytest.raises(ContextError):
        await s.append("a", "c", "text", "user", b"\xff\xfe")  # not UTF-8
    with pytest.raises(ContextError):
        await s.append("a", "bad id!", "text", "user", b"x")
    with pytest.raises(ContextError):
        await s.append("a{b}", "c", "text", "user", b"x")
    with pytest.raises(ContextError):
        await s.append("a", "c", "text", "user", b"x", tokens=-1)
    with pytest.raises(ContextError):
        await s.append("a", "c", "text", "user", b"x", links=["image:7"])  # no such entry
    with pytest.raises(ContextError):
        await s.append("a", "c", "text", "user", b"x", links=["text:1"])  # same channel
    # digits that are not ASCII ('²' and '٣' pass str.isdigit), or too many for the script's numbers
    for link in ("image:²", "image:٣", "image:1٣", "image:99999999999999999999999", "image:", "image:1,text:1"):
        with pytest.raises(ContextError, match="must name an entry"):
            await s.append("a", "c", "text", "user", b"x", links=[link])
    # nothing written, not even audit (only the principal's global LRU stamp)
    assert [k for k in await r.keys("*") if not k.startswith(b"lm:ctx:{ctxglobal-")] == []
    await s.append("a", "c", "text", "user", b"ok")
    img = await s.append("a", "c", "image", "user", b"\x00img", links=["text:01"])  # read back as one spelling
    assert (await s.get_window("a", "c", modalities=["image"])).channels["image"][0].links == ("text:1",)
    await s.append("a", "c", "text", "user", b"see", links=[img.entry_id])
    assert len((await s.get_window("a", "c", resolve_links=True)).entries()) == 3
    bad: dict[str, Any]
    for bad in ({"last_n": 0}, {"last_n": -3}, {"max_tokens": 0}, {"modalities": []},
                {"modalities": ["video"]}, {"last_n": 10**9}):
        with pytest.raises(ContextError):
            await s.get_window("a", "c", **bad)
    with pytest.raises(ContextNotFound):
        await s.get_window("a", "nope")
    with pytest.raises(ContextNotFound):
        await s.clear("a", "nope")
    with pytest.raises(ContextNotFound):
        await s.version("a", "nope")


def test_config_validation():
    with pytest.raises(ConfigError):
        ContextConfig(modalities=["Text!"])
    with pytest.raises(ConfigError):
        ContextConfig(max_entry_bytes=10, channel_max_bytes=5)
    with pytest.raises(ConfigError):
        ContextConfig(principal_budget_bytes=10**6, global_budget_bytes=10**5, max_entry_bytes=1000,
                      channel_max_bytes=1000)
    with pytest.raises(ConfigError):
        ContextConfig(versions_retained=0)


async def test_an_append_retried_with_its_request_id_appends_once(r):
    """A client that lost an append's answer (a timeout, a failover, replicas behind) sends it
    again with the same request id: the context holds it once, and the retry is answered with
    the first append's entry and version, even after later appends of other requests."""
    s = make(r)
    first = await s.append("a", "c", "text", "user", b"pay the invoice", request_id="r-1")
    assert (first.entry_id, first.version, first.repeated) == ("text:1", 1, False)
    other = await s.append("a", "c", "image", "user", b"\x89PNG", request_id="r-2")
    plain = await s.append("a", "c", "text", "user", b"no id")
    again = await s.append("a", "c", "text", "user", b"pay the invoice", request_id="r-1")
    assert (again.entry_id, again.version, again.repeated) == ("text:1", 1, True)
    assert (await s.append("a", "c", "text", "user", b"x", request_id="r-2")).entry_id == other.entry_id
    win = await s.get_window("a", "c")
    assert win.version == plain.version == 3
    assert [e.text for e in win.channels["text"]] == ["pay the invoice", "no id"]
    assert await s.principal_bytes("a") == size(b"pay the invoice") + size(b"\x89PNG") + size(b"no id")
    # ids are the context's own: another context, or another principal, appends
    assert not (await s.append("a", "d", "text", "user", b"pay the invoice", request_id="r-1")).repeated
    assert not (await s.append("b", "c", "text", "user", b"pay the invoice", request_id="r-1")).repeated
    # the last 8 ids are kept: the 9th newer append makes r-1 new again
    for i in range(8):
        await s.append("a", "c", "text", "user", b"%d" % i, request_id=f"n-{i}")
    assert not (await s.append("a", "c", "text", "user", b"pay the invoice", request_id="r-1")).repeated
    assert (await s.append("a", "c", "text", "user", b"7", request_id="n-7")).repeated
    with pytest.raises(ContextError, match="request id must be 1-64 characters"):
        await s.append("a", "c", "text", "user", b"x", request_id="has space")
    assert (await s.get_window("a", "c")).version == 12


async def test_versions_retained_and_clear(r):
    s = make(r, versions_retained=3)
    for i in range(3):
        await s.append("a", "c", "text", "user", b"m%d" % i)
    assert await s.clear("a", "c") == 4
    assert (await s.get_window("a", "c")).channels == {}
    old = await s.read_at_version("a", "c", 2)
    assert old.version == 2 and [e.text for e in old.channels["text"]] == ["m0", "m1"]
    await s.append("a", "c", "text", "user", b"after")  # v5; retained: 3, 4, 5
    assert [e.text for e in (await s.read_at_version("a", "c", 3)).channels["text"]] == ["m0", "m1", "m2"]
    with pytest.raises(VersionUnavailable):
        await s.read_at_version("a", "c", 2)
    with pytest.raises(VersionUnavailable):
        await s.read_at_version("a", "c", 6)
    await s.append("a", "c", "text", "user", b"x")
    await s.append("a", "c", "text", "user", b"y")  # v7; retained 5..7: m0..m2 physically freed
    fields = sorted(f.decode() for f in await r.hkeys(keys.ctx_entries("a")))
    assert fields == ["c|text|4", "c|text|5", "c|text|6"]
    assert await s.principal_bytes("a") == sum(size(x) for x in (b"after", b"x", b"y"))


async def test_channel_window_entries_and_bytes(r):
    s = make(r, channel_max_entries=3, channel_max_bytes=size(b"x" * 100) * 2, max_entry_bytes=150,
             versions_retained=1)
    for i in range(5):
        await s.append("a", "c", "text", "user", b"%d" % i)
    w = await s.get_window("a", "c")
    assert [e.text for e in w.channels["text"]] == ["2", "3", "4"]
    for _ in range(3):
        await s.append("a", "c", "image", "user", b"x" * 100)
    w = await s.get_window("a", "c")
    assert len(w.channels["image"]) == 2 and len(w.channels["text"]) == 3
    assert await s.principal_bytes("a") == 3 * size(b"2") + 2 * size(b"x" * 100)


async def test_fork_copies_current_entries_and_is_independent(r):
    s = make(r)
    await s.append("a", "src", "text", "user", b"one")
    await s.append("a", "src", "image", "user", b"\x00img")
    dst = await s.fork("a", "src", "dst")
    assert dst == "dst" and await s.version("a", "dst") == 1
    await s.append("a", "dst", "text", "user", b"two")
    src_w, dst_w = await s.get_window("a", "src"), await s.get_window("a", "dst")
    assert [e.text for e in src_w.channels["text"]] == ["one"]
    assert [e.text for e in dst_w.channels["text"]] == ["one", "two"]
    assert dst_w.channels["image"][0].content == b"\x00img"
    with pytest.raises(ContextExists):
        await s.fork("a", "src", "dst")
    auto = await s.fork("a", "src")
    assert auto.startswith("src-") and auto in {i.id for i in await s.list_contexts("a")}
    with pytest.raises(ContextNotFound):
        await s.fork("b", "src")  # another principal's context does not exist for b
    assert await s.principal_bytes("a") == 3 * (size(b"one") + size(b"\x00img")) + size(b"two")


async def test_principal_budget_exact_lru(r):
    one = size(b"x" * 100)
    s = make(r, principal_budget_bytes=3 * one, max_entry_bytes=100, channel_max_bytes=1000,
             global_budget_bytes=10**9, versions_retained=1)
    for c in ("c1", "c2", "c3"):
        await s.append("a", c, "text", "user", b"x" * 100)
    await s.get_window("a", "c1")  # c1 becomes most recent: c2 is now LRU
    res = await s.append("a", "c4", "text", "user", b"x" * 100)
    assert res.evicted == ["c2"]
    assert {i.id for i in await s.list_contexts("a")} == {"c1", "c3", "c4"}
    rec = await audit.query(r, principal="a", action="evict")
    assert rec[0]["context"] == "c2" and rec[0]["reason"] == "principal_budget"
    # a context alone over budget keeps its newest entries, never half an entry
    for _ in range(5):
        await s.append("a", "c4", "text", "user", b"x" * 100)
    assert await s.principal_bytes("a") <= 3 * one
    assert [i.id for i in await s.list_contexts("a")] == ["c4"]
    assert len((await s.get_window("a", "c4")).channels["text"]) == 3


async def test_global_budget_lru_over_principals(r):
    """Over the global budget, the evictor evicts the least recently used principal whole,
    through its own script, and the sharded total follows."""
    clock = Clock()
    one = size(b"x" * 100)
    s = make(r, clock, principal_budget_bytes=3 * one, global_budget_bytes=3 * one, max_entry_bytes=100,
             channel_max_bytes=1000, versions_retained=1, global_lru_resolution_ms=0)
    for p in ("p1", "p2", "p3"):
        await s.append(p, "c", "text", "user", b"x" * 100)
        await s.append(p, "d", "image", "user", b"y")
        clock.now_ms += 1
    await s.get_window("p1", "c")  # p2 is now the least recently used principal
    clock.now_ms += 1
    await s.append("p4", "c", "text", "user", b"x" * 100)
    assert await s.global_bytes() == 4 * one + 3 * size(b"y")  # over until the evictor runs
    assert await s.enforce_global_budget() == ["p2", "p3"]
    assert set(await s.principals()) == {"p1", "p4"}
    for gone in ("p2", "p3"):  # every context of the principal went, in one call
        assert await s.list_contexts(gone) == []
        with pytest.raises(ContextNotFound):
            await s.get_window(gone, "c")
    assert await s.global_bytes() == 2 * one + size(b"y")
    assert {x["context"] for x in await audit.query(r, principal="p2", action="evict")} == {"c", "d"}
    assert (await audit.query(r, action="evict"))[0]["reason"] == "global_budget"  # merged over principals
    assert await s.enforce_global_budget() == []  # within budget: nothing more
    # versions stay monotonic when an evicted context is recreated
    assert (await s.append("p2", "c", "text", "user", b"again")).version == 2


async def test_one_server_keeps_the_global_accounting_inside_the_script(r):
    """On one server every call's byte change and use stamp are written by the context script
    itself: the store posts no bookkeeping command beside its calls, yet the shard's report,
    total and LRU are exact (a read's idle expiry included) and the evictor evicts whole
    principals through them. On a cluster the store posts them, as before."""
    clock = Clock()
    one = size(b"x" * 100)
    s = make(r, clock, principal_budget_bytes=3 * one, global_budget_bytes=3 * one, max_entry_bytes=100,
             channel_max_bytes=1000, versions_retained=1, idle_ttl_s=60, global_lru_resolution_ms=1000)
    single = not isinstance(r, aioredis.RedisCluster)

    async def accounted(p: str) -> tuple[int, int | None]:
        """(the principal's report, its global LRU stamp) as the evictor reads them."""
        shard = keys.ctx_global_shard(p)
        await s._global.settled()
        reported = await r.hget(keys.ctx_global_bytes(shard), p)
        stamp = await r.zscore(keys.ctx_global_lru(shard), p)
        return int(reported or 0), None if stamp is None else int(stamp)

    await s.append("p1", "old", "text", "user", b"o" * 100)
    clock.now_ms += 30_000
    await s.append("p1", "new", "text", "user", b"n" * 100)
    assert await accounted("p1") == (2 * one, 1_030_000)
    clock.now_ms += 40_000  # "old" idle
    await s.get_window("p1", "new")
    assert await s.principal_bytes("p1") == one
    assert await accounted("p1") == ((one if single else 2 * one), 1_070_000)  # exact on one server
    clock.now_ms += 500  # within the resolution: no new stamp
    await s.append("p2", "c", "text", "user", b"x" * 100)
    await s.get_window("p1", "new")
    assert (await accounted("p1"))[1] == 1_070_000
    clock.now_ms += 500
    await s.append("p3", "c", "text", "user", b"x" * 100)
    await s.append("p3", "d", "text", "user", b"x" * 100)
    assert await s.principals() == ["p3", "p2", "p1"]
    assert await s.global_bytes() == (4 if single else 5) * one
    assert (s.posted == 0) is single  # nothing beside the script calls on one server
    assert s.round_trips == 7
    assert await s.enforce_global_budget() == ["p1"]
    assert await accounted("p1") == (0, None)
    assert await r.zscore(keys.ctx_global_seen(keys.ctx_global_shard("p1")), "p1") == 1_071_000
    assert await s.global_bytes() == 3 * one
    assert (s.posted == 0) is single
    clock.now_ms += 1
    assert await s.list_contexts("p1") == []  # used again: stamped again
    await s.append("p1", "c", "text", "user", b"x" * 10)
    assert await accounted("p1") == (size(b"x" * 10), 1_071_001) and (await s.principals())[0] == "p1"


async def test_a_posted_stamp_never_moves_the_global_lru_back(r):
    """On a cluster the stamps ride beside the script calls and two of them can reach Redis out
    of order (the first waited for the slot map, the next did not): the newer one stays."""
    if not isinstance(r, aioredis.RedisCluster):
        pytest.skip("one server: the script stamps inside the call, in order")
    clock = Clock()
    s = make(r, clock, global_lru_resolution_ms=1000)
    lru = keys.ctx_global_lru(keys.ctx_global_shard("p1"))
    await r.zadd(lru, {"p1": 2_000_000})  # a newer use, already stamped
    await s.append("p1", "c", "text", "user", b"x" * 10)  # stamps 1_000_000 afterwards
    await s._global.settled()
    assert await r.zscore(lru, "p1") == 2_000_000


async def test_the_evictor_skips_a_principal_used_after_its_stamp(r):
    """A principal used after the stamp the evictor saw is no longer the LRU: its script says
    so and keeps everything; the evictor's lease lets one replica sweep at a time."""
    clock = Clock()
    one = size(b"x" * 100)
    s = make(r, clock, principal_budget_bytes=one, global_budget_bytes=one, max_entry_bytes=100,
             channel_max_bytes=1000, versions_retained=1, global_lru_resolution_ms=1000)
    await s.append("p1", "c", "text", "user", b"x" * 100)
    clock.now_ms += 10
    await s.append("p2", "c", "text", "user", b"x" * 100)
    clock.now_ms += 2000
    await s.get_window("p1", "c")  # used, and re-stamped
    n = (await s._script.call("evict_principal", "p1", 1_000_000 + 1000, "global_budget"))[0]
    assert n == -1  # used after that stamp: kept
    assert [i.id for i in await s.list_contexts("p1")] == ["c"]
    first, second = s.evictor(owner="a"), s.evictor(owner="b")
    assert await first.sweep_once() == ["p2"]
    assert await second.sweep_once() == []  # "a" holds the lease
    assert second.sweeps == 0 and first.sweeps == 1


class _TakenOverAfterRead:
    """The client the evictor talks through, where another replica ("b") takes the lease the
    moment this replica has read who holds it (its lease expired right then)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def get(self, key: Any) -> Any:
        held = await self._client.get(key)
        if key == keys.CTX_EVICTOR_LEASE:
            await self._client.set(key, "b", px=60_000)
        return held


async def test_a_replica_never_renews_a_lease_another_took(r):
    """The lease is taken or renewed in one step: a replica that believes it holds the lease
    holds it, even when its lease expires and another replica takes it mid-renewal."""
    s = make(r, global_budget_bytes=10**9)
    first = s.evictor(owner="a")
    await first.sweep_once()
    assert first.sweeps == 1 and await r.get(keys.CTX_EVICTOR_LEASE) == b"a"
    first.accounts.redis = _TakenOverAfterRead(r)
    holds = await first._lease()
    owner = await r.get(keys.CTX_EVICTOR_LEASE)
    assert holds == (owner == b"a"), f"replica 'a' believes it holds the lease: {holds}, held by {owner!r}"
    second = s.evictor(owner="c")
    assert await second.sweep_once() == [] and second.sweeps == 0


async def test_global_budget_evicts_a_principal_holding_no_bytes(r):
    """A principal whose contexts were all cleared holds 0 bytes but is still the least
    recently used: the evictor evicts it (its cleared context goes) and goes on to the next."""
    clock = Clock()
    one = size(b"x" * 100)
    s = make(r, clock, principal_budget_bytes=2 * one, global_budget_bytes=2 * one, max_entry_bytes=100,
             channel_max_bytes=1000, versions_retained=1)
    await s.append("p1", "c", "text", "user", b"x" * 100)
    await s.clear("p1", "c")
    assert await s.principal_bytes("p1") == 0
    clock.now_ms += 1000
    await s.append("p2", "c", "text", "user", b"x" * 100)
    await s.append("p2", "c", "text", "user", b"x" * 100)
    clock.now_ms += 1000
    await s.append("p3", "c", "text", "user", b"x" * 100)  # over: p1 (0 B), then p2
    assert await s.enforce_global_budget() == ["p1", "p2"]
    assert await s.global_bytes() == one
    assert await s.principals() == ["p3"]


async def test_idle_expiry_is_exact_to_the_millisecond(r):
    """A call skips the idle check while no context can be idle yet (the principal keeps the
    time the oldest one becomes idle); at that millisecond the check runs again."""
    clock = Clock()
    s = make(r, clock, idle_ttl_s=100)
    t0 = clock.now_ms
    await s.append("a", "c1", "text", "user", b"1")
    clock.now_ms = t0 + 40_000
    await s.append("a", "c2", "text", "user", b"2")
    clock.now_ms = t0 + 99_999
    assert [i.id for i in await s.list_contexts("a")] == ["c2", "c1"]
    clock.now_ms = t0 + 100_000  # c1 idle for exactly idle_ttl
    assert [i.id for i in await s.list_contexts("a")] == ["c2"]
    clock.now_ms = t0 + 139_999
    assert [i.id for i in await s.list_contexts("a")] == ["c2"]
    clock.now_ms = t0 + 140_000
    with pytest.raises(ContextNotFound):
        await s.get_window("a", "c2")
    assert await s.list_contexts("a") == []
    await s.append("a", "c3", "text", "user", b"3")  # a principal with no contexts starts again
    clock.now_ms += 99_999
    assert [i.id for i in await s.list_contexts("a")] == ["c3"]
    clock.now_ms += 1
    assert await s.list_contexts("a") == []


async def test_idle_ttl_lazy_and_redis_expiry_reconciled(r):
    clock = Clock()
    s = make(r, clock, idle_ttl_s=60)
    await s.append("a", "old", "text", "user", b"o")
    clock.now_ms += 30_000
    await s.append("a", "new", "text", "user", b"n")
    clock.now_ms += 40_000  # "old" idle 70 s, "new" idle 40 s
    assert [i.id for i in await s.list_contexts("a")] == ["new"]
    rec = await audit.query(r, principal="a", action="evict")
    assert rec[0]["context"] == "old" and rec[0]["reason"] == "idle"
    # keys outlive idle_ttl after the last use: TTL idle_ttl + idle_ttl/16, refreshed lazily
    assert 60_000 < await r.pttl(keys.ctx_entries("a")) <= 63_750
    # Redis expiring the principal's keys wholesale is reconciled into the global total by
    # the evictor, which checks what a principal holds before evicting anyone
    for k in keys.ctx_keys("a"):
        await r.delete(k)
    clock.now_ms += 1000
    await s.append("b", "c", "text", "user", b"b")
    assert await s.global_bytes() > size(b"b")  # stale until the evictor looks at "a"
    s.cfg.global_budget_bytes = size(b"b")
    assert await s.enforce_global_budget() == []
    assert await s.global_bytes() == size(b"b")
    assert [e.text for e in (await s.get_window("b", "c")).channels["text"]] == ["b"]


async def test_evict_and_audit_trail(r):
    s = make(r)
    await s.append("a", "c", "text", "user", b"x")
    await s.clear("a", "c")
    await s.fork("a", "c", "d")
    assert await s.evict("a", "c") is True
    assert await s.evict("a", "c") is False
    actions = [x["action"] for x in await audit.query(r, principal="a")]
    assert actions == ["evict", "fork", "clear", "append"]
    await audit.audit(r, principal="admin", action="admin_evict", context="c", version=3, admin="root")
    got = await audit.query(r, action="admin_evict")
    assert got[0]["version"] == "3" and got[0]["admin"] == "root"
    assert len(await audit.query(r, limit=2)) == 2


async def test_principals_are_isolated_in_the_store(r):
    s = make(r)
    await s.append("alice", "shared-name", "text", "user", b"alice secret")
    await s.append("bob", "shared-name", "text", "user", b"bob data")
    assert [e.text for e in (await s.get_window("bob", "shared-name")).channels["text"]] == ["bob data"]
    await s.clear("bob", "shared-name")
    assert [e.text for e in (await s.get_window("alice", "shared-name")).channels["text"]] == ["alice secret"]
    assert [i.id for i in await s.list_contexts("carol")] == []
    # every key of a principal carries its hash tag
    for k in await r.keys("lm:ctx:*"):
        k = k.decode()
        assert "{alice}" in k or "{bob}" in k or "{ctxglobal-" in k


async def test_decode_responses_client_is_handled(redis_url):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        s = make(client)
        await s.append("a", "c", "image", "user", b"\xff\x00\xfe")
        assert (await s.get_window("a", "c")).channels["image"][0].content == b"\xff\x00\xfe"
        await s.redis.aclose()
    finally:
        await client.aclose()


async def test_ttl_refreshed_lazily_and_on_recreated_keys(r):
    clock = Clock()
    s = make(r, clock, idle_ttl_s=160, versions_retained=1)  # refresh granularity 10 s
    await s.append("a", "c", "text", "user", b"x")
    await r.pexpire(keys.ctx_meta("a"), 100_000)  # marker: a refresh would raise it again
    clock.now_ms += 5_000
    await s.get_window("a", "c")  # last refresh 5 s ago: not due
    assert await r.pttl(keys.ctx_meta("a")) <= 100_000
    clock.now_ms += 5_000
    await s.get_window("a", "c")  # 10 s: due
    assert await r.pttl(keys.ctx_meta("a")) > 160_000
    # clearing frees every entry (one retained version): the entries hash disappears; the
    # next append recreates it and must give it a TTL at once, though no refresh is due
    await s.clear("a", "c")
    assert not await r.exists(keys.ctx_entries("a"))
    clock.now_ms += 1_000
    await s.append("a", "c", "text", "user", b"y")
    for k in keys.ctx_keys("a"):
        if k != keys.ctx_state("a"):  # created by the first eviction only: below
            assert await r.pttl(k) > 160_000, k
    assert not await r.exists(keys.ctx_state("a"))
    assert await s.evict("a", "c")  # remembers the last version in a new key: with a TTL
    assert 160_000 < await r.pttl(keys.ctx_state("a")) <= 170_000


async def test_global_lru_stamps_a_principal_at_most_once_per_resolution(r):
    """With global_lru_resolution_ms, a use renews the principal's place in the global LRU
    only if its last stamp is that old: a read 999 ms after p1's stamp leaves p1 the least
    recently used principal, a read 1000 ms after it makes p1 the most recent."""
    clock = Clock()
    one = size(b"x" * 100)
    s = make(r, clock, principal_budget_bytes=3 * one, global_budget_bytes=3 * one, max_entry_bytes=100,
             channel_max_bytes=1000, versions_retained=1, global_lru_resolution_ms=1000)
    for p in ("p1", "p2", "p3"):
        await s.append(p, "c", "text", "user", b"x" * 100)
        clock.now_ms += 1
    clock.now_ms += 996  # 999 ms after p1's stamp
    await s.get_window("p1", "c")
    assert await s.principals() == ["p3", "p2", "p1"]  # not re-stamped
    clock.now_ms += 1
    await s.get_window("p1", "c")
    assert await s.principals() == ["p1", "p3", "p2"]
    await s.append("p4", "c", "text", "user", b"x" * 100)
    assert await s.enforce_global_budget() == ["p2"]
    # the per-principal LRU stays exact whatever the global resolution
    await s.append("p1", "d", "text", "user", b"y")
    await s.get_window("p1", "c")
    assert await s.lru_order("p1") == ["d", "c"]


async def test_last_used_follows_reads_and_ties_keep_exact_lru(r):
    clock = Clock()
    s = make(r, clock)
    for c in ("c1", "c2", "c3"):  # same millisecond: the order is still exact
        await s.append("a", c, "text", "user", b"x")
    await s.get_window("a", "c1")
    assert await s.lru_order("a") == ["c2", "c3", "c1"]
    clock.now_ms += 7_000
    await s.get_window("a", "c2")
    infos = await s.list_contexts("a")
    assert [i.id for i in infos] == ["c2", "c1", "c3"]
    assert infos[0].last_used_ms == clock.now_ms and infos[1].last_used_ms == clock.now_ms - 7_000
    await s.version("a", "c3")  # version and list are not use
    assert [i.id for i in await s.list_contexts("a")][0] == "c2"


async def test_function_library_reloaded_and_evalsha_fallback_agree(redis_url):
    r = aioredis.Redis.from_url(redis_url)
    try:
        await _reloaded_and_evalsha_agree(r)
    finally:
        await r.aclose()


async def _reloaded_and_evalsha_agree(r):
    if int((await r.info("server"))["redis_version"].split(".")[0]) < 7:
        pytest.skip("Redis < 7 has no Functions: every test here already runs the EVALSHA path")
    s = make(r)
    await s.append("a", "c", "text", "user", b"one")
    # the server lost the library (restart without persistence): loaded again on the next call
    lib = "learnmesh_ctx_" + s._script.fn.removeprefix("lm_ctx_")
    await r.execute_command("FUNCTION", "DELETE", lib)
    await s.append("a", "c", "image", "user", b"\x00two", links=["text:1"])
    # Redis < 7 path: the same code as an EVALSHA script gives the same results
    old = make(r)
    old._script.use_functions = False
    await r.config_resetstat()
    win = await old.get_window("a", "c", resolve_links=True)
    assert [e.content for e in win.channels["text"]] == [b"one"]
    assert [(e.content, e.links) for e in win.channels["image"]] == [(b"\x00two", ("text:1",))]
    assert (await old.append("a", "c", "text", "user", b"three")).version == 3
    assert [i.id for i in await old.list_contexts("a")] == ["c"]
    assert [e.text for e in (await s.get_window("a", "c", modalities=["text"])).channels["text"]] == ["one", "three"]
    stats = await r.info("commandstats")
    # 3 operations (+1 EVALSHA answered NOSCRIPT the first time), 1 FCALL
    assert int(stats["cmdstat_evalsha"]["calls"]) >= 3 and int(stats["cmdstat_fcall"]["calls"]) == 1


async def test_function_library_reloaded_on_the_master_that_lost_it(r, redis_target):
    """FUNCTION FLUSH on one master (a restart without persistence, a new master): the next
    call whose slot that master serves loads the library again — on every master — and
    succeeds; the caller never sees "function not found"."""
    from shared.redis_client import for_each_primary

    s = make(r)
    principals = [f"p{i}" for i in range(30)]  # their slots spread over every master
    for p in principals:
        await s.append(p, "c", "text", "user", b"one")
    lib = "learnmesh_ctx_" + s._script.fn.removeprefix("lm_ctx_")
    flushed = 0

    async def flush_first(node):
        nonlocal flushed
        if flushed == 0:
            await node.function_flush()
        flushed += 1
    await for_each_primary(r, flush_first)
    assert 0 in [len(x) for x in await for_each_primary(r, lambda n: n.function_list(library=lib))]
    for p in principals:
        await s.append(p, "c", "text", "user", b"two")
    assert [len(x) for x in await for_each_primary(r, lambda n: n.function_list(library=lib))] == [1] * flushed
    assert [e.text for e in (await s.get_window("p7", "c")).channels["text"]] == ["one", "two"]


def test_a_run_header_fits_runs_of_every_length():
    """A run of n stored entries is decoded behind array_header(n): every MessagePack
    array form (fix, 16, 32 bits) must say n."""
    for n in (0, 1, 15, 16, 65_535, 65_536, 70_000):
        assert len(msgspec.msgpack.decode(array_header(n) + b"\xc0" * n)) == n


async def test_sequence_numbers_on_both_sides_of_the_scripts_table_of_names(r):
    """The script formats a sequence number below 65536 once and keeps its name; from 65536
    up it formats it every time. A channel crossing 65536 appends, trims, reads (whole and
    through the read cache), reads old versions and forks the same on both sides."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "bench_context.py"
    spec = importlib.util.spec_from_file_location("bench_context", path)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = bench  # type: ignore[union-attr]  # its dataclasses resolve names there
    try:
        spec.loader.exec_module(bench)  # type: ignore[union-attr]
    finally:
        sys.modules.pop(spec.name, None)  # type: ignore[union-attr]
    bulk_load = bench.bulk_load  # the store's layout, checked against the script by the bench
    now = 1_000_000
    cfg = ContextConfig(channel_max_entries=8, versions_retained=4)
    n = 65_533
    packed = [pack_entry("user", b"e%d" % i, tokens=1, ts_ms=now) for i in range(1, n + 1)]
    pipe = r.pipeline(transaction=False)
    bulk_load(pipe, cfg, "alice", "c", packed, now, not isinstance(r, aioredis.RedisCluster))
    await pipe.execute()
    s = ContextStore(r, cfg, clock_ms=lambda: now)
    uncached = ContextStore(r, ContextConfig(channel_max_entries=8, versions_retained=4, read_cache_bytes=0),
                            clock_ms=lambda: now)
    assert [e.id for e in (await s.get_window("alice", "c")).channels["text"]] == [
        f"text:{i}" for i in range(n - 7, n + 1)]
    for i in range(n + 1, n + 6):  # 65534 .. 65538
        res = await s.append("alice", "c", "text", "user", b"e%d" % i)
        assert res.entry_id == f"text:{i}"
    want = list(range(n - 2, n + 6))  # the window of 8: 65531 .. 65538
    for store in (s, uncached):
        win = await store.get_window("alice", "c")
        assert [(e.id, e.content) for e in win.channels["text"]] == [(f"text:{i}", b"e%d" % i) for i in want]
    old = await s.read_at_version("alice", "c", win.version - 2)  # before the last two appends
    assert [e.id for e in old.channels["text"]] == [f"text:{i}" for i in range(n - 4, n + 4)]
    fork = await s.fork("alice", "c", "d")
    forked = await uncached.get_window("alice", fork, last_n=3)
    assert [(e.id, e.content) for e in forked.channels["text"]] == [(f"text:{i}", b"e%d" % i) for i in want[-3:]]


async def test_a_call_that_fails_still_reports_the_evictions_it_made(r):
    """A read of the very context that just went idle evicts it, then answers "not found":
    the eviction is reported all the same (a client's resource list changed)."""
    clock = Clock()
    s = make(r, clock, idle_ttl_s=100)
    told: list[tuple[str, list[str]]] = []
    s.on_evicted = lambda principal, gone: told.append((principal, gone))
    await s.append("a", "c1", "text", "user", b"1")
    await s.append("a", "c2", "text", "user", b"2")
    clock.now_ms += 100_000
    with pytest.raises(ContextNotFound) as got:
        await s.get_window("a", "c1")
    assert got.value.context_id == "c1" and str(got.value) == "context c1"
    assert told == [("a", ["c1", "c2"])] or told == [("a", ["c2", "c1"])]
    told.clear()
    with pytest.raises(ContextNotFound):  # nothing left to evict: nothing reported
        await s.version("a", "c1")
    assert told == []
