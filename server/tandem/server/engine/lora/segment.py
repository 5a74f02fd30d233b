"""The segmented LoRA product: each adapter's rows of a step times that adapter's pair.

This is the seam a GPU kernel plugs into. A step's rows are grouped once into segments, one
per adapter slot (``SegmentPlan``: the rows and the slot of each, what a segment GEMM such
as FlashInfer's ``SegmentGEMMWrapper`` or Punica's shrink/expand take as ``seg_indptr`` and
``weight_indices``); every adapted layer then calls ``add_lora``. The version here is the
reference, plain PyTorch on any device: per segment one gather (none when the segment's rows
are contiguous), the shrink (``x @ A.T``) and the expand added in place (``y += t @ B.T *
scaling``), the order of operations PEFT's own forward uses. Rows of the base model belong
to no segment and are left exactly as the base layer computed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .adapter import LoraPair

Rows = slice | torch.Tensor


@dataclass(frozen=True)
class SegmentPlan:
    """One step's rows by adapter slot: ``rows[i]`` (a slice when contiguous, else an index
    tensor) run through slot ``slots[i]``."""

    slots: list[int]
    rows: list[Rows]


def plan_segments(
    lora_slots: Sequence[int], query_lens: Sequence[int], device: torch.device
) -> SegmentPlan | None:
    """Group the flat rows of a step (each sequence's ``query_lens`` rows, through its slot,
    -1 for the base) by slot; None when no row has an adapter."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for slot, n in zip(lora_slots, query_lens):
        if slot >= 0 and n > 0:
            spans = ranges.setdefault(slot, [])
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], start + n)
            else:
                spans.append((start, start + n))
        start += n
    if not ranges:
        return None
    rows: list[Rows] = []
    for spans in ranges.values():
        if len(spans) == 1:
            rows.append(slice(*spans[0]))
        else:
            index = torch.cat([torch.arange(a, b) for a, b in spans])
            rows.append(index.to(device))
    return SegmentPlan(list(ranges), rows)


def add_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    plan: SegmentPlan,
    pairs: Sequence[tuple[LoraPair, float] | None],
) -> None:
    """``y[rows] += (x[rows] @ A.T) @ B.T * scaling`` for each segment, in place; ``pairs[i]``
    is segment i's adapter's pair for this layer (None: the adapter leaves it alone)."""
    for rows, pair in zip(plan.rows, pairs):
        if pair is None:
            continue
        (p, scaling) = pair
        if isinstance(rows, slice):
            shrunk = x[rows] @ p.a.T
            y[rows] += (shrunk @ p.b.T) * scaling
        else:
            shrunk = x.index_select(0, rows) @ p.a.T
            y.index_add_(0, rows, (shrunk @ p.b.T) * scaling)
