"""The segmented LoRA product: each adapter's rows of a step times that adapter's pair.

This is the seam a GPU kernel plugs into. A step's rows are grouped once into segments, one
per adapter slot (``SegmentPlan``: the rows and the slot of each, what a segment GEMM such
as FlashInfer's ``SegmentGEMMWrapper`` or Punica's shrink/expand take as ``seg_indptr`` and
``weight_indices``); every adapted layer then calls one of the two reference versions here,
plain PyTorch on any device:

- ``add_lora``, per segment: one gather (none when the segment's rows are contiguous), the
  shrink (``x @ A.T``) and the expand added in place (``y += t @ B.T * scaling``). What a
  prefill wants: each row multiplied by its own adapter only.
- ``add_lora_stacked``, for a few rows (decode): the step's adapters' A's stacked into one
  matrix and their B's side by side (``Stacked``), so every row is shrunk by every adapter
  in one product, the columns of the other adapters zeroed (and the own ones scaled) by a
  per-row mask, and expanded in one more. Two matrix products per layer whatever the number
  of adapters, no gather or scatter: on a CPU the per-segment loop's small operations cost
  more than the few extra columns (``bench/lora.py``).

Rows of the base model belong to no segment (in the stacked version, their mask is zero)
and keep exactly what the base layer computed.
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
    tensor) run through slot ``slots[i]``; ``row_slot`` is every row's slot (-1: the base)."""

    slots: list[int]
    rows: list[Rows]
    row_slot: torch.Tensor

    @property
    def contiguous(self) -> bool:
        """Every segment is one run of rows (no gather or scatter needed)."""
        return all(isinstance(r, slice) for r in self.rows)


@dataclass(frozen=True)
class Stacked:
    """The pairs of several slots for one layer, side by side: ``a`` ``[R, in]`` (their A's
    stacked), ``b`` ``[out, R]``; column j belongs to slot ``col_slot[j]`` and is scaled by
    ``col_scale[j]``."""

    a: torch.Tensor
    b: torch.Tensor
    col_slot: torch.Tensor
    col_scale: torch.Tensor
    layout: tuple[tuple[int, int, float], ...]  # (slot, columns, scaling) per adapter


def stack_pairs(pairs: Sequence[tuple[int, LoraPair, float]]) -> Stacked:
    """(slot, pair, scaling) of the adapters that adapt one layer, stacked."""
    ref = pairs[0][1].a
    cols = [p.a.shape[0] for _, p, _ in pairs]
    slots = torch.tensor([s for (s, _, _), n in zip(pairs, cols) for _ in range(n)])
    scales = torch.tensor([c for (_, _, c), n in zip(pairs, cols) for _ in range(n)])
    return Stacked(
        torch.cat([p.a for _, p, _ in pairs]),
        torch.cat([p.b for _, p, _ in pairs], dim=1),
        slots.to(ref.device),
        scales.to(device=ref.device, dtype=ref.dtype),
        tuple((s, n, c) for (s, _, c), n in zip(pairs, cols)),
    )


def row_weights(plan: SegmentPlan, stacked: Stacked) -> torch.Tensor:
    """``[rows, R]``: a row's own adapter's columns scaled, every other column zero."""
    own = plan.row_slot[:, None] == stacked.col_slot[None, :]
    return own * stacked.col_scale


def add_lora_stacked(
    x: torch.Tensor, y: torch.Tensor, stacked: Stacked, weights: torch.Tensor
) -> None:
    """``y += ((x @ A.T) * weights) @ B.T`` over the stacked adapters, in place."""
    shrunk = x @ stacked.a.T
    shrunk.mul_(weights)
    y.addmm_(shrunk, stacked.b.T)


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
    row_slot = torch.tensor(
        [slot for slot, n in zip(lora_slots, query_lens) for _ in range(n)], device=device
    )
    rows: list[Rows] = []
    for spans in ranges.values():
        if len(spans) == 1:
            rows.append(slice(*spans[0]))
        else:
            index = torch.cat([torch.arange(a, b) for a, b in spans])
            rows.append(index.to(device))
    return SegmentPlan(list(ranges), rows, row_slot)


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
