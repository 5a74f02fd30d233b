"""The device side of multi-LoRA: ``max_loras`` slots of adapter weights on the model's
device, and a forward hook on every adaptable layer (q|k|v, o, gate|up, down) that adds the
step's segments (``segment.add_lora``) to what the base layer computed.

Hooks leave the model code untouched: a step without adapters (``plan`` None) costs each
hooked layer one attribute test. The runner sets the plan before each eager forward; decode
steps that replay CUDA graphs never have adapters (the runner runs those eagerly), so the
graphs hold only the base model.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from .adapter import LoraAdapter, LoraPair
from .segment import (
    SegmentPlan,
    Stacked,
    add_lora,
    add_lora_stacked,
    plan_segments,
    row_weights,
    stack_pairs,
)

# Up to this many rows a step with several adapters (or scattered rows) takes the stacked
# product (decode batches); above it, the per-segment one (prefills, whose rows are mostly
# long contiguous runs).
STACKED_ROWS = 128
ADAPTED = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


class LoraLayers:
    def __init__(self, max_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        # slot -> (layer, packed name) -> (pair on the device, scaling)
        self.slots: list[dict[tuple[int, str], tuple[LoraPair, float]] | None] = [None] * max_loras
        self.plan: SegmentPlan | None = None
        self._stacked = False  # this step takes the stacked product
        # (layer key, slots) -> the stacked pairs; dropped when a slot is reloaded
        self._stacks: dict[tuple[tuple[int, str], tuple[int, ...]], Stacked | None] = {}
        # this step's row weights, per stacked layout (layers adapted alike share them)
        self._weights: dict[tuple[tuple[int, int, float], ...], torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, model: nn.Module) -> None:
        """Hook ``model``'s adaptable layers (again after the model is rebuilt)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            for parent, name in ADAPTED:
                module = getattr(getattr(layer, parent), name)
                hook = partial(self._forward_hook, (i, name))
                self._handles.append(module.register_forward_hook(hook))

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter``'s pairs into ``slot`` (replacing what it held)."""

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=self.dtype).contiguous()

        self.slots[slot] = {
            key: (LoraPair(put(p.a), put(p.b)), adapter.scaling) for key, p in adapter.pairs.items()
        }
        self._stacks.clear()  # they hold the slot's old pairs

    def begin_step(self, lora_slots: Sequence[int], query_lens: Sequence[int]) -> None:
        """Group this step's rows by slot (no adapter anywhere: the hooks do nothing)."""
        self.plan = plan_segments(lora_slots, query_lens, self.device) if lora_slots else None
        plan = self.plan
        self._stacked = (
            plan is not None
            and (len(plan.slots) > 1 or not plan.contiguous)
            and len(plan.row_slot) <= STACKED_ROWS
        )
        self._weights = {}

    def _forward_hook(
        self, key: tuple[int, str], module: nn.Module, args: tuple, output: torch.Tensor
    ) -> None:
        plan = self.plan
        if plan is None:
            return
        if not self._stacked:
            pairs = [(w.get(key) if (w := self.slots[s]) is not None else None) for s in plan.slots]
            add_lora(args[0], output, plan, pairs)
            return
        stacked = self._stack(key, plan)
        if stacked is None:
            return
        weights = self._weights.get(stacked.layout)
        if weights is None:
            weights = self._weights[stacked.layout] = row_weights(plan, stacked)
        add_lora_stacked(args[0], output, stacked, weights)

    def _stack(self, key: tuple[int, str], plan: SegmentPlan) -> Stacked | None:
        """The step's adapters' pairs for layer ``key``, stacked (None: none adapts it)."""
        cache_key = (key, tuple(plan.slots))
        if cache_key not in self._stacks:
            pairs = [
                (s, *self.slots[s][key])
                for s in plan.slots
                if self.slots[s] is not None and key in self.slots[s]
            ]
            self._stacks[cache_key] = stack_pairs(pairs) if pairs else None
        return self._stacks[cache_key]
