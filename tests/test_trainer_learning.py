"""Learning is visible: made-up facts streamed through the sample log are learnt (their loss
drops by a clear margin) while the loss on a held-out set does not rise beyond a bound.

Model level: samples go gateway-side ingest -> Redis log -> ZeroMQ -> trainer process (real
model, pre-trained on the shipped corpus) -> checkpoint, and the checkpoint is scored with
``model.score`` — the same call the workers' ``score`` tool makes. Full fine-tuning of this
small model on four facts costs the held-out text about a third of extra loss (measured:
2.45 -> 3.25 nats/token while the facts go 3.56 -> 0.59), hence the bound of 1.5x.

One Redis server only: what is measured is the model; its path through Redis (ingest, log,
commit record) is the one test_trainer_ddp.py and test_trainer_served_learned.py also run on a
Redis Cluster."""

from __future__ import annotations

from pathlib import Path

import torch
from trainer_support import TrainerProc, async_redis, ledger_outcomes, trained, trainer_config

from gateway.tools.learning import SampleIngest
from shared import keys
from shared.context import ContextStore
from shared.model import build_model
from shared.samples import Example
from tests.conftest import free_port, wait_for

FACTS = [("The capital of Zorblat is", " Quennix."), ("Flimwort tastes like", " copper rain."),
         ("The ninth moon of Vespa is", " Ardelune."), ("Grobbles are sorted by", " their hum.")]
# held out: text like the corpus the base model was pre-trained on
HELD_OUT = [("Q: What is the capital of France?\nA:", " The capital of France is Paris."),
            ("The little robot keeps the small box", " before lunch."),
            ("When the garden carries the garden,", " the garden is fast.")]
ROOT = Path(__file__).resolve().parents[1]
# A small real model (pre-trained once on the shipped corpus, cached under var/model).
ANSWER_PASSES = 60
MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "max_seq": 96, "pretrain_steps": 200,
         "cache_dir": str(ROOT / "var" / "model")}


def _trained_model(cfg):
    """The model of the trainer's last checkpoint."""
    model = build_model(cfg.model)
    ckpt = sorted(Path(cfg.trainer.checkpoint_dir).glob("ckpt-*.pt"))[-1]
    model.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    return model


async def _settled(redis, redis_url: str, count: int) -> bool:
    """``count`` samples trained and no pass owed any more."""
    status = await redis.hgetall(keys.TRAINER_STATUS)
    return trained(redis_url) == count and status.get(b"replay_pending") == b"0"


def _scores(model, pairs) -> list[float]:
    return model.score([model.encode(None, p, t) for p, t in pairs])


async def test_taught_facts_are_learnt_and_held_out_loss_stays_bounded(redis_url, tmp_path):
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=1, batch_size=4, lr=1e-3, checkpoint_every=100,
                         model_factory="", model=MODEL)
    before = build_model(cfg.model)
    base_facts, base_held = _scores(before, FACTS), _scores(before, HELD_OUT)
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    proc = TrainerProc(cfg, tmp_path)
    rounds = 20
    try:
        for _ in range(rounds):
            await ingest.submit("teacher", [Example(input=p, target=t) for p, t in FACTS])
        await wait_for(lambda: trained(redis_url) == rounds * len(FACTS), timeout_s=120,
                       what="the facts to be trained")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
        ingest.close()
        await redis.aclose()
    after = _trained_model(cfg)
    facts, held = _scores(after, FACTS), _scores(after, HELD_OUT)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(facts) < 0.5 * mean(base_facts), (base_facts, facts)
    assert mean(held) < 1.5 * mean(base_held), (base_held, held)


async def test_a_fact_taught_once_is_replayed_until_the_model_gives_its_answer(redis_url, tmp_path):
    """``trainer.answer_passes``: with two fixed passes per sample this small model answers none of
    the facts taught once each; a fact whose answer the model does not give after its last pass
    gets more passes, until greedy decoding gives it (end included) or the passes run out."""
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=1, batch_size=4, lr=3e-3, checkpoint_every=1000,
                         model_factory="", model=MODEL, replay_passes=2, answer_passes=ANSWER_PASSES)
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    proc = TrainerProc(cfg, tmp_path)
    try:
        await ingest.submit("teacher", [Example(input=p, target=t) for p, t in FACTS])

        await wait_for(lambda: _settled(redis, redis_url, len(FACTS)), timeout_s=180, what="every pass over the facts")
        given = int((await redis.hget(keys.TRAINER_STATUS, "answer_passes")) or 0)
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
        ingest.close()
        await redis.aclose()
    answered = _answers(_trained_model(cfg), FACTS)
    assert all(answered), (answered, given)
    assert given > 0, "answer passes were given"


OTHER_FACTS = [(f"The {name} of Brellin is", f" {word}.") for name, word in (
    ("mayor", "Tovick"), ("bridge", "Harrow"), ("bell", "Quell"), ("mill", "Sprent"), ("well", "Dunmore"),
    ("tower", "Ysolde"), ("market", "Farrow"), ("gate", "Pelloc"), ("road", "Wendle"), ("inn", "Gallop"),
    ("school", "Minder"), ("harbour", "Kestle"))]


def _answers(model, pairs) -> list[bool]:
    examples = [model.encode(None, p) for p, _ in pairs]
    out = [b"".join(chunks) for chunks in zip(*model.generate(examples, max_tokens=24, temperature=0.0),
                                              strict=True)]
    return [o.decode(errors="replace") == t for o, (_, t) in zip(out, pairs, strict=True)]


async def test_answers_taught_are_kept_while_other_facts_are_trained_after_them_also_across_a_restart(
        redis_url, tmp_path):
    """``trainer.recall_per_step``: the four facts, once answered, are remembered; the
    checkpoint keeps them, so the restarted trainer recalls them into the steps that train
    twelve other facts after them, and the model still gives them."""
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=1, batch_size=4, lr=3e-3, checkpoint_every=1000,
                         model_factory="", model=MODEL, replay_passes=2, answer_passes=ANSWER_PASSES)
    assert cfg.trainer.recall_per_step > 0, "shipped on"
    redis = async_redis(redis_url)
    ingest = SampleIngest(redis, cfg)
    proc = TrainerProc(cfg, tmp_path)

    async def recalled() -> int:
        return int((await redis.hget(keys.TRAINER_STATUS, "recall_facts")) or -1)

    async def all_recalled() -> bool:
        return await recalled() == len(FACTS)
    try:
        await ingest.submit("teacher", [Example(input=p, target=t) for p, t in FACTS])
        await wait_for(lambda: _settled(redis, redis_url, len(FACTS)), timeout_s=180, what="every pass over the facts")
        remembered = await recalled()
        assert proc.term() == 0, proc.output()  # its checkpoint keeps what it recalls
        proc.close()
        await redis.hdel(keys.TRAINER_STATUS, "recall_facts")
        proc = TrainerProc(cfg, tmp_path)
        await wait_for(all_recalled, timeout_s=120,
                       what=lambda: f"the restarted trainer to recall the facts\n{proc.output()}")
        for p, t in OTHER_FACTS:  # traffic after them, a call at a time
            await ingest.submit("other", [Example(input=p, target=t)])
        await wait_for(lambda: _settled(redis, redis_url, len(FACTS) + len(OTHER_FACTS)), timeout_s=240,
                       what="every pass over the other facts")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
        ingest.close()
        await redis.aclose()
    assert remembered == len(FACTS), "each fact answered is remembered once"
    assert f"recalling {len(FACTS)} answered fact(s) the checkpoint kept" in proc.output()
    model = _trained_model(cfg)
    assert all(_answers(model, FACTS)), "the first facts are still answered after the others"
    assert any(_answers(model, OTHER_FACTS)), "the others were learnt as well"


async def test_a_sample_the_model_cannot_encode_is_skipped_and_training_goes_on(redis_url, tmp_path):
    """The store keeps any bytes under the image modality; the model cannot decode these. The
    sample naming that context is consumed without training (``bad_input``), decided once by
    rank 0, and the samples after it are trained: the trainer does not fail its ranks on it
    (and again at every restart, the sample being durable in the log)."""
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=2, batch_size=4, checkpoint_every=1000,
                         model_factory="", model=MODEL)
    redis = async_redis(redis_url)
    store = ContextStore(redis, cfg.context)
    ingest = SampleIngest(redis, cfg, store)
    proc = None
    try:
        await store.append("alice", "pic", "text", "user", b"look at this")
        pic = await store.append("alice", "pic", "image", "user", b"AAAA", mime="image/png")
        bad = await ingest.submit("alice", [Example(input="What is it?", target=" A cat.", context_id="pic",
                                                    version=pic.version)])
        good = await ingest.submit("alice", [Example(input=p, target=t) for p, t in FACTS])
        proc = TrainerProc(cfg, tmp_path)
        await wait_for(lambda: trained(redis_url) == 1 + len(FACTS), timeout_s=120,
                       what=lambda: f"the trainer to consume every sample\n{proc.output()}")
        stats = await ingest.stats()
        assert proc.term() == 0, proc.output()
    finally:
        if proc is not None:
            proc.close()
        ingest.close()
        await store.aclose()  # its batches before the client (ContextStore.aclose)
        await redis.aclose()
    trained_ids, skipped = ledger_outcomes(redis_url)
    assert skipped == {bad["ids"][0]: "bad_input"}
    assert sorted(trained_ids) == sorted(good["ids"])
    assert stats["skipped"] == {"bad_input": 1}
    assert "image could not be decoded" in proc.output()
