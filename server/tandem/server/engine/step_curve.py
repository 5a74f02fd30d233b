"""What a step of decode or verification rows costs by its number of rows, measured.

Speculation's cost model (``spec_decode.cost.StepCost``) weighs the tokens a proposed row
is expected to return against what the row adds to the step. That price depends on the CPU
(its vector width, its cores, who else runs on them) and on the code path a step takes, so a
constant fitted on one machine is wrong on the next. The worker times every step whose rows
are all sampled (decodes and speculation's verification rows, no prompt) and feeds this
curve: a moving average of seconds per step for each row count, and how many steps it holds.

Costs are read, in one-row steps, off the straight line fitted to those averages (least
squares, each row count weighted by its steps, never falling): over the few rows speculation
adds, a step's time is close to linear in its rows (per-row compute on a CPU's block kernels,
nearly flat under a GPU's weight read). Read point by point, the curve's noise decided plans:
a row count measured a few times on a noisy machine looked dear, the plan stopped short of it,
and it was never measured again (the default model's ``edit`` bench proposed three tokens a
step where four paid). Below the first measured count the seed (the cost model's constant)
gives the shape; with fewer than two counts measured it stands alone.
"""

from __future__ import annotations

from collections.abc import Callable

ALPHA = 0.1  # weight of the newest step in a row count's moving average
MOST_WEIGHT = 32  # a row count's weight in the fit: its steps, up to this many


class StepCurve:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._steps: dict[int, int] = {}

    def record(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` sampled rows ran its forward pass in ``seconds``."""
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + ALPHA * (seconds - old)
        self._steps[rows] = min(self._steps.get(rows, 0) + 1, MOST_WEIGHT)

    def measured(self) -> dict[int, float]:
        """Each measured row count's average seconds (a copy)."""
        return dict(self._seconds)

    def cost(self, rows: int, seed: Callable[[int], float], upto: int | None = None) -> float:
        """A step of ``rows`` rows in one-row steps: ``seed`` (one-row steps by rows) until
        two row counts (at most ``upto``: past it steps take another path) are measured,
        the fitted line after."""
        seconds = {n: s for n, s in self._seconds.items() if upto is None or n <= upto}
        return curve_cost(seconds, rows, seed, self._steps)


def curve_cost(
    seconds: dict[int, float],
    rows: int,
    seed: Callable[[int], float],
    weights: dict[int, float] | None = None,
) -> float:
    """``rows`` rows' cost in one-row steps on the line fitted to ``seconds`` (row count:
    seconds, each weighted by ``weights``, 1 when not given; its slope never negative, as a
    row is never negative work), below its first point in the seed's shape; ``seed``
    (one-row steps by rows) alone with fewer than two points."""
    if len(seconds) < 2:
        return seed(rows)
    w = {n: 1.0 if weights is None else weights[n] for n in seconds}
    total = sum(w.values())
    mean_n = sum(w[n] * n for n in seconds) / total
    mean_s = sum(w[n] * s for n, s in seconds.items()) / total
    spread = sum(w[n] * (n - mean_n) ** 2 for n in seconds)
    slope = max(sum(w[n] * (n - mean_n) * (s - mean_s) for n, s in seconds.items()) / spread, 0)
    first = min(seconds)

    def at(n: int) -> float:
        if n < first:
            return at(first) * seed(n) / seed(first)
        return mean_s + slope * (n - mean_n)

    return at(rows) / at(1)
