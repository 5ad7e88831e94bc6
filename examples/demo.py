"""learnmesh demo: the official MCP Python SDK talking to a running mesh.

Start the mesh first (``make run`` or ``learnmesh up``), then::

    .venv/bin/python examples/demo.py                 # Streamable HTTP, 2026-07-28
    .venv/bin/python examples/demo.py --mode legacy   # 2025-11-25 sessions

It chats with context (a text turn and an image), scores ten made-up facts, teaches them
with ``learn`` (eight copies each), asks again with the ``learned`` token the acknowledgement
carries (``after_learn``: answered by a model version that has finished training them) and
shows the greedy answers and the losses before and after.
The URL and API key default to what ``learnmesh up`` printed (kept in var/keys).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from facts import COPIES, FACTS  # noqa: E402


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """A real (valid) PNG made here, so nothing is downloaded."""
    rows = []
    for y in range(height):
        row = bytearray(b"\x00")
        for x in range(width):
            row += bytes(((x * 32) % 256, (y * 32) % 256, 128))
        rows.append(bytes(row))
    raw = b"".join(rows)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


REPO = Path(__file__).resolve().parent.parent


def default_key() -> str | None:
    # `make run` runs `learnmesh up` in the repository, which keeps its keys in var/ there: found
    # from whatever directory the demo runs in
    var = os.environ.get("LEARNMESH_VAR")
    path = (Path(var) if var else REPO / "var") / "keys" / "generated.yaml"
    if path.is_file():
        data = yaml.safe_load(path.read_text()) or {}
        keys = data.get("api_keys") or {}
        return next(iter(keys.values()), None)
    return None


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from _leaves(sub)
    else:
        yield exc


def plain_failure(exc: BaseException, url: str, key: str | None, refused: int | None = None) -> str | None:
    """One line for a failure the user fixes by hand (a key the gateway refuses, nothing at the
    URL) in place of the transport's nested traceback; None for any other failure. ``refused``:
    an HTTP status the gateway answered that the exception itself does not carry."""
    leaves = list(_leaves(exc))
    statuses = {refused, *(getattr(getattr(e, "response", None), "status_code", None) for e in leaves)}
    if 401 in statuses:
        told = "refused the key" if key else "wants a key"
        return f"the gateway {told} (HTTP 401): pass --key or set LEARNMESH_KEY; `make run` prints the demo key"
    if any(isinstance(e, (httpx2.ConnectError, ConnectionRefusedError)) for e in leaves):
        return f"nothing answers at {url}; is the mesh up?"
    return None


def structured(result: Any) -> dict[str, Any]:
    if getattr(result, "isError", False) or getattr(result, "is_error", False):
        texts = [getattr(c, "text", "") for c in result.content]
        raise SystemExit(f"tool error: {' '.join(texts)}")
    data = getattr(result, "structuredContent", None) or getattr(result, "structured_content", None)
    if data is None:
        data = json.loads(result.content[0].text)
    return data


UNAVAILABLE = -32050  # learnmesh: a backend is unreachable or no worker serves the version yet; retry
TRANSIENT_S = 120.0  # a Redis restart or failover, a worker restarting: the mesh answers -32050 meanwhile
LEARN_TIMEOUT_S = 900.0


async def until_a_worker_serves(call: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
    """``call()`` again while the mesh answers "no worker yet" (-32050): on its first start
    each worker pre-trains the base model (one to two minutes on 2 cores) before it serves; on a restart
    workers take what the trainer learned (its snapshot) before they serve."""
    return await retrying(call, timeout_s, "waiting for an inference worker (a first start pre-trains the base "
                                           "model, one to two minutes; a restart loads what was learned first)")


async def until_trained(call: Callable[[], Awaitable[Any]]) -> Any:
    """``call()`` with ``after_learn`` again while the mesh answers "not trained yet" (-32050,
    after ``consistency.learn_wait_s``): on a busy machine eighty samples' passes take longer."""
    return await retrying(call, LEARN_TIMEOUT_S, "still training; asking again")


def unavailable(exc: BaseException) -> BaseException | None:
    """The "retry later" answer in ``exc`` (-32050, or HTTP 503 where no JSON-RPC answer came, as to
    a WebSocket upgrade), also where the SDK wraps it in a group."""
    return next((e for e in _leaves(exc) if getattr(e, "code", None) == UNAVAILABLE
                 or getattr(getattr(e, "response", None), "status_code", None) == 503), None)


def retry_after(exc: BaseException) -> float:
    """The wait an answer of "retry later" asks for (``data.retryAfterS``, also the HTTP
    Retry-After), within 1-30 s; 2 s when it names none."""
    data = getattr(exc, "data", None)
    wait = data.get("retryAfterS") if isinstance(data, dict) else None
    response = getattr(exc, "response", None)  # an HTTP answer: its Retry-After header
    if wait is None and response is not None and str(response.headers.get("Retry-After", "")).isdigit():
        wait = int(response.headers["Retry-After"])
    return min(max(float(wait), 1.0), 30.0) if isinstance(wait, (int, float)) else 2.0


async def retrying(call: Callable[[], Awaitable[Any]], timeout_s: float = TRANSIENT_S, note: str | None = None) -> Any:
    """``call()`` again while the mesh answers "retry later" (-32050), up to ``timeout_s``,
    waiting what each answer asks for. Prints ``note`` once, or else each new reason the mesh
    gives: a Redis failover or restart is seconds of -32050 on the calls that need it, then
    the same call succeeds, and a client that gives up at the first one loses its work."""
    deadline = time.monotonic() + timeout_s
    told: set[str] = set()
    while True:
        try:
            return await call()
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is "retry later"
            later = unavailable(exc)
            if later is None or time.monotonic() > deadline:
                raise
            wait = retry_after(later)
            answer = "-32050" if getattr(later, "code", None) == UNAVAILABLE else "HTTP 503"
            line = note or f"the mesh answers {answer} ({later}); asking again in {wait:g}s"
            if line not in told:
                print(line)
                told.add(line)
            await asyncio.sleep(wait)


async def run(url: str, key: str | None, mode: str, context_id: str, timeout_s: float,
              refused: list[int] | None = None) -> None:
    """The demo; ``refused`` collects a 401 the gateway answers, which the SDK reports only as
    "Server returned an error response"."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    http = create_mcp_http_client(headers=headers)

    async def note_refusal(response: httpx2.Response) -> None:
        if response.status_code == 401 and refused is not None:
            refused.append(401)

    http.event_hooks["response"].append(note_refusal)
    async with contextlib.AsyncExitStack() as stack:
        # a legacy session is stored in Redis: opening one waits out an outage like any call
        client = await retrying(lambda: stack.enter_async_context(
            Client(streamable_http_client(url, http_client=http), mode=mode)))
        tools = await retrying(client.list_tools)
        print(f"connected ({client.protocol_version}); tools: {', '.join(t.name for t in tools.tools)}")

        async def tool(name: str, args: dict[str, Any]) -> dict[str, Any]:
            return structured(await retrying(lambda: client.call_tool(name, args)))

        # a request_id per append: an append sent again after a lost answer is not stored twice
        image_id = (await tool("context_append", {
            "context_id": context_id, "modality": "image", "role": "user", "request_id": str(uuid.uuid4()),
            "data": base64.b64encode(tiny_png()).decode(), "mime_type": "image/png"}))["entry_id"]
        version = (await tool("context_append", {
            "context_id": context_id, "modality": "text", "role": "user", "request_id": str(uuid.uuid4()),
            "text": "Here is a picture of the Zorbland flag.", "links": [image_id]}))["version"]
        print(f"context {context_id!r} now at version {version} (text turn linked to {image_id})")

        reply = structured(await until_a_worker_serves(lambda: client.call_tool("generate", {
            "context_id": context_id, "prompt": "What do you see?", "max_tokens": 32,
            "temperature": 0.0, "seed": 1}), timeout_s))
        print(f"generate -> {reply['text']!r} (model version {reply['model_version']})")

        async def losses(**wait: Any) -> tuple[list[float], int]:
            out, served = [], 0
            for prompt, target in FACTS:
                r = await tool("score", {"prompt": prompt, "target": target, **wait})
                out.append(r["nll"])
                served = max(served, r["model_version"])
            return out, served

        async def answers(**wait: Any) -> list[str]:
            return [(await tool("generate", {"prompt": p, "max_tokens": len(t.encode()) + 4, "temperature": 0.0,
                                             "append": False, **wait}))["text"] for p, t in FACTS]

        before, v_before = await losses()
        answers_before = await answers()
        print(f"before learning (model v{v_before}): mean loss {sum(before) / len(before):.3f}")

        samples = [{"kind": "example", "input": p, "target": t} for p, t in FACTS for _ in range(COPIES)]
        ack = await tool("learn", {"samples": samples, "request_id": str(uuid.uuid4())})  # logged once, retried or not
        acked = time.monotonic()
        print(f"learn -> {len(ack['ids'])} samples acknowledged; waiting for a model that has learnt them "
              f"(after_learn={ack['learned']!r})")
        # after_learn: the gateway waits until a worker serves a version that finished training them
        answers_after = await until_trained(lambda: answers(after_learn=ack["learned"]))
        waited = time.monotonic() - acked
        after, v_after = await losses(after_learn=ack["learned"])
        print(f"after learning (model v{v_after}, {waited:.1f}s after the acknowledgement): "
              f"mean loss {sum(after) / len(after):.3f}")
        hits = 0
        for (prompt, target), a, b in zip(FACTS, answers_before, answers_after, strict=True):
            hit = b.startswith(target)
            hits += hit
            print(f"  {prompt!r}\n     before: {a!r}\n     after:  {b!r}   {'==' if hit else '!='} taught {target!r}")
        print(f"{hits} of {len(FACTS)} taught answers reproduced")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("LEARNMESH_URL", "http://127.0.0.1:8000/mcp"))
    p.add_argument("--key", default=os.environ.get("LEARNMESH_KEY") or default_key())
    p.add_argument("--mode", default="2026-07-28", help="legacy | 2026-07-28 | auto")
    p.add_argument("--context", default=f"demo-{int(time.time())}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the first worker")
    args = p.parse_args()
    refused: list[int] = []
    try:
        asyncio.run(run(args.url, args.key, args.mode, args.context, args.timeout, refused))
    except Exception as exc:
        line = plain_failure(exc, args.url, args.key, refused[0] if refused else None)
        if line is not None:
            print(line, file=sys.stderr)
            return 2
        errors = [e for e in _leaves(exc) if isinstance(e, MCPError)]
        if not errors:
            raise
        print(f"error {errors[0].code}: {errors[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
