"""The torch attention backend against attention written out per sequence, in float64.

The scenarios cover what the backend treats differently: fresh prompts (attending to the
step's own K/V), prefix hits and chunks (the pages, causal aligned to the end), decodes of
mixed lengths (split into two groups), and decodes sharing their leading pages (the shared
pages attended once for all rows, in both paths).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tandem.server.engine import kernels
from tandem.server.engine.attention import BatchLayout, TorchAttentionBackend
from tandem.server.engine.attention.base import KeptRows
from tandem.server.engine.attention.torch_backend import SHARED_PAGES
from tandem.server.engine.kv_cache import KVCache

H, H_KV, D, BS, BLOCKS = 6, 2, 32, 4, 1280  # D: the narrowest the C kernels take


def _reference(cache, layout, q, k, v, scale):
    """Write the new K/V into their slots, then softmax(q k^T) v per sequence and query."""
    flat = cache.view(2, -1, H_KV, D).clone()
    flat[0, layout.slot_mapping] = k
    flat[1, layout.slot_mapping] = v
    out, start = [], 0
    for q_len, kv_len, table in zip(layout.query_lens, layout.kv_lens, layout.block_tables):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(kv_len)])
        keys = flat[0, slots].repeat_interleave(H // H_KV, dim=1)  # [kv_len, H, D]
        values = flat[1, slots].repeat_interleave(H // H_KV, dim=1)
        for j in range(q_len):
            visible = kv_len - q_len + j + 1
            s = torch.einsum("hd,khd->hk", q[start + j], keys[:visible]) * scale
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), values[:visible]))
        start += q_len
    return torch.stack(out), flat


def _scenario(seqs, shared_blocks: int, seed: int):
    """seqs: (tokens already cached, new tokens[, prefix]): the first ``shared_blocks`` pages
    of the sequences naming the same prefix (0 by default, when their context is long
    enough; -1: none) are one set of pages (a prefix-cache hit)."""
    rng = random.Random(seed)
    free = list(range(1, BLOCKS))
    rng.shuffle(free)
    prefixes: dict[int, list[int]] = {}
    tables, slots = [], []
    for cached, new, *prefix in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BS))]
        which = prefix[0] if prefix else 0
        if which >= 0 and cached >= shared_blocks * BS:
            if which not in prefixes:
                prefixes[which] = [free.pop() for _ in range(shared_blocks)]
            table[:shared_blocks] = prefixes[which]
        tables.append(table)
        slots.extend(table[p // BS] * BS + p % BS for p in range(cached, total))
    n = sum(s[1] for s in seqs)
    layout = BatchLayout(
        [s[1] for s in seqs],
        [s[0] + s[1] for s in seqs],
        tables,
        torch.tensor(slots, dtype=torch.int64),
    )
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (H, H_KV, H_KV))
    return layout, q, k, v


SCENARIOS = {
    "fresh_prompts": ([(0, 37), (0, 5), (0, 16)], 0),
    "prefix_hits_and_a_decode": ([(32, 20), (17, 9), (48, 1), (8, 3)], 2),
    "decodes": ([(40, 1), (0, 1), (15, 1), (100, 1)], 0),
    "decodes_of_very_different_lengths": ([(n, 1) for n in (3, 5, 7, 9, 60, 70, 80, 90)], 0),
    "decodes_sharing_a_prefix": ([(n, 1) for n in (33, 40, 41, 47, 64)], 8),
    "a_shared_prefix_ending_at_the_newest_token": ([(32, 1), (32, 1), (36, 1)], 8),
    "mixed_with_a_shared_prefix": ([(32, 1), (0, 12), (44, 1), (32, 5), (70, 1)], 8),
    # past SHARED_PAGES in bfloat16: on an AMX CPU, the shared pages attended once (sixteen
    # rows a tile, then a remainder of four and four)
    "many_decodes_sharing_a_long_prefix": ([(n, 1) for n in (68, 70, 75, 80, 83, 90, 99, 130)], 17),
    # past SHARED_PAGES in float32 too: the shared pages walked once by every row's queries
    "sixteen_decodes_sharing_a_longer_prefix": ([(n, 1) for n in range(260, 292, 2)], 64),
    "decodes_sharing_two_prefixes_and_none": (
        [(40, 1, 0), (50, 1, 1), (36, 1, -1), (45, 1, 0), (90, 1, 1), (60, 1, -1), (33, 1, 1)],
        8,
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "c-kernel"])
def test_matches_attention_per_sequence(name: str, dtype: torch.dtype, in_place: bool) -> None:
    """``c-kernel``: decodes in ``kernels.paged_decode`` and prefills in
    ``kernels.prefill_attention`` (bfloat16 where the CPU has AVX512-BF16)."""
    if in_place and not kernels.paged_decode_for(torch.device("cpu"), dtype, D):
        pytest.skip("the C decode kernel needs AVX-512 and a C compiler")
    prefill_kernel = in_place and kernels.prefill_attention_for(torch.device("cpu"), dtype, D)
    seqs, shared = SCENARIOS[name]
    layout, q, k, v = _scenario(seqs, shared, seed=len(name))
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=H_KV, head_dim=D)
    cache = KVCache(cfg, BLOCKS, BS, dtype, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(1)))
    scale = D**-0.5
    want, written = _reference(
        cache.data[0].double(), layout, q.double(), k.double(), v.double(), scale
    )
    step = TorchAttentionBackend(
        cache, scale, in_place=in_place, prefill_kernel=prefill_kernel
    ).plan(layout)
    got = step.forward(0, q.to(dtype), k.to(dtype), v.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)
    assert torch.equal(cache.data[0].view(2, -1, H_KV, D), written.to(dtype))

    keep = _some_tails(layout.query_lens)  # a last layer's rows: the same outputs, no others
    got = step.forward(0, q.to(dtype), k.to(dtype), v.to(dtype), keep)
    assert torch.allclose(got.double(), want[keep.index], atol=tol, rtol=tol)
    assert torch.equal(cache.data[0].view(2, -1, H_KV, D), written.to(dtype))


def _some_tails(query_lens: list[int]) -> KeptRows:
    """Each sequence's last one to three rows, or none for every fourth."""
    tails = [0 if i % 4 == 3 else min(n, 1 + i % 3) for i, n in enumerate(query_lens)]
    ends = [sum(query_lens[: i + 1]) for i in range(len(query_lens))]
    rows = [r for end, t in zip(ends, tails) for r in range(end - t, end)]
    return KeptRows(tails, torch.tensor(rows, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_pages_are_attended_once(dtype: torch.dtype) -> None:
    """The C path takes the pages every decode begins with apart once enough rows share enough
    of them (``SHARED_PAGES``: in float32 sixteen rows, in bfloat16 on an AMX CPU eight), and
    keeps them whole below that."""
    if not kernels.shared_attention_for(torch.device("cpu"), dtype, D):
        pytest.skip("shared pages are attended apart in float32 on AVX-512, bfloat16 on AMX")
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=H_KV, head_dim=D)
    cache = KVCache(cfg, BLOCKS, BS, dtype, torch.device("cpu"))
    backend = TorchAttentionBackend(cache, D**-0.5, in_place=True)
    least = SHARED_PAGES[dtype]
    for name in [
        "sixteen_decodes_sharing_a_longer_prefix",
        "many_decodes_sharing_a_long_prefix",
        "decodes_sharing_a_prefix",
    ]:
        seqs, pages = SCENARIOS[name]
        shared = pages if len(seqs) >= least.rows and pages * BS >= least.tokens else 0
        layout, *_ = _scenario(seqs, pages, seed=0)
        (decodes,) = backend.plan(layout).decodes
        assert (0 if decodes.shared is None else len(decodes.shared)) == shared
        assert decodes.lens.tolist() == [n - shared * BS for n in layout.kv_lens]
