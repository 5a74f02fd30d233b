"""Typed calls into the C kernels: CPU tensors in float32 or bfloat16 in, tensors out.

Callers check ``cpu_kernels_for`` first and keep their PyTorch code for everything else.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import cpu
from . import library

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cpu_kernels_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the layer kernels can take tensors on ``device`` in ``dtype`` (built, or buildable)."""
    return device.type == "cpu" and dtype in DTYPES and library.load() is not None


def paged_decode_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``paged_decode`` can serve a KV cache like this (it needs AVX-512)."""
    return (
        cpu_kernels_for(device, dtype)
        and hasattr(library.load(), "paged_decode")
        and head_dim % 16 == 0
        and head_dim <= 256
    )


def paged_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """One query token per sequence over its pages, read in place, written into ``out``.

    q, out: ``[B, H, D]``, rows of the step's q and output, each sequence's heads contiguous
    in ``out`` (q is copied only where its are not); pages: one layer's
    ``[2, blocks, block_size, H_kv, D]`` (contiguous, q's dtype); tables: ``[B, width]`` int32
    page ids; lens: ``[B]`` int32 tokens each attends to (at most ``max_len``); lse: None, or
    float32 ``[B, H, 2]`` for each row's softmax max and sum (``merge_attention`` reads them).
    """
    batch, heads, dim = q.shape
    _, _, block_size, kv_heads, _ = pages.shape
    if not _heads_in_rows(q):
        q = q.contiguous()
    library.load().paged_decode(
        q.data_ptr(),
        q.stride(0),
        pages[0].data_ptr(),
        pages[1].data_ptr(),
        out.data_ptr(),
        out.stride(0),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        max_len,
        scale,
        DTYPES[q.dtype],
        torch.get_num_threads(),
        None if lse is None else lse.data_ptr(),
    )


def shared_attention_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``shared_attention`` pays here: bfloat16 on AMX tiles, float32 on AVX-512
    (``shared_decode``; bfloat16 without tiles takes that too, measured within the noise, so
    not here)."""
    if dtype == torch.float32:
        return paged_decode_for(device, dtype, head_dim)
    return (
        dtype == torch.bfloat16
        and prefill_attention_for(device, dtype, head_dim)
        and library.load().shared_attention_tiles() == 1
    )


def shared_attention(
    q: torch.Tensor, pages: torch.Tensor, shared: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's query heads against the pages ``shared`` (int32 ids) that all of them
    begin with, at once: float32 ``[B, H, D]`` normalised outputs and ``[B, H, 2]`` softmax max
    and sum, for ``merge_attention``. q and pages as ``paged_decode`` takes them."""
    batch, heads, dim = q.shape
    _, _, block_size, kv_heads, _ = pages.shape
    if not _heads_in_rows(q):
        q = q.contiguous()
    out = torch.empty(batch, heads, dim)
    lse = torch.empty(batch, heads, 2)
    library.load().shared_attention(
        q.data_ptr(),
        q.stride(0),
        pages[0].data_ptr(),
        pages[1].data_ptr(),
        shared.data_ptr(),
        shared.numel(),
        block_size,
        batch,
        heads,
        kv_heads,
        dim,
        scale,
        DTYPES[q.dtype],
        torch.get_num_threads(),
        out.data_ptr(),
        lse.data_ptr(),
    )
    return out, lse


def merge_attention(
    out: torch.Tensor, lse: torch.Tensor, shared: torch.Tensor, shared_lse: torch.Tensor
) -> None:
    """``out`` (``paged_decode``'s, over each sequence's own pages, with its ``lse``) and
    ``shared`` (``shared_attention``'s) made one attention over both spans, in place."""
    batch, heads, dim = out.shape
    library.load().merge_attention(
        out.data_ptr(),
        out.stride(0),
        lse.data_ptr(),
        shared.data_ptr(),
        shared_lse.data_ptr(),
        batch,
        heads,
        dim,
        DTYPES[out.dtype],
    )


def prefill_attention_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``prefill_attention`` can serve these tensors (AVX-512; bfloat16 with
    AVX512-BF16; head sizes that are a multiple of 32, up to 256)."""
    if not (cpu_kernels_for(device, dtype) and hasattr(library.load(), "prefill_attention")):
        return False
    pairs = ctypes.c_int.in_dll(library.load(), "prefill_attention_bf16").value
    return head_dim % 32 == 0 and head_dim <= 256 and (dtype == torch.float32 or pairs == 1)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """One sequence's causal attention, written into ``out``.

    q, out: ``[q_len, H, D]``; k, v: ``[kv_len, H_kv, D]`` (rows of the step's q|k|v, or
    gathered pages), read where they lie when each row holds its heads contiguous (and k and
    v lie alike), copied otherwise. Query i sits at position ``kv_len - q_len + i`` and
    attends to the keys up to it. bfloat16 runs as float32 where that is faster
    (``cpu.widens_bfloat16``).
    """
    if q.dtype == torch.bfloat16 and cpu.widens_bfloat16():
        wide = torch.empty(out.shape)
        prefill_attention(q.float(), k.float(), v.float(), scale, wide)
        out.copy_(wide)
        return
    q_len, heads, dim = q.shape
    kv_len, kv_heads, _ = k.shape
    if not _heads_in_rows(q):
        q = q.contiguous()
    if k.stride() != v.stride() or not _heads_in_rows(k):
        k, v = k.contiguous(), v.contiguous()
    if not _heads_in_rows(out):
        raise ValueError("out's rows must hold their heads contiguous")
    library.load().prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        out.data_ptr(),
        out.stride(0),
        q_len,
        kv_len,
        heads,
        kv_heads,
        dim,
        scale,
        DTYPES[q.dtype],
        torch.get_num_threads(),
    )


def _heads_in_rows(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in HuggingFace's order (see ``models/layers.RMSNorm``)."""
    rows = x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous().view(-1, x.shape[-1])
    out = torch.empty(x.shape, dtype=x.dtype)
    library.load().rms_norm(
        rows.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        rows.stride(0),
        eps,
        DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` (rounded as torch's add rounds) and its RMSNorm, in one pass: the
    normalised rows and the sum (the residual stream's next value), written over ``x`` and
    ``residual`` (the callers' tensors are spent, as on a GPU): fresh outputs of 4,096 rows
    cost their page faults on every call (float32, two threads: 0.67 against 0.43 ms)."""
    x, residual = x.contiguous(), residual.contiguous()
    library.load().add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        residual.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        eps,
        DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a contiguous ``[N, 2 * I]`` holding ``[gate | up]`` per row."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    library.load().silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        width // 2,
        DTYPES[gate_up.dtype],
        torch.get_num_threads(),
    )
    return out


def argmax_rows_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``argmax_rows`` can read logits like these (it needs AVX-512)."""
    return cpu_kernels_for(device, dtype) and hasattr(library.load(), "argmax_rows")


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.float().max(dim=-1)`` of ``[N, vocab]`` logits (rows contiguous) without the
    copy: each row's largest value as float32 (NaN where the row holds one) and the first
    index of it (int64)."""
    rows, vocab = logits.shape
    best = torch.empty(rows, dtype=torch.float32)
    ids = torch.empty(rows, dtype=torch.int64)
    library.load().argmax_rows(
        logits.data_ptr(),
        logits.stride(0),
        rows,
        vocab,
        DTYPES[logits.dtype],
        torch.get_num_threads(),
        best.data_ptr(),
        ids.data_ptr(),
    )
    return best, ids


def draw_rows_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``draw_rows`` can draw from logits like these (it needs AVX-512)."""
    return cpu_kernels_for(device, dtype) and hasattr(library.load(), "draw_rows")


def draw_rows(
    logits: torch.Tensor, uniforms: torch.Tensor, temperatures: list[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token from each row's softmax of ``[N, vocab]`` logits (rows contiguous) divided by
    its temperature (float32, as torch divides; none: 1): the first index whose running sum
    of ``exp(x - max)`` exceeds its float64 uniform (``[N]``, in [0, 1)) times their total,
    weights under e^-87 of the largest being 0. Returns each row's largest logit over its
    temperature (float32, NaN where the row holds one) and the token (int64; -1 where that
    largest is not finite, as nothing can be drawn). One pass makes the weights and their
    partial sums, read in the model's dtype: torch's float32 copy, softmax, float64 cumsum,
    normalisation and search took 13 ms for 32 rows of 49,152 on two cores."""
    rows, vocab = logits.shape
    best = torch.empty(rows, dtype=torch.float32)
    ids = torch.empty(rows, dtype=torch.int64)
    uniforms = uniforms.to(torch.float64).contiguous()
    temps = None if temperatures is None else torch.tensor(temperatures, dtype=torch.float32)
    library.load().draw_rows(
        logits.data_ptr(),
        logits.stride(0),
        rows,
        vocab,
        DTYPES[logits.dtype],
        None if temps is None else temps.data_ptr(),
        uniforms.data_ptr(),
        torch.get_num_threads(),
        best.data_ptr(),
        ids.data_ptr(),
    )
    return best, ids


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, D]``, heads contiguous within a token) in place by the step's
    tables (``[T, 1, rotary_dim]``, contiguous, x's dtype); returns ``x``."""
    tokens, heads, dim = x.shape
    library.load().rope(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        dim,
        cos.shape[-1],
        x.stride(0),
        DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return x


# ggml's type ids of the block formats quant_gemv multiplies by, and each block's bytes.
QUANT_BLOCK_BYTES = {8: 34, 2: 18, 3: 20}  # Q8_0, Q4_0, Q4_1
QUANT_BLOCK = 32  # weights per block
QUANT_MAX_ROWS = 8  # quant_gemv.c's MAX_ROWS


def quant_gemv_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``quant_gemv`` can multiply activations on ``device`` in ``dtype`` (AVX-512)."""
    return cpu_kernels_for(device, dtype) and hasattr(library.load(), "quant_gemv")


def quant_gemv_q8_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``quant_gemv_q8`` can (AVX512-VNNI: Ice Lake, Zen 4 and later)."""
    return cpu_kernels_for(device, dtype) and hasattr(library.load(), "quant_gemv_q8")


def quant_kernel(mode: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The block kernel a ``quantized_weights`` mode gets here, by its name (the same in
    ``kernels`` and in the C library): ``int8`` the int8 one where the CPU has VNNI, else the
    exact one; ``auto`` and ``exact`` the exact one (int8 activations change the default
    model's greedy tokens: tests/engine/test_quant_gemv.py); None for ``off`` or where
    neither runs."""
    if mode == "int8" and quant_gemv_q8_for(device, dtype):
        return "quant_gemv_q8"
    if mode in ("auto", "exact", "int8") and quant_gemv_for(device, dtype):
        return "quant_gemv"
    return None


def quant_gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W^T`` for W kept as GGUF blocks: x ``[M, K]`` (M <= 8, rows contiguous, float32
    or bfloat16), blocks ``[N, K / 32 * block bytes]`` uint8 of ggml type ``qtype``
    (``QUANT_BLOCK_BYTES``'s keys); returns ``[M, N]`` in x's dtype. Each weight is rebuilt
    in float32 as gguf dequantizes it: the dequantized product up to the order of the sums."""
    return _quant_product("quant_gemv", x, blocks, qtype)


def quant_gemv_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``quant_gemv``'s product as llama.cpp computes it: x quantized to 8 bits per block of
    32 (one scale each), integer dot products (VNNI), so off by x's rounding (``quant_vnni.c``)."""
    return _quant_product("quant_gemv_q8", x, blocks, qtype)


def _quant_product(name: str, x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    rows, k = x.shape
    if not 0 <= rows <= QUANT_MAX_ROWS or k % QUANT_BLOCK:
        raise ValueError(f"{name} takes 0..{QUANT_MAX_ROWS} rows of 32k values, got {x.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, blocks.shape[0], dtype=x.dtype)
    if not rows:  # a step whose last layer finishes no row (``KeptRows``)
        return out
    getattr(library.load(), name)(
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        blocks.stride(0),
        out.data_ptr(),
        out.stride(0),
        rows,
        blocks.shape[0],
        k,
        qtype,
        DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return out


# A decode step's rows times a weight packed for them: per dtype, the kernels in the order
# preferred (the library's product, the function that packs a weight for it, and the one of
# gate|up with SiLU * up in one pass, if any); the first the library holds and may run.
DECODE_KERNELS = {
    torch.bfloat16: (
        ("tile_linear", "tile_pack", "tile_linear_silu"),
        ("panel_linear_pairs", "panel_pack_pairs", None),
        ("panel_linear_bf16", "panel_pack_bf16", None),
    ),
    torch.float32: (("panel_linear", "panel_pack", None),),
}


def decode_linear_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``decode_linear`` runs here: bfloat16 in AMX tiles (``tile_linear.c``: Sapphire
    Rapids and later, the tiles granted to the process), else, like float32, in AVX-512 panels
    (``panel_linear.c``: bfloat16 as dot pairs where they outrun FMAs, else widened)."""
    return device.type == "cpu" and decode_kernel(dtype) is not None


@functools.cache
def decode_kernel(dtype: torch.dtype) -> tuple[str, str, str | None] | None:
    """``DECODE_KERNELS``' choice for ``dtype`` here, asked once (every linear layer of a
    decode step asks)."""
    lib = library.load()
    for names in DECODE_KERNELS.get(dtype, ()):
        if lib is not None and hasattr(lib, names[0]) and _may_run(lib, names[0]):
            return names
    return None


def _may_run(lib: ctypes.CDLL, product: str) -> bool:
    """Tiles only where the process was granted them; dot pairs only where they outrun
    float32 FMAs (``cpu.dot_pairs_outrun_fmas``)."""
    if product == "tile_linear":
        return lib.tile_linear_tiles() == 1
    if product == "panel_linear_pairs":
        return cpu.dot_pairs_outrun_fmas()
    return True


def packed_elements(pack: str, n: int, k: int) -> int:
    """Elements of an ``[n, k]`` weight packed by the library's ``pack``: N and K rounded up to
    32 for AMX tiles, N up to 64 for panels (and K up to 2 for dot pairs)."""
    if pack == "tile_pack":
        return -(-n // 32) * 32 * -(-k // 32) * 32
    return -(-n // 64) * 64 * (k + k % 2 if pack == "panel_pack_pairs" else k)


def decode_pack(w: torch.Tensor) -> torch.Tensor:
    """A weight ``[N, K]`` (``nn.Linear``'s) in its dtype's ``decode_linear`` layout: a flat
    copy, ``packed_elements`` long."""
    n, k = w.shape
    w = w.contiguous()
    _, pack, _ = decode_kernel(w.dtype)
    out = torch.empty(packed_elements(pack, n, k), dtype=w.dtype)
    getattr(library.load(), pack)(w.data_ptr(), n, k, out.data_ptr())
    return out


def decode_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W^T + bias`` for x ``[M, K]`` and W ``[n, K]`` packed by ``decode_pack``, in x's
    dtype: bfloat16's float32 sums rounded once, as oneDNN's product rounds them; float32's
    each the sum over the inputs in order, whatever rows share the call."""
    return _packed_product(decode_kernel(x.dtype)[0], x, packed, n, bias)


def _packed_product(
    product: str, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """The library's ``product`` (``decode_linear``'s or ``plane_linear``: one signature) of
    x ``[M, K]`` and a weight ``[n, K]`` packed for it, plus bias, in x's dtype."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    getattr(library.load(), product)(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        packed.data_ptr(),
        n,
        None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def plane_linear_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32 products of more than a decode step's rows run as ``plane_linear``:
    AMX tiles (Sapphire Rapids and later) built and granted to the process."""
    return device.type == "cpu" and dtype == torch.float32 and _planes_here()


@functools.cache
def _planes_here() -> bool:
    lib = library.load()
    return lib is not None and hasattr(lib, "plane_linear") and lib.plane_linear_tiles() == 1


def plane_pack(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight ``[N, K]`` as ``plane_linear``'s three bfloat16 planes in AMX's tile
    layout (``plane_linear.c``): a flat copy, N and K rounded up to 32, 1.5x the weight's bytes."""
    n, k = w.shape
    w = w.contiguous()
    out = torch.empty(3 * -(-n // 32) * 32 * -(-k // 32) * 32, dtype=torch.bfloat16)
    library.load().plane_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def plane_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W^T + bias`` in float32 for x ``[M, K]`` and W ``[n, K]`` packed by ``plane_pack``:
    six bfloat16 tile products a step, as exact as float32's FMAs (``plane_linear.c``)."""
    return _packed_product("plane_linear", x, packed, n, bias)


def plane_linear_silu(x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of a gate|up layer (``[2 * inter, K]`` packed by ``plane_pack``,
    inter a multiple of 32) in one pass: ``plane_linear`` then ``silu_and_mul``'s bits."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, inter, dtype=torch.float32)
    library.load().plane_linear_silu(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        packed.data_ptr(),
        inter,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out
