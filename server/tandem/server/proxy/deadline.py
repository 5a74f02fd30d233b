"""One request's deadline for progress, shared by every wait inside it.

A client never waits more than ``budget`` seconds (the proxy's ``--stall-timeout``) in total
for progress: measured from the request's arrival, or from the last byte the proxy passed to
the client. Stall detection on an engine, failing over to another one and waiting for an engine
expected back all draw on the same deadline instead of each starting a fresh one.

Pure: the clock is injected (``time.monotonic`` by default), so the logic is tested without
sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """``budget`` seconds of silence allowed, counted from the last ``progress()``."""

    def __init__(
        self, budget: float, clock: Callable[[], float] = time.monotonic, end: float | None = None
    ) -> None:
        if budget <= 0:
            raise ValueError("a deadline's budget must be > 0")
        self.budget = budget
        self._clock = clock
        self._end = clock() + budget if end is None else end

    def now(self) -> float:
        return self._clock()

    def progress(self) -> None:
        """Bytes reached the client: the budget starts over."""
        self._end = self._clock() + self.budget

    def remaining(self) -> float:
        """Seconds left before the client has waited its budget (never below 0)."""
        return max(0.0, self._end - self._clock())

    def expired(self) -> bool:
        return self._clock() >= self._end

    def capped(self, limit: float) -> Deadline:
        """A deadline for one step: this one, or ``limit`` seconds from now if sooner (a
        prefill leaves the rest of the budget to the decode side)."""
        return Deadline(self.budget, self._clock, min(self._end, self._clock() + limit))
