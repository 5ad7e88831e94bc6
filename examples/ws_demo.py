"""learnmesh demo over WebSocket (``/mcp/ws``, subprotocol ``mcp``, one JSON-RPC message per
text frame — the SEP-1288 draft shape), with the ``websockets`` library.

Start the mesh first (``make run`` or ``learnmesh up``), then::

    .venv/bin/python examples/ws_demo.py                # legacy session over the socket
    .venv/bin/python examples/ws_demo.py --stateless    # 2026-07-28: _meta on every message

It does what examples/demo.py does over HTTP: appends an image and a text turn to a context,
generates with it, scores a few made-up facts, teaches them with ``learn``, asks again with
the ``learned`` token (``after_learn``: answered by a model version that has finished training
them) and prints the answers and losses before and after. The URL and API key default to what ``learnmesh up`` printed (kept in var/keys).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import (  # noqa: E402
    default_key,
    plain_failure,
    retrying,
    tiny_png,
    until_a_worker_serves,
    until_trained,
)
from facts import COPIES, FACTS  # noqa: E402

LEGACY, MODERN = "2025-11-25", "2026-07-28"


class RpcError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.code, self.data = error.get("code"), error.get("data")


class WsClient:
    """A minimal MCP client over one WebSocket: requests are matched to replies by id;
    notifications (progress, logs) are printed when ``verbose``."""

    def __init__(self, ws: Any, stateless: bool) -> None:
        self.ws, self.stateless = ws, stateless
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                msg = json.loads(frame)
                fut = self.pending.pop(msg["id"], None) if "id" in msg and "method" not in msg else None
                if fut is not None:
                    fut.set_result(msg)
        except websockets.ConnectionClosed as exc:  # the requests still waiting fail with it, not the reader
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(exc)

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        params = dict(params or {})
        if self.stateless:
            params["_meta"] = {"io.modelcontextprotocol/protocolVersion": MODERN,
                               "io.modelcontextprotocol/clientCapabilities": {}}
        rid = next(self.ids)
        self.pending[rid] = asyncio.get_running_loop().create_future()
        await self.ws.send(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}))
        msg = await asyncio.wait_for(self.pending[rid], 120)
        if "error" in msg:
            raise RpcError(msg["error"])
        return msg["result"]

    async def tool(self, name: str, **args: Any) -> dict[str, Any]:
        """``call`` again while the mesh answers "retry later" (a Redis failover, a worker restarting)."""
        return await retrying(lambda: self.call(name, **args))

    async def call(self, name: str, **args: Any) -> dict[str, Any]:
        res = await self.request("tools/call", {"name": name, "arguments": args})
        if res.get("isError"):
            raise SystemExit(f"tool {name} failed: {res['content']}")
        return res.get("structuredContent") or json.loads(res["content"][0]["text"])

    async def initialize(self) -> str:
        if self.stateless:
            return MODERN
        res = await self.request("initialize", {"protocolVersion": LEGACY, "capabilities": {},
                                                "clientInfo": {"name": "learnmesh-ws-demo", "version": "1"}})
        await self.ws.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        return str(res["protocolVersion"])


async def open_socket(url: str, headers: dict[str, str]) -> Any:
    """The WebSocket, opened again while the gateway answers the upgrade with 503 (Redis, where
    it keeps its limits and sessions, restarting or failing over), after its Retry-After."""
    return await retrying(lambda: websockets.connect(url, subprotocols=[websockets.Subprotocol("mcp")],
                                                     additional_headers=headers, max_size=16 * 1024 * 1024))


async def run(url: str, key: str | None, stateless: bool, context_id: str, timeout_s: float) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with await open_socket(url, headers) as ws:
        client = WsClient(ws, stateless)
        version = await retrying(client.initialize)  # a legacy session is stored in Redis
        tools = await retrying(lambda: client.request("tools/list"))
        print(f"connected over WebSocket ({version}, subprotocol {ws.subprotocol}); "
              f"tools: {', '.join(t['name'] for t in tools['tools'])}")

        # a request_id per append: an append sent again after a lost answer is not stored twice
        image = await client.tool("context_append", context_id=context_id, modality="image", role="user",
                                  request_id=str(uuid.uuid4()),
                                  data=base64.b64encode(tiny_png()).decode(), mime_type="image/png")
        turn = await client.tool("context_append", context_id=context_id, modality="text", role="user",
                                 request_id=str(uuid.uuid4()),
                                 text="Here is a picture of the Zorbland flag.", links=[image["entry_id"]])
        print(f"context {context_id!r} at version {turn['version']} (text turn linked to {image['entry_id']})")
        reply = await until_a_worker_serves(lambda: client.call(
            "generate", context_id=context_id, prompt="What do you see?", max_tokens=24, temperature=0.0, seed=1),
            timeout_s)
        print(f"generate -> {reply['text']!r} (model version {reply['model_version']})")

        async def losses(**wait: Any) -> tuple[float, int]:
            scores = [await client.tool("score", prompt=p, target=t, **wait) for p, t in FACTS]
            return sum(s["nll"] for s in scores) / len(scores), max(s["model_version"] for s in scores)

        async def answers(**wait: Any) -> list[str]:
            return [(await client.tool("generate", prompt=p, max_tokens=len(t.encode()) + 4, temperature=0.0,
                                       append=False, **wait))["text"] for p, t in FACTS]

        before, v_before = await losses()
        print(f"before learning (model v{v_before}): mean loss {before:.3f}")
        ack = await client.tool("learn", request_id=str(uuid.uuid4()),  # logged once, retried or not
                                samples=[{"kind": "example", "input": p, "target": t}
                                         for p, t in FACTS for _ in range(COPIES)])
        acked = time.monotonic()
        print(f"learn -> {len(ack['ids'])} samples acknowledged; waiting for a model that has learnt them "
              f"(after_learn={ack['learned']!r})")
        # after_learn: the gateway waits until a worker serves a version that finished training them
        taught = await until_trained(lambda: answers(after_learn=ack["learned"]))
        waited = time.monotonic() - acked
        after, v_after = await losses(after_learn=ack["learned"])
        print(f"after learning (model v{v_after}, {waited:.1f}s after the acknowledgement): mean loss {after:.3f} "
              f"({after - before:+.3f})")
        hits = 0
        for (prompt, target), answer in zip(FACTS, taught, strict=True):
            hits += answer.startswith(target)
            print(f"  {prompt!r} -> {answer!r}   ({'==' if answer.startswith(target) else '!='} taught {target!r})")
        print(f"{hits} of {len(FACTS)} taught answers reproduced")
        client.reader.cancel()
        await asyncio.gather(client.reader, return_exceptions=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("LEARNMESH_WS_URL", "ws://127.0.0.1:8000/mcp/ws"))
    p.add_argument("--key", default=os.environ.get("LEARNMESH_KEY") or default_key())
    p.add_argument("--stateless", action="store_true", help="2026-07-28 messages instead of a legacy session")
    p.add_argument("--context", default=f"ws-demo-{int(time.time())}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the first worker")
    args = p.parse_args()
    try:
        asyncio.run(run(args.url, args.key, args.stateless, args.context, args.timeout))
    except RpcError as exc:
        print(f"error {exc.code}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        line = plain_failure(exc, args.url, args.key)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
