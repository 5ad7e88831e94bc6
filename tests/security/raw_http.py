"""Raw-socket helpers for the attack tests: they speak HTTP/1.1 byte by byte, as an attacker
does, where a client library would complete or fix what the test means to leave broken."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator

WAIT_S = 15.0  # how long any wait on the gateway may take before the test fails


@contextlib.contextmanager
def connection(port: int) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    try:
        yield sock
    finally:
        sock.close()


def read_until_closed(sock: socket.socket, timeout_s: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection; AssertionError if it has not
    closed it within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the server still holds the connection after {timeout_s}s (got {got[:200]!r})")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            continue
        if not chunk:
            return got
        got += chunk


def read_response(sock: socket.socket, timeout_s: float = WAIT_S) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-case headers, body by Content-Length); AssertionError if it
    does not arrive within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _expected_length(data):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no complete response within {timeout_s}s (got {data[:200]!r})")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), data[:200]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def _expected_length(data: bytes) -> int:
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value.strip())
    return len(head) + 4


def websocket(port: int, key: str, rcvbuf: int) -> socket.socket:
    """A WebSocket handshake for ``/mcp/ws`` over a plain socket whose receive buffer is ``rcvbuf``
    bytes (small: a client that does not read shows soon, the server's writes fill the buffers).
    Frames are then the caller's to write and read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", port))
    sock.sendall((f"GET /mcp/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n"
                  f"Sec-WebSocket-Protocol: mcp\r\nAuthorization: Bearer {key}\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def masked_text_frame(text: str) -> bytes:
    """One text frame as a client sends it, masked with the all-zero key (which leaves the payload as is)."""
    payload = text.encode()
    n = len(payload)
    length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n) if n < 65536 \
        else bytes([0x80 | 127]) + struct.pack("!Q", n)
    return bytes([0x81]) + length + bytes(4) + payload
