"""A hostile (or broken) stdio MCP server for the proxy's attack tests, in plain Python (no SDK,
so it can write what no SDK server would): ``python tests/proxy/hostile_stdio.py``.

It speaks 2025-11-25. ``tools/call`` of ``endless_line`` writes one line that never ends;
``garbage`` writes lines that are not JSON-RPC before its answer; ``chatter`` sends
``notifications/message`` by the hundred thousand before its answer; ``big_int`` sends a log message,
then an answer, each holding an integer beyond 64 bits; ``deaf`` reads no more input and never
answers (the process stays); ``park`` is never answered (the process reads on; with
``$HOSTILE_PARKED`` set, a file of that name is made once it has the call); ``null_id_error``
is answered with an error whose id is null, as a server sends for a request whose id it could not
read; ``echo`` answers at once. With ``$HOSTILE_BIG_LIST`` set, ``tools/list``
lists one more tool, whose description is that many characters.
Whatever it writes to stderr is noise, and it carries the value of ``$HOSTILE_SECRET`` there.
"""

from __future__ import annotations

import json
import os
import sys
import time

TOOLS = ["endless_line", "garbage", "chatter", "big_int", "deaf", "park", "null_id_error", "echo"]
CHATTER = 200_000


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def text(rid: object, value: str) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": value}]}}


def call(rid: object, name: str) -> None:
    if name == "endless_line":
        sys.stdout.write(f'{{"jsonrpc": "2.0", "id": {json.dumps(rid)}, "result": {{"x": "')
        while True:
            sys.stdout.write("a" * 65536)
    if name == "garbage":
        sys.stdout.write("not json\n\x00\xff{]\n[1, 2]\n\"a string\"\n")
    if name == "chatter":
        note = json.dumps({"jsonrpc": "2.0", "method": "notifications/message",
                           "params": {"level": "info", "data": "x" * 200}}) + "\n"
        sys.stdout.write(note * CHATTER)
    if name == "deaf":
        time.sleep(3600)
    if name == "park":
        if os.environ.get("HOSTILE_PARKED"):
            open(os.environ["HOSTILE_PARKED"], "w").close()
        return
    if name == "null_id_error":
        send({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}})
        return
    if name == "big_int":
        send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": 10**30}})
        send({"jsonrpc": "2.0", "id": rid, "result": {"content": [], "structuredContent": {"n": 10**30}}})
        return
    send(text(rid, name))


def main() -> None:
    sys.stderr.write(f"hostile stdio server starting with {os.environ.get('HOSTILE_SECRET')}\n" * 1000)
    for line in sys.stdin:
        msg = json.loads(line)
        rid, method = msg.get("id"), msg.get("method")
        if rid is None:
            continue
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": rid, "result": {
                "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile-stdio", "version": "1"}}})
        elif method == "tools/list":
            tools = [{"name": n, "inputSchema": {"type": "object"}} for n in TOOLS]
            big = int(os.environ.get("HOSTILE_BIG_LIST", "0"))
            if big:
                tools.append({"name": "big", "description": "x" * big, "inputSchema": {"type": "object"}})
            send({"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}})
        elif method == "tools/call":
            call(rid, msg["params"]["name"])
        else:
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no"}})


if __name__ == "__main__":
    main()
