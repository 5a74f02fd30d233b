"""How many tokens a step should verify: a step's cost as a function of its rows, against the
tokens each proposed row is expected to return.

A decode step of ``n`` rows costs ``step(n)`` one-row steps, read from the worker's measured
``StepCurve`` (seconds by rows, ``step_curve.py``) and, until that has two row counts, from a
constant: ``1 + row_cost * (n - 1)``. Where a step is bound by reading the weights (a GPU, or
float32 on a CPU) a further row is nearly free; where it is bound by compute (a GGUF model's
Q4_1 blocks on a CPU, ``models.layers.QUANT_ROWS`` rows at most) one costs a good part of a
one-row step, and past ``max_rows`` the step falls onto the dequantized weights, several
times the bytes read. So speculation only adds rows while they pay: the ``j``-th proposed
token of a request whose tokens are each accepted with probability ``a`` returns ``a ** j``
tokens on average, and a row is worth adding while that is more than the step's current cost
per expected token times the row's cost (adding it raises tokens / cost). A step whose other
rows already exceed ``max_rows`` gets no proposals at all, so speculation never slows a full
batch; a request whose estimate is established pays for its first row like any other
(``Draft.free``), so one that keeps missing stops costing rows.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from torch import nn

from ..models.layers import QUANT_ROWS
from ..step_curve import StepCurve

# Measured on the default model (Q4_1 SmolLM2-135M, 2 threads, docs/performance.md): 5 rows
# through the quantized GEMV took about twice one row's step.
QUANTIZED_ROW_COST = 0.25
# A weight-read-bound step: verifying a few more rows costs little beside the weights' read.
BANDWIDTH_ROW_COST = 0.05


@dataclass(frozen=True)
class StepCost:
    row_cost: float  # a further row's cost, in one-row steps, until the curve is measured
    max_rows: int | None = None  # the most rows a step may hold with proposals (None: any)
    # A draft model's forward pass, in one-row steps of the target: one per proposed position
    # (all requests' j-th tokens share it); 0 for a lookup.
    pass_cost: float = 0.0
    curve: StepCurve | None = None  # the steps' measured seconds by rows (the worker's)

    def seed(self, rows: int) -> float:
        """A step of ``rows`` rows in one-row steps, by the constant."""
        return 1 + self.row_cost * (rows - 1)

    def step(self, rows: int) -> float:
        """A step of ``rows`` rows in one-row steps: measured once the curve is."""
        return (
            self.seed(rows)
            if self.curve is None
            else self.curve.cost(rows, self.seed, self.max_rows)
        )

    def plan(
        self,
        rows: int,
        caps: list[int],
        acceptance: list[float],
        budget: int | None = None,
        free: list[bool] | None = None,
    ) -> list[int]:
        """How many tokens each request should propose (at most ``caps[i]``, its tokens each
        accepted with probability ``acceptance[i]``, ``budget`` in all) in a step of ``rows``
        other rows.

        A request whose first row is ``free`` (all, when not given) gets it while there is
        room, whatever it is worth: its estimate is not established yet, or it is due a probe
        (an estimate only moves by proposing). Every other row, a first one included, goes to
        the best next token first while it pays."""
        free = [True] * len(caps) if free is None else free
        room = sum(caps) if self.max_rows is None else self.max_rows - rows
        room = room if budget is None else min(room, budget)
        lengths = [0] * len(caps)
        for i, cap in enumerate(caps):
            if cap > 0 and room > 0 and free[i]:
                lengths[i], room = 1, room - 1
        depth = max(lengths, default=0)
        tokens = rows + sum(a for a, n in zip(acceptance, lengths) if n)
        total = rows + sum(lengths)
        cost = self.step(total) + self.pass_cost * depth
        # (-gain, request, the token's index): the best next token first.
        heap = [
            (-(acceptance[i] ** (n + 1)), i, n + 1)
            for i, n in enumerate(lengths)
            if caps[i] > 0 and (n or not free[i])
        ]
        heapq.heapify(heap)
        while heap and room > 0:
            neg_gain, i, n = heapq.heappop(heap)
            if lengths[i] != n - 1 or n > caps[i]:
                continue  # taken with its level already, or past the request's cap
            if n > depth and self.pass_cost:
                # A position no request reached yet takes a draft pass: it pays only for every
                # request that can go that deep together.
                level = [j for j, m in enumerate(lengths) if m == depth and caps[j] > depth]
                level = level[:room]
            else:
                level = [i]
            gains = [acceptance[j] ** n for j in level]
            more = self.step(total + len(level)) - self.step(total)
            more += self.pass_cost if n > depth else 0.0
            if sum(gains) * cost <= more * tokens:
                break  # the best rows left would lower tokens / cost
            for j, gain in zip(level, gains):
                lengths[j] += 1
                heapq.heappush(heap, (-gain * acceptance[j], j, n + 1))
            room, depth, total = room - len(level), max(depth, n), total + len(level)
            tokens, cost = tokens + sum(gains), cost + more
        return lengths


def step_cost(model: nn.Module, curve: StepCurve | None = None) -> StepCost:
    """The cost model for ``model`` as loaded (``curve``: its steps' measured seconds):
    compute-bound rows up to ``QUANT_ROWS`` when its linears multiply a GGUF file's blocks,
    weight-read-bound rows otherwise, until the curve says what a row costs."""
    quantized = any(getattr(m, "quantized", None) is not None for m in model.modules())
    if quantized:
        return StepCost(QUANTIZED_ROW_COST, QUANT_ROWS, curve=curve)
    return StepCost(BANDWIDTH_ROW_COST, curve=curve)
