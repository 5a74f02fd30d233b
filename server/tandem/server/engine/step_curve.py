"""What a step of decode or verification rows costs by its number of rows, measured.

Speculation's cost model (``spec_decode.cost.StepCost``) weighs the tokens a proposed row
is expected to return against what the row adds to the step. That price depends on the CPU
(its vector width, its cores, who else runs on them) and on the code path a step takes, so a
constant fitted on one machine is wrong on the next. The worker times every step whose rows
are all sampled (decodes and speculation's verification rows, no prompt) and feeds this
curve: a moving average of seconds per step for each row count.

Costs are read, in one-row steps, off the lower convex hull of those averages from their
lowest point on (flat before it, linear between its corners, along its last segment beyond):
on a shared machine noise only ever adds time, so the lowest points are the truest, and a
convex curve (each further row costing at least what the one before did) is what lets the
cost model add rows greedily, stopping at the first that does not pay. Read point by point,
the curve's noise decided plans: a row count measured dear on a noisy moment made the plan
stop short of it, and it was never measured again (the default model's ``edit`` bench
proposed three tokens a step where four paid); a straight line fitted to all counts mispriced
curves that are flat and then rise (weights read once for a few rows, compute past that).
Below the first measured count the seed (the cost model's constant) gives the shape; with
fewer than two counts measured it stands alone.
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
        the curve's lower convex hull after."""
        seconds = {n: s for n, s in self._seconds.items() if upto is None or n <= upto}
        return curve_cost(seconds, rows, seed)


def curve_cost(seconds: dict[int, float], rows: int, seed: Callable[[int], float]) -> float:
    """``rows`` rows' cost in one-row steps on ``seconds`` (row count: seconds): flat up to
    the lowest point (a row is never negative work), its lower convex hull from there on and
    along the hull's last segment beyond it, and below the first measured count in the seed's
    shape; ``seed`` (one-row steps by rows) alone with fewer than two points."""
    if len(seconds) < 2:
        return seed(rows)
    points = sorted(seconds.items())
    low = min(range(len(points)), key=lambda i: points[i][1])
    hull = _lower_hull(points[low:])
    first, (n0, s0) = points[0][0], hull[0]

    def at(n: int) -> float:
        if n < first:
            return s0 * seed(n) / seed(first)
        if n <= n0 or len(hull) == 1:
            return s0
        i = next((i for i in range(1, len(hull) - 1) if n <= hull[i][0]), len(hull) - 1)
        (a, sa), (b, sb) = hull[i - 1], hull[i]
        return sa + (sb - sa) * (n - a) / (b - a)

    return at(rows) / at(1)


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The corners of the lower convex hull of ``points`` (sorted by row count; Andrew's
    monotone chain, lower half): each kept point lies below the segment joining its
    neighbours, so the slopes between corners never fall."""
    hull: list[tuple[int, float]] = []
    for p in points:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def _cross(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    """Positive when o -> a -> b turns left (a lies below the segment o -> b)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
