"""Runs one scheduled batch through the model: flat inputs in, logits of the sampling rows out
(and the final-norm hidden states of the rows a pooled request reads, without their logits).

``prepare_inputs`` flattens a ``ScheduledBatch`` into plain lists (``StepInputs``): the token
ids, positions and KV slots of every new token, and each sequence's query length, context
length and block table. That is all a model shard needs, so under tensor parallelism rank 0
sends exactly this to the other ranks, and every rank runs ``ModelRunner.run`` on it.

Decode-only steps can replay CUDA graphs captured per padded batch size (``capture_graphs``):
the batch is padded up to the next captured size with rows that read and write only the
reserved null page (block 0), the static input buffers are filled, the attention backend
re-plans its static page table outside the graph, and the graph replays. Anything else
(prefill, mixed batches, batches above the largest size, ``enforce_eager``, a backend that
cannot be captured) runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from .attention import AttentionBackend, BatchLayout
from .attention.base import SeqShape
from .block_pool import NULL_BLOCK
from .pooling import rows_read

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


@dataclass(frozen=True)
class StepInputs(SeqShape):
    """One step, flattened: what every model shard needs (plain lists, cheap to pickle)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]  # flat rows whose logits are sampled
    hidden_rows: list[int] = field(default_factory=list)  # flat rows pooled requests read


def prepare_inputs(batch: ScheduledBatch, block_size: int) -> tuple[StepInputs, list[Request]]:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    kv_lens: list[int] = []
    logits_rows: list[int] = []
    hidden_rows: list[int] = []
    sampling: list[Request] = []
    for req, n in zip(batch.requests, batch.num_new_tokens):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if req.pooling is not None:
            base = len(input_ids) - start
            hidden_rows.extend(
                base + p for p in rows_read(req.pooling.kind, start, end, req.num_tokens)
            )
        input_ids.extend(req.token_slice(start, end))
        positions.extend(range(start, end))
        table = req.block_ids
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        kv_lens.append(end)
        if end == req.num_tokens and req.pooling is None:
            logits_rows.append(len(input_ids) - 1)
            sampling.append(req)
    inputs = StepInputs(
        input_ids,
        positions,
        slots,
        list(batch.num_new_tokens),
        kv_lens,
        [list(r.block_ids) for r in batch.requests],
        logits_rows,
        hidden_rows,
    )
    return inputs, sampling


# ----- CUDA-graph helpers (pure; tested on CPU) ---------------------------------------------
def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    if top not in sizes:
        sizes.append(top)
    return sizes


def pick_graph_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs >= 1 else None


def pad_decode_inputs(inputs: StepInputs, size: int) -> StepInputs:
    """Pad a decode batch to ``size`` rows that touch only the null page.

    A padded row has token 0 at position 0, one token of context in block 0, and writes its
    K/V into slot 0 of block 0, so no real sequence's pages are read or written.
    """
    if not inputs.is_decode:
        raise ValueError("only decode batches run in CUDA graphs")
    pad = size - inputs.num_seqs
    if pad < 0:
        raise ValueError(f"{inputs.num_seqs} rows do not fit a graph of {size}")
    return replace(
        inputs,
        input_ids=inputs.input_ids + [0] * pad,
        positions=inputs.positions + [0] * pad,
        slots=inputs.slots + [NULL_BLOCK] * pad,
        query_lens=inputs.query_lens + [1] * pad,
        kv_lens=inputs.kv_lens + [1] * pad,
        block_tables=inputs.block_tables + [[NULL_BLOCK]] * pad,
    )


class _Graphs:
    """Captured decode graphs sharing one memory pool and one set of static buffers."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.sizes = sizes
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slots = torch.zeros(top, dtype=torch.int64, device=device)  # slot 0: the null page
        self.hidden: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}


class ModelRunner:
    def __init__(
        self, model: nn.Module, backend: AttentionBackend, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self._graphs: _Graphs | None = None

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Compute the batch's new tokens; returns logits [S, vocab] for the S requests that sample."""
        inputs, sampling = prepare_inputs(batch, self.block_size)
        return self.run(inputs), sampling

    @torch.inference_mode()
    def run(self, inputs: StepInputs, compute_logits: bool = True) -> torch.Tensor:
        """Forward one step; logits (float32) of ``inputs.logits_rows`` unless ``compute_logits`` is off."""
        return self.run_pooled(inputs, compute_logits)[0]

    @torch.inference_mode()
    def run_pooled(
        self, inputs: StepInputs, compute_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``run``'s logits, and the final-norm hidden states of ``inputs.hidden_rows``
        (float32, ``[len(hidden_rows), hidden]``): pooled rows never reach the lm_head."""
        size = self._graph_size(inputs)
        hidden = self._replay(inputs, size) if size is not None else self._eager(inputs)
        pooled = hidden[self._index(inputs.hidden_rows)].float()
        if not compute_logits or not inputs.logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32), pooled
        logits = self.model.compute_logits(hidden[self._index(inputs.logits_rows)]).float()
        return logits, pooled

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _eager(self, inputs: StepInputs) -> torch.Tensor:
        dev = self.device
        layout = BatchLayout(
            query_lens=list(inputs.query_lens),
            kv_lens=list(inputs.kv_lens),
            block_tables=inputs.block_tables,
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.int64, device=dev),
        )
        step = self.backend.plan(layout)
        return self.model(
            torch.tensor(inputs.input_ids, dtype=torch.int64, device=dev),
            torch.tensor(inputs.positions, dtype=torch.int64, device=dev),
            step,
        )

    # ----- CUDA graphs --------------------------------------------------------------------
    @property
    def graph_sizes(self) -> list[int]:
        return list(self._graphs.sizes) if self._graphs else []

    def _graph_size(self, inputs: StepInputs) -> int | None:
        if self._graphs is None or not inputs.is_decode:
            return None
        return pick_graph_size(inputs.num_seqs, self._graphs.sizes)

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Capture one decode graph per size in ``graph_batch_sizes(max_num_seqs)``, largest first.

        Needs CUDA and a backend that supports graphs; the KV cache and the weights must stay
        where they are while the graphs live (``drop_graphs`` before moving them).
        """
        if self.device.type != "cuda" or not self.backend.supports_cuda_graphs:
            raise ValueError(
                f"CUDA graphs need a CUDA device and a capturable attention backend "
                f"(device {self.device}, backend {self.backend.name})"
            )
        sizes = graph_batch_sizes(max_num_seqs)
        g = _Graphs(sizes, self.device)
        pool = None
        empty = StepInputs([], [], [], [], [], [], [])
        for size in reversed(sizes):
            step = self.backend.graph_step(size, g.slots[:size], max_blocks_per_seq)
            self.backend.plan_graph(size, self._layout(pad_decode_inputs(empty, size)))
            ids, pos = g.input_ids[:size], g.positions[:size]
            warm = self.model(ids, pos, step)  # warm-up outside the graph (kernel selection, JIT)
            if g.hidden is None:
                g.hidden = torch.zeros(
                    sizes[-1], warm.shape[-1], dtype=warm.dtype, device=self.device
                )
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                g.hidden[:size] = self.model(ids, pos, step)
            pool = graph.pool() if pool is None else pool
            g.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self._graphs = g
        log.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def drop_graphs(self) -> None:
        self._graphs = None
        drop = getattr(self.backend, "drop_graphs", None)
        if drop is not None:
            drop()

    def _layout(self, inputs: StepInputs) -> BatchLayout:
        return BatchLayout(
            list(inputs.query_lens),
            list(inputs.kv_lens),
            inputs.block_tables,
            torch.tensor(inputs.slots, dtype=torch.int64),
        )

    def _replay(self, inputs: StepInputs, size: int) -> torch.Tensor:
        g = self._graphs
        assert g is not None and g.hidden is not None
        padded = pad_decode_inputs(inputs, size)
        g.input_ids[:size].copy_(
            torch.tensor(padded.input_ids, dtype=torch.int64), non_blocking=True
        )
        g.positions[:size].copy_(
            torch.tensor(padded.positions, dtype=torch.int64), non_blocking=True
        )
        g.slots[:size].copy_(torch.tensor(padded.slots, dtype=torch.int64), non_blocking=True)
        self.backend.plan_graph(size, self._layout(padded))
        g.graphs[size].replay()
        return g.hidden[: inputs.num_seqs]
