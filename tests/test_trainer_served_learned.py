"""What the trainer records is what it trained: replay passes, skipped samples kept out of the
ledger with their reason, and offsets bound to the identity of the sample log they count in
(on one server and on a Redis Cluster, whose sample log is split into partitions)."""

from __future__ import annotations

import pytest
from trainer_support import (
    TrainerProc,
    async_redis,
    committed,
    ledger_outcomes,
    position,
    sync_redis_open,
    trained,
    trainer_config,
)

from gateway.tools.learning import SampleIngest
from services.trainer import ledger
from services.trainer.data import TrainRecord
from services.trainer.leader import outcomes
from services.trainer.replay import ASK_BATCH, ReplayBuffer
from shared import keys
from shared.context import ContextStore
from shared.samples import (
    Example,
    Feedback,
    LoggedSample,
    Sample,
    learned_token,
    parse_learned_token,
    partition_of,
    sample_partitions,
)
from tests.conftest import free_port, wait_for


def _record(seq: int, sample: Sample | None = None, skip: str = "") -> TrainRecord:
    s = sample or Example(input=f"q{seq}", target=f"a{seq}")
    return TrainRecord(LoggedSample(f"e-{seq}:0", seq, "alice", s, f"e-{seq}"), None, skip=skip)


def test_replay_gives_every_sample_its_passes_mixed_and_tracks_what_is_settled() -> None:
    buf = ReplayBuffer(passes=3, capacity=100, seed=1)
    buf.add([_record(i) for i in range(1, 9)])
    assert buf.settled_seqs({0: 8}) == {0: 0}, "no sample has had all its passes yet"
    passes: dict[int, int] = {}
    steps = []
    while len(buf):
        step = buf.take(3)
        assert all(r.replay for r in step)
        seqs = [r.logged.seq for r in step]
        assert len(set(seqs)) == len(seqs), "a sample at most once per step"
        steps.append(seqs)
        for q in seqs:
            passes[q] = passes.get(q, 0) + 1
    assert passes == {i: 2 for i in range(1, 9)}, "every sample gets exactly passes - 1 replays"
    assert steps[0] != [1, 2, 3], "replays are drawn at random, not in arrival order"
    assert buf.settled_seqs({0: 8}) == {0: 8} and buf.take(3) == []


def test_replay_settled_seq_is_below_the_oldest_sample_still_owed_a_pass() -> None:
    buf = ReplayBuffer(passes=2, capacity=100, seed=2)
    buf.add([_record(i) for i in range(1, 4)])
    taken = {r.logged.seq for r in buf.take(2)}
    owed = {1, 2, 3} - taken
    assert buf.settled_seqs({0: 3, 1: 5}) == {0: min(owed) - 1, 1: 5}, "per partition of the log"


def test_a_short_answer_not_given_yet_gets_more_passes_up_to_the_limit() -> None:
    """After its last pass a sample with a short target is judged; one not answered goes back
    for one more pass at a time, up to ``answer_passes``, and counts as unsettled meanwhile. Long
    targets and samples already answered keep their fixed passes."""
    buf = ReplayBuffer(passes=2, capacity=100, seed=3, answer_passes=2, answer_max_bytes=8)
    short, long_ = _record(1, Example(input="q", target="short")), _record(2, Example(input="q", target="x" * 9))
    buf.add([short, long_])
    assert {r.logged.seq for r in buf.take(5)} == {1, 2} and len(buf) == 0
    assert [item[0] for item in buf.due] == [short], "only the short target is judged"
    assert buf.settled_seqs({0: 2}) == {0: 0}, "a sample waiting for its verdict is not settled"
    asked: list[list[int]] = []

    def never(records: list[TrainRecord]) -> list[bool]:
        asked.append([r.logged.seq for r in records])
        return [False] * len(records)
    assert buf.judge(never) == 1 and len(buf) == 1 and buf.settled_seqs({0: 2}) == {0: 0}
    for _ in range(3):
        taken = buf.take(5)
        buf.judge(never)
        assert [r.logged.seq for r in taken] in ([1], []), taken
    assert asked == [[1], [1]], "judged while a pass can follow: two more passes at most"
    assert buf.answer_passes_given == 2 and len(buf) == 0 and buf.settled_seqs({0: 2}) == {0: 2}

    answered = ReplayBuffer(passes=2, capacity=100, answer_passes=5, answer_max_bytes=8)
    answered.add([_record(3, Example(input="q", target="yes"))])
    answered.take(5)
    assert answered.judge(lambda rs: [True] * len(rs)) == 0 and len(answered) == 0
    assert answered.judge(never) == 0 and asked == [[1], [1]], "nothing due: the model is not asked"
    once = ReplayBuffer(passes=1, capacity=10, answer_passes=5, answer_max_bytes=8)
    once.add([_record(4, Example(input="q", target="yes"))])
    assert len(once) == 0 and once.take(5) == [] and once.due == [], "one pass: no replay, no verdict"


def test_an_answer_lost_to_later_steps_is_asked_again_and_taught_again_before_it_is_settled() -> None:
    """Once no pass is owed, the model is asked again about every fact it answered since the
    buffer last ran empty (one copy each); if it no longer gives one, every fact gets one more
    pass, one copy each in one step, and the batch stays unsettled until weights give every
    answer."""
    buf = ReplayBuffer(passes=2, capacity=100, seed=4, answer_passes=3, answer_max_bytes=8)
    copies = [_record(i, Example(input="capital", target="Quix")) for i in (1, 2, 3)]
    buf.add(copies)
    given = {1, 2, 3, 4}  # what the model answers now, by seq
    asked: list[list[int]] = []

    def model(records: list[TrainRecord]) -> list[bool]:
        asked.append(sorted(r.logged.seq for r in records))
        return [r.logged.seq in given for r in records]

    assert sorted(r.logged.seq for r in buf.take(3)) == [1, 2, 3]
    buf.add([_record(4, Example(input="moon", target="Oodle"))])  # trained fresh in the same step
    assert buf.judge(model) == 0 and asked == [[1, 2, 3]], "answered at their last pass; a pass is owed"
    assert buf.settled_seqs({0: 4}) == {0: 3}, "settled up to the sample still owed a pass"
    given = {4}  # the step on the other sample made the model lose the fact taught three times
    assert [r.logged.seq for r in buf.take(3)] == [4]
    assert buf.judge(model) == 1, "no pass owed any more: all are asked again, one fact is lost"
    assert asked[1:] == [[4], [1, 4]] and len(buf) == 2, "asked and sent back: one copy of each fact"
    assert buf.settled_seqs({0: 4})[0] < 3, "the copies sent back are not settled"
    again = sorted(r.logged.seq for r in buf.take(3))
    assert again == [1, 4], "in one step"
    given = {1, 2, 3, 4}
    assert buf.judge(model) == 0 and buf.settled_seqs({0: 4}) == {0: 4}, "answered by the last weights: settled"
    assert asked[2:] == [[1, 4]] * 2, "asked with the others once the buffer is empty again"
    assert buf.answer_passes_given == 1 and len(buf) == 0


def test_answered_facts_are_recalled_in_steps_one_copy_per_prompt_and_taught_anew_replaces_them() -> None:
    """``recall_per_step``: a fact answered at its last pass is remembered (one copy per
    principal, context and prompt) and drawn into later steps as a replay; a newer sample with
    the same prompt drops the old answer; the oldest give way beyond ``recall_facts``; a fact
    not answered is not remembered; clear() forgets them all."""
    buf = ReplayBuffer(passes=2, capacity=100, seed=7, answer_passes=2, answer_max_bytes=8,
                       recall_per_step=2, recall_facts=3)
    assert buf.recall() == [], "nothing answered yet"
    facts = [_record(i, Example(input=f"q{(i - 1) // 2}", target=f"a{(i - 1) // 2}")) for i in range(1, 9)]
    buf.add(facts)  # four facts, two copies each
    buf.take(8)
    assert buf.judge(lambda rs: [r.logged.seq != 7 and r.logged.seq != 8 for r in rs]) > 0
    assert buf.remembered == 3, "one copy per prompt, the one not answered left out"
    drawn = [buf.recall() for _ in range(30)]
    assert all(len(d) == 2 and all(r.replay for r in d) and len({r.logged.seq for r in d}) == 2 for d in drawn)
    prompts = {r.logged.sample.training_pair()[0] for d in drawn for r in d}
    assert prompts == {"q0", "q1", "q2"}, prompts
    assert buf.settled_seqs({0: 8})[0] == 6, "recalled facts settle nothing and hold nothing back"
    buf.add([_record(9, Example(input="q1", target="new"))])
    assert buf.remembered == 2 and all(r.logged.sample.training_pair()[0] != "q1"
                                      for _ in range(10) for r in buf.recall()), "taught anew: not recalled"
    for seq in (10, 11):
        buf.add([_record(seq, Example(input=f"n{seq}", target="x"))])
        buf.take(8)
        buf.judge(lambda rs: [True] * len(rs))
    assert buf.remembered == 3
    recalled = {r.logged.sample.training_pair() for _ in range(20) for r in buf.recall()}
    assert recalled == {("q1", "new"), ("n10", "x"), ("n11", "x")}, "the new answer remembered, the oldest gave way"
    kept = buf.memory_bytes()
    buf.clear(recall=False)
    assert buf.remembered == 3, "passes forgotten, the facts kept for recall stay"
    buf.clear()
    assert buf.remembered == 0 and buf.recall() == [] and buf.memory_bytes() == b""
    buf.add([_record(12, Example(input="n12", target="y"))])
    buf.take(1)
    buf.judge(lambda rs: [True] * len(rs))  # remembered after the checkpoint was written
    buf.restore_memory(kept)
    assert buf.remembered == 3, "the checkpoint's facts come back, the oldest giving way"
    recalled = {r.logged.sample.training_pair() for _ in range(20) for r in buf.recall()}
    assert recalled == {("n10", "x"), ("n11", "x"), ("n12", "y")}, "the newest stay the newest"
    off = ReplayBuffer(passes=2, capacity=10, answer_passes=2, answer_max_bytes=8)
    off.add([_record(1, Example(input="q", target="yes"))])
    off.take(1)
    off.judge(lambda rs: [True] * len(rs))
    assert off.remembered == 0 and off.recall() == [], "recall_per_step 0: nothing kept"


def test_a_fact_that_stays_lost_goes_back_at_most_answer_passes_times() -> None:
    buf = ReplayBuffer(passes=2, capacity=100, seed=5, answer_passes=2, answer_max_bytes=8)
    buf.add([_record(i, Example(input="q", target="yes")) for i in (1, 2, 3)])
    calls: list[int] = []

    def fickle(records: list[TrainRecord]) -> list[bool]:  # answers once, never again
        calls.append(len(records))
        return [len(calls) == 1] * len(records)
    buf.take(3)
    given = buf.judge(fickle)
    for _ in range(10):
        buf.take(3)
        given += buf.judge(fickle)
    assert len(buf) == 0 and buf.due == [] and buf.settled_seqs({0: 3}) == {0: 3}, "it ends, settled"
    assert given == buf.answer_passes_given <= 2 + 2, "answer_passes asked back, plus those judged at a last pass"


def test_the_second_question_asks_only_what_greedy_decoding_gives() -> None:
    """At a sample's last pass the answer must hold with a margin (steps follow); once no pass
    is owed the buffer asks ``given`` (greedy decoding as it is), so an answer that holds by a
    smaller margin costs no pass then."""
    buf = ReplayBuffer(passes=2, capacity=10, answer_passes=2, answer_max_bytes=8)
    buf.add([_record(1, Example(input="q", target="yes"))])
    buf.take(1)
    asked: list[str] = []

    def with_margin(records: list[TrainRecord]) -> list[bool]:
        asked.append("margin")
        return [True] * len(records)

    def greedy(records: list[TrainRecord]) -> list[bool]:
        asked.append("greedy")
        return [False] * len(records)
    assert buf.judge(with_margin, greedy) == 1 and asked == ["margin", "greedy"] and len(buf) == 1


def test_the_second_question_asks_one_copy_per_fact_in_bounded_batches() -> None:
    buf = ReplayBuffer(passes=2, capacity=1000, answer_passes=2, answer_max_bytes=8)
    facts = [_record(i, Example(input=f"q{(i - 1) // 2}", target="yes")) for i in range(1, 601)]  # 300 facts, 2 copies
    buf.add(facts)
    sizes: list[int] = []

    def model(records: list[TrainRecord]) -> list[bool]:
        sizes.append(len(records))
        return [True] * len(records)
    buf.take(600)
    assert buf.judge(model) == 0 and len(buf) == 0
    assert sizes == [600, ASK_BATCH, 300 - ASK_BATCH], "all due at once, then each fact once, in batches"


def test_replay_capacity_drops_the_oldest_and_one_pass_means_no_replay() -> None:
    buf = ReplayBuffer(passes=2, capacity=2)
    buf.add([_record(i) for i in range(1, 5)])
    assert sorted(r.logged.seq for r in buf.take(10)) == [3, 4] and buf.dropped == 2
    single = ReplayBuffer(passes=1, capacity=10)
    single.add([_record(1)])
    assert len(single) == 0 and single.take(5) == []


def test_replay_buffer_overflow_is_logged_however_many_samples_a_step_adds(caplog) -> None:
    """Samples that lose their remaining passes are said in the log: at the first loss, then
    every 1000, also when steps add several samples at once (the count skips over 1 and 1000)."""
    buf = ReplayBuffer(passes=2, capacity=4)
    with caplog.at_level("WARNING", logger="learnmesh.trainer"):
        for start in range(0, 4 + 3 * 400, 3):
            buf.add([_record(i) for i in range(start, start + 3)])
    lost = [r.getMessage() for r in caplog.records if "lost remaining passes" in r.getMessage()]
    assert buf.dropped == 3 * 401 + 3 - 4 and len(lost) == 2, lost
    assert lost[0].endswith(": 2 sample(s) lost remaining passes") and ": 1001 sample(s)" in lost[1]


def test_outcomes_never_count_a_sample_without_gradient_as_trained() -> None:
    down = Feedback(input="q", generation_id="g", output="a", preference="down")
    trained, skipped = outcomes([_record(1), _record(2, skip="context_gone"), _record(3, down)])
    assert trained == ["e-1:0"]
    assert skipped == {"e-2:0": "context_gone", "e-3:0": "no_gradient"}


def test_learned_tokens_round_trip_and_refuse_anything_else() -> None:
    assert parse_learned_token(learned_token("ab12", 42)) == ("ab12", 42, 0)
    assert learned_token("ab12", 42) == "ab12.42", "partition 0 keeps the one-partition form"
    assert parse_learned_token(learned_token("ab12", 42, 5)) == ("ab12", 42, 5)
    for bad in (None, 42, "", "ab12", "ab12.", ".5", "a.b.3", "ab 1.3", "ab12.-3", "x" * 70 + ".1", "ab.1.2.3",
                "ab12.4.", "ab12.4.x", "ab12.4.-1", "ab12.4.12345"):
        with pytest.raises(ValueError):
            parse_learned_token(bad)


async def test_a_copied_context_trains_however_old_its_version_gets_and_a_lost_one_is_skipped(redis_target, tmp_path):
    redis_url = redis_target.url
    # windows up to 64 content bytes are copied into the log with their samples; larger ones are
    # read from the store when trained, and can age out first
    cfg = trainer_config(redis_url, tmp_path, free_port(), max_context_copy_bytes=64)
    redis = async_redis(redis_url)
    store = ContextStore(redis, cfg.context)
    ingest = SampleIngest(redis, cfg, store)
    proc = None
    try:
        small = await store.append("alice", "small", "text", "user", b"hello there")
        big = await store.append("alice", "big", "text", "user", b"x" * 200)
        ok = await ingest.submit("alice", [Example(input="hi", target=" there")])
        copied = await ingest.submit("alice", [Example(input="x", target=" y", context_id="small",
                                                      version=small.version)])
        aged = await ingest.submit("alice", [Example(input="x", target=" y", context_id="big",
                                                    version=big.version)])
        down = await ingest.submit("alice", [Feedback(input="q", generation_id="g1", output="a",
                                                    preference="down")])
        # both versions age out of the store before the trainer reaches the samples
        for i in range(cfg.context.versions_retained + 2):
            await store.append("alice", "small", "text", "user", f"turn {i}".encode())
            await store.append("alice", "big", "text", "user", f"turn {i}".encode())
        proc = TrainerProc(cfg, tmp_path)
        await wait_for(lambda: trained(redis_url) == 4, timeout_s=90,
                       what=lambda: f"the trainer to consume all four samples\n{proc.output()}")
        assert proc.term() == 0, proc.output()
        stats = await ingest.stats()
    finally:
        if proc is not None:
            proc.close()
        ingest.close()
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()
    trained_ids, skipped = ledger_outcomes(redis_url)
    assert sorted(trained_ids) == sorted(ok["ids"] + copied["ids"]), "a copied context trains after its version aged out"
    assert skipped == {aged["ids"][0]: "context_gone", down["ids"][0]: "no_gradient"}
    assert stats["skipped"] == {"context_gone": 1, "no_gradient": 1}
    assert stats["trained_seq"] == 4


def test_copied_windows_round_trip_through_a_log_entry() -> None:
    from shared.samples import pack_windows, parse_entry
    from shared.types import ContextWindow, Entry

    img = Entry("image:1", "image", "user", bytes(range(256)) * 3, "image/png", 0, 768, 5)
    txt = Entry("text:2", "text", "user", "é and ok".encode(), None, 3, 9, 6, ("image:1",))
    window = ContextWindow("alice", "c", 7, {"text": [txt], "image": [img]})
    sample = Example(input="x", target="y", context_id="c", version=7)
    fields = {b"seq": b"3", b"n": b"2", b"p": b"alice", b"s": b"[" + sample.to_json() + b"," +
              Example(input="a", target="b").to_json() + b"]", b"c": pack_windows([window])}
    got = parse_entry(b"1-0", fields)
    assert got[0].window == window and got[0].window.channels["image"][0].content == img.content
    assert got[1].window is None


async def test_a_trainer_against_a_log_that_lost_its_data_trains_the_new_log_from_its_start(redis_target, tmp_path):
    redis_url = redis_target.url
    cfg = trainer_config(redis_url, tmp_path, free_port(), checkpoint_every=2)
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    first = second = None

    async def teach(n: int, tag: str) -> dict:
        return await ingest.submit("alice", [Example(input=f"{tag}{i}", target=f" {i}") for i in range(n)])

    def trained_with(seq: int, log: str) -> bool:
        return position(committed(redis_url), cfg, "alice") == (seq, log)

    try:
        old = await teach(8, "old")
        first = TrainerProc(cfg, tmp_path)
        await wait_for(lambda: trained_with(8, old["learned"].partition(".")[0]), timeout_s=90,
                       what=lambda: f"the first log trained\n{first.output()}")
        assert first.term() == 0, first.output()  # checkpoint at seq 8 of the old log

        await redis.flushdb()  # a Redis that lost its data (every master): an empty log numbers from 1 again
        new = await teach(5, "new")
        new_log = new["learned"].partition(".")[0]
        assert new_log != old["learned"].partition(".")[0] and new["seqs"] == [1, 2, 3, 4, 5]
        second = TrainerProc(cfg, tmp_path)
        await wait_for(lambda: trained_with(5, new_log), timeout_s=90,
                       what=lambda: f"the new log trained from its start\n{second.output()}")
        with sync_redis_open(redis_url) as r:
            assert set(new["ids"]) <= set(ledger.trained_ids(r))
            assert int(committed(redis_url)["step"]) > 1, "the weights (and steps) of the checkpoint were kept"

            await redis.flushdb()  # and once more while the trainer runs
            again = await teach(3, "again")
            await wait_for(lambda: trained_with(3, again["learned"].partition(".")[0]), timeout_s=90,
                           what=lambda: f"the log recreated under a running trainer\n{second.output()}")
            assert set(again["ids"]) <= set(ledger.trained_ids(r))
            # the step is committed before it is published, and only the publish marks its version
            part = partition_of("alice", sample_partitions(cfg))
            new_log = again["learned"].partition(".")[0]
            await wait_for(lambda: r.zcard(keys.model_version_seq(part, new_log)) >= 1, timeout_s=10,
                           what="a version marked with the new log's seq")
        assert second.term() == 0, second.output()
        out = second.output()
        assert "is gone" in out and f"sample log partition {part} changed" in out, out
    finally:
        for p in (first, second):
            if p is not None:
                p.close()
        ingest.close()
        await redis.aclose()


async def test_samples_whose_passes_were_owed_at_a_restart_are_answered_by_the_restored_version(
        redis_target, tmp_path):
    """Passes still owed when the trainer stops are not repeated after it restarts: the version
    it resumes with holds those samples, and their after_learn token resolves to it at once,
    with no further sample to make a step."""
    redis_url = redis_target.url
    # passes enough to be owed however slowly the test looks (the tiny model takes ~100 steps a second)
    cfg = trainer_config(redis_url, tmp_path, free_port(), replay_passes=100_000, checkpoint_every=100_000)
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    part = partition_of("alice", sample_partitions(cfg))
    first = second = None
    try:
        taught = await ingest.submit("alice", [Example(input=f"q{i}", target=f" a{i}") for i in range(4)])
        log_id, seq, _ = parse_learned_token(taught["learned"])
        first = TrainerProc(cfg, tmp_path)
        await wait_for(lambda: position(committed(redis_url), cfg, "alice")[0] == seq, timeout_s=90,
                       what=lambda: f"the samples' first pass\n{first.output()}")
        assert first.term() == 0, first.output()
        status = await redis.hgetall(keys.TRAINER_STATUS)
        assert int(status[b"replay_pending"]) > 0, "passes were still owed at the stop"

        async def answered() -> list[bytes]:
            return await redis.zrangebyscore(keys.model_version_seq(part, log_id), seq, "+inf", start=0, num=1)

        assert await answered() == []
        second = TrainerProc(cfg, tmp_path)
        await wait_for(answered, timeout_s=90, what=lambda: f"a version holding the samples\n{second.output()}")
        assert b"replay_pending" not in await redis.hgetall(keys.TRAINER_STATUS), "the passes owed before are not"
        assert second.term() == 0, second.output()
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.close()
        ingest.close()
        await redis.aclose()
