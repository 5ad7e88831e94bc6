"""A worker's announcement in Redis (shared.worker_registry), renewed by a thread of its own:
a long batch or a slow forward pass in the serving loop never lets it expire, while a process
that dies stops renewing it at once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from shared import worker_registry
from shared.config import Config
from shared.redis_client import ClusterUnreachable
from shared.worker_registry import Registration

log = logging.getLogger("learnmesh.worker")


class Registrar:
    """Renews ``describe()``'s registration every ``worker.register_interval_ms`` until
    :meth:`close`, which withdraws it. Redis being away — also at start, before any client
    could be made (a cluster client needs a node that answers) — is logged once and retried with
    backoff up to ``worker.registration_ttl_ms`` between tries: serving goes on, and gateways
    that follow the announcements drop the worker when it expires. ``connect()`` gives the
    Redis client, raising while no node answers."""

    def __init__(self, cfg: Config, connect: Callable[[], Any], describe: Callable[[], Registration]) -> None:
        self.connect = connect
        self.describe = describe
        self.interval_s = cfg.worker.register_interval_ms / 1000
        self.max_interval_s = cfg.worker.registration_ttl_ms / 1000
        self.ttl_ms = cfg.worker.registration_ttl_ms
        self.renewals = 0
        self._stop = threading.Event()
        self._failing = False
        self._failures = 0  # tries in a row that failed: the wait before the next one doubles
        self._duplicate_of: str | None = None  # endpoint of another process announced under this id
        self._thread = threading.Thread(target=self._run, name="worker-registration", daemon=True)

    def start(self) -> None:
        self._renew()  # announced before the serving loop starts
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._next_wait_s()):
            self._renew()

    def _next_wait_s(self) -> float:
        if not self._failures:
            return self.interval_s
        return min(self.max_interval_s, self.interval_s * 2 ** min(self._failures - 1, 16))

    def _renew(self) -> None:
        reg = self.describe()
        try:
            worker_registry.register(self.connect(), reg, self.ttl_ms)
        except worker_registry.DuplicateWorker as exc:  # serve on; announced once the other one's expires
            if exc.endpoint != self._duplicate_of:
                log.error("worker %s at %s is not announced: %s", reg.worker_id, reg.endpoint, exc)
            self._duplicate_of = exc.endpoint
            return
        except Exception as exc:  # Redis away: keep serving, retry after a backoff
            if not self._failing:  # a reply (WRONGTYPE: a key holds something else) says what to fix
                why = f"{type(exc).__name__}: {exc}" if isinstance(exc, (ResponseError, ClusterUnreachable)) \
                    else type(exc).__name__
                if self.renewals:
                    log.warning("worker %s could not renew its registration: %s", reg.worker_id, why)
                else:
                    log.warning("worker %s cannot announce itself yet (%s); it serves at %s and keeps trying "
                                "until Redis answers", reg.worker_id, why, reg.endpoint)
            self._failing = True
            self._failures += 1
            return
        if self._failing or self._duplicate_of is not None or not self.renewals:
            log.info("worker %s announced at %s", reg.worker_id, reg.endpoint)
        self._failing, self._duplicate_of, self._failures = False, None, 0
        self.renewals += 1

    @property
    def holds_id(self) -> bool:
        """Whether this process's announcement stands (not refused as another process's id)."""
        return self.renewals > 0 and self._duplicate_of is None

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self.renewals:  # never announced: nothing to withdraw (and no client to wait for)
            return
        reg = self.describe()
        try:
            worker_registry.withdraw(self.connect(), reg.worker_id, reg.instance)
        except Exception as exc:  # gone with Redis: the announcement expires by itself
            log.debug("worker %s could not withdraw its registration: %s", reg.worker_id, exc)
