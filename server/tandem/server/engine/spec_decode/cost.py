"""How many tokens a step should verify: a step's cost as a function of its rows, against the
tokens each proposed row is expected to return.

A decode step costs ``1`` (one row) plus ``row_cost`` for each further row while the step
stays on one code path. Where a step is bound by reading the weights (a GPU, or float32 on a
CPU) a further row is nearly free; where it is bound by compute (a GGUF model's Q4_1 blocks
on a CPU, ``models.layers.QUANT_ROWS`` rows at most) one costs about a quarter of a one-row
step, and past ``max_rows`` the step falls onto the dequantized weights, several times the
bytes read. So speculation only adds rows while they pay: the ``j``-th proposed token of a
request whose tokens are each accepted with probability ``a`` returns ``a ** j`` tokens on
average, and a row is worth adding while that is more than the step's current cost per
expected token times ``row_cost`` (adding it raises tokens / cost). A step whose other rows
already exceed ``max_rows`` gets no proposals at all, so speculation never slows a full batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from torch import nn

from ..models.layers import QUANT_ROWS

# Measured on the default model (Q4_1 SmolLM2-135M, 2 threads, docs/performance.md): 5 rows
# through the quantized GEMV took about twice one row's step.
QUANTIZED_ROW_COST = 0.25
# A weight-read-bound step: verifying a few more rows costs little beside the weights' read.
BANDWIDTH_ROW_COST = 0.05


@dataclass(frozen=True)
class StepCost:
    row_cost: float  # a further row's cost, in one-row steps
    max_rows: int | None = None  # the most rows a step may hold with proposals (None: any)
    # A draft model's forward pass, in one-row steps of the target: one per proposed position
    # (all requests' j-th tokens share it); 0 for a lookup.
    pass_cost: float = 0.0

    def plan(
        self, rows: int, caps: list[int], acceptance: list[float], budget: int | None = None
    ) -> list[int]:
        """How many tokens each request should propose (at most ``caps[i]``, its tokens each
        accepted with probability ``acceptance[i]``, ``budget`` in all) in a step of ``rows``
        other rows.

        Each request with a cap gets its first row while there is room, whatever it is worth:
        an estimate only moves by proposing (a request that keeps missing is held back by its
        own backoff, ``Draft.skip``). Further rows go to the best next token first."""
        room = sum(caps) if self.max_rows is None else self.max_rows - rows
        room = room if budget is None else min(room, budget)
        lengths = [0] * len(caps)
        for i, cap in enumerate(caps):
            if cap > 0 and room > 0:
                lengths[i], room = 1, room - 1
        depth = max(lengths, default=0)
        tokens = rows + sum(a for a, n in zip(acceptance, lengths) if n)
        cost = 1 + self.row_cost * (rows + sum(lengths) - 1) + self.pass_cost * depth
        # (-gain, request, the token's index): the best next token first.
        heap = [(-(acceptance[i] ** 2), i, 2) for i, n in enumerate(lengths) if n]
        heapq.heapify(heap)
        while heap and room > 0:
            neg_gain, i, n = heapq.heappop(heap)
            if lengths[i] != n - 1 or n > caps[i]:
                continue  # taken with its level already, or past the request's cap
            if n > depth:
                # A position no request reached yet takes a draft pass: it pays only for every
                # request that can go that deep together.
                level = [j for j, m in enumerate(lengths) if m == depth and caps[j] > depth]
                level = level[:room]
            else:
                level = [i]
            gains = [acceptance[j] ** n for j in level]
            more = self.row_cost * len(level) + (self.pass_cost if n > depth else 0.0)
            if sum(gains) * cost <= more * tokens:
                break  # the best rows left would lower tokens / cost
            for j, gain in zip(level, gains):
                lengths[j] += 1
                heapq.heappush(heap, (-gain * acceptance[j], j, n + 1))
            room, depth = room - len(level), max(depth, n)
            tokens, cost = tokens + sum(gains), cost + more
        return lengths


def step_cost(model: nn.Module) -> StepCost:
    """The cost model for ``model`` as loaded: compute-bound rows up to ``QUANT_ROWS`` when its
    linears multiply a GGUF file's blocks, weight-read-bound rows otherwise."""
    quantized = any(getattr(m, "quantized", None) is not None for m in model.modules())
    if quantized:
        return StepCost(QUANTIZED_ROW_COST, QUANT_ROWS)
    return StepCost(BANDWIDTH_ROW_COST)
