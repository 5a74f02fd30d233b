"""The reference attention backend: plain PyTorch, on CPU or GPU.

Decodes (one new token each) are batched. On a CPU where the C kernels build (AVX-512 and a C
compiler), they all go to one call of ``kernels.paged_decode``, which reads their pages in
place; when enough of them (``SHARED_PAGES``) begin with the same pages (a shared system
prompt, a prompt's ``n > 1`` samples), those pages are attended once for all of them
(``kernels.shared_attention``: in bfloat16 on an AMX CPU every row's queries against the
packed pages as one prompt, in tiles; in float32 the pages walked once by every row's queries)
and merged by their softmax sums with the rest (``kernels.merge_attention``). Elsewhere their
pages are gathered and attended with two ``bmm`` calls per group, and the pages every decode
of a group shares at the start of its block table (a common system prompt, ``n > 1``
siblings) are gathered and attended once for all of them. Prefills run one
``scaled_dot_product_attention`` call each, so no prompt pays for another's padding; on an
AVX-512 CPU, one call each of ``kernels.prefill_attention`` instead (bfloat16 where the CPU
has AVX512-BF16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionStep, BatchLayout, KeptRows


@dataclass(frozen=True)
class SharedPages:
    """Leading pages every decode of a step shares are attended once for all of them when at
    least ``rows`` decodes share at least ``tokens`` tokens."""

    rows: int
    tokens: int


# bfloat16 on AMX tiles: with two query heads a KV head or more, the sixteen rows of a tile.
# float32 (``shared_decode``, kernels/paged_decode.c): 16 rows sharing 256 tokens ran 0.85x
# the time of each row reading them (1,024: 0.76x); 8 or 12 rows, or 128 tokens, no faster
# (docs/performance.md).
SHARED_PAGES = {torch.bfloat16: SharedPages(8, 64), torch.float32: SharedPages(16, 256)}


@dataclass(frozen=True)
class _Prefill:
    seq: int  # the sequence's place in the step
    start: int  # first flat token of the sequence's new tokens
    end: int
    blocks: torch.Tensor  # [nb] its pages
    kv_len: int
    mask: torch.Tensor | None  # [q_len, kv_len] bool, causal aligned to the end of the KV;
    # None: a fresh prompt (nothing computed before), plain causal over the step's own K/V


@dataclass(frozen=True)
class _Decodes:
    rows: torch.Tensor  # [B] flat token index of each decode
    shared: torch.Tensor | None  # [c] the pages all B rows start with; None: no common start
    tables: torch.Tensor  # [B, nb] the pages after the shared ones, padded with the null page
    padding: torch.Tensor  # [1, B, 1, nb * block_size] bool, True = no key there

    def attend(self, q: torch.Tensor, pages: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        out[self.rows] = _paged_decode(q[self.rows], pages, self, scale)


@dataclass(frozen=True)
class _InPlaceDecodes:
    """Every decode of the step, for the C kernels."""

    rows: slice | torch.Tensor  # flat token rows: a slice when they are adjacent (the usual
    # case: decodes lead the batch), so q and the output are passed as they lie, uncopied
    tables: torch.Tensor  # [B, nb] int32 pages after the shared ones, padded with the null page
    lens: torch.Tensor  # [B] int32 context lengths after the shared pages
    max_len: int
    shared: torch.Tensor | None = None  # [c] int32 pages every row begins with, attended once

    def attend(self, q: torch.Tensor, pages: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        adjacent = isinstance(self.rows, slice)
        rows_q = q[self.rows]
        rows_out = out[self.rows] if adjacent else torch.empty_like(rows_q)
        lse = None if self.shared is None else torch.empty(*rows_q.shape[:2], 2)
        args = (pages, self.tables, self.lens, self.max_len, scale)
        kernels.paged_decode(rows_q, *args, out=rows_out, lse=lse)
        if self.shared is not None:
            kernels.merge_attention(
                rows_out, lse, *kernels.shared_attention(rows_q, pages, self.shared, scale)
            )
        if not adjacent:
            out[self.rows] = rows_out


class TorchAttentionBackend(AttentionBackend):
    """``in_place``: decodes use the C kernel; ``prefill_kernel``: prefills use the C kernel
    instead of SDPA (each by default where it supports the cache)."""

    name = "torch"

    def __init__(
        self,
        kv_cache: KVCache,
        scale: float,
        in_place: bool | None = None,
        prefill_kernel: bool | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        where = (kv_cache.device, kv_cache.dtype, kv_cache.head_dim)
        self.in_place = kernels.paged_decode_for(*where) if in_place is None else in_place
        if prefill_kernel is None:
            prefill_kernel = kernels.prefill_attention_for(*where)
        self.prefill_kernel = prefill_kernel
        shared = self.in_place and kernels.shared_attention_for(*where)
        self.shared_pages = SHARED_PAGES[kv_cache.dtype] if shared else None

    def plan(self, layout: BatchLayout) -> AttentionStep:
        starts = [0]
        for n in layout.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(layout.query_lens) if n == 1]
        decodes: list[_Decodes | _InPlaceDecodes]
        if self.in_place:
            decodes = [self._in_place(layout, starts, decode)] if decode else []
        else:
            shared, alone = _by_first_page(decode, layout, self.kv_cache.block_size)
            groups = shared + _split_by_length(alone, layout)
            decodes = [self._decodes(layout, starts, idx) for idx in groups]
        prefills = [
            self._prefill(layout, starts[i], i) for i, n in enumerate(layout.query_lens) if n > 1
        ]
        return _TorchStep(
            self.kv_cache,
            layout.slot_mapping,
            decodes,
            prefills,
            self.scale,
            self.prefill_kernel,
        )

    def _prefill(self, layout: BatchLayout, start: int, i: int) -> _Prefill:
        q_len, kv_len = layout.query_lens[i], layout.kv_lens[i]
        device = self.kv_cache.device
        num_blocks = -(-kv_len // self.kv_cache.block_size)
        blocks = torch.tensor(layout.block_tables[i][:num_blocks], device=device)
        mask = None
        if q_len < kv_len:  # query j sits at absolute position kv_len - q_len + j
            mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
            mask = mask.to(device)
        return _Prefill(i, start, start + q_len, blocks, kv_len, mask)

    def _in_place(self, layout: BatchLayout, starts: list[int], idx: list[int]) -> _InPlaceDecodes:
        bs = self.kv_cache.block_size
        lens = [layout.kv_lens[i] for i in idx]
        tables = [layout.block_tables[i] for i in idx]
        shared = shared_start(tables, lens, bs, self.shared_pages)
        lens = [n - shared * bs for n in lens]
        width = -(-max(lens) // bs)
        rows = [starts[i] for i in idx]
        adjacent = rows == list(range(rows[0], rows[0] + len(rows)))
        return _InPlaceDecodes(
            slice(rows[0], rows[0] + len(rows)) if adjacent else torch.tensor(rows),
            torch.tensor([_padded(t[shared:], width) for t in tables], dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            max(lens),
            torch.tensor(tables[0][:shared], dtype=torch.int32) if shared else None,
        )

    def _decodes(self, layout: BatchLayout, starts: list[int], idx: list[int]) -> _Decodes:
        device = self.kv_cache.device
        bs = self.kv_cache.block_size
        kv_lens = [layout.kv_lens[i] for i in idx]
        tables = [layout.block_tables[i] for i in idx]
        # whole pages every row holds, leaving each row at least its newest token of its own
        shared = _common_start(tables, (min(kv_lens) - 1) // bs) if len(idx) > 1 else 0
        rest = [n - shared * bs for n in kv_lens]
        num_blocks = -(-max(rest) // bs)
        padded = [_padded(t[shared:], num_blocks) for t in tables]
        kv_pos = torch.arange(num_blocks * bs)
        padding = kv_pos[None, :] >= torch.tensor(rest)[:, None]
        return _Decodes(
            torch.tensor([starts[i] for i in idx], device=device),
            torch.tensor(tables[0][:shared], device=device) if shared else None,
            torch.tensor(padded, dtype=torch.int64, device=device),
            padding.view(1, len(idx), 1, -1).to(device),
        )


class _TorchStep(AttentionStep):
    def __init__(
        self,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        decodes: list[_Decodes | _InPlaceDecodes],
        prefills: list[_Prefill],
        scale: float,
        prefill_kernel: bool,
    ) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.decodes = decodes
        self.prefills = prefills
        self.scale = scale
        self.prefill_kernel = prefill_kernel

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        """With ``keep``, the C prefill kernel attends only each prompt's kept tail (its
        queries sit at the end of the keys, as the kernel aligns them); SDPA attends all."""
        kv = self.kv_cache.flat_kv(layer)  # [2, slots, H_kv, D]
        kv[0].index_copy_(0, self.slot_mapping, k.to(kv.dtype))
        kv[1].index_copy_(0, self.slot_mapping, v.to(kv.dtype))
        pages = self.kv_cache.data[layer]  # [2, blocks, block_size, H_kv, D]
        out = torch.empty_like(q)
        for d in self.decodes:
            d.attend(q, pages, self.scale, out)
        for p in self.prefills:
            first = p.start
            if keep is not None and self.prefill_kernel:
                first = p.end - keep.tails[p.seq]
                if first == p.end:
                    continue
            self._prefill(p, first, q, k, v, pages, out)
        return out if keep is None else out[keep.index]

    def _prefill(
        self,
        p: _Prefill,
        first: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pages: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Prompt ``p``'s attention for its queries from flat row ``first`` on."""
        if p.mask is None and pages.dtype == q.dtype:
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:
            kp, vp = _gather_pages(pages, p.blocks, p.kv_len, q.dtype)
        if self.prefill_kernel:
            kernels.prefill_attention(q[first : p.end], kp, vp, self.scale, out[first : p.end])
            return
        o = F.scaled_dot_product_attention(
            q[p.start : p.end].transpose(0, 1).unsqueeze(0),  # [1, H, Lq, D]
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=self.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out[p.start : p.end] = o[0].transpose(0, 1)


def _gather_pages(
    pages: torch.Tensor, blocks: torch.Tensor, kv_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, each ``[kv_len, H_kv, D]`` (token-major, contiguous)."""
    # index_select on whole pages: several times faster than advanced indexing on CPU
    gathered = pages.view(2, pages.shape[1], -1).index_select(1, blocks)
    gathered = gathered.view(2, -1, *pages.shape[3:])[:, :kv_len].to(dtype)
    return gathered[0], gathered[1]


def _by_first_page(
    idx: list[int], layout: BatchLayout, block_size: int
) -> tuple[list[list[int]], list[int]]:
    """The groups of decodes sharing their first page (a prefix-cache hit on the same prompt
    start), which attend to the shared pages together, and the rows sharing none."""
    by_page: dict[int, list[int]] = {}
    for i in idx:
        if layout.kv_lens[i] > block_size:  # a full first page, with the newest token after it
            by_page.setdefault(layout.block_tables[i][0], []).append(i)
    groups = [rows for rows in by_page.values() if len(rows) > 1]
    grouped = {i for rows in groups for i in rows}
    return groups, [i for i in idx if i not in grouped]


def _split_by_length(idx: list[int], layout: BatchLayout) -> list[list[int]]:
    """Two padded groups instead of one when contexts differ a lot: the short half no longer
    pays for gathering and attending over the longest sequence's pages."""
    kv_lens = layout.kv_lens
    if len(idx) < 8:
        return [idx] if idx else []
    ordered = sorted(idx, key=lambda i: kv_lens[i])
    half = len(ordered) // 2
    if kv_lens[ordered[-1]] < 2 * kv_lens[ordered[half]]:
        return [idx]
    return [ordered[:half], ordered[half:]]


def shared_start(
    tables: list[list[int]], lens: list[int], block_size: int, least: SharedPages | None
) -> int:
    """How many leading pages the decodes with these block tables and context lengths attend
    to once, together (``kernels.shared_attention``): the whole pages every row holds, leaving
    each row at least its newest token of its own, when ``least.rows`` or more rows share
    ``least.tokens`` or more tokens; else 0 (always 0 where ``least`` is None: no shared
    pass)."""
    if least is None or len(tables) < least.rows:
        return 0
    shared = _common_start(tables, (min(lens) - 1) // block_size)
    return shared if shared * block_size >= least.tokens else 0


def _common_start(tables: list[list[int]], limit: int) -> int:
    """How many leading pages (at most ``limit``) all block tables share."""
    first = tables[0]
    n = 0
    while n < limit and all(t[n] == first[n] for t in tables):
        n += 1
    return n


def _padded(table: list[int], width: int) -> list[int]:
    return table[:width] + [0] * (width - len(table))


def _paged_decode(q: torch.Tensor, pages: torch.Tensor, d: _Decodes, scale: float) -> torch.Tensor:
    """One query per sequence, q: [B, H, D]; returns [B, H, D].

    The pages are gathered head-major (``[2, H_kv, B * nb, block_size, D]``) by one
    ``index_select`` into a contiguous buffer, so each (KV head, sequence) pair's keys are one
    contiguous ``[Lk, D]`` matrix: both matmuls run as plain ``bmm`` over ``H_kv * B`` batches,
    and the query heads sharing a KV head form one row block, so K/V are never expanded per
    query head. Shared leading pages are gathered once and multiplied by all B rows' queries
    at once (``[B * G, D]`` per KV head, a real matrix product instead of B thin ones); the
    softmax runs over the shared and the own scores together, so the result is the same.
    """
    b, h, dim = q.shape
    h_kv = pages.shape[3]
    group = h // h_kv
    by_head = pages.permute(0, 3, 1, 2, 4)  # [2, H_kv, blocks, block_size, D]
    qh = q.view(b, h_kv, group, dim).transpose(0, 1)  # [H_kv, B, G, D]
    kv = _gather_by_head(by_head, d.tables.view(-1), q.dtype).view(2, h_kv * b, -1, dim)
    lk = kv.shape[2]
    scores = torch.bmm(qh.reshape(h_kv * b, group, dim), kv[0].transpose(1, 2))
    scores = scores.view(h_kv, b, group, lk).masked_fill_(d.padding, float("-inf"))
    if d.shared is None:
        probs = torch.softmax(scores.mul_(scale), dim=-1)
        out = torch.bmm(probs.view(h_kv * b, group, lk), kv[1])
        return out.view(h_kv, b, group, dim).transpose(0, 1).reshape(b, h, dim)
    pre = _gather_by_head(by_head, d.shared, q.dtype)  # [2, H_kv, P, D]
    lp = pre.shape[2]
    shared = torch.bmm(qh.reshape(h_kv, b * group, dim), pre[0].transpose(1, 2))
    scores = torch.cat([shared.view(h_kv, b, group, lp), scores], dim=-1).mul_(scale)
    probs_pre, probs = torch.softmax(scores, dim=-1).split([lp, lk], dim=-1)
    out = torch.bmm(probs_pre.reshape(h_kv, b * group, lp), pre[1]).view(h_kv, b, group, dim)
    out += torch.bmm(probs.reshape(h_kv * b, group, lk), kv[1]).view(h_kv, b, group, dim)
    return out.transpose(0, 1).reshape(b, h, dim)


def _gather_by_head(
    by_head: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[2, H_kv, n * block_size, D]``: the pages ``blocks``, each head's keys contiguous."""
    _, h_kv, _, bs, dim = by_head.shape
    kv = torch.empty(2, h_kv, blocks.numel(), bs, dim, dtype=by_head.dtype, device=by_head.device)
    torch.index_select(by_head, 2, blocks, out=kv)
    kv = kv.view(2, h_kv, -1, dim)
    return kv if kv.dtype == dtype else kv.to(dtype)
