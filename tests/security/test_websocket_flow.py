"""A WebSocket peer that does not read: its ping frames (each answered with a pong) must not pile
up answers in the gateway's memory (gateway/transports/ws_protocol.py). The gateway stops
reading it while what it wrote is unread, goes on serving others, and serves the peer again
once it reads."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from raw_http import WAIT_S, masked_text_frame, websocket

from tests.conftest import free_port
from tests.gateway_support import start_gateway, stop

KEY = "flow-key-0123456789"
CHUNK = bytes([0x89, 0x80 | 125]) + b"\0\0\0\0" + b"p" * 125  # a masked ping with the largest control payload
FLOOD_BYTES = 64 * 1024 * 1024
HELD_BYTES = 24 * 1024 * 1024  # kernel buffers on both sides and one read's worth of pongs fit far below


class Gateway:
    def __init__(self, port: int, pid: int) -> None:
        self.port = port
        self.pid = pid

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def gw(redis_server: str) -> Iterator[Gateway]:
    port = free_port()
    # no keepalive ping during the test: the peer is held by flow control alone, not dropped
    proc = start_gateway(port, redis_server, api_keys=f"alice:{KEY}",
                         overrides={"gateway": {"ws_ping_interval_s": 600.0, "ws_ping_timeout_s": 600.0}})
    yield Gateway(port, proc.pid)
    stop(proc)


def _read_frames_until_text(sock: socket.socket) -> tuple[int, bytes]:
    """Read server frames (unmasked) until a text frame: (pongs read before it, its payload)."""
    buf, pongs = b"", 0
    while True:
        while len(buf) < 2 or len(buf) < 2 + _length(buf):
            chunk = sock.recv(65536)
            assert chunk, "the gateway closed the connection"
            buf += chunk
        opcode, n = buf[0] & 0x0F, _length(buf)
        header = 2 if (buf[1] & 0x7F) < 126 else 4
        payload, buf = buf[header:header + n], buf[header + n:]
        if opcode == 0x1:
            return pongs, payload
        assert opcode == 0xA, opcode
        pongs += 1


def _length(buf: bytes) -> int:
    n = buf[1] & 0x7F
    if n < 126:
        return n
    return int.from_bytes(buf[2:4], "big") + 2 if len(buf) >= 4 else 1 << 30


def test_a_peer_that_sends_pings_and_never_reads_is_held_not_buffered(gw: Gateway) -> None:
    before = gw.rss_bytes()
    sock = websocket(gw.port, KEY, 256 * 1024)  # small, yet larger than a loopback segment
    try:
        flood = CHUNK * (1024 * 1024 // len(CHUNK))
        sock.settimeout(3.0)  # a send that makes no progress this long: the gateway stopped reading
        sent = 0
        try:
            while sent < FLOOD_BYTES:
                sent += sock.send(flood)
        except TimeoutError:
            pass
        assert sent < HELD_BYTES, f"the gateway read {sent >> 20} MiB of pings its peer never read the pongs of"
        assert gw.rss_bytes() - before < HELD_BYTES
        # meanwhile everyone else is served
        assert httpx.get(f"http://127.0.0.1:{gw.port}/healthz", timeout=WAIT_S).status_code == 200
        # and the peer is served again once it reads: every ping gets its pong, then its request its answer
        # (read while the request is sent: the request waits in the peer's own full send buffer)
        sock.settimeout(WAIT_S)
        got: list[tuple[int, bytes]] = []
        reader = threading.Thread(target=lambda: got.append(_read_frames_until_text(sock)))
        reader.start()
        unfinished = -sent % len(CHUNK)  # the flood's last send may have stopped inside a frame
        sock.sendall(CHUNK[len(CHUNK) - unfinished:] + masked_text_frame('{"jsonrpc":"2.0","id":"after","method":"ping"}'))
        reader.join(WAIT_S * 2)
        assert got, "no answer after the peer read"
        pongs, answer = got[0]
        assert b'"id":"after"' in answer and pongs > 0, answer
    finally:
        sock.close()
