"""CurveZMQ keys and the ZAP allow-list of every ZeroMQ link (docs/operations.md, "ZeroMQ links").

Three roles talk over ZeroMQ, and each has one CURVE keypair in ``zmq.keys_dir``:
``<role>.key_secret`` (its own; 0600, read only by that role's processes) and ``<role>.key``
(the public key its peers pin or allow; the same ZPL certificate format as pyzmq's
``zmq.auth``). Who binds and who connects:

=========  ============================================  =======================  ==============
server     sockets                                       ZAP domain               clients allowed
=========  ============================================  =======================  ==============
worker     ROUTER (inference)                            ``infer``                gateway
trainer    PULL (sample wake-ups)                        ``samples``              gateway
trainer    PUB (deltas), ROUTER (snapshots), PULL (acks)  ``deltas``               worker
=========  ============================================  =======================  ==============

A client pins its server's public key: a process that binds the port in the server's place
cannot complete the handshake, so it receives nothing. A server admits only the client keys
allowed for the socket's domain, through pyzmq's ZAP authenticator (one thread per ZeroMQ
context, running while a server socket of that context is open). The allowed keys of a role
are ``<role>.key`` and any ``<role>.*.key`` (a key being rotated in or out), read again when
the directory changes, so a client key rotates without restarting servers.

Keys are made on first start: by ``learnmesh up`` before it starts anything, else by the
first process that finds ``keys_dir`` without any secret key.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.auth import load_certificate
from zmq.auth.thread import ThreadAuthenticator

from shared import metrics
from shared.aio import stop_if_cancelled
from shared.config import ConfigError, ZmqConfig
from shared.log_throttle import ThrottledWarning
from shared.secret_files import InsecureFileError, check_private, write_private

log = logging.getLogger("learnmesh.curve")

ROLES = ("gateway", "worker", "trainer")
DOMAIN_CLIENTS = {"infer": "gateway", "samples": "gateway", "deltas": "worker"}
"""ZAP domain of a server socket -> the role whose keys may connect to it."""


class CurveKeyError(ConfigError):
    """A CURVE key file is missing, malformed, or readable by other users."""


# ---------------------------------------------------------------------------- key files


def secret_file(keys_dir: str | os.PathLike[str], role: str) -> Path:
    return Path(keys_dir) / f"{role}.key_secret"


def public_file(keys_dir: str | os.PathLike[str], role: str) -> Path:
    return Path(keys_dir) / f"{role}.key"


def _certificate(public: bytes, secret: bytes | None, role: str) -> str:
    lines = [f"#   learnmesh {role} CURVE {'secret' if secret else 'public'} certificate "
             f"({time.strftime('%Y-%m-%d %H:%M:%S')})",
             "#   ZeroMQ ZPL format (zmq.auth.load_certificate reads it)" if secret is None else
             "#   Private: never copy it to another role's host", "metadata", "    role = " + role, "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_keypair(keys_dir: str | os.PathLike[str], role: str, *, keep_previous: bool = False) -> bytes:
    """A fresh keypair for ``role`` (secret 0600, public 0644); returns the public key.
    ``keep_previous``: the replaced public key stays allowed as ``<role>.previous.key``."""
    d = Path(keys_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    old = public_file(d, role)
    if keep_previous and old.exists():
        os.replace(old, d / f"{role}.previous.key")
    write_private(secret_file(d, role), _certificate(public, secret, role))
    write_private(public_file(d, role), _certificate(public, None, role), mode=0o644)
    return public


def ensure_keys(keys_dir: str | os.PathLike[str], roles: tuple[str, ...] = ROLES) -> list[str]:
    """Make the keypairs of ``roles`` that ``keys_dir`` lacks; returns the roles made. Safe
    when several processes start at once (a lock file serialises them)."""
    d = Path(keys_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = []
    with open(d / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for role in roles:
            if not secret_file(d, role).exists():
                write_keypair(d, role)
                made.append(role)
    if made:
        log.info("made CURVE keypairs for %s in %s", ", ".join(made), d)
    return made


def read_key_file(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZPL certificate (what ``learnmesh keys`` writes, and
    pyzmq's ``zmq.auth`` format), or from a file holding only the Z85 keys on one line —
    ``PUBLIC`` or ``PUBLIC SECRET`` — the form a container secret passed as one environment
    value takes."""
    text = path.read_bytes()
    if b"public-key" not in text:
        keys = text.split()
        if len(keys) in (1, 2) and all(len(k) == 40 for k in keys):
            return keys[0], keys[1] if len(keys) == 2 else None
        raise ValueError("neither a ZPL certificate nor Z85 keys")
    public, secret = load_certificate(path)
    return public, secret


def _read_public(path: Path) -> bytes:
    try:
        public, _ = read_key_file(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE public key {path}: {exc}") from None
    return public


def _check_private(path: Path) -> None:
    """A secret key file must be a regular file only its owner may read or write."""
    if not path.exists():
        raise CurveKeyError(f"CURVE secret key {path} is missing: run `learnmesh keys` (or `learnmesh up`, which "
                            f"makes every missing key), or copy this role's key there")
    try:
        check_private(path, "CURVE secret key")
    except InsecureFileError as exc:
        raise CurveKeyError(str(exc)) from None


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1


@dataclass(frozen=True)
class Keypair:
    public: bytes  # z85, 40 bytes
    secret: bytes


class CurveKeys:
    """What one process of ``role`` holds: its own keypair, and read access to its peers'
    public keys (pinned when it connects, allowed when it binds)."""

    def __init__(self, keys_dir: str | os.PathLike[str], role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        self.dir = Path(keys_dir)
        self.role = role
        path = secret_file(self.dir, role)
        _check_private(path)
        try:
            public, secret = read_key_file(path)
        except (OSError, ValueError) as exc:
            raise CurveKeyError(f"cannot read CURVE secret key {path}: {exc}") from None
        if secret is None:
            raise CurveKeyError(f"{path} holds no secret key")
        self.own = Keypair(public, secret)
        self._allowed: dict[str, tuple[tuple[tuple[str, int], ...], frozenset[bytes]]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the secret key
        return f"CurveKeys(dir={self.dir}, role={self.role!r}, public={self.own.public.decode()[:8]}...)"

    @classmethod
    def load(cls, cfg: ZmqConfig, role: str) -> CurveKeys | None:
        """This process's keys, or None when ``zmq.curve`` is off. A keys directory without
        any secret key is a first start: every role's keypair is made there."""
        if not cfg.curve:
            return None
        d = Path(cfg.keys_dir)
        if not d.is_dir() or not any(d.glob("*.key_secret")):
            ensure_keys(d)
        return cls(d, role)

    def server_key(self, role: str) -> bytes:
        """The public key a client pins for a server of ``role``."""
        return _read_public(public_file(self.dir, role))

    def allowed(self, role: str) -> frozenset[bytes]:
        """Client keys of ``role`` a server admits: ``<role>.key`` and ``<role>.*.key``, read
        again when one of those files is added, removed or changed (a key rotated in or out)."""
        paths = [public_file(self.dir, role), *sorted(self.dir.glob(f"{role}.*.key"))]
        stamp = tuple((str(p), _mtime_ns(p)) for p in paths)
        with self._lock:
            cached = self._allowed.get(role)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            keys = set()
            for path in paths:
                try:
                    keys.add(_read_public(path))
                except CurveKeyError as exc:
                    log.warning("%s", exc)
            found = frozenset(keys)
            self._allowed[role] = (stamp, found)
            return found

    def server(self, domain: str) -> CurveServer:
        """Options for a socket that binds: this role's secret key, and the allow-list of
        the clients of ``domain``."""
        client_role = DOMAIN_CLIENTS[domain]
        return CurveServer(self.own.secret, domain, lambda: self.allowed(client_role))

    def client(self, server_role: str) -> CurveClient:
        """Options for a socket that connects to a server of ``server_role`` (its key pinned)."""
        return CurveClient(self.own.public, self.own.secret, self.server_key(server_role), server_role)


# ---------------------------------------------------------------------------- socket options


@dataclass(frozen=True)
class CurveServer:
    secret_key: bytes
    domain: str
    allowed: Callable[[], frozenset[bytes]]


@dataclass(frozen=True)
class CurveClient:
    public_key: bytes
    secret_key: bytes
    server_key: bytes
    server_role: str


def _fingerprint(key: bytes) -> str:
    return key.decode(errors="replace")[:8]


class _AllowList:
    """The credentials provider pyzmq's authenticator asks once per CURVE handshake."""

    def __init__(self) -> None:
        self.domains: dict[str, list[Callable[[], frozenset[bytes]]]] = {}
        self._reported: set[tuple[str, bytes]] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if any(key in allowed() for allowed in list(self.domains.get(domain, ()))):
            return True
        metrics.ZMQ_AUTH_REFUSED.labels(domain).inc()
        if (domain, key) not in self._reported and len(self._reported) < 1000:
            self._reported.add((domain, key))
            log.warning("refused a CURVE client on the %s link: key %s... is not allowed (counted in "
                        "learnmesh_zmq_auth_refused_total)", domain, _fingerprint(key))
        return False


class _Zap:
    """One running authenticator of a ZeroMQ context, and how many server sockets use it."""

    def __init__(self, ctx: zmq.Context, start_timeout_s: float = 5.0) -> None:
        self.allow = _AllowList()
        deadline = time.monotonic() + start_timeout_s
        while True:
            self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("learnmesh.curve.zap"))
            try:
                self.auth.start()
                break
            except zmq.ZMQError as exc:
                self.auth.stop()  # closes what start() made
                # the previous authenticator of this context releases its endpoint in the I/O
                # thread, a moment after it stopped
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise RuntimeError(f"the ZAP authenticator could not start: {exc}") from None
            time.sleep(0.02)
        self.auth.configure_curve_callback("*", self.allow)
        for domain in DOMAIN_CLIENTS:
            self.auth.configure_curve_callback(domain, self.allow)
        self.users = 0

    def stop(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # ctx.destroy() may have closed its sockets already
            self.auth.stop()


_ZAPS: dict[int, _Zap] = {}
_ZAPS_LOCK = threading.Lock()


def _attach(ctx: zmq.Context, opts: CurveServer) -> Callable[[], None]:
    """Start (or share) the context's authenticator with ``opts``'s allow-list; returns the
    release to call when the server socket closes (the last one stops the authenticator,
    so ``ctx.term()`` does not wait on its sockets)."""
    key = ctx.underlying  # shadow contexts share one libzmq context, hence one ZAP endpoint
    with _ZAPS_LOCK:
        zap = _ZAPS.get(key)
        if zap is None:
            zap = _ZAPS[key] = _Zap(ctx)
        zap.users += 1
        zap.allow.domains.setdefault(opts.domain, []).append(opts.allowed)

    def release() -> None:
        with _ZAPS_LOCK:
            providers = zap.allow.domains.get(opts.domain, [])
            with contextlib.suppress(ValueError):
                providers.remove(opts.allowed)
            zap.users -= 1
            if zap.users > 0:
                return
            _ZAPS.pop(key, None)
        zap.stop()

    return release


_SERVER_CLASSES: dict[type, type] = {}


def _server_class(base: type[zmq.Socket]) -> type[zmq.Socket]:
    """``base`` whose close() also releases the context's authenticator."""
    cls = _SERVER_CLASSES.get(base)
    if cls is None:
        def close(self: Any, linger: int | None = None) -> None:
            release, self._zap_release = self._zap_release, None
            base.close(self, linger)
            if release is not None:
                release()

        cls = _SERVER_CLASSES[base] = type(f"Curve{base.__name__}", (base,),
                                           {"_zap_release": None, "close": close})
    return cls


def new_socket(ctx: zmq.Context, kind: int, curve: CurveServer | CurveClient | None) -> zmq.Socket:
    """A socket of ``kind`` with ``curve`` applied (before any bind or connect)."""
    if isinstance(curve, CurveServer):
        sock = ctx.socket(kind, socket_class=_server_class(ctx._socket_class))
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, curve.domain.encode())
        try:
            sock._zap_release = _attach(ctx, curve)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock
    sock = ctx.socket(kind)
    if isinstance(curve, CurveClient):
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    return sock


# ---------------------------------------------------------------------------- handshake watch

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
_FAILED: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
                           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused"}
_RETRY_S = (0.5, 1.0, 2.0, 5.0)
_ABANDONED_AFTER_S = 0.5
"""How long after a connection closed libzmq has surely started its reconnect timer (it does so
within milliseconds, in its I/O thread) if it is going to: without one, it abandoned the link."""


class HandshakeWatch:
    """Follows the CURVE handshakes and the connections of one client socket and keeps its link
    alive.

    A server that does not hold the pinned key (another mesh's, a process that took the port,
    one with CURVE off) never completes a handshake: each failure is counted in
    ``learnmesh_zmq_handshake_failed_total{peer,reason}`` and logged once per failure streak.
    libzmq gives up on an endpoint for good after a protocol error or a refusal (it would stay
    dead after the impostor left, or once the allow-list is fixed), so the watch connects it
    again, with a growing pause.

    The same holds for an established connection that the peer broke — a frame longer than
    the socket reads (``ZMQ_MAXMSGSIZE``), or bytes that are not ZMTP: libzmq closes it and
    never connects again, and the socket would wait for ever. The watch tells that from a
    connection closed for other reasons (libzmq then starts its reconnect timer), counts it in
    ``learnmesh_zmq_connections_broken_total{peer}``, logs it, calls ``on_broken`` (what was in
    flight on that connection will not be answered) and connects again, with a growing pause.

    Every connecting socket has one, with CURVE or without. Create it before the socket
    (``make_socket(monitor=watch.address)``) so the first handshake is seen, then
    :meth:`attach` the socket; read events with :meth:`run` (asyncio contexts) or :meth:`poll`
    (synchronous)."""

    def __init__(self, ctx: zmq.Context, peer: str, endpoint: str,
                 on_change: Callable[[bool], None] | None = None, *, max_frame_bytes: int = 0,
                 on_broken: Callable[[], None] | None = None) -> None:
        self.peer, self.endpoint, self.on_change, self.on_broken = peer, endpoint, on_change, on_broken
        self.max_frame_bytes = max_frame_bytes  # only for the log line: what a frame may be
        self.address = f"inproc://curve-handshakes-{id(self)}"
        self.mon = ctx.socket(zmq.PAIR)
        self.mon.setsockopt(zmq.LINGER, 0)
        self.mon.connect(self.address)  # before the monitor binds it: inproc queues what it emits
        self.sock: zmq.Socket | None = None
        self.failing = False
        self.broken = 0  # connections the peer broke (see above)
        self._up = False  # a connection completed its handshake and has not closed since
        self._closed_at: float | None = None  # when it closed, until libzmq is seen reconnecting
        self._retries = 0
        self._retry_at: float | None = None
        self._broken_warning = ThrottledWarning(log)

    def attach(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def _handle(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            if self._up:
                self._up, self._closed_at = False, time.monotonic()
            return
        if event == zmq.EVENT_CONNECT_RETRIED:
            self._closed_at = None  # libzmq reconnects by itself
            return
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up, self._closed_at = True, None
            if self.failing:
                log.info("CURVE handshake with %s %s succeeded", self.peer, self.endpoint)
            self.failing, self._retries = False, 0
        elif event in _FAILED:
            metrics.ZMQ_HANDSHAKE_FAILED.labels(self.peer, _FAILED[event]).inc()
            if not self.failing and event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                log.warning("CURVE handshake with %s %s refused: this process's key is not in its allow-list; "
                            "nothing is sent to it", self.peer, self.endpoint)
            elif not self.failing:
                log.warning("CURVE handshake with %s %s failed (%s): it does not hold the %s key this "
                            "process pins (another mesh's %s, a process that took its port, or CURVE off "
                            "there); nothing is sent to it", self.peer, self.endpoint, _FAILED[event], self.peer,
                            self.peer)
            self.failing = True
            if event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # that one libzmq retries by itself
                self._retry_at = time.monotonic() + _RETRY_S[min(self._retries, len(_RETRY_S) - 1)]
                self._retries += 1
        else:
            return
        if self.on_change is not None:
            self.on_change(self.failing)

    def _check_abandoned(self) -> None:
        """A closed connection libzmq does not reconnect: reported, and connected again."""
        if self._closed_at is None or time.monotonic() - self._closed_at < _ABANDONED_AFTER_S:
            return
        self._closed_at = None
        self.broken += 1
        metrics.ZMQ_CONNECTIONS_BROKEN.labels(self.peer).inc()
        limit = f"a frame over {self.max_frame_bytes} bytes" if self.max_frame_bytes else "a frame over its limit"
        self._broken_warning.warning(
            "closed the connection to %s %s: it sent %s or bytes that are not ZeroMQ's protocol (a misconfigured "
            "or hostile peer, counted in learnmesh_zmq_connections_broken_total); what was in flight on it is "
            "lost, connecting again", self.peer, self.endpoint, limit)
        if self.on_broken is not None:
            self.on_broken()
        self._retry_at = time.monotonic() + _RETRY_S[min(self._retries, len(_RETRY_S) - 1)]
        self._retries += 1

    def _next_check_s(self) -> float | None:
        due = [t for t in (self._retry_at, None if self._closed_at is None else self._closed_at + _ABANDONED_AFTER_S)
               if t is not None]
        return min(due) - time.monotonic() if due else None

    def _reconnect_if_due(self) -> None:
        self._check_abandoned()
        if self._retry_at is None or time.monotonic() < self._retry_at or self.sock is None or self.sock.closed:
            return
        self._retry_at = None
        with contextlib.suppress(zmq.ZMQError):  # the failed session may already be gone
            self.sock.disconnect(self.endpoint)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.connect(self.endpoint)

    def poll(self) -> None:
        """Take the events so far and reconnect when due (synchronous sockets; cheap)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                frames = self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(int(parse_monitor_message(frames)["event"]))
        self._reconnect_if_due()

    async def run(self) -> None:
        """Follow the events until cancelled (asyncio sockets)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            stop_if_cancelled()
            wait_s = self._next_check_s()
            timeout_ms = None if wait_s is None else max(0, int(wait_s * 1000))
            if await self.mon.poll(timeout_ms):
                self._handle(int(parse_monitor_message(await self.mon.recv_multipart())["event"]))
            self._reconnect_if_due()

    def close(self) -> None:
        if self.sock is not None and not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
        self.mon.close(0)
