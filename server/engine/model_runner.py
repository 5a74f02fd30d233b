"""Runs one scheduled batch through the model: flat inputs in, logits of the sampling rows out."""
from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionBackend, BatchLayout
from .request import Request
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Compute the batch's new tokens; returns logits [S, vocab] for the S requests that sample."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        kv_lens: list[int] = []
        logits_rows: list[int] = []
        sampling: list[Request] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            input_ids.extend(req.token_slice(start, end))
            positions.extend(range(start, end))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            kv_lens.append(end)
            if end == req.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(req)
        dev = self.device
        layout = BatchLayout(
            query_lens=list(batch.num_new_tokens),
            kv_lens=kv_lens,
            block_tables=[r.block_ids for r in batch.requests],
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        step = self.backend.plan(layout)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), step)
        if not sampling:
            return hidden.new_empty(0, 0, dtype=torch.float32), sampling
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=dev)
        return self.model.compute_logits(hidden[rows]).float(), sampling
