"""A peer that stops answering without closing its connection (a frozen process, a host gone)
is noticed through ZMTP heartbeats: its connection is closed on both sides. Real sockets, and a
real process frozen with SIGSTOP (its kernel keeps the TCP connection open, as a vanished host's
network would)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.zmq_util import make_socket
from tests.conftest import free_port
from tests.waiting import wait_for_sync

FAST = (200, 1_000)  # PING interval, silence that closes a connection (ms)

SERVER = textwrap.dedent("""
    import sys, zmq
    from shared.zmq_util import make_socket
    sock = make_socket(zmq.Context(), zmq.ROUTER, bind=sys.argv[1], heartbeat_ms=(200, 1_000))
    print("bound", flush=True)
    while True:
        ident, msg = sock.recv_multipart()
        sock.send_multipart([ident, b"re:" + msg])
""")


def test_a_frozen_peer_loses_its_connection_and_nothing_queues_towards_it() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, endpoint], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    ctx = zmq.Context()
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "bound"
        sock = make_socket(ctx, zmq.DEALER, connect=endpoint, immediate=True, heartbeat_ms=FAST)
        sock.send(b"ping")
        assert sock.poll(10_000) and sock.recv() == b"re:ping"  # connected, handshake done
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        server.send_signal(signal.SIGSTOP)
        wait_for_sync(lambda: monitor.poll(0) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED,
                      timeout_s=15, what="the frozen server's connection to be closed")
        # with the connection gone, a message is refused at once instead of waiting for the server
        try:
            sock.send(b"lost", flags=zmq.NOBLOCK)
            queued = True
        except zmq.Again:
            queued = False
        assert not queued
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()
        ctx.destroy(linger=0)
