"""The FlashInfer backend: its choice, its page table, and its output against the torch backend.

On CPU the backend runs over a fake ``flashinfer`` module (pure torch, FlashInfer's documented
semantics: CSR page table, causal mask aligned to the end of the KV), which checks our side
of the contract: the metadata, the keyword gating, slot writes, the CUDA-graph wrappers and
padding. The tests marked ``cuda`` run the real kernels and need a GPU with flashinfer.
"""

from __future__ import annotations

import random
import types
from types import SimpleNamespace

import pytest
import torch

from tandem.server.engine.attention import BatchLayout, TorchAttentionBackend, choose_backend
from tandem.server.engine.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    accepted_kwargs,
    paged_metadata,
)
from tandem.server.engine.kv_cache import KVCache
from tandem.server.engine.model_runner import StepInputs, pad_decode_inputs

HAS_CUDA = torch.cuda.is_available()


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


needs_gpu = pytest.mark.skipif(
    not (HAS_CUDA and _has_flashinfer()), reason="needs CUDA and flashinfer"
)


# ----- backend choice ---------------------------------------------------------------------
def test_auto_is_torch_on_cpu() -> None:
    assert choose_backend("auto", "cpu", torch.bfloat16, lambda: True) == "torch"


def test_auto_is_flashinfer_on_cuda_when_it_imports() -> None:
    assert choose_backend("auto", "cuda", torch.bfloat16, lambda: True) == "flashinfer"
    assert choose_backend("auto", "cuda", torch.float16, lambda: True) == "flashinfer"
    assert choose_backend("auto", "cuda", torch.bfloat16, lambda: False) == "torch"
    assert (
        choose_backend("auto", "cuda", torch.float32, lambda: True) == "torch"
    )  # kernels are 16-bit


def test_torch_is_always_torch() -> None:
    assert choose_backend("torch", "cuda", torch.bfloat16, lambda: True) == "torch"


@pytest.mark.parametrize(
    "device,dtype,ok,match",
    [
        ("cpu", torch.bfloat16, True, "needs a CUDA device"),
        ("cuda", torch.float32, True, "float16 or bfloat16"),
        ("cuda", torch.bfloat16, False, "does not import"),
    ],
)
def test_flashinfer_where_it_cannot_run_is_an_error(device, dtype, ok, match) -> None:
    with pytest.raises(ValueError, match=match):
        choose_backend("flashinfer", device, dtype, lambda: ok)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("flash", "cpu", torch.float32)


def test_engine_with_flashinfer_on_cpu_is_a_clear_error(llama_dir) -> None:
    from tandem.server.engine import LLM

    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(str(llama_dir), device="cpu", attention_backend="flashinfer", kv_cache_tokens=256)


# ----- page table ---------------------------------------------------------------------------
def test_paged_metadata() -> None:
    layout = BatchLayout(
        query_lens=[3, 1, 5],
        kv_lens=[3, 17, 20],
        block_tables=[[4], [7, 2, 9], [5, 6, 8]],
        slot_mapping=torch.zeros(9, dtype=torch.int64),
    )
    m = paged_metadata(layout, block_size=8)
    assert m.qo_indptr.tolist() == [0, 3, 4, 9]
    assert m.kv_indptr.tolist() == [0, 1, 4, 7]
    assert m.kv_indices.tolist() == [4, 7, 2, 9, 5, 6, 8]
    assert m.kv_last_page_len.tolist() == [3, 1, 4]
    assert {t.dtype for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len)} == {
        torch.int32
    }
    assert all(t.device.type == "cpu" for t in (m.qo_indptr, m.kv_indptr, m.kv_last_page_len))


def test_paged_metadata_rejects_short_tables() -> None:
    layout = BatchLayout([1], [9], [[3]], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="cannot hold"):
        paged_metadata(layout, block_size=8)


def test_accepted_kwargs_reads_plan_impl_behind_var_kwargs() -> None:
    class New:
        def plan(self, a, *args, **kwargs): ...

        def _plan_impl(self, a, *, q_data_type=None, sm_scale=None): ...

    class Old:
        def plan(self, a, data_type=None, sm_scale=None): ...

    assert accepted_kwargs(New().plan, q_data_type=1, data_type=2, sm_scale=3) == {
        "q_data_type": 1,
        "sm_scale": 3,
    }
    assert accepted_kwargs(Old().plan, q_data_type=1, data_type=2, sm_scale=3) == {
        "data_type": 2,
        "sm_scale": 3,
    }
    assert accepted_kwargs(lambda **kw: None, x=1) == {"x": 1}


# ----- a fake flashinfer for CPU ------------------------------------------------------------
def _paged_attention(q, k_pages, v_pages, qo_indptr, kv_indptr, indices, last_len, scale, causal):
    out = torch.empty_like(q)
    ps = k_pages.shape[1]
    for b in range(len(kv_indptr) - 1):
        pages = indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        kv_len = (len(pages) - 1) * ps + int(last_len[b])
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len].float()
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len].float()
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        qb = q[q0:q1].float()  # [n, H, D]
        group = qb.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,khd->hnk", qb, k) * scale
        if causal:
            n = q1 - q0
            qpos = kv_len - n + torch.arange(n)
            scores = scores.masked_fill(
                torch.arange(kv_len)[None, :] > qpos[:, None], float("-inf")
            )
        out[q0:q1] = torch.einsum("hnk,khd->nhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _FakeDecode:
    """Shaped like flashinfer >= 0.3: ``plan(..., **kwargs)`` forwarding to ``_plan_impl``."""

    instances: list[_FakeDecode] = []

    def __init__(
        self,
        workspace,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
    ):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(torch.is_tensor(b) for b in self.bufs)
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        _FakeDecode.instances.append(self)

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *args,
        **kwargs,
    ):
        assert not args
        return self._plan_impl(
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            **kwargs,
        )

    def _plan_impl(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        pos_encoding_mode="NONE",
        q_data_type="float16",
        kv_data_type=None,
        data_type=None,
        sm_scale=None,
        non_blocking=True,
    ):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert q_data_type in (torch.float16, torch.bfloat16) and pos_encoding_mode == "NONE"
        if self.graph:
            assert len(last_page_len) == len(self.bufs[2]) and len(indices) <= len(self.bufs[1])
            self.bufs[0].copy_(indptr)
            self.bufs[1][: len(indices)].copy_(indices)
            self.bufs[2].copy_(last_page_len)
            indptr, indices, last_page_len = self.bufs[0], self.bufs[1], self.bufs[2]
        self.meta = (indptr, indices, last_page_len, sm_scale or head_dim**-0.5)

    def run(self, q, paged_kv_cache):
        indptr, indices, last, scale = self.meta
        k, v = paged_kv_cache
        return _paged_attention(
            q, k, v, torch.arange(len(indptr)), indptr, indices, last, scale, causal=False
        )


class _FakePrefill:
    """Shaped like flashinfer 0.2: explicit keyword arguments (unknown ones are a TypeError)."""

    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD"

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
        non_blocking=True,
    ):
        assert qo_indptr.device.type == "cpu" and paged_kv_indptr.device.type == "cpu"
        assert {
            t.dtype for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        } == {torch.int32}
        self.meta = (
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            sm_scale or head_dim_qk**-0.5,
            causal,
        )

    def run(self, q, paged_kv_cache):
        qo, kvp, idx, last, scale, causal = self.meta
        k, v = paged_kv_cache
        return _paged_attention(q, k, v, qo, kvp, idx, last, scale, causal)


FAKE = types.SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=_FakeDecode, BatchPrefillWithPagedKVCacheWrapper=_FakePrefill
)


# ----- scenarios ------------------------------------------------------------------------------
# FlashInfer builds kernels for head sizes 64, 128 and 256; 128 is the real models'.
H, H_KV, D, BS, BLOCKS = 8, 2, 128, 16, 64


def _cache(dtype, device, kv_heads: int = H_KV) -> KVCache:
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=kv_heads, head_dim=D)
    return KVCache(cfg, BLOCKS, BS, dtype, device)


def _scenario(seqs: list[tuple[int, int]], dtype, device, seed: int = 0, kv_heads: int = H_KV):
    """seqs: (context already cached, new tokens). Returns caches, layout, q, k, v."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, BLOCKS))
    rng.shuffle(free)
    cache = _cache(dtype, device, kv_heads)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    tables, slots, q_lens, kv_lens = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BS))]
        tables.append(table)
        slots.extend(table[p // BS] * BS + p % BS for p in range(cached, total))
        q_lens.append(new)
        kv_lens.append(total)
    n = sum(q_lens)
    q = torch.randn(n, H, D, generator=gen).to(dtype).to(device)
    k = torch.randn(n, kv_heads, D, generator=gen).to(dtype).to(device)
    v = torch.randn(n, kv_heads, D, generator=gen).to(dtype).to(device)
    layout = BatchLayout(
        q_lens, kv_lens, tables, torch.tensor(slots, dtype=torch.int64, device=device)
    )
    return cache, layout, q, k, v


SCENARIOS = {
    "prefill": [(0, 37), (0, 5), (0, 16)],
    "chunked_prefill_with_prefix": [
        (32, 20),
        (17, 9),
        (48, 1),
    ],  # the last row is a decode in a mixed batch
    "decode": [(40, 1), (0, 1), (15, 1), (100, 1)],
}


def _compare(
    fi_backend_factory, dtype, device, name: str, tol: float, kv_heads: int = H_KV
) -> None:
    cache, layout, q, k, v = _scenario(SCENARIOS[name], dtype, device, kv_heads=kv_heads)
    ref_cache = _cache(dtype, device, kv_heads)
    ref_cache.data.copy_(cache.data)
    ref = TorchAttentionBackend(ref_cache, D**-0.5).plan(layout).forward(0, q.clone(), k, v)
    out = fi_backend_factory(cache).plan(layout).forward(0, q.clone(), k, v)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, f"{name}: relative error {err}"
    assert torch.equal(cache.data, ref_cache.data)  # the same K/V written in the same slots


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fake_flashinfer_matches_torch_on_cpu(name: str) -> None:
    _compare(
        lambda c: FlashInferAttentionBackend(c, D**-0.5, H, flashinfer=FAKE, workspace_bytes=1024),
        torch.bfloat16,
        torch.device("cpu"),
        name,
        tol=1e-2,
    )


def test_float32_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferAttentionBackend(
            _cache(torch.float32, torch.device("cpu")), 1.0, H, flashinfer=FAKE
        )


def test_graph_step_pads_onto_the_null_page() -> None:
    """A graph wrapper of 4 rows replays 3 real decodes: real rows match eager, padding stays in block 0."""
    dtype, device = torch.bfloat16, torch.device("cpu")
    cache, layout, q, k, v = _scenario(SCENARIOS["decode"][:3], dtype, device, seed=3)
    eager_cache = _cache(dtype, device)
    eager_cache.data.copy_(cache.data)
    eager = FlashInferAttentionBackend(
        eager_cache, D**-0.5, H, flashinfer=FAKE, workspace_bytes=1024
    )
    want = eager.plan(layout).forward(0, q, k, v)

    backend = FlashInferAttentionBackend(cache, D**-0.5, H, flashinfer=FAKE, workspace_bytes=1024)
    slots = torch.zeros(4, dtype=torch.int64)
    step = backend.graph_step(4, slots, max_blocks_per_seq=8)
    assert _FakeDecode.instances[-1].graph
    inputs = StepInputs(
        [1, 2, 3],
        [0, 0, 0],
        layout.slot_mapping.tolist(),
        layout.query_lens,
        layout.kv_lens,
        layout.block_tables,
        [0, 1, 2],
    )
    padded = pad_decode_inputs(inputs, 4)
    slots.copy_(torch.tensor(padded.slots))
    backend.plan_graph(
        4, BatchLayout(padded.query_lens, padded.kv_lens, padded.block_tables, slots)
    )
    pad = lambda t: torch.cat([t, t[:1]])  # noqa: E731  (garbage row for the padding)
    got = step.forward(0, pad(q), pad(k), pad(v))
    assert torch.allclose(got[:3].float(), want.float(), atol=1e-2)
    assert torch.equal(
        cache.data[:, :, 1:], eager_cache.data[:, :, 1:]
    )  # real pages: exactly what eager wrote
    with pytest.raises(ValueError, match="decode rows"):
        backend.plan_graph(4, layout)


# ----- the real kernels (GPU) -----------------------------------------------------------------
@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("kv_heads", [2, 4])  # groups of 4 (tensor-core decode) and of 2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flashinfer_matches_torch_on_gpu(name: str, dtype, kv_heads: int) -> None:
    _compare(
        lambda c: FlashInferAttentionBackend(c, D**-0.5, H),
        dtype,
        torch.device("cuda"),
        name,
        tol=2e-2,
        kv_heads=kv_heads,
    )


# The engine's tokens with FlashInfer (graphs on and off) and with the torch backend, each
# against transformers in float32: tests/engine/test_gpu_exactness.py.


@needs_gpu
@pytest.mark.cuda
def test_engine_tokens_torch_float32_on_gpu_equal_cpu(tiny_models) -> None:
    """float32 on a GPU takes the torch backend (auto) and must equal the CPU engine."""
    from tandem.server.engine import LLM, SamplingParams

    prompts = [[5, 17, 99, 300, 41], list(range(40, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    gpu = LLM(str(tiny_models["llama"]), device="cuda", dtype="float32", kv_cache_tokens=4096)
    assert gpu.engine.worker.runner.backend.name == "torch"
    cpu = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", kv_cache_tokens=4096)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]
