"""What a step of decode or verification rows costs by its number of rows, measured.

Speculation's cost model (``spec_decode.cost.StepCost``) weighs the tokens a proposed row
is expected to return against what the row adds to the step. That price depends on the CPU
(its vector width, its cores, who else runs on them) and on the code path a step takes, so a
constant fitted on one machine is wrong on the next. The worker times every step whose rows
are all sampled (decodes and speculation's verification rows, no prompt) and feeds this
curve: a moving average of seconds per step for each row count. Costs are read in one-row
steps, linear between measured row counts and along the nearest measured segment beyond them;
until a count is measured the seed (the cost model's constant) stands in for its shape.
"""

from __future__ import annotations

from collections.abc import Callable

ALPHA = 0.1  # weight of the newest step in a row count's moving average


class StepCurve:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` sampled rows ran its forward pass in ``seconds``."""
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + ALPHA * (seconds - old)

    def measured(self) -> dict[int, float]:
        """Each measured row count's average seconds (a copy)."""
        return dict(self._seconds)

    def cost(self, rows: int, seed: Callable[[int], float], upto: int | None = None) -> float:
        """A step of ``rows`` rows in one-row steps: ``seed`` (one-row steps by rows) until
        two row counts (at most ``upto``: past it steps take another path) are measured,
        the measured curve after."""
        seconds = {n: s for n, s in self._seconds.items() if upto is None or n <= upto}
        return curve_cost(seconds, rows, seed)


def curve_cost(seconds: dict[int, float], rows: int, seed: Callable[[int], float]) -> float:
    """``rows`` rows' cost in one-row steps on the piecewise linear curve through
    ``seconds`` (row count: seconds; each point raised to the ones before it, as a row is
    never negative work), extended along its last segment, and below its first point in the
    seed's shape; ``seed`` (one-row steps by rows) alone with fewer than two points."""
    points: list[tuple[int, float]] = []
    for n, s in sorted(seconds.items()):
        points.append((n, max(s, points[-1][1]) if points else s))
    if len(points) < 2:
        return seed(rows)

    def at(n: int) -> float:
        if n < points[0][0]:
            return points[0][1] * seed(n) / seed(points[0][0])
        i = next((i for i in range(1, len(points) - 1) if n <= points[i][0]), len(points) - 1)
        (a, sa), (b, sb) = points[i - 1], points[i]
        return sa + (sb - sa) * (n - a) / (b - a)

    return at(rows) / at(1)
