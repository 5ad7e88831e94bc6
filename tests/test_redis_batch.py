"""Automatic pipelining (shared/redis_batch.py) against a real Redis: concurrent callers
share round trips, each gets its own reply or error, a dropped connection fails only the
batch on the wire, and the next call reconnects. On a real cluster too
(shared/redis_cluster_batch.py): one pipeline per master, and a slot moving between masters
(ASK, MOVED) is followed without an error reaching a caller."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys, redis_batch
from shared.redis_batch import AutoPipeline, pack_command
from shared.redis_client import close_sync, for_each_primary_sync
from shared.redis_cluster_batch import ClusterAutoPipeline, auto_pipeline
from tests.conftest import wait_for


@pytest.fixture(params=["hiredis-batch-reader", "redis-py-reader"])
async def r(redis_url, request, monkeypatch):
    """Every test runs on both ways of reading a batch's replies: one hiredis reader per
    batch on connections taken over (the default) and redis-py's per-reply reads (used for a
    connection that cannot be taken over)."""
    if request.param == "redis-py-reader":
        monkeypatch.setattr(redis_batch._RedisPyConnection, "stream", lambda self: "not taken over (test)")
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def test_pack_command_is_resp() -> None:
    assert pack_command(("SET", b"k\r\n", 12)) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n"
    with pytest.raises(TypeError):
        pack_command(("SET", "k", 1.5))
    with pytest.raises(TypeError):
        pack_command(("SET", "k", True))  # not silently "1"

    class Name(str):
        pass

    assert pack_command((Name("GET"), bytearray(b"k"))) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


async def test_the_installed_redis_py_takes_the_fast_path(redis_url) -> None:
    """Taking connections over leans on redis-py internals (see _RedisPyConnection): with
    the installed redis-py every connection must be taken over. If this fails, the pipeline
    silently became the slow path: check the redis-py pin in pyproject.toml."""
    client = aioredis.Redis.from_url(redis_url)
    ap = AutoPipeline(client, max_inflight=2)
    try:
        assert await asyncio.gather(*(ap.execute("ECHO", i) for i in range(8))) == [b"%d" % i for i in range(8)]
        assert ap.slow_path is None, f"redis-py {redis.__version__}: {ap.slow_path}"
        assert ap._idle and all(isinstance(c, redis_batch._Link) for c in ap._idle)
    finally:
        await client.aclose()


async def test_a_connection_not_taken_over_is_reported(redis_url, monkeypatch, caplog) -> None:
    """A connection that cannot be taken over is read redis-py's way — correct, but slower —
    and the pipeline says why: ``slow_path`` and one warning."""
    monkeypatch.setattr(redis_batch._RedisPyConnection, "stream", lambda self: "no stream (test)")
    client = aioredis.Redis.from_url(redis_url)
    ap = AutoPipeline(client, max_inflight=2)
    try:
        with caplog.at_level(logging.WARNING, logger="shared.redis_batch"):
            assert await asyncio.gather(*(ap.execute("ECHO", i) for i in range(8))) == [b"%d" % i for i in range(8)]
        assert ap.slow_path == "no stream (test)"
        assert [rec.message for rec in caplog.records if rec.name == "shared.redis_batch"] == [
            "redis batches are read redis-py's way (slower): no stream (test)"]
    finally:
        await client.aclose()


async def test_replies_spanning_many_socket_reads(r) -> None:
    """Big replies and many of them: a batch's replies arrive in many reads and pieces."""
    ap = AutoPipeline(r, max_inflight=2, max_batch=8)
    big = bytes(range(256)) * 4096  # 1 MiB
    await asyncio.gather(*(ap.execute("SET", f"big:{i}", big + bytes([i])) for i in range(6)))
    got = await asyncio.gather(*(ap.execute("GET", f"big:{i}") for i in range(6)),
                               *(ap.execute("INCR", "big:n") for _ in range(50)))
    assert got[:6] == [big + bytes([i]) for i in range(6)]
    assert sorted(got[6:]) == list(range(1, 51))


async def test_concurrent_callers_share_round_trips(r) -> None:
    ap = AutoPipeline(r, max_inflight=2, max_batch=16)
    await asyncio.gather(*(ap.execute("SET", f"ab:{i}", i) for i in range(200)))
    replies = await asyncio.gather(*(ap.execute("GET", f"ab:{i}") for i in range(200)))
    assert replies == [str(i).encode() for i in range(200)]
    assert ap.commands == 400
    assert ap.batches < ap.commands / 4  # batched, not one round trip per command
    # One caller alone: a plain round trip, same answer.
    assert await ap.execute("GET", "ab:7") == b"7"


async def test_error_reply_reaches_only_its_caller(r) -> None:
    ap = AutoPipeline(r)
    await r.set("ab:str", "x")
    replies: list[object] = await asyncio.gather(ap.execute("INCR", "ab:n"), ap.execute("INCR", "ab:str"),
                                                 ap.execute("GET", "ab:str"), return_exceptions=True)
    ok1, bad, ok2 = replies
    assert ok1 == 1 and ok2 == b"x"
    assert isinstance(bad, ResponseError)
    assert await ap.execute("INCR", "ab:n") == 2  # the connection stayed in step


async def test_commands_submitted_together_share_one_connection(r) -> None:
    """A submission of several commands is never split: with batches of one command and
    many callers, both CLIENT IDs of each pair come from the same connection; an error
    reply among them is raised, and the connection stays in step."""
    ap = AutoPipeline(r, max_inflight=3, max_batch=1)
    pair = pack_command(("CLIENT", "ID")) * 2
    got = await asyncio.gather(*(ap.submit(pair, None, 2) for _ in range(30)),
                               *(ap.execute("INCR", "ab:pairs") for _ in range(30)))
    assert all(len(ids) == 2 and ids[0] == ids[1] for ids in got[:30])
    assert sorted(got[30:]) == list(range(1, 31))
    await r.set("ab:str", "x")
    with pytest.raises(ResponseError):
        await ap.submit(pack_command(("INCR", "ab:str")) + pack_command(("GET", "ab:str")), None, 2)
    assert await ap.submit(pack_command(("GET", "ab:str")) + pack_command(("INCR", "ab:pairs")), None, 2) == [b"x", 31]


async def test_dropped_connection_fails_the_batch_then_recovers(r) -> None:
    ap = AutoPipeline(r, max_inflight=1)
    admin = aioredis.Redis.from_pool(r.connection_pool.__class__(**r.connection_pool.connection_kwargs))
    try:
        await ap.execute("PING")
        blocked = asyncio.ensure_future(ap.execute("BLPOP", "ab:never", 30))

        async def blpop_waiting() -> bool:
            clients = await admin.client_list()
            return any(c.get("cmd") == "blpop" for c in clients)

        await wait_for(blpop_waiting)
        queued = asyncio.ensure_future(ap.execute("PING"))  # waits behind the blocked batch
        await wait_for(lambda: len(ap._pending) == 1)
        victim = [c for c in await admin.client_list() if c.get("cmd") == "blpop"][0]
        await admin.client_kill_filter(_id=victim["id"])
        with pytest.raises(RedisConnectionError) as info:  # redis-py's: the gateway maps it to 503
            await asyncio.wait_for(blocked, 10)
        assert "closed" in str(info.value).lower() or "connection" in str(info.value).lower()
        assert await asyncio.wait_for(queued, 10) in (True, b"PONG")  # sent on a fresh connection
        assert await ap.execute("ECHO", "again") == b"again"
    finally:
        await admin.aclose()


async def test_a_connection_closed_while_kept_is_replaced_without_an_error(r) -> None:
    """The pipeline keeps its connections between batches; one the server closed meanwhile
    (here CLIENT KILL; a restart or an idle timeout alike) is not used for the next batch."""
    ap = AutoPipeline(r, max_inflight=1)
    admin = aioredis.Redis.from_pool(r.connection_pool.__class__(**r.connection_pool.connection_kwargs))
    try:
        await admin.client_setname("ab-admin")
        assert await ap.execute("CLIENT", "SETNAME", "ab-kept") in (True, b"OK")
        kept = ap._idle[0]
        await admin.client_kill_filter(_id=(await ap.execute("CLIENT", "ID")))

        def seen_closed() -> bool:  # the event loop saw the close (a taken-over link, or redis-py's reader)
            if isinstance(kept, redis_batch._Link):
                return kept.closed
            return kept.lost()

        await wait_for(seen_closed)
        assert await ap.execute("ECHO", "still") == b"still"  # no error: a fresh connection
        assert await ap.execute("CLIENT", "GETNAME") is None  # a new server-side client
        assert "ab-kept" not in [c.get("name") for c in await admin.client_list()]
    finally:
        await admin.aclose()


async def test_cancelled_waiter_is_skipped(r) -> None:
    ap = AutoPipeline(r, max_inflight=1)
    gate = asyncio.ensure_future(ap.execute("BLPOP", "ab:gate", 30))  # holds the only slot
    await wait_for(lambda: ap._inflight == 1)
    second = asyncio.ensure_future(ap.execute("SET", "ab:c", 2))
    await wait_for(lambda: len(ap._pending) == 1)  # queued behind the gate
    second.cancel()
    await r.lpush("ab:gate", "go")
    assert await asyncio.wait_for(gate, 10) == [b"ab:gate", b"go"]
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await ap.execute("GET", "ab:c") is None  # the cancelled command was never sent
    assert ap.commands == 2


async def test_a_batch_without_replies_fails_after_the_socket_timeout_then_recovers(redis_url) -> None:
    """A peer that stops answering (here: CLIENT PAUSE) fails the batch on the wire with a
    timeout after the connection's socket_timeout instead of hanging; later calls work."""
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.5)
    admin = aioredis.Redis.from_url(redis_url)
    ap = AutoPipeline(client, max_inflight=1)
    try:
        assert await ap.execute("PING") in (True, b"PONG")  # connected before the pause
        await admin.execute_command("CLIENT", "PAUSE", 2500, "ALL")
        with pytest.raises(RedisTimeoutError) as info:  # redis-py's: the gateway maps it to 503
            await asyncio.wait_for(ap.execute("PING"), 10)  # far above the 0.5 s timeout
        assert "no reply from redis within 0.5 s" in str(info.value)  # the pipeline timed it out, not wait_for
        await admin.execute_command("CLIENT", "UNPAUSE")
        assert await asyncio.wait_for(ap.execute("ECHO", "back"), 10) == b"back"
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()
        await admin.aclose()


# ---------------------------------------------------------------- on a cluster (and one server)
# shared/redis_cluster_batch.py: the same pipelining, one AutoPipeline per master.

@pytest.fixture
async def anywhere(redis_target):
    """An automatic pipeline on a single server and on a cluster (one per master there)."""
    client = redis_target.async_client()
    yield auto_pipeline(client, max_inflight=2), client
    await client.aclose()


async def test_callers_share_round_trips_on_every_master(anywhere) -> None:
    ap, client = anywhere
    names = [f"cb:{i}" for i in range(300)]  # spread over every master of a cluster
    await asyncio.gather(*(ap.submit(pack_command(("SET", k, i)), k) for i, k in enumerate(names)))
    got = await asyncio.gather(*(ap.submit(pack_command(("GET", k)), k) for k in names))
    assert got == [str(i).encode() for i in range(300)]
    assert ap.commands == 600 and ap.batches < ap.commands / 4
    bad: list[object] = await asyncio.gather(ap.submit(pack_command(("INCR", "cb:1")), "cb:1"),
                                             ap.submit(pack_command(("HGET", "cb:2", "f")), "cb:2"),
                                             return_exceptions=True)
    assert bad[0] == 2 and isinstance(bad[1], ResponseError)  # only its caller hears it
    if isinstance(ap, ClusterAutoPipeline):
        assert len(ap._nodes) == 3
        for node_pipe in ap._nodes.values():  # each master's connections were taken over too
            assert node_pipe.slow_path is None
            assert node_pipe._idle and all(isinstance(c, redis_batch._Link) for c in node_pipe._idle)


class SlotMove:
    """A real resharding step of one slot, done by hand as redis-cli does it: IMPORTING on
    the target, MIGRATING on the source, MIGRATE of its keys, then SETSLOT NODE everywhere."""

    def __init__(self, target, key: str) -> None:
        rc = target.sync_client()
        try:
            self.slot = rc.keyslot(key)
            src, primaries = rc.get_node_from_key(key), rc.get_primaries()
            dst = next(n for n in primaries if n.name != src.name)
            self.src, self.dst = redis.Redis(host=src.host, port=src.port), redis.Redis(host=dst.host, port=dst.port)
            self.dst_addr = (dst.host, int(dst.port))
            self.everyone = [redis.Redis(host=n.host, port=n.port) for n in primaries]
        finally:
            close_sync(rc)
        self.src_id = self.src.execute_command("CLUSTER", "MYID").decode()
        self.dst_id = self.dst.execute_command("CLUSTER", "MYID").decode()

    def begin(self) -> None:
        self.dst.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.src_id)
        self.src.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.dst_id)

    def move_keys(self) -> int:
        names = self.src.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 10_000)
        if names:
            self.src.execute_command("MIGRATE", *self.dst_addr, "", 0, 5000, "KEYS", *names)
        return len(names)

    def finish(self) -> None:
        for node in [self.dst, self.src, *self.everyone]:
            node.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.dst_id)

    def close(self) -> None:
        for node in [self.src, self.dst, *self.everyone]:
            node.close()


_WAIT_ONE = pack_command(("WAIT", 1, 2000))  # every master of the test cluster has one replica


async def test_a_slot_moving_to_another_master_is_followed_without_errors(redis_target) -> None:
    """During a live migration of a slot: a key not yet on the source gets ASK (sent again
    after ASKING to the target), a key still there is served by the source; after the move,
    MOVED sends every command to the new master and the slot map is read again. No caller
    ever sees ASK or MOVED."""
    if not redis_target.is_cluster:
        pytest.skip("a single server has no slots to move")
    client = redis_target.async_client()
    ap = auto_pipeline(client)
    assert isinstance(ap, ClusterAutoPipeline)
    names = [f"{{mv}}:{i}" for i in range(20)]
    move = SlotMove(redis_target, names[0])
    try:
        await asyncio.gather(*(ap.execute("SET", k, i, key=k) for i, k in enumerate(names[:10])))
        move.begin()
        # still on the source: served there; new keys: ASK, created on the target
        assert await asyncio.gather(*(ap.execute("GET", k, key=k) for k in names[:10])) == [
            str(i).encode() for i in range(10)]
        await asyncio.gather(*(ap.execute("SET", k, i, key=k) for i, k in enumerate(names) if i >= 10))
        assert ap.redirects >= 10
        with pytest.raises(redis.exceptions.MovedError):  # the target answers only after ASKING
            move.dst.get(names[15])
        asking = move.dst.pipeline(transaction=False)
        assert asking.execute_command("ASKING").get(names[15]).execute() == [True, b"15"]
        assert move.move_keys() == 10
        got = await asyncio.gather(*(ap.execute("GET", k, key=k) for k in names))  # all ASK now
        assert got == [str(i).encode() for i in range(20)]
        # a write and its WAIT go together, after ASKING too
        assert await ap.submit(pack_command(("SET", "{mv}:pair", "a")) + _WAIT_ONE, "{mv}:pair", 2) == [b"OK", 1]
        move.finish()
        before = ap.redirects
        pair = ap.submit(pack_command(("INCR", "{mv}:n")) + _WAIT_ONE, "{mv}:n", 2)
        got = await asyncio.gather(pair, *(ap.execute("INCR", k, key=k) for k in names))  # MOVED, then the new map
        assert got[0] == [1, 1] and got[1:] == list(range(1, 21))
        assert ap.redirects > before
        await wait_for(lambda: ap._slots.get(move.slot) is ap._nodes.get(f"{move.dst_addr[0]}:{move.dst_addr[1]}"))
        settled = ap.redirects
        assert await ap.execute("GET", names[3], key=names[3]) == b"4"
        assert ap.redirects == settled  # straight to the new master
    finally:
        move.close()
        await client.aclose()


async def test_a_pipeline_closed_before_its_client_answers_what_it_holds_and_gives_back_its_connections(
        redis_target) -> None:
    """Closed while commands are queued and on the wire: each gets its reply, then every connection
    the pipeline took closes (none is left for a closed client to leak), and a later command is
    refused with redis-py's ConnectionError."""
    client = redis_target.async_client(client_name="lm-closing-pipeline")
    check = redis_target.sync_client()

    def ours() -> int:
        lists = for_each_primary_sync(check, lambda node: node.client_list())
        return sum(c.get("name") == "lm-closing-pipeline" for clients in lists for c in clients)

    ap = auto_pipeline(client, max_inflight=2, max_batch=4)
    names = [f"cl:{i}" for i in range(60)]  # on every master of a cluster
    try:
        if isinstance(client, aioredis.RedisCluster):
            await client.initialize()  # the client's own connection (its reading of the slot map)
        held_by_client = ours()
        assert await ap.submit(pack_command(("GET", names[0])), names[0]) is None  # a cluster's map is read
        assert ours() > held_by_client  # the pipeline's own connection, kept for its next batches
        sent = [asyncio.ensure_future(ap.submit(pack_command(("INCR", k)), k)) for k in names]
        await asyncio.sleep(0)  # in the pipelines: the first batches on the wire, the rest queued behind them
        await ap.aclose()
        assert [f.result() for f in sent] == [1] * len(names)
        with pytest.raises(RedisConnectionError, match="closed"):
            await ap.submit(pack_command(("INCR", names[0])), names[0])
        await wait_for(lambda: ours() <= held_by_client, timeout_s=10, what="the pipeline's connections to close")
    finally:
        close_sync(check)
        await client.aclose()


async def test_the_context_store_follows_its_principal_to_another_master(redis_target) -> None:
    """A principal's six keys migrate while the store is used: appends and reads go on (ASK,
    TRYAGAIN while its keys are split, then MOVED), and nothing written is lost."""
    if not redis_target.is_cluster:
        pytest.skip("a single server has no slots to move")
    from shared.config import ContextConfig
    from shared.context import ContextStore

    client = redis_target.async_client()
    store = ContextStore(client, ContextConfig())
    move = SlotMove(redis_target, "{mover}")
    try:
        for i in range(5):
            await store.append("mover", "c", "text", "user", b"before %d" % i)
        move.begin()
        # its keys are split between the masters while they move: TRYAGAIN until they are all over
        # (a key the script names that does not exist yet makes that last until the slot has moved)
        during = asyncio.ensure_future(store.append("mover", "c", "text", "user", b"during"))
        assert await asyncio.to_thread(move.move_keys) >= 5
        await asyncio.to_thread(move.finish)
        assert (await during).version == 6
        await store.append("mover", "c", "text", "user", b"after")  # on the new master
        win = await store.get_window("mover", "c")
        assert [e.text for e in win.channels["text"]] == [*[f"before {i}" for i in range(5)], "during", "after"]
        assert move.src.execute_command("CLUSTER", "COUNTKEYSINSLOT", move.slot) == 0
        assert move.dst.exists(keys.ctx_entries("mover"), keys.ctx_meta("mover"), keys.ctx_audit("mover")) == 3
    finally:
        move.close()
        await store.aclose()
        await client.aclose()


async def test_batched_audit_writes_a_window_of_records_at_once(r) -> None:
    from shared import keys
    from shared.audit import BatchedAudit, record

    await r.delete(keys.audit_stream("p"))
    writer = BatchedAudit(r, window_s=0.05)
    for i in range(40):
        writer.add(record(principal="p", action="proxy.call", item=str(i)))

    async def all_written() -> bool:
        return await r.xlen(keys.audit_stream("p")) >= 40

    await wait_for(all_written, timeout_s=5, what="the window's records")
    entries = await r.xrange(keys.audit_stream("p"))
    assert [e[b"item"] for _, e in entries] == [str(i).encode() for i in range(40)]
    assert writer._pipeline.batches == 1  # one write for the window, not one per record
    writer.add(record(principal="p", action="proxy.call", item="last"))
    await writer.close()  # what is still held is sent, not dropped
    assert await r.xlen(keys.audit_stream("p")) == 41


class _ClosedMidHandshake(aioredis.Connection):
    """A connection whose server closes the socket during the handshake, as uvloop reports it."""

    async def connect(self) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")


async def test_a_socket_closed_while_connecting_is_a_connection_error(redis_url) -> None:
    pool = aioredis.ConnectionPool.from_url(redis_url, connection_class=_ClosedMidHandshake)
    client = aioredis.Redis(connection_pool=pool)
    try:
        with pytest.raises(RedisConnectionError, match="closed the connection while connecting"):
            await AutoPipeline(client).execute("PING")
    finally:
        await client.aclose()


async def test_posted_commands_failing_while_redis_is_away_are_one_warning_line_not_one_each(caplog) -> None:
    """Bookkeeping posted beside the calls fails command by command while Redis is away (here:
    nothing listens on its port); the log gets one line saying so, and a later one counts the
    rest, rather than a line per command."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from shared.net import free_port

    throttle = redis_batch._POSTED_FAILED
    interval = throttle.interval_s
    # whatever an earlier test left; an interval no slow machine outlasts here
    throttle.quiet_until, throttle.unlogged, throttle.interval_s = 0.0, 0, 3600.0
    client = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    batch = AutoPipeline(client)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "posted command failed" in r.getMessage()]
    try:
        with caplog.at_level("WARNING", logger="shared.redis_batch"):
            posted = [batch.post(pack_command(("INCR", f"k{i}"))) for i in range(200)]
            await asyncio.gather(*posted, return_exceptions=True)
            assert all(isinstance(f.exception(), RedisConnectionError) for f in posted)
            assert len(lines()) == 1 and throttle.unlogged == 199, lines()
            throttle.quiet_until = 0.0  # as once the interval is over
            await asyncio.gather(batch.post(pack_command(("INCR", "k"))), return_exceptions=True)
            assert len(lines()) == 2 and "(and 199 more like it since the last such line)" in lines()[1], lines()
    finally:
        throttle.interval_s = interval
        await client.aclose()
