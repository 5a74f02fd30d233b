"""The reference attention backend: plain PyTorch, on CPU or GPU.

Sequences are grouped into decodes (one new token) and prefills, each group padded to its
longest query and context and run through one ``scaled_dot_product_attention`` call, with
keys and values gathered from the pages by slot index.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionStep, BatchLayout


@dataclass(frozen=True)
class _Group:
    token_index: torch.Tensor  # [B, Lq] flat token index per padded query (clamped)
    query_valid: torch.Tensor  # [B, Lq] bool
    kv_slots: torch.Tensor  # [B, Lk] flat cache slot per padded key
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_cache: KVCache, scale: float) -> None:
        self.kv_cache = kv_cache
        self.scale = scale

    def plan(self, layout: BatchLayout) -> AttentionStep:
        starts = [0]
        for n in layout.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(layout.query_lens) if n == 1]
        prefill = [i for i, n in enumerate(layout.query_lens) if n > 1]
        groups = [self._group(layout, starts, idx) for idx in (decode, prefill) if idx]
        return _TorchStep(self.kv_cache, layout.slot_mapping, groups, self.scale)

    def _group(self, layout: BatchLayout, starts: list[int], idx: list[int]) -> _Group:
        device = self.kv_cache.device
        bs = self.kv_cache.block_size
        q_lens = torch.tensor([layout.query_lens[i] for i in idx])
        kv_lens = torch.tensor([layout.kv_lens[i] for i in idx])
        seq_starts = torch.tensor([starts[i] for i in idx])
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
        q_pos = torch.arange(max_q)
        query_valid = q_pos[None, :] < q_lens[:, None]
        token_index = seq_starts[:, None] + torch.minimum(q_pos[None, :], q_lens[:, None] - 1)
        num_blocks = -(-max_kv // bs)
        tables = torch.zeros(len(idx), num_blocks, dtype=torch.int64)
        for row, i in enumerate(idx):
            table = layout.block_tables[i][:num_blocks]
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.int64)
        kv_pos = torch.arange(max_kv)
        kv_slots = tables[:, kv_pos // bs] * bs + kv_pos % bs
        # query j of a sequence sits at absolute position kv_len - q_len + j
        q_abs = (kv_lens - q_lens)[:, None] + q_pos[None, :]
        causal = kv_pos[None, None, :] <= q_abs[:, :, None]
        mask = causal & (kv_pos[None, None, :] < kv_lens[:, None, None]) & query_valid[:, :, None]
        mask |= ~query_valid[:, :, None] & (kv_pos == 0)[None, None, :]  # padded rows: no NaN
        return _Group(token_index.to(device), query_valid.to(device), kv_slots.to(device),
                      mask.unsqueeze(1).to(device))


class _TorchStep(AttentionStep):
    def __init__(self, kv_cache: KVCache, slot_mapping: torch.Tensor, groups: list[_Group], scale: float) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.groups = groups
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.flat(layer)
        k_cache.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for g in self.groups:
            qg = q[g.token_index].transpose(1, 2)  # [B, H, Lq, D]
            kg = k_cache[g.kv_slots].transpose(1, 2).to(q.dtype)
            vg = v_cache[g.kv_slots].transpose(1, 2).to(q.dtype)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale, enable_gqa=gqa)
            out[g.token_index[g.query_valid]] = og.transpose(1, 2)[g.query_valid]
        return out
