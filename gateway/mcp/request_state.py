"""Sealed ``requestState`` for 2026-07-28 multi-round-trip requests.

The server hands the client an opaque token with an ``input_required`` result; the
client sends it back with its answers, possibly to another replica. The token is
AES-256-GCM sealed with a key from ``gateway.request_state_keys`` (hex; the first
seals, all open, so keys can be rotated), carries an expiry, and is bound to the
principal through the associated data — a token minted for alice is useless to bob,
and any tampering fails authentication.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import time
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.errors import InvalidParams

log = logging.getLogger(__name__)

_VERSION = b"\x01"


def _derive(secret_hex: str) -> bytes:
    raw = bytes.fromhex(secret_hex)
    if len(raw) < 16:
        raise ValueError("gateway.request_state_keys entries must be at least 16 bytes (32 hex chars)")
    return hashlib.sha256(b"learnmesh-request-state\x00" + raw).digest()


class RequestStateSealer:
    """Seal/open request states. ``keys`` are hex secrets; the first one seals."""

    def __init__(self, keys: list[str], ttl_s: int = 600) -> None:
        if not keys:
            log.warning("gateway.request_state_keys is empty: using an ephemeral key; input_required "
                        "round trips will only succeed on this replica and not across restarts (give every "
                        "replica the same keys, e.g. LEARNMESH_REQUEST_STATE_KEYS_FILE)")
            keys = [os.urandom(32).hex()]
        self._keys = [(hashlib.sha256(_derive(k)).digest()[:4], AESGCM(_derive(k))) for k in keys]
        self.ttl_s = ttl_s

    def seal(self, principal: str, state: dict[str, Any]) -> str:
        kid, aead = self._keys[0]
        nonce = os.urandom(12)
        body = orjson.dumps({"exp": int(time.time()) + self.ttl_s, "s": state})
        aad = _VERSION + kid + principal.encode()
        blob = _VERSION + kid + nonce + aead.encrypt(nonce, body, aad)
        return base64.urlsafe_b64encode(blob).rstrip(b"=").decode()

    def open(self, principal: str, token: Any) -> dict[str, Any]:
        """Return the sealed state; raise :class:`InvalidParams` if forged, tampered, foreign or expired."""
        if not isinstance(token, str) or len(token) > 1 << 20:
            raise InvalidParams("requestState is invalid")
        try:
            blob = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (ValueError, TypeError):
            raise InvalidParams("requestState is invalid") from None
        if len(blob) < 1 + 4 + 12 + 16 or blob[:1] != _VERSION:
            raise InvalidParams("requestState is invalid")
        kid, nonce, sealed = blob[1:5], blob[5:17], blob[17:]
        for key_id, aead in self._keys:
            if key_id != kid:
                continue
            try:
                body = orjson.loads(aead.decrypt(nonce, sealed, _VERSION + kid + principal.encode()))
            except InvalidTag:
                break
            if body["exp"] < time.time():
                raise InvalidParams("requestState has expired; start the request again")
            return body["s"]
        raise InvalidParams("requestState is invalid")
