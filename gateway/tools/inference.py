"""Inference over MCP: tools ``generate`` and ``score``, served by the worker pool.

The gateway reads the caller's context window from Redis and sends it with each request
(workers hold no per-client state). ``generate`` streams partial text as MCP progress
notifications (``message`` = the text so far), and returns the text, the model version that
produced it and a generation id; the exchange (prompt, then reply) is appended to the context
when ``worker.append_exchange`` is on. ``score`` returns the model's negative log-likelihood
of a continuation (used to check that learning took effect). Every request names the
authenticated principal (never anything the caller sends): workers take requests into batches
round-robin across principals, and each principal has at most ``limits.<…>.inference_in_flight``
calls in flight on a replica (gateway/limits.py). Store, Redis and worker-pool
exceptions propagate: gateway/errors.py decides what the client sees (no worker or a timeout:
-32050 and retry later; a worker refusing the input: -32602; a worker failing: ``isError``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import InvalidParams, Unavailable
from gateway.registry import Registry, ToolContext
from gateway.tools.context import MODALITIES, announcing, integer, notify_changed
from shared import keys
from shared.context import ContextError
from shared.inference import pack_entries
from shared.samples import parse_learned_token, sample_partitions

log = logging.getLogger("learnmesh.inference")

PROGRESS_INTERVAL_S = 0.05  # at most ~20 progress notifications per second per request
_ID = {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]*$"}
_COMMON: dict[str, Any] = {
    "prompt": {"type": "string", "minLength": 1, "description": "the new input (UTF-8 text)"},
    "context_id": {**_ID, "description": "one of your contexts; its window is the model's context"},
    "modalities": {**MODALITIES, "description": "channels of context_id to include (default: all)"},
    "min_model_version": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "default": 0,
                          "description": "only a worker at or past this model version may answer"},
    "after_learn": {"type": "string", "maxLength": 100,
                    "description": "the 'learned' token of a learn call: wait until a model version that has "
                    "finished training those samples serves this request"},
}
GENERATE_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_COMMON,
        "max_tokens": {"type": "integer", "minimum": 1, "default": 64},
        "temperature": {"type": "number", "minimum": 0, "maximum": 5, "default": 0.8},
        "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1,
                 "description": "makes sampling reproducible"},
        "append": {"type": "boolean", "description": "append the exchange to the context "
                   "(default: worker.append_exchange)"},
    },
    "required": ["prompt"],
    "additionalProperties": False,
}
GENERATE_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "model_version": {"type": "integer"},
                   "generation_id": {"type": "string"}, "tokens": {"type": "integer"},
                   "finish_reason": {"type": "string"},
                   # present only when known: several clients take a single type per property
                   "worker": {"type": "string"}, "context_version": {"type": "integer"}},
    "required": ["text", "model_version", "generation_id", "tokens", "finish_reason"],
}
SCORE_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {**_COMMON, "target": {"type": "string", "minLength": 1,
                                         "description": "the continuation to score"}},
    "required": ["prompt", "target"],
    "additionalProperties": False,
}
SCORE_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"nll": {"type": "number"}, "log_likelihood": {"type": "number"},
                   "perplexity": {"type": "number"}, "tokens": {"type": "integer"},
                   "model_version": {"type": "integer"}},
    "required": ["nll", "log_likelihood", "tokens", "model_version"],
}


def _check_prompt(ctx: ToolContext, args: dict[str, Any]) -> str:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidParams("prompt must be a non-empty string")
    limit = ctx.state.config.worker.max_prompt_bytes
    if len(prompt.encode()) > limit:
        raise InvalidParams(f"prompt is {len(prompt.encode())} bytes; at most {limit} are accepted")
    return prompt


async def _window(ctx: ToolContext, args: dict[str, Any]) -> tuple[list[dict[str, Any]], list[bytes], int | None]:
    context_id = args.get("context_id")
    if context_id is None:
        if args.get("modalities") is not None:  # a channel filter with no context to filter
            raise InvalidParams("modalities selects channels of a context: give context_id with it")
        return [], [], None
    win = await ctx.state.store.get_window(ctx.principal, context_id, modalities=args.get("modalities"))
    meta, frames = pack_entries(win.entries(), text_tail_bytes=ctx.state.config.model.max_seq)
    return meta, frames, win.version


async def _min_version(ctx: ToolContext, args: dict[str, Any]) -> int:
    """``min_model_version``, raised to the first version that holds the samples of ``after_learn``
    (waiting up to ``consistency.learn_wait_s`` for the trainer to publish it)."""
    wanted = int(args.get("min_model_version") or 0)
    token = args.get("after_learn")
    if token is None:
        return wanted
    cfg = ctx.state.config
    try:
        log_id, seq, part = parse_learned_token(token)
        if part >= sample_partitions(cfg):  # no learn call of this mesh answers with it
            raise ValueError("after_learn must be the 'learned' token a learn call returned")
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None
    deadline = time.monotonic() + cfg.consistency.learn_wait_s
    poll_s = _LEARN_POLL_S
    while True:
        pipe = ctx.state.redis.pipeline(transaction=False)
        pipe.get(keys.sample_log_id(part))
        pipe.get(keys.sample_seq(part))
        pipe.zrangebyscore(keys.model_version_seq(part, log_id), seq, "+inf", start=0, num=1)
        current, handed_out, found = await pipe.execute()
        if (current.decode() if isinstance(current, bytes) else current) != log_id:
            raise InvalidParams("after_learn names samples of a sample log that no longer exists (it was "
                                "recreated); learn them again", {"after_learn": token})
        if seq > int(handed_out or 0):  # no learn call answered it: it would wait learn_wait_s for nothing
            raise InvalidParams("after_learn names samples the sample log does not hold; pass the 'learned' token "
                                "a learn call returned", {"after_learn": token})
        if found:
            return max(wanted, int(found[0]))
        if ctx.state.shutting_down.is_set():
            raise Unavailable("this gateway replica is stopping; retry (another replica answers)")
        if time.monotonic() >= deadline:
            raise Unavailable(f"the samples of after_learn are not trained yet (waited "
                              f"{cfg.consistency.learn_wait_s:g}s); retry later")
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        poll_s = min(poll_s * 1.5, _LEARN_POLL_MAX_S)


# A wait polls Redis, soon at first (training a few samples takes seconds), then less often:
# a call waiting learn_wait_s must not cost thousands of round trips, nor a burst of such calls
# a Redis busy with nothing else.
_LEARN_POLL_S = 0.02
_LEARN_POLL_MAX_S = 0.25


async def _call(ctx: ToolContext, header: dict[str, Any], frames: list[bytes], args: dict[str, Any],
                **kw: Any) -> dict[str, Any]:
    min_version = await _min_version(ctx, args)
    return await ctx.state.workers.request(header, frames, min_version=min_version, **kw)


async def generate(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    state = ctx.state
    wcfg = state.config.worker
    prompt = _check_prompt(ctx, args)
    max_tokens = integer(args.get("max_tokens", 64))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= wcfg.max_tokens_limit:
        raise InvalidParams(f"max_tokens must be an integer in 1..{wcfg.max_tokens_limit}")
    with state.limits.inference_slot(ctx.principal):  # over the principal's cap: -32029 before any work
        return await _generate(ctx, args, prompt, max_tokens)


async def _generate(ctx: ToolContext, args: dict[str, Any], prompt: str, max_tokens: int) -> dict[str, Any]:
    state = ctx.state
    meta, frames, _ = await _window(ctx, args)
    generation_id = uuid.uuid4().hex
    header = {"id": generation_id, "op": "generate", "principal": ctx.principal, "prompt": prompt, "max_tokens": max_tokens,
              "temperature": float(args.get("temperature", 0.8)), "seed": integer(args.get("seed")),
              "modalities": args.get("modalities"), "entries": meta}
    # ``before``: tokens streamed by workers lost under the request. Its text restarts on the next
    # worker, its progress goes on from there: MCP wants every notification's progress higher.
    partial: dict[str, Any] = {"text": "", "tokens": 0, "before": 0, "sent_s": 0.0}

    async def on_token(text: str, _h: dict[str, Any]) -> None:
        partial["text"] += text
        partial["tokens"] += 1
        now = time.monotonic()
        if now - partial["sent_s"] >= PROGRESS_INTERVAL_S:
            partial["sent_s"] = now
            await ctx.progress(partial["before"] + partial["tokens"], partial["before"] + max_tokens,
                               message=partial["text"])

    async def on_retry() -> None:
        partial.update(text="", tokens=0, before=partial["before"] + partial["tokens"])

    streaming = ctx.meta.get("progressToken") is not None if isinstance(ctx.meta, dict) else False
    res = await _call(ctx, header, frames, args, on_token=on_token if streaming else None, on_retry=on_retry)
    worker = res.get("worker")
    out = {"text": str(res["text"]), "model_version": int(res["version"]), "generation_id": generation_id,
           "tokens": int(res["tokens"]), "finish_reason": str(res["finish_reason"])}
    if worker is not None:
        out["worker"] = str(worker)
    context_id = args.get("context_id")
    if context_id is not None and args.get("append", state.config.worker.append_exchange):
        try:
            asked = await state.store.append(ctx.principal, context_id, "text", "user", prompt.encode())
            appended = await state.store.append(ctx.principal, context_id, "text", "assistant", res["text"].encode())
            out["context_version"] = appended.version
        except (ContextError, RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("could not append generation %s to its context: %s", generation_id, type(exc).__name__)
        else:  # the context's subscribers learn of the exchange as of any other append
            await notify_changed(ctx, context_id, ["text"], listed=asked.opened)
    return out


async def score(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    prompt = _check_prompt(ctx, args)
    target = args.get("target")
    if not isinstance(target, str) or not target:
        raise InvalidParams("target must be a non-empty string")
    with ctx.state.limits.inference_slot(ctx.principal):
        return await _score(ctx, args, prompt, target)


async def _score(ctx: ToolContext, args: dict[str, Any], prompt: str, target: str) -> dict[str, Any]:
    meta, frames, _ = await _window(ctx, args)
    header = {"id": uuid.uuid4().hex, "op": "score", "principal": ctx.principal, "prompt": prompt, "target": target,
              "modalities": args.get("modalities"), "entries": meta}
    res = await _call(ctx, header, frames, args)
    nll, tokens = float(res["nll"]), int(res["tokens"])
    return {"nll": nll, "log_likelihood": -nll * tokens, "perplexity": math.exp(min(nll, 700.0)),
            "tokens": tokens, "model_version": res["version"]}


def register(registry: Registry) -> None:
    registry.tool("generate", description="Generate a reply from the model, given your prompt and (optionally) one "
                  "of your contexts. Streams partial text as progress notifications; returns the text, the "
                  "model version and a generation id; appends the exchange to the context.",
                  input_schema=GENERATE_INPUT, output_schema=GENERATE_OUTPUT, title="Generate")(announcing(generate))
    registry.tool("score", description="The model's negative log-likelihood (nats per token) of a continuation "
                  "of your prompt and context; lower means the model finds it more likely.",
                  input_schema=SCORE_INPUT, output_schema=SCORE_OUTPUT, title="Score a continuation",
                  annotations={"readOnlyHint": True})(announcing(score))
