"""Upstream server processes and the SDK client, for the proxy tests and the proxy bench.

:func:`start_http_upstream` runs ``python -m tests.proxy.upstreams http`` on a free port
(``shared.net.free_port``), pinned to one protocol revision and, when given a token, demanding
it as a bearer token (passed in the environment, never on the command line), and waits until
the port answers HTTP. :func:`sdk_client` connects the official SDK client to an upstream or
to a proxy, answering elicitation and sampling requests with fixed answers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import CreateMessageResult, ElicitResult, TextContent

from shared.net import free_port
from tests.conftest import wait_for_sync
from tests.proxy.upstreams.server import MARK_DIR_ENV
from tests.waiting import listens_on

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "UPSTREAM_BEARER_TOKEN"
STOP_TIMEOUT_S = 10.0


@dataclass
class Upstream:
    """One upstream server process and how to reach it."""

    name: str
    revision: str  # what it speaks: "2025-11-25", "2026-07-28" or "both"
    command: list[str]
    env: dict[str, str]
    mark_dir: Path
    url: str | None = None  # None for stdio: a proxy runs ``command`` itself
    token: str | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = field(default=None, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        """What a direct client sends to be let in."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def calls_started(self) -> int:
        """How many marked calls (``slow``) have begun on this upstream."""
        return sum(1 for _ in self.mark_dir.iterdir())

    def marks(self, what: str) -> int:
        """How many marks ``what`` (a tool that started, or ``cancelled``) this upstream left."""
        return sum(1 for f in self.mark_dir.iterdir() if f.name.startswith(what + "-"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to answer anything in flight. A stdio upstream is
        whoever runs it's child: its pid comes from the marks its calls left."""
        if self.proc is None:
            for pid in {int(mark.name.split("-")[1]) for mark in self.mark_dir.iterdir()}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)


def upstream_command(transport: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.proxy.upstreams", transport, "--name", name, *extra]


def upstream_env(mark_dir: Path, token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEARNMESH_", TOKEN_ENV))}
    env["PYTHONPATH"] = str(ROOT)
    env[MARK_DIR_ENV] = str(mark_dir)
    if token:
        env[TOKEN_ENV] = token
    return env


def _answers_http(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True


def start_http_upstream(name: str, revision: str, workdir: Path, token: str | None = None) -> Upstream:
    """Start an HTTP upstream pinned to ``revision`` ("both" for an unpinned one) and wait until
    it answers HTTP."""
    port = free_port()
    mark_dir = workdir / f"{name}-marks"
    mark_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--port", str(port), "--revision", revision]
    if token:
        extra += ["--token-env", TOKEN_ENV]
    up = Upstream(name=name, revision=revision, command=upstream_command("http", name, *extra),
                  env=upstream_env(mark_dir, token), mark_dir=mark_dir,
                  url=f"http://127.0.0.1:{port}/mcp", token=token, log_path=workdir / f"{name}.log")
    launch(up)
    return up


def launch(up: Upstream) -> None:
    """(Re)start an HTTP upstream's process on its port and wait until it answers HTTP; a stdio
    upstream is started again by whoever runs it, on its next use."""
    if up.url is None:
        return
    assert up.log_path is not None
    with up.log_path.open("ab") as log:
        proc = up.proc = subprocess.Popen(up.command, cwd=ROOT, env=up.env, stdout=log, stderr=subprocess.STDOUT)
    root = up.url.removesuffix("/mcp") + "/"
    try:
        port = int(root.rstrip("/").rsplit(":", 1)[1])
        # listens_on: not another test's server that took the port first
        wait_for_sync(lambda: _alive(up) and _answers_http(root) and listens_on(proc.pid, port),
                      timeout_s=30, interval_s=0.05,
                      what=lambda: f"upstream {up.name} at {root}:\n{up.log()}")
    except BaseException:
        stop_upstream(up)
        raise


def _alive(up: Upstream) -> bool:
    if up.proc is not None and up.proc.poll() is not None:
        raise AssertionError(f"upstream {up.name} exited with {up.proc.returncode}:\n{up.log()}")
    return True


def stop_upstream(up: Upstream) -> None:
    if up.proc is None or up.proc.poll() is not None:
        return
    up.proc.terminate()
    try:
        up.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        up.kill()


def stdio_upstream_spec(name: str, workdir: Path) -> Upstream:
    """The stdio upstream: not started here; whoever mounts it runs ``command`` with ``env``."""
    mark_dir = workdir / f"{name}-marks"
    mark_dir.mkdir(parents=True, exist_ok=True)
    return Upstream(name=name, revision="both", command=upstream_command("stdio", name, "--mark-dir", str(mark_dir)),
                    env=upstream_env(mark_dir), mark_dir=mark_dir)


CallOutcome = tuple[str, Any]  # ("result", value), ("error", exception) or ("cancelled", None)


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups: the SDK client raises its transport's
    failures out of task groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]
    return [exc]


ELICITED_NAME = "Ada"
SAMPLED_TEXT = "Paris"


async def answer_elicitation(context: Any, params: Any) -> ElicitResult:
    """The client side of ``greet_user``: accept with a name in the first requested field."""
    field_name = next(iter(params.requested_schema["properties"]))
    return ElicitResult(action="accept", content={field_name: ELICITED_NAME})


async def answer_sampling(context: Any, params: Any) -> CreateMessageResult:
    """The client side of ``ask_model``: a fixed model answer."""
    return CreateMessageResult(role="assistant", content=TextContent(type="text", text=SAMPLED_TEXT),
                               model="test-model")


@contextlib.asynccontextmanager
async def sdk_client(target: str | Upstream, mode: str, headers: dict[str, str] | None = None,
                     **options: Any) -> AsyncIterator[Client]:
    """The official SDK client on ``target`` (a URL or an upstream: its URL and bearer token, or
    its stdio command) in ``mode`` ("legacy", "auto" or "2026-07-28"), answering elicitation
    and sampling requests; ``headers`` are sent with every HTTP request."""
    options = {"elicitation_callback": answer_elicitation, "sampling_callback": answer_sampling,
               "cache": None, **options}
    if isinstance(target, Upstream) and target.url is None:
        params = StdioServerParameters(command=target.command[0], args=target.command[1:], env=target.env,
                                       cwd=str(ROOT))
        async with Client(params, mode=mode, **options) as client:
            yield client
        return
    url = target if isinstance(target, str) else target.url
    sent = {**(target.headers if isinstance(target, Upstream) else {}), **(headers or {})}
    async with create_mcp_http_client(headers=sent) as http, \
            Client(streamable_http_client(url, http_client=http), mode=mode, **options) as client:
        yield client


# ----------------------------------------------------------------------------- the proxy
PROXY_AUTH_ENV = "LM_E2E_UPSTREAM_AUTHORIZATION"  # the proxy reads the upstream credential here
ALICE_KEY, BOB_KEY, ADMIN_KEY = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef", "admin-key-0123456789ab"


@dataclass
class Proxy:
    """A learnmesh gateway process whose ``proxy`` section mounts the given upstreams."""

    url: str  # its MCP endpoint
    proc: subprocess.Popen
    log_path: Path

    @property
    def base(self) -> str:
        return self.url.removesuffix("/mcp")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def proxy_entry(up: Upstream) -> dict[str, Any]:
    """``proxy.upstreams`` entry for ``up``: pinned to the revision it speaks, its bearer token
    named by environment variable (never written into the configuration)."""
    entry: dict[str, Any] = {"name": up.name, "timeout_s": 20.0}
    if up.url is None:
        entry["command"] = up.command
    else:
        entry.update(url=up.url, revision=up.revision if up.revision != "both" else "auto")
    if up.token:
        entry["headers_from_env"] = {"Authorization": PROXY_AUTH_ENV}
    return entry


def start_proxy(redis_url: str, upstreams: list[Upstream], log_path: Path,
                allow: dict[str, Any] | None = None, **fields: Any) -> Proxy:
    """A proxy gateway (principals alice and bob, admin key ADMIN_KEY) logging at DEBUG into
    ``log_path``; ``fields`` go into every upstream's entry. The caller puts ``Bearer <token>`` into ``$LM_E2E_UPSTREAM_AUTHORIZATION``
    (and a stdio upstream's environment into this process's) before the call."""
    from tests.gateway_support import start_gateway

    proxy: dict[str, Any] = {"upstreams": [{**proxy_entry(up), **fields} for up in upstreams]}
    if allow is not None:
        proxy["allow"] = allow
    overrides = {"proxy": proxy, "gateway": {"admin_keys": {"root": {"key": ADMIN_KEY, "role": "admin"}}}}
    port = free_port()
    with log_path.open("wb") as log:
        proc = start_gateway(port, redis_url, api_keys=f"alice:{ALICE_KEY},bob:{BOB_KEY}", overrides=overrides,
                             output=log, log_level="debug")
    return Proxy(f"http://127.0.0.1:{port}/mcp", proc, log_path)
