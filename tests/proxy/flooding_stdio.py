"""A stdio JSON-RPC responder that floods, stops reading, or sends what was never asked, for
tests/test_proxy_stdio_backpressure.py: ``python tests/proxy/flooding_stdio.py <mark file>``.

``pid`` answers with its pid. ``flood`` writes ``n`` progress notifications then its answer,
noting in ``<mark file>``, each time the pipe takes no more, how many bytes it took so far. ``deaf`` reads no more input and never answers.
``crafted`` sends answers to requests never made, a notification whose subscription id is a list,
and ``questions`` requests (roots/list) at once, then answers with how many of those were refused.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

SUBSCRIPTION_ID_META_KEY = "io.modelcontextprotocol/subscriptionId"


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def flood(rid: object, n: int, mark: str) -> None:
    notes = "".join(json.dumps({"jsonrpc": "2.0", "method": "notifications/progress",
                                "params": {"progressToken": "t", "progress": i}}) + "\n" for i in range(n))
    out = memoryview((notes + json.dumps({"jsonrpc": "2.0", "id": rid, "result": {"flooded": n}}) + "\n").encode())
    sys.stdout.flush()
    os.set_blocking(1, False)
    written = 0
    while out:
        try:
            sent = os.write(1, out)
        except BlockingIOError:
            with open(mark + ".new", "w") as f:
                f.write(str(written))
            os.replace(mark + ".new", mark)
            select.select([], [1], [])
            continue
        written += sent
        out = out[sent:]
    os.set_blocking(1, True)


def crafted(rid: object, questions: int) -> None:
    for fake in (rid + 1, True, "7", None, [rid]):
        send({"jsonrpc": "2.0", "id": fake, "result": {"not": "yours"}})
    send({"jsonrpc": "2.0", "method": "notifications/message",
          "params": {"level": "info", "data": "x", "_meta": {SUBSCRIPTION_ID_META_KEY: [rid]}}})
    for q in range(questions):
        send({"jsonrpc": "2.0", "id": f"q{q}", "method": "roots/list"})
    refused = 0
    for _ in range(questions):
        reply = json.loads(sys.stdin.readline())
        refused += "error" in reply
    send({"jsonrpc": "2.0", "id": rid, "result": {"refused": refused}})


def main() -> None:
    mark = sys.argv[1]
    for line in sys.stdin:
        msg = json.loads(line)
        rid, method, params = msg.get("id"), msg.get("method"), msg.get("params") or {}
        if method == "pid":
            send({"jsonrpc": "2.0", "id": rid, "result": {"pid": os.getpid()}})
        elif method == "flood":
            flood(rid, params["n"], mark)
        elif method == "deaf":
            time.sleep(3600)
        elif method == "crafted":
            crafted(rid, params["questions"])


if __name__ == "__main__":
    main()
