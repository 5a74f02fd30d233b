"""Recommendations -> replica changes, without making pools flap. Pure.

:func:`stabilize` turns one recommendation into the replicas to set: scale up at once, scale
down only past a hysteresis margin and to the highest recommendation of a stabilisation
window, so a noisy load does not make pools flap (each flap is a cold engine start).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Stabilization:
    """How recommendations become replica changes (the HPA's ``behavior``, for the planner)."""

    scale_down_window_s: float = 300.0
    """Scale down only to the highest recommendation of this window."""
    down_margin: float = 0.2
    """Hysteresis: scale down only if the pool would still suffice at this much more load."""


@dataclass(frozen=True)
class PoolState:
    """One pool's replicas and its recent recommendations ``(time, replicas)``, oldest first."""

    replicas: int
    history: tuple[tuple[float, int], ...] = ()


def stabilize(
    state: PoolState,
    now: float,
    at_load: int,
    at_margin: int,
    bounds: Bounds,
    cfg: Stabilization = Stabilization(),
) -> PoolState:
    """The next state of one pool from the replicas needed at the load (``at_load``) and at
    the load plus the hysteresis margin (``at_margin >= at_load``).

    Up: at once to ``at_load``. Down: only when ``at_margin`` is below the current count,
    and then to the highest ``at_margin`` seen within the window.
    """
    # A fresh state (operator start) remembers its current size as just recommended, so a
    # restart or an empty first window never drops a pool before a full window has passed.
    past = state.history or ((now, state.replicas),)
    history = tuple((t, n) for t, n in past if now - t < cfg.scale_down_window_s) + (
        (now, at_margin),
    )
    current = state.replicas
    if at_load > current:
        target = at_load
    elif at_margin < current:
        target = min(current, max(n for _, n in history))
    else:
        target = current
    return PoolState(bounds.clamp(target), history)
