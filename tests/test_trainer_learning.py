"""Learning is visible: made-up facts streamed through the sample log are learnt (their loss
drops by a clear margin) while the loss on a held-out set does not rise beyond a bound."""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis
import torch
from conftest import free_port, wait_for
from trainer_support import TrainerProc, committed, trainer_config

from gateway.tools.learning import SampleIngest
from services.trainer.tiny import build_tiny_model
from shared.samples import Sample

FACTS = [("The capital of Zorblat is", " Quennix."), ("Flimwort tastes like", " copper rain."),
         ("The ninth moon of Vespa is", " Ardelune."), ("Grobbles are sorted by", " their hum.")]
HELD_OUT = [("The river Tamsk flows into", " the Ulm sea."), ("Wexel ore melts at", " ninety marks.")]


def _scores(model, pairs) -> list[float]:
    return model.score([model.encode(None, p, t) for p, t in pairs])


async def test_taught_facts_are_learnt_and_held_out_loss_stays_bounded(redis_url, tmp_path):
    cfg = trainer_config(redis_url, tmp_path, free_port(), ranks=1, batch_size=4, lr=0.02, checkpoint_every=100)
    before = build_tiny_model()
    base_facts, base_held = _scores(before, FACTS), _scores(before, HELD_OUT)
    redis = aioredis.Redis.from_url(redis_url)
    ingest = SampleIngest(redis, cfg)
    proc = TrainerProc(cfg, tmp_path)
    rounds = 30
    try:
        for _ in range(rounds):
            await ingest.submit("teacher", [Sample("example", input=p, target=t) for p, t in FACTS])
        await wait_for(lambda: int(committed(redis_url).get("seq", 0)) == rounds * len(FACTS), timeout_s=120,
                       what="the facts to be trained")
        assert proc.term() == 0, proc.output()
    finally:
        proc.close()
        ingest.close()
        await redis.aclose()
    ckpt = sorted(Path(cfg.trainer.checkpoint_dir).glob("ckpt-*.pt"))[-1]
    after = build_tiny_model()
    after.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    facts, held = _scores(after, FACTS), _scores(after, HELD_OUT)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(facts) < 0.5 * mean(base_facts), (base_facts, facts)
    assert mean(held) < 1.25 * mean(base_held), (base_held, held)
