"""A warning that can repeat thousands of times a second — every request or posted command
while Redis is away — written once per interval with the count it stands for, so an outage
leaves a readable log rather than a flood."""

from __future__ import annotations

import logging
import time
from typing import Any

INTERVAL_S = 10.0


class ThrottledWarning:
    """``warning(msg, *args)``: logged at once, then at most once per ``interval_s``; the next
    line says how many it stood in for."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.quiet_until = 0.0
        self.unlogged = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self.quiet_until:
            self.unlogged += 1
            return
        if self.unlogged:
            msg, args = msg + " (and %d more like it since the last such line)", (*args, self.unlogged)
        self.logger.warning(msg, *args)
        self.quiet_until, self.unlogged = now + self.interval_s, 0
