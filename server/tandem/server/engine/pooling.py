"""Pooling a prompt's final-norm hidden states into one vector (embeddings, ``/pooling``).

A pooled request is prefill-only: it is scheduled like any prompt (chunked, batched with
generation, preempted and recomputed), the model returns the hidden states of the rows
its pooling reads (never their logits), and it finishes when its last prompt token is
computed. ``last`` reads one row (the last token: a decoder LM's summary of the prompt, and
vLLM's default for one), ``cls`` the first, ``mean`` every row; a chunked prompt's rows are
summed chunk by chunk, so no step holds more than its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .config import PoolingKind

if TYPE_CHECKING:
    from .models.config import ModelConfig
    from .request import Request


@dataclass(frozen=True)
class PoolingParams:
    """How one request's vector is made: the pooling (None: the engine's ``--pooling``), L2
    normalisation, and an optional Matryoshka truncation to ``dimensions`` (before
    normalising, as such models are trained)."""

    kind: PoolingKind | None = None
    normalize: bool = True
    dimensions: int | None = None

    def resolve(self, default: PoolingKind) -> PoolingParams:
        return self if self.kind is not None else replace(self, kind=default)

    @property
    def reads_every_row(self) -> bool:
        """Whether every prompt token's hidden state counts, so none may come from the
        prefix cache (whose blocks hold K/V, not hidden states)."""
        return self.kind != "last"


def rows_read(kind: PoolingKind, start: int, end: int, num_tokens: int) -> range:
    """The positions in ``[start, end)`` (one step's chunk of a ``num_tokens`` prompt) whose
    hidden states ``kind`` reads."""
    if kind == "mean":
        return range(start, end)
    pos = 0 if kind == "cls" else num_tokens - 1
    return range(pos, pos + 1) if start <= pos < end else range(0)


def accumulate(
    kind: PoolingKind, state: torch.Tensor | None, rows: torch.Tensor, start: int
) -> torch.Tensor | None:
    """Fold one chunk's rows (``[len(rows_read(...)), hidden]``) into the running state: the
    row itself for ``last``/``cls``, a float32 sum for ``mean``. A chunk starting at position
    0 starts over (a preempted request recomputes from the beginning)."""
    if start == 0:
        state = None
    if not len(rows):
        return state
    if kind != "mean":
        return rows[0].float()
    total = rows.float().sum(0)
    return total if state is None else state + total


def finish(params: PoolingParams, state: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request's vector: the mean (for ``mean``), truncated to ``dimensions``, normalised."""
    vec = state / num_tokens if params.kind == "mean" else state
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec


def check_dimensions(dimensions: int | None, model: ModelConfig) -> str | None:
    """Why ``dimensions`` cannot be served (None when it can). Truncating a model not trained
    for it (Matryoshka representation learning) gives poor vectors, so only such a model,
    declared in its config.json as vLLM reads it, may be truncated; the full size always works."""
    hidden_size, allowed = model.hidden_size, model.matryoshka_dimensions
    if dimensions is None or dimensions == hidden_size:
        return None
    if not 1 <= dimensions <= hidden_size:
        return f"dimensions must be between 1 and the model's hidden size {hidden_size}"
    if not model.is_matryoshka:
        return (
            f"this model does not support Matryoshka truncation; dimensions may only be "
            f"{hidden_size}, its hidden size"
        )
    if allowed and dimensions not in allowed:
        return f"this model supports dimensions {sorted(allowed)}"
    return None


def fold_hidden_rows(
    requests: list[Request], num_new_tokens: list[int], hidden: torch.Tensor
) -> list[Request]:
    """Fold each pooled request's hidden rows (in batch order, after the scheduler's update)
    into its state; returns those whose prompt is now computed, with their final vector."""
    done: list[Request] = []
    offset = 0
    for req, n in zip(requests, num_new_tokens):
        pooled = req.pooling
        if pooled is None:
            continue
        kind, end = pooled.params.kind, req.num_computed_tokens
        count = len(rows_read(kind, end - n, end, req.num_tokens))
        pooled.vector = accumulate(kind, pooled.vector, hidden[offset : offset + count], end - n)
        offset += count
        if end == req.num_tokens:
            pooled.vector = finish(pooled.params, pooled.vector, req.num_tokens)
            done.append(req)
    return done
