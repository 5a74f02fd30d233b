"""The CPU C kernels of a decoder layer against the PyTorch code they replace.

In bfloat16 both sides round at the same points, so they agree bit for bit except where the
RMSNorm sum's order or exp's last bit tips a rounding: at most one bfloat16 step, rarely. In
float32 they agree to float32 rounding. Decode attention is held to float64 here at real head
sizes, and in ``test_torch_attention.py`` in every batch shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.server.engine import cpu, kernels
from tandem.server.engine.models.layers import RMSNorm
from tandem.server.engine.models.rope import RotaryEmbedding, _apply

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _need_kernels() -> None:
    if not kernels.cpu_kernels_for(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler to build the CPU kernels")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    step = want.float().abs().clamp_min(1e-30) * 2**-7  # one bfloat16 step at that magnitude
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.98


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype) * 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, rows: int) -> None:
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = _rand(576, dtype=dtype, seed=1)
    x = _rand(rows, 576, dtype=dtype)
    _close(kernels.rms_norm(x, norm.weight, norm.eps), norm.reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_is_torchs_add_then_the_norm(dtype: torch.dtype, rows: int) -> None:
    """The residual stream's sum is torch's bit for bit (every later layer adds to it),
    written over the spent inputs (the norm over x, the sum over residual); rows of 576 (36
    vectors) and of 40 (no whole vector: the scalar loop)."""
    for width in (576, 40):
        norm = RMSNorm(width, 1e-5).to(dtype)
        norm.weight.data = _rand(width, dtype=dtype, seed=1)
        x, residual = _rand(rows, width, dtype=dtype), _rand(rows, width, dtype=dtype, seed=2)
        want = residual + x
        out, total = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
        assert out.data_ptr() == x.data_ptr() and total.data_ptr() == residual.data_ptr()
        assert torch.equal(total, want)
        assert torch.equal(out, kernels.rms_norm(want, norm.weight, norm.eps))
        _close(out, norm.reference(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_viewed_in_a_wider_row(dtype: torch.dtype) -> None:
    """Qwen3's q/k norms run over ``[tokens, heads, head_dim]`` views of the qkv output."""
    norm = RMSNorm(64, 1e-6).to(dtype)
    norm.weight.data = _rand(64, dtype=dtype, seed=1)
    qkv = _rand(5, 12 * 64, dtype=dtype)
    q = qkv[:, : 8 * 64].view(5, 8, 64)
    _close(kernels.rms_norm(q, norm.weight, norm.eps), norm.reference(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, rows: int) -> None:
    gate_up = _rand(rows, 2 * 1536, dtype=dtype)
    gate, up = gate_up.split(1536, dim=-1)
    _close(kernels.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_in_place_matches_the_reference(dtype: torch.dtype, rotary_fraction: float) -> None:
    params = {"rope_theta": 10000.0, "partial_rotary_factor": rotary_fraction}
    rotary = RotaryEmbedding(params, 64, 4096)
    positions = torch.tensor([0, 1, 17, 900, 4095])
    cos, sin, _ = rotary.tables(positions, dtype)
    qkv = _rand(5, (9 + 3 + 3) * 64, dtype=dtype)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    v_before = qkv[:, 12 * 64 :].clone()
    want_q, want_k = (_apply(x, cos, sin, rotary.rotary_dim) for x in (q, k))
    got_q, got_k = kernels.rope_(q, cos, sin), kernels.rope_(k, cos, sin)
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # v, beside them in the same rows, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 9, 3), (64, 34, 2)])
def test_paged_decode_at_model_head_dims_matches_float64(
    dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int
) -> None:
    """SmolLM2's and Llama's head sizes take the kernel's specialised bodies (and, in bfloat16
    on a CPU with AVX512-BF16, its pairwise q.k), which the 16-wide test model never reaches;
    a group of 17 query heads per KV head is wider than the kernel's 16 and goes in two parts."""
    _check_paged_decode(dtype, head_dim, heads, kv_heads, [1, 15, 16, 17, 100, 200])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 8, 2), (64, 34, 2)])
def test_paged_decode_of_long_sequences_matches_float64(
    dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int
) -> None:
    """Sequences whose cached keys pass a megabyte take every KV head 64 tokens at a time
    (attend_heads: the running softmax carried from span to span) where there are at least as
    many sequences as threads; short ones beside them and a lone long one do not."""
    long = (1 << 20) // (kv_heads * head_dim * dtype.itemsize) + 1
    lens = [long + 100, long, 40, long + 7 + 64 * 3]
    _check_paged_decode(dtype, head_dim, heads, kv_heads, lens)
    _check_paged_decode(dtype, head_dim, heads, kv_heads, [long + 33])


def _check_paged_decode(
    dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, lens: list[int]
) -> None:
    """``paged_decode`` of one query a sequence over pages in shuffled order, its outputs and
    each row's max and sum, against attention in float64."""
    if not kernels.paged_decode_for(torch.device("cpu"), dtype, head_dim):
        pytest.skip("the C decode kernel needs AVX-512")
    bs = 16
    blocks = sum(-(-n // bs) for n in lens) + 1
    pages = _rand(2, blocks, bs, kv_heads, head_dim, dtype=dtype, seed=2) / 3
    order = iter(
        torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(3)).add(1).tolist()
    )
    tables = [[next(order) for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    q = _rand(len(lens), heads, head_dim, dtype=dtype, seed=4) / 3
    out, lse = torch.empty_like(q), torch.empty(len(lens), heads, 2)
    kernels.paged_decode(
        q,
        pages,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        max(lens),
        head_dim**-0.5,
        out=out,
        lse=lse,
    )
    for b, (n, table) in enumerate(zip(lens, tables)):
        k, v = (pages[i, table].reshape(-1, kv_heads, head_dim)[:n].double() for i in (0, 1))
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * head_dim**-0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].double(), want, rtol=tol, atol=tol)
        got = lse[b, :, 0].double() + lse[b, :, 1].double().log()
        torch.testing.assert_close(got, scores.logsumexp(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "dim"),
    [(8, 9, 3, 64), (3, 4, 2, 64), (30, 9, 3, 64), (2, 4, 2, 64), (5, 4, 2, 128), (6, 8, 8, 32)],
)
def test_shared_pages_merged_match_float64(
    dtype: torch.dtype, batch: int, heads: int, kv_heads: int, dim: int
) -> None:
    """Decodes beginning with the same pages: those attended once for all rows
    (``shared_attention``: 16-row tiles with AMX in bfloat16 from six rows of queries a KV
    head, else the pages walked once by every row's queries), the rest per row
    (``paged_decode`` with each row's max and sum), merged by ``merge_attention``: the
    attention over the whole context."""
    if not kernels.prefill_attention_for(torch.device("cpu"), dtype, dim):
        pytest.skip("the C attention kernels need AVX-512 (and AVX512-BF16 in bfloat16)")
    bs, shared_pages = 16, 9
    pages = _rand(2, 128, bs, kv_heads, dim, dtype=dtype, seed=6) / 3
    order = iter(torch.randperm(127, generator=torch.Generator().manual_seed(7)).add(1).tolist())
    shared = [next(order) for _ in range(shared_pages)]
    own_lens = [1 + 7 * b % 40 for b in range(batch)]
    own = [[next(order) for _ in range(-(-n // bs))] for n in own_lens]
    width = max(len(t) for t in own)
    q = _rand(batch, heads, dim, dtype=dtype, seed=8) / 3
    out, lse = torch.empty_like(q), torch.empty(batch, heads, 2)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in own], dtype=torch.int32)
    lens = torch.tensor(own_lens, dtype=torch.int32)
    kernels.paged_decode(q, pages, tables, lens, max(own_lens), dim**-0.5, out=out, lse=lse)
    common = kernels.shared_attention(q, pages, torch.tensor(shared, dtype=torch.int32), dim**-0.5)
    kernels.merge_attention(out, lse, *common)
    for b in range(batch):
        n = shared_pages * bs + own_lens[b]
        k, v = (pages[i, shared + own[b]].reshape(-1, kv_heads, dim)[:n].double() for i in (0, 1))
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * dim**-0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "q_len", "kv_len"),
    [
        (64, 9, 3, 37, 37),
        (64, 9, 3, 300, 300),
        (64, 9, 3, 21, 70),
        (64, 9, 3, 100, 700),
        (64, 9, 3, 10, 90),
        (128, 9, 3, 50, 50),
        (64, 34, 2, 19, 19),
        (32, 4, 4, 1, 9),
        (32, 4, 2, 40, 90),
        (96, 4, 2, 33, 33),
        (256, 2, 1, 20, 150),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_matches_float64(
    dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, q_len: int, kv_len: int
) -> None:
    """Causal over the step's own q|k|v rows (strided views, as the model hands them), and a
    chunk after cached tokens (query i at position kv_len - q_len + i); prompts spanning
    several of the kernel's key blocks (128) and row chunks, row counts not a multiple of its
    block of four (nor, in bfloat16 on an AMX CPU, of its sixteen-row tile blocks: the rest
    in dot pairs, or padded to sixteen from PADDED_ROWS on); the specialised head sizes and the
    generic ones."""
    if not kernels.prefill_attention_for(torch.device("cpu"), dtype, head_dim):
        pytest.skip("the C prefill kernel needs AVX-512 (and AVX512-BF16 in bfloat16)")
    width = (heads + 2 * kv_heads) * head_dim
    qkv = _rand(kv_len, width, dtype=dtype, seed=5) / 3
    q = qkv[kv_len - q_len :, : heads * head_dim].view(q_len, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(kv_len, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(kv_len, kv_heads, head_dim)
    out = torch.empty(q_len, heads, head_dim, dtype=dtype)
    kernels.prefill_attention(q, k, v, head_dim**-0.5, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _causal_float64(q, k, v), rtol=tol, atol=tol)


@pytest.mark.parametrize("widens", [False, True])
def test_bfloat16_prefill_attention_widened_or_not_matches_float64(
    monkeypatch: pytest.MonkeyPatch, widens: bool
) -> None:
    """Whichever way ``cpu.widens_bfloat16`` decides (dot pairs or tiles in bfloat16, or the
    float32 kernel on the widened operands, rounded back), within bfloat16's tolerance."""
    if not kernels.prefill_attention_for(torch.device("cpu"), torch.bfloat16, 64):
        pytest.skip("the C prefill kernel needs AVX-512 and AVX512-BF16")
    monkeypatch.setattr(cpu, "widens_bfloat16", lambda: widens)
    qkv = _rand(200, 15 * 64, dtype=torch.bfloat16, seed=6) / 3
    q = qkv[130:, : 9 * 64].view(70, 9, 64)
    k, v = (qkv[:, a : a + 3 * 64].view(200, 3, 64) for a in (9 * 64, 12 * 64))
    out = torch.empty(70, 9, 64, dtype=torch.bfloat16)
    kernels.prefill_attention(q, k, v, 64**-0.5, out)
    torch.testing.assert_close(out.double(), _causal_float64(q, k, v), rtol=2e-2, atol=2e-2)


def _causal_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64, query i at position kv_len - q_len + i seeing keys up to it."""
    (q_len, heads, head_dim), (kv_len, kv_heads, _) = q.shape, k.shape
    keys, values = (x.double().repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * head_dim**-0.5
    visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    return torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(~visible, -torch.inf).softmax(-1), values
    )


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_with_scores_rising_key_by_key(dtype: torch.dtype, head_dim: int) -> None:
    """Scores that climb through the prompt (by ~0.1 a key, 60 in all: a row's max moves in
    nearly every block and step): in bfloat16 with AMX the rows' probabilities are taken
    against a reference max that moves only when a score rises 8 (log2) above it, and later
    blocks run in steps of 32 keys where such a rise flushes the value sums out of the tiles."""
    if not kernels.prefill_attention_for(torch.device("cpu"), dtype, head_dim):
        pytest.skip("the C prefill kernel needs AVX-512 (and AVX512-BF16 in bfloat16)")
    n, heads, kv_heads = 600, 4, 2
    q = _rand(n, heads, head_dim, dtype=dtype, seed=9) / 3
    k = _rand(n, kv_heads, head_dim, dtype=dtype, seed=10) / 3
    v = _rand(n, kv_heads, head_dim, dtype=dtype, seed=11) / 3
    q[..., 0] = 1.0
    k[..., 0] = (torch.arange(n) * 0.1 * head_dim**0.5).to(dtype)[:, None]
    out = torch.empty_like(q)
    kernels.prefill_attention(q, k, v, head_dim**-0.5, out)
    tol = 2e-4 if dtype == torch.float32 else 2e-2  # float32: scores of 60 carry its rounding
    torch.testing.assert_close(out.double(), _causal_float64(q, k, v), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 97), (64, 49152), (5, 16), (2, 1)])
def test_argmax_rows_is_torchs_max_without_the_float32_copy(
    dtype: torch.dtype, rows: int, vocab: int
) -> None:
    """The first index of the largest value, ties included (bfloat16 holds many), and the
    value as float32; a row with a NaN gives NaN, one with only -inf gives -inf."""
    if not kernels.argmax_rows_for(torch.device("cpu"), dtype):
        pytest.skip("argmax_rows needs AVX-512")
    logits = _rand(rows, vocab, dtype=dtype).round()  # small integers: ties everywhere
    if rows >= 3:
        logits[1, vocab // 2] = float("nan")
        logits[2].fill_(float("-inf"))
    best, ids = kernels.argmax_rows(logits)
    want_best, want_ids = logits.float().max(dim=-1)
    assert best.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(best.isnan(), want_best.isnan())
    plain = ~want_best.isnan() & want_best.isfinite()
    assert torch.equal(best[plain], want_best[plain]) and torch.equal(ids[plain], want_ids[plain])
    if rows >= 3:
        assert best[2] == float("-inf")


def _inverse_cdf_float64(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The draw's definition in float64: the first index whose running sum of
    ``exp(x - max)`` exceeds ``u`` times the total (weights under e^-87 of the largest: 0)."""
    x = logits.double()
    w = (x - x.amax(1, keepdim=True)).exp()
    w = torch.where(x - x.amax(1, keepdim=True) > -87, w, 0.0)
    cum = w.cumsum(1)
    return torch.searchsorted(cum, (uniforms * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (32, 49152), (7, 300), (3, 17), (2, 1)])
def test_draw_rows_draws_the_float64_inverse_cdf(rows: int, vocab: int) -> None:
    """For each row and many uniforms (0 and the largest below 1 among them) the token is the
    float64 definition's wherever the uniform is not within float32's rounding of a
    boundary; a masked token (-inf: the first and last of each row, and every other one in
    row 0) is never drawn; a row draws the same token alone as in the batch."""
    if not kernels.draw_rows_for(torch.device("cpu"), torch.float32):
        pytest.skip("draw_rows needs AVX-512")
    logits = _rand(rows, vocab, dtype=torch.float32)
    if vocab > 2:
        logits[:, [0, -1]] = float("-inf")
        logits[0, ::2] = float("-inf")
    gen = torch.Generator().manual_seed(1)
    for draw in range(40):
        u = torch.rand(rows, dtype=torch.float64, generator=gen)
        u[0] = (0.0, 1.0 - 2**-53)[draw % 2] if draw < 2 else u[0]
        got = kernels.draw_rows(logits, u)[1]
        want = _inverse_cdf_float64(logits, u)
        assert (logits[torch.arange(rows), got] > float("-inf")).all()
        x = logits.double()
        w = (x - x.amax(1, keepdim=True)).exp().cumsum(1)
        target = (u * w[:, -1]).unsqueeze(1)
        near = ((w - target).abs() <= 1e-5 * w[:, -1:]).any(1)  # a boundary within rounding
        assert torch.equal(got[~near], want[~near])
        alone = [kernels.draw_rows(logits[r : r + 1], u[r : r + 1])[1].item() for r in range(rows)]
        assert got.tolist() == alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_draw_rows_divides_by_the_temperature_and_draws_nothing_from_a_row_not_finite(
    dtype: torch.dtype,
) -> None:
    """Logits in the model's dtype with a temperature each draw what their float32 copy
    divided by it (as the sampler divides) draws, the largest of each row over its
    temperature beside it; a row holding a NaN, or only -inf, gives no token (-1)."""
    if not kernels.draw_rows_for(torch.device("cpu"), dtype):
        pytest.skip("draw_rows needs AVX-512")
    logits = _rand(6, 3000, dtype=dtype)
    logits[4, 17] = float("nan")
    logits[5] = float("-inf")
    temps = [0.7, 1.0, 1.3, 1e-5, 2.0, 1.0]
    u = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    best, ids = kernels.draw_rows(logits, u, temps)
    scaled = logits.float() / torch.tensor(temps).unsqueeze(1)
    want_best, want_ids = kernels.draw_rows(scaled, u)
    assert torch.equal(ids, want_ids) and torch.equal(best[:4], scaled[:4].amax(1))
    assert ids[4] == -1 and best[4].isnan() and ids[5] == -1 and best[5] == float("-inf")
    assert torch.equal(ids[:4], want_ids[:4]) and (ids[:4] >= 0).all()
