"""Following a Redis pub/sub channel for the life of a replica: the one reconnect loop behind
the control channel (gateway/state.py) and the tasks channel (gateway/tasks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
POLL_S = 1.0


async def follow(redis: aioredis.Redis, channel: str, on_message: Callable[[bytes], None], *,
                 on_subscribed: Callable[[], Awaitable[None]], on_lost: Callable[[], None], what: str) -> None:
    """Hand every message published on ``channel`` to ``on_message`` until cancelled, subscribing
    again with backoff when Redis goes away. Messages published while unsubscribed are lost:
    ``on_subscribed`` runs after every (re)subscription so the caller can catch up on what they
    would have said; ``on_lost`` runs when the subscription breaks. ``redis`` must have no
    socket timeout (a quiet channel is not a dead one)."""
    backoff_s = FIRST_BACKOFF_S
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            await on_subscribed()
            backoff_s = FIRST_BACKOFF_S
            while True:
                msg = await pubsub.get_message(timeout=POLL_S)
                if msg is not None and msg.get("type") == "message":
                    on_message(msg["data"])
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError) as exc:
            on_lost()
            log.warning("%s lost (%s); retrying", what, type(exc).__name__)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        await asyncio.sleep(backoff_s)
        backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
