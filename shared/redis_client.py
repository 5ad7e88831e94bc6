"""Every Redis client a learnmesh process opens is made here, from ``redis.*`` config.

Redis holds the mesh's trust root (admin key hashes, the sample log every model learns
from), so whoever reaches it must authenticate: ``redis.url`` may carry
``redis://user:password@host`` (``rediss://`` for TLS), or ``redis.username`` with
``redis.password`` / ``redis.password_file``; ``redis.tls_*`` name the CA, client
certificate and key. One function turns them into redis-py arguments so the gateway,
workers, trainer and supervisor connect alike. Passwords never reach a log line:
:func:`redact_url` is what prints a URL.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis as redis_sync
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from shared.config import DEFAULT_REDIS_URL, ConfigError, RedisConfig
from shared.secret_files import check_private, read_private_text


class RedisAccessError(ConfigError):
    """Redis refused this process's credentials or TLS identity: a setting to fix, not an outage
    to wait out, so processes stop at start with this message."""


def url_of(cfg: RedisConfig) -> str:
    return cfg.url or DEFAULT_REDIS_URL


def client_kwargs(cfg: RedisConfig) -> dict[str, Any]:
    """redis-py keyword arguments for the credentials and TLS settings the URL does not carry
    (the URL's own user and password win where it has them)."""
    kwargs: dict[str, Any] = {}
    if cfg.username:
        kwargs["username"] = cfg.username
    if cfg.password_file:
        kwargs["password"] = read_private_text(cfg.password_file, "redis.password_file")
    elif cfg.password:
        kwargs["password"] = cfg.password
    if url_of(cfg).startswith("rediss://"):
        kwargs["ssl_cert_reqs"], kwargs["ssl_check_hostname"] = "required", True  # older redis-py: off
        if cfg.tls_ca_file:
            kwargs["ssl_ca_certs"] = cfg.tls_ca_file
        if cfg.tls_cert_file and cfg.tls_key_file:
            check_private(cfg.tls_key_file, "redis.tls_key_file")
            kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = cfg.tls_cert_file, cfg.tls_key_file
    return kwargs


def sync_client(cfg: RedisConfig, **options: Any) -> redis_sync.Redis:
    """A blocking client (trainer, workers, supervisor); ``options``: timeouts, pool size, ..."""
    return redis_sync.Redis.from_url(url_of(cfg), **client_kwargs(cfg), **options)


def async_client(cfg: RedisConfig, **options: Any) -> aioredis.Redis:
    """An asyncio client (gateway, the trainer's context reader)."""
    return aioredis.Redis.from_url(url_of(cfg), **client_kwargs(cfg), **options)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (the user name stays: it is not secret)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def without_password(url: str) -> tuple[str, str | None]:
    """(``url`` without its password, the password or None)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    user = f"{parts.username}@" if parts.username else ""
    netloc = user + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc)), parts.password


def access_problem(exc: BaseException, has_password: bool) -> str | None:
    """What is wrong when ``exc`` means Redis refused who we are (credentials, ACL, TLS
    identity) rather than being away; None for an outage."""
    if isinstance(exc, AuthenticationError):
        return "wrong user name or password" if has_password else "it requires a password and none is configured"
    if isinstance(exc, NoPermissionError):
        return f"the ACL user lacks a permission learnmesh needs ({exc})"
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"its TLS certificate did not verify ({cause.verify_message})"
        if isinstance(cause, ssl.SSLError):
            return f"the TLS handshake failed ({cause.reason or cause})"
        cause = cause.__cause__ or cause.__context__
    return None


def check_access(cfg: RedisConfig, timeout_s: float = 5.0) -> bool:
    """Connect once at start: raise :class:`RedisAccessError` naming the settings to fix when
    Redis refuses our credentials or TLS identity; False when it cannot be reached (processes
    start anyway and wait for it), True when it answers."""
    client = sync_client(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
        return True
    except (RedisError, OSError) as exc:
        problem = access_problem(exc, bool(client.connection_pool.connection_kwargs.get("password")))
        if problem is None:
            return False
        raise RedisAccessError(
            f"Redis at {redact_url(url_of(cfg))} refused this process: {problem}; check redis.url, "
            "redis.username, redis.password / redis.password_file and redis.tls_* (REDIS_URL, "
            "LEARNMESH_REDIS__*)") from None
    finally:
        client.close()
