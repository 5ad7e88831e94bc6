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
from shared.worker_registry import Registration

log = logging.getLogger("learnmesh.worker")


class Registrar:
    """Renews ``describe()``'s registration every ``worker.register_interval_ms`` until
    :meth:`close`, which withdraws it. Redis being away is logged once and retried: serving
    goes on, and gateways that follow the announcements drop the worker when it expires."""

    def __init__(self, cfg: Config, redis: Any, describe: Callable[[], Registration]) -> None:
        self.redis = redis
        self.describe = describe
        self.interval_s = cfg.worker.register_interval_ms / 1000
        self.ttl_ms = cfg.worker.registration_ttl_ms
        self.renewals = 0
        self._stop = threading.Event()
        self._failing = False
        self._duplicate_of: str | None = None  # endpoint of another process announced under this id
        self._thread = threading.Thread(target=self._run, name="worker-registration", daemon=True)

    def start(self) -> None:
        self._renew()  # announced before the serving loop starts
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._renew()

    def _renew(self) -> None:
        reg = self.describe()
        try:
            worker_registry.register(self.redis, reg, self.ttl_ms)
        except worker_registry.DuplicateWorker as exc:  # serve on; announced once the other one's expires
            if exc.endpoint != self._duplicate_of:
                log.error("worker %s at %s is not announced: %s", reg.worker_id, reg.endpoint, exc)
            self._duplicate_of = exc.endpoint
            return
        except Exception as exc:  # Redis away: keep serving, retry at the next interval
            if not self._failing:  # a reply (WRONGTYPE: a key holds something else) says what to fix
                why = f"{type(exc).__name__}: {exc}" if isinstance(exc, ResponseError) else type(exc).__name__
                log.warning("worker %s could not renew its registration: %s", reg.worker_id, why)
            self._failing = True
            return
        if self._failing or self._duplicate_of is not None or not self.renewals:
            log.info("worker %s announced at %s", reg.worker_id, reg.endpoint)
        self._failing, self._duplicate_of = False, None
        self.renewals += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        reg = self.describe()
        try:
            worker_registry.withdraw(self.redis, reg.worker_id, reg.instance)
        except Exception as exc:  # gone with Redis: the announcement expires by itself
            log.debug("worker %s could not withdraw its registration: %s", reg.worker_id, exc)
