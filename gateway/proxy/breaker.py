"""A per-upstream circuit breaker: closed, open, half-open.

Closed: calls pass; ``failures`` consecutive failures open it. Open: calls fail at once for
``reset_s``. Then half-open: one probe call passes (the others still fail fast); its success
closes the breaker, its failure opens it again.

State is per replica, on purpose: each replica judges its own path to the upstream (its network
route, its DNS answer, its stdio process, its concurrency slots), learns on its own within
``failures`` calls that the upstream is down for it, and keeps calling an upstream that only
another replica cannot reach. A shared breaker would let one replica's bad path stop every
replica's calls, and would cost a Redis round trip per call. What the mesh shares is the view:
every replica publishes its breakers' states (:mod:`gateway.proxy.health`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the /metrics gauge


class Breaker:
    """``on_change`` is called (synchronously) each time the state moves, never per call."""

    def __init__(self, failures: int, reset_s: float, on_change: Callable[[], None] | None = None) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self.failures = 0
        self.opened_at = 0.0  # monotonic
        self.on_change = on_change
        self._probing = False
        self._state = CLOSED

    @property
    def state(self) -> str:
        if self._state == OPEN and time.monotonic() - self.opened_at >= self.reset_s:
            self._probing = False
            self._move(HALF_OPEN)
        return self._state

    def admit(self) -> bool:
        """Whether a call may go to the upstream now (half-open: only the one probe)."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def retry_in_s(self) -> float:
        return max(0.0, self.reset_s - (time.monotonic() - self.opened_at))

    def abandoned(self) -> None:
        """An admitted call never reached the upstream (it got no slot): another may probe."""
        self._probing = False

    def succeeded(self) -> None:
        self.failures = 0
        self._probing = False
        self._move(CLOSED)

    def failed(self) -> None:
        self.failures += 1
        self._probing = False
        if self._state == HALF_OPEN or self.failures >= self.threshold:
            self.opened_at = time.monotonic()
            self._move(OPEN)  # calls in flight when it opened re-open it: not a change to tell

    def _move(self, state: str) -> None:
        if state != self._state:
            self._state = state
            if self.on_change is not None:
                self.on_change()
