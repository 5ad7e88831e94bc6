"""Teach and answer, on a whole mesh (``learnmesh up``) with the shipped defaults.

Ten made-up facts (examples/facts.py), eight copies each, go in through one ``learn`` call.
Reported, before and after:

* greedy answers (temperature 0) on each taught prompt: how many reproduce the taught
  continuation (target: at least 8 of 10), asked with the acknowledgement's ``learned`` token,
  and the time from the acknowledgement to the answers (target: within 5 s);
* loss (nats/token, ``score``) on the taught facts, on ten control sentences of the same
  style that were never taught (their relative fall must be less than half the taught one)
  and on windows of the corpus's held-out tenth, which rehearsal never draws from (may rise
  at most 5 %);
* the served-vs-trainer weight gap (‖trainer − served‖ / ‖trainer‖, from the trainer's
  ``delta`` report) while teaching and after the last step, and the time until every worker
  reports the trainer's exact weights digest (bit-exact; target within 1 s of idle);
* learn acknowledgement → every worker serving a version that holds the samples, p50/p99 over
  ``--probes`` single-sample ``learn`` calls (resolution: the workers' heartbeat interval).

The baseline is the same mesh before teaching (the "before" column), in the same run.

``--traffic RATE`` measures answers under traffic instead: other made-up facts keep arriving
through ``learn`` at RATE samples/s, so the replay buffer never runs empty, and the ten facts
are taught in the middle of it. Reported: how many the workers give at ``after_learn`` and
again after ``--hold`` more seconds of traffic (asked without a wait: what is served then),
the fewest replay samples pending while it ran, and the answer passes given.

    .venv/bin/python bench/bench_learning.py [--probes 10] [--json out.json]
    .venv/bin/python bench/bench_learning.py --traffic 1 [--hold 60] [--set trainer.recall_per_step=0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from facts import CONTROLS, COPIES, FACTS  # noqa: E402

from bench.mesh_support import McpHttp, Mesh, RedisServer  # noqa: E402
from shared import keys  # noqa: E402
from shared.config import ModelConfig  # noqa: E402
from shared.model.pretrain import corpus_windows  # noqa: E402
from shared.samples import parse_learned_token  # noqa: E402
from shared.text import as_str  # noqa: E402

HELD_OUT = 48


def shipped_config(mesh: Mesh, overrides: list[str]) -> None:
    """Keep only what must differ from the shipped defaults (free ports, paths, fast status);
    ``overrides`` (``section.key=value``) make an extra, labelled row."""
    cfg = mesh.cfg
    cfg["model"] = {"cache_dir": str(ROOT / "var" / "model")}  # the default model, pre-trained once
    t = cfg["trainer"]
    cfg["trainer"] = {k: t[k] for k in ("samples_endpoint", "master_port", "checkpoint_dir")}
    cfg["consistency"] = {}
    cfg["metrics"]["status_interval_s"] = 0.1  # reporting only: resolution of the digest comparison
    for item in overrides:
        dotted, _, value = item.partition("=")
        section, _, key = dotted.partition(".")
        cfg.setdefault(section, {})[key] = yaml.safe_load(value)
    mesh.config_path.write_text(yaml.safe_dump(cfg))


class GapSampler(threading.Thread):
    """The trainer's ``delta`` report and the workers' digests, every 50 ms."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(daemon=True)
        import redis

        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.stop = threading.Event()
        self.series: list[tuple[float, float, int]] = []  # (t, served_gap, version)
        self.exact_at: float | None = None
        self.exact_version = 0

    def snapshot(self) -> tuple[dict[str, str], list[dict[str, str]]]:
        delta = self._hash(keys.component_status("delta"))
        workers = [self._hash(keys.component_status(as_str(c))) for c in self.r.smembers(keys.STATUS_INDEX)
                   if as_str(c).startswith("worker:")]
        return delta, [w for w in workers if w]

    def _hash(self, key: str) -> dict[str, str]:
        return {as_str(k): as_str(v) for k, v in self.r.hgetall(key).items()}

    def run(self) -> None:
        while not self.stop.wait(0.05):
            delta, workers = self.snapshot()
            if not delta:
                continue
            now = time.monotonic()
            self.series.append((now, float(delta.get("served_gap") or 0.0), int(delta.get("version") or 0)))
            digest = delta.get("weights_digest")
            exact = bool(digest) and len(workers) >= 2 and all(w.get("weights_digest") == digest for w in workers)
            if exact and self.exact_at is None:
                self.exact_at, self.exact_version = now, int(delta.get("version") or 0)
            elif not exact:
                self.exact_at = None


async def measure(client: McpHttp, pairs: list[tuple[str, str]], **wait: Any) -> tuple[float, int]:
    nll, version = [], 0
    for prompt, target in pairs:
        r = await client.call("score", {"prompt": prompt, "target": target, **wait})
        nll.append(r["nll"])
        version = max(version, r["model_version"])
    return statistics.fmean(nll), version


async def answers(client: McpHttp, **wait: Any) -> list[str]:
    out = []
    for prompt, target in FACTS:
        r = await client.call("generate", {"prompt": prompt, "max_tokens": len(target.encode()) + 4,
                                           "temperature": 0.0, "append": False, **wait})
        out.append(r["text"])
    return out


async def probe_sync(client: McpHttp, mesh: Mesh, n: int) -> list[float]:
    """learn ack -> every worker serving a version that holds the sample (heartbeat resolution)."""
    r = mesh.redis()
    out = []
    try:
        for i in range(n):
            ack = await client.call("learn", {"input": f"probe {i} says", "target": f" ok {i}."})
            t0 = time.monotonic()
            log_id, seq, part = parse_learned_token(ack["learned"])
            deadline = t0 + 120
            while time.monotonic() < deadline:
                found = r.zrangebyscore(keys.model_version_seq(part, log_id), seq, "+inf", start=0, num=1)
                versions = mesh.worker_versions()
                if found and len(versions) >= mesh.workers and min(versions) >= int(as_str(found[0])):
                    out.append(time.monotonic() - t0)
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.0)  # let the trainer go idle between probes
    finally:
        r.close()
    return out


async def experiment(mesh: Mesh, key: str, probes: int) -> dict[str, Any]:
    import httpx

    # generate/score with after_learn wait for training (consistency.learn_wait_s)
    http = httpx.AsyncClient(timeout=300)
    client = await McpHttp(mesh.base, key, client=http).open()
    rng = random.Random(11)
    seq = ModelConfig().pretrain_seq - 3
    windows = corpus_windows(HELD_OUT, rng, seq, held_out=True)  # the tenth rehearsal never draws from
    held = [(a.decode(errors="replace"), b.decode(errors="replace")) for a, b in windows]
    held = [(a, b) for a, b in held if a.strip() and b.strip()]
    sampler = GapSampler(mesh.redis_url)
    try:
        before = {"taught": await measure(client, FACTS), "control": await measure(client, CONTROLS),
                  "held_out": await measure(client, held)}
        answers_before = await answers(client)
        sampler.start()
        samples = [{"kind": "example", "input": p, "target": t} for p, t in FACTS for _ in range(COPIES)]
        ack = await client.call("learn", {"samples": samples})
        acked = time.monotonic()
        answers_after = await answers(client, after_learn=ack["learned"])
        answered_s = time.monotonic() - acked
        wait = {"after_learn": ack["learned"]}
        after = {"taught": await measure(client, FACTS, **wait), "control": await measure(client, CONTROLS, **wait),
                 "held_out": await measure(client, held, **wait)}
        deadline = time.monotonic() + 60
        while sampler.exact_at is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        sampler.stop.set()
        sampler.join()
        answers_exact = await answers(client, min_model_version=sampler.exact_version) \
            if sampler.exact_at is not None else []
        exact_at = sampler.exact_at
        series = [(round(t - acked, 2), g, v) for t, g, v in sampler.series]
        last_step = _last_lossy(series)
        sync = await probe_sync(client, mesh, probes)
    finally:
        await client.close()
        await http.aclose()
    hits, hits_exact = _hits(answers_after), _hits(answers_exact)
    return {"before": before, "after": after, "answers_before": answers_before, "answers_after": answers_after,
            "hits": hits, "hits_exact": hits_exact, "answered_s": answered_s, "gap_series": series, "last_lossy_s": last_step,
            "exact_after_ack_s": None if exact_at is None else exact_at - acked, "learn_to_all_workers_s": sync}


async def under_traffic(mesh: Mesh, key: str, rate: float, hold_s: float) -> dict[str, Any]:
    """Teach the ten facts while other facts arrive at ``rate`` samples/s (see the module notes)."""
    import httpx

    http = httpx.AsyncClient(timeout=300)
    client = await McpHttp(mesh.base, key, client=http).open()
    feeder = await McpHttp(mesh.base, key, client=http).open()
    r = mesh.redis()
    stop = asyncio.Event()
    sent = 0

    async def feed() -> None:
        nonlocal sent
        while not stop.is_set():
            await feeder.call("learn", {"input": f"Locker {sent} of the Vantle depot holds", "target": f" crate {sent * 7 % 1000}."})
            sent += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / rate)

    def status() -> dict[str, str]:
        return {as_str(k): as_str(v) for k, v in r.hgetall(keys.TRAINER_STATUS).items()}

    pending: list[int] = []

    async def watch() -> None:
        while not stop.is_set():
            pending.append(int(status().get("replay_pending") or 0))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    tasks = [asyncio.create_task(feed())]
    try:
        while int(status().get("replay_pending") or 0) == 0:  # the traffic has reached the buffer
            await asyncio.sleep(0.2)
        tasks.append(asyncio.create_task(watch()))
        passes_before = int(status().get("answer_passes") or 0)
        samples = [{"kind": "example", "input": p, "target": t} for p, t in FACTS for _ in range(COPIES)]
        ack = await client.call("learn", {"samples": samples})
        acked = time.monotonic()
        at_ack = await answers(client, after_learn=ack["learned"])
        answered_s = time.monotonic() - acked
        await asyncio.sleep(hold_s)  # the traffic goes on: what is served after it
        held = await answers(client)
        passes = int(status().get("answer_passes") or 0) - passes_before
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await feeder.close()
        await client.close()
        await http.aclose()
        r.close()
    return {"rate": rate, "hold_s": hold_s, "sent": sent, "hits_after_learn": _hits(at_ack), "answered_s": answered_s,
            "hits_held": _hits(held), "min_replay_pending": min(pending) if pending else None,
            "answer_passes": passes, "answers_after_learn": at_ack, "answers_held": held}


def report_traffic(res: dict[str, Any], label: str) -> None:
    print(f"ten facts x {COPIES} taught under traffic of {res['rate']:g} other samples/s ({label}):")
    print(f"  answered at after_learn: {res['hits_after_learn']} of {len(FACTS)} ({res['answered_s']:.1f} s after the ack)")
    print(f"  answered after {res['hold_s']:g} s more traffic: {res['hits_held']} of {len(FACTS)}")
    print(f"  fewest replay samples pending meanwhile: {res['min_replay_pending']} (0: the buffer ran empty); "
          f"answer passes given: {res['answer_passes']}; traffic samples sent: {res['sent']}")


def _hits(texts: list[str]) -> int:
    """How many greedy answers reproduce the taught continuation (an empty list: none)."""
    return sum(a.startswith(t) for a, (_, t) in zip(texts, FACTS, strict=False))


def _last_lossy(series: list[tuple[float, float, int]]) -> float | None:
    lossy = [t for t, g, _ in series if g > 0]
    return max(lossy) if lossy else None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(res: dict[str, Any], label: str) -> None:
    b, a = res["before"], res["after"]

    def change(name: str) -> float:
        return (a[name][0] - b[name][0]) / b[name][0]

    print(f"\n== teach 10 made-up facts x8 through learn, {label} (2 workers, 2 trainer ranks) ==")
    print(f"{'loss (nats/token)':<22}{'before':>9}{'after':>9}{'change':>9}")
    for name in ("taught", "control", "held_out"):
        print(f"{name:<22}{b[name][0]:>9.3f}{a[name][0]:>9.3f}{change(name) * 100:>8.1f}%")
    fall_t, fall_c = -change("taught"), -change("control")
    print(f"control fall / taught fall: {fall_c / fall_t if fall_t else float('nan'):.2f}  (target < 0.5)")
    print(f"held-out change: {change('held_out') * 100:+.1f}%  (target <= +5%)")
    print(f"greedy answers reproducing the taught continuation: {res['hits']} of {len(FACTS)} (target >= 8), "
          f"answered {res['answered_s']:.1f} s after the acknowledgement (target <= 5 s)")
    print(f"  once every worker serves the trainer's exact weights: {res['hits_exact']} of {len(FACTS)}")
    for (prompt, target), x, y in zip(FACTS, res["answers_before"], res["answers_after"], strict=True):
        print(f"  {prompt!r}: {x!r} -> {y!r} {'==' if y.startswith(target) else '!='} {target!r}")
    series = res["gap_series"]
    if series:
        gaps = [g for _, g, _ in series if g > 0]
        print(f"served-vs-trainer weight gap while teaching: max {max(gaps, default=0):.2%}, "
              f"median {statistics.median(gaps) if gaps else 0:.2%} (samples every 50 ms)")
        marks, shown = [], -1
        for t, g, v in series:  # one sample per second after the acknowledgement
            if int(t) > shown:
                shown = int(t)
                marks.append(f"{t:.0f}s {g:.2%} (v{v})")
        print("  over time: " + ", ".join(marks))
    exact, last = res["exact_after_ack_s"], res["last_lossy_s"]
    if exact is None:
        print("served == trainer (bit-exact digests): NOT reached within 60 s")
    else:
        idle = exact - last if last is not None else exact
        print(f"served == trainer bit-exact on every worker {exact:.2f} s after the acknowledgement, "
              f"{idle:.2f} s after the last lossy publish (target <= 1 s of idle)")
    sync = res["learn_to_all_workers_s"]
    if sync:
        print(f"learn ack -> every worker serves the samples' version: p50 {pct(sync, 0.5) * 1000:.0f} ms, "
              f"p99 {pct(sync, 0.99) * 1000:.0f} ms over {len(sync)} probes (heartbeat resolution 200 ms)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="an extra row with a setting other than the shipped one (repeatable)")
    p.add_argument("--traffic", type=float, default=0.0, metavar="RATE",
                   help="teach under traffic of RATE other samples/s (see above)")
    p.add_argument("--hold", type=float, default=60.0, help="seconds of traffic after the facts' answers")
    args = p.parse_args()
    server = RedisServer()
    server.start()
    workdir = Path(tempfile.mkdtemp(prefix="lm-bench-learning-"))
    mesh = Mesh(workdir, f"redis://127.0.0.1:{server.port}/0", ["alice"], workers=2, ranks=2)
    shipped_config(mesh, args.set)
    try:
        with mesh.running():
            if args.traffic > 0:
                res = asyncio.run(under_traffic(mesh, mesh.api_keys["alice"], args.traffic, args.hold))
            else:
                res = asyncio.run(experiment(mesh, mesh.api_keys["alice"], args.probes))
    finally:
        server.close()
    label = "settings: " + ", ".join(args.set) if args.set else "shipped defaults"
    if args.traffic > 0:
        report_traffic(res, label)
    else:
        report(res, label)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
