"""What the context store accepts from callers — names, modalities, entries, limits —
checked before the script is called, so bad input never reaches Redis."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from shared.config import ContextConfig
from shared.context.errors import ContextError, EntryTooLarge, InvalidModality

MAX_ROLE_BYTES = 64
MAX_MIME_BYTES = 128
MAX_LINKS = 64
MAX_LAST_N = 1_000_000
MAX_TOKENS_LIMIT = 2**31 - 1
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# Braces would change a key's hash tag, '|' separates the parts of an entry's field name, and
# NUL marks the principal in the scripts' command template (see scripts.py).
_PRINCIPAL_BAD = re.compile(r"[{}|\x00\s]")
_REASON_RE = re.compile(r"[a-z_]{1,32}")
# A call's request id (context_append, learn): a UUID fits; kept in the context's meta or the
# principal's list of learn ids, so short and without the '|' those records are split on.
REQUEST_ID_PATTERN = "[A-Za-z0-9._:-]{1,64}"
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
_SEQ = re.compile(r"[0-9]{1,15}")  # a sequence number (exact as a Lua number, as the script reads it)


def check_principal(principal: str) -> None:
    if not principal or len(principal) > 256 or _PRINCIPAL_BAD.search(principal):
        raise ContextError(f"bad principal name {principal!r}")


def is_context_id(context_id: Any) -> bool:
    return isinstance(context_id, str) and _ID_RE.fullmatch(context_id) is not None


def check_id(context_id: str) -> None:
    if not is_context_id(context_id):
        raise ContextError("context id must be 1-128 characters of [A-Za-z0-9._:-], starting alphanumeric")


def is_request_id(request_id: object) -> bool:
    return isinstance(request_id, str) and _REQUEST_ID_RE.fullmatch(request_id) is not None


def check_request_id(request_id: str) -> None:
    if not is_request_id(request_id):
        raise ContextError("request id must be 1-64 characters of [A-Za-z0-9._:-] (a UUID fits)")


def check_modality(cfg: ContextConfig, modality: str) -> None:
    if modality not in cfg.modalities:
        raise InvalidModality(f"unknown modality {modality!r}; configured: {', '.join(cfg.modalities)}")


def modalities_arg(cfg: ContextConfig, modalities: Iterable[str] | None) -> str:
    """The script's modalities argument: "" for all, else the names joined by commas."""
    if modalities is None:
        return ""
    mods = list(modalities)
    if not mods:
        raise ContextError("modalities must not be empty (omit it for all)")
    for m in mods:
        check_modality(cfg, m)
    return ",".join(mods)


def check_limit(name: str, v: Any, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise ContextError(f"{name} must be an integer in 1..{hi}")


def check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ContextError("version must be a positive integer")


def check_reason(reason: str) -> None:
    if not _REASON_RE.fullmatch(reason):
        raise ContextError("bad eviction reason")


def check_entry(cfg: ContextConfig, modality: str, role: str, content: Any, *, mime: str | None,
                tokens: int | None, links: Sequence[str]) -> tuple[bytes, int, list[str]]:
    """An entry to append, checked: its content as bytes, its tokens (one per byte unless
    given: the built-in model's tokenizer) and its links as a list."""
    check_modality(cfg, modality)
    if not isinstance(content, (bytes, bytearray, memoryview)):
        raise ContextError("content must be bytes")
    content = bytes(content)
    if len(content) > cfg.max_entry_bytes:
        raise EntryTooLarge(f"entry of {len(content)} bytes exceeds context.max_entry_bytes "
                            f"({cfg.max_entry_bytes})")
    if not role or len(role.encode()) > MAX_ROLE_BYTES:
        raise ContextError(f"role must be 1-{MAX_ROLE_BYTES} bytes")
    if mime is not None and (len(mime.encode()) > MAX_MIME_BYTES or not mime):
        raise ContextError(f"mime must be 1-{MAX_MIME_BYTES} bytes")
    if modality == "text":
        try:
            content.decode("utf-8")
        except UnicodeDecodeError:
            raise ContextError("text content must be valid UTF-8") from None
    if tokens is None:
        tokens = len(content)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS_LIMIT:
        raise ContextError("tokens must be an integer in 0..2^31-1")
    links = list(links)
    if len(links) > MAX_LINKS:
        raise ContextError(f"at most {MAX_LINKS} links per entry")
    for i, link in enumerate(links):
        mod, _, seq = str(link).partition(":")
        check_modality(cfg, mod)
        # ASCII digits only: str.isdigit() takes '²' and '٣', which int() or the script then read otherwise
        if mod == modality or not _SEQ.fullmatch(seq) or int(seq) < 1:
            raise ContextError(f"link {link!r} must name an entry of another channel, like 'image:3'")
        links[i] = f"{mod}:{int(seq)}"  # one spelling per entry ('image:03' is 'image:3')
    return content, tokens, links
