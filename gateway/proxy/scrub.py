"""Keeping an upstream's credentials out of what it sends back.

An upstream may echo what the gateway sent it — an error quoting the ``Authorization`` header it
refused, a debugging tool that returns its request — and the gateway's clients must never learn
the gateway's own credential that way. Every value the gateway sends an upstream as a credential
(a header or query value of ``headers_from_*`` / ``query_from_*``, a stdio server's credential
variables), and the token of a ``<scheme> <token>`` header value, is replaced by
:data:`REDACTED` wherever it appears in a string of the upstream's answers, errors,
notifications and questions. An upstream without credentials costs nothing; one with them, an
``orjson`` encoding and a substring search per message, and a walk only of a message that holds
a credential.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar
from urllib.parse import quote

import orjson

from gateway.proxy.wire import Hooks, Message

REDACTED = "[redacted]"
# A shorter value would be found by chance in ordinary text, which would then reach clients mangled.
MIN_SCRUBBED_CHARS = 8

T = TypeVar("T")


def _forms(value: str) -> Iterable[str]:
    """How ``value`` may come back: whole, its token after an auth scheme (``Bearer <token>``), and
    as a URL query writes it."""
    yield value
    scheme, space, token = value.partition(" ")
    if space and scheme.isalpha():
        yield token.strip()
    yield quote(value, safe="")


class Scrubber:
    """Replaces an upstream's credential values in what it sends back (see the module)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        found = {form for value in secrets for form in _forms(value) if len(form) >= MIN_SCRUBBED_CHARS}
        # Longest first: "Bearer tok..." goes whole before its token alone could leave "Bearer " behind.
        self._secrets = sorted(found, key=len, reverse=True)
        # A string holding a value holds it in its JSON encoding too (JSON escapes character by
        # character), so the encoded message tells at once whether any walk is needed.
        self._probes = [orjson.dumps(s)[1:-1] for s in self._secrets]

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def scrub(self, value: T) -> T:
        """``value`` (a decoded JSON value) with every credential in its strings replaced."""
        if not self._secrets:
            return value
        try:
            encoded = orjson.dumps(value)
        except orjson.JSONEncodeError:
            return self._walk(value)
        if not any(probe in encoded for probe in self._probes):
            return value
        return self._walk(value)

    def hooks(self, hooks: Hooks) -> Hooks:
        """``hooks`` seeing the upstream's notifications and questions scrubbed."""
        if not self._secrets:
            return hooks
        notify, ask = hooks.notify, hooks.ask
        scrubbed_notify, scrubbed_ask = None, None
        if notify is not None:
            async def scrubbed_notify(msg: Message) -> None:
                await notify(self.scrub(msg))
        if ask is not None:
            async def scrubbed_ask(msg: Message) -> Message:
                return await ask(self.scrub(msg))
        return Hooks(notify=scrubbed_notify, ask=scrubbed_ask, progress_token=hooks.progress_token)

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self._secrets:
                if secret in value:
                    value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, dict):
            return {self._walk(k): self._walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v) for v in value]
        return value
