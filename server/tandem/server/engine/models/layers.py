"""Building blocks shared by the decoder families."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu, kernels
from ..parallel import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, in HuggingFace's order (on CPU,
    one pass of the C kernel that rounds where this code does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.cpu_kernels_for(x.device, x.dtype):
            return kernels.rms_norm(x, self.weight, self.eps)
        if kernels.cuda_ops.cuda_kernels_for(x.device, x.dtype):
            return kernels.cuda_ops.rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``x + residual`` and that sum, the residual stream's next value: on CPU
        one pass of the C kernel, where the add alone was a pass (and a parallel region) of
        its own, on a GPU one launch; both overwrite ``x`` and ``residual`` (the callers'
        tensors are spent: a layer's output and the stream)."""
        if kernels.cpu_kernels_for(x.device, x.dtype):
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if kernels.cuda_ops.cuda_kernels_for(x.device, x.dtype):
            return kernels.cuda_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# The products Linear.matmul takes (Linear.route names the one for an input).
Route = Literal["quantized", "plain", "decode", "planes", "widened", "onednn"]


class Linear(nn.Linear):
    """``nn.Linear`` that, on CPU, multiplies by a copy of its weight in oneDNN's own layout,
    or, for a few rows, by the GGUF blocks the weight was dequantized from.

    Given a plain weight, oneDNN reorders it into its blocked layout on every call; for the
    few rows of a decode step that reorder costs about as much as the product. The copy is
    made on first use and again whenever the weight is replaced or written in place (its
    data pointer or version changes). It doubles the memory these weights take on CPU.
    Up to ``DECODE_ROWS`` rows (a decode step's) are multiplied by another copy packed for
    them (``kernels.decode_linear``: in bfloat16 on a CPU with AMX, tiles, 1.1-1.8x oneDNN's
    product there and nearly always the same bits; in float32 with AVX-512, panels, at par
    with it), kept the same way, which the decode chain calls from C. More rows in float32 on
    a CPU with AMX are multiplied by a third copy, the weight's three bfloat16 planes
    (``kernels.plane_linear``: as exact as float32's FMAs, 1.6-1.9x oneDNN's float32 product
    on two cores), which then takes the place of oneDNN's.

    A layer loaded from a GGUF file on CPU may also keep the file's Q8_0 / Q4_0 / Q4_1
    blocks (``use_quantized``): up to ``QUANT_ROWS`` rows are multiplied by them (a quarter
    to an eighth of the float32 weight's bytes read per step); more rows, and any weight
    written since, take the dequantized weight, which stays the reference. ``kernel`` names
    the block kernel (``kernels.quant_gemv``, exact, or ``kernels.quant_gemv_q8``, x in int8),
    the same name in the C library: whatever multiplies this layer's blocks reads it here.
    """

    _packed: tuple[tuple[int, int], torch.Tensor] | None = None
    _decode: tuple[tuple[int, int], torch.Tensor] | None = None  # kernels.decode_pack's copy
    _planes: tuple[tuple[int, int], torch.Tensor] | None = None  # kernels.plane_pack's copy
    _quantized_for: tuple[int, int] | None = None  # the weight's (pointer, version) it matches
    qtype: int = 0  # the blocks' ggml type id
    kernel: str = "quant_gemv"  # the function of kernels (and of the C library) they take

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # a buffer, so that dropping the weights (to_empty on meta) drops the blocks too
        self.register_buffer("quantized", None, persistent=False)

    def use_quantized(self, blocks: torch.Tensor, qtype: int, kernel: str = "quant_gemv") -> None:
        """Multiply few rows by ``blocks`` (uint8 ``[out, in / 32 * block bytes]`` of ggml
        type ``qtype``), the blocks the current weight was dequantized from, with ``kernel``
        (``quant_gemv`` or ``quant_gemv_q8``: ``kernels.quant_kernel``)."""
        row_bytes = self.in_features // kernels.QUANT_BLOCK * kernels.QUANT_BLOCK_BYTES[qtype]
        if blocks.shape != (self.out_features, row_bytes) or blocks.dtype != torch.uint8:
            raise ValueError(
                f"blocks {tuple(blocks.shape)} do not fit a {self.weight.shape} weight"
            )
        if kernel not in ("quant_gemv", "quant_gemv_q8"):
            raise ValueError(f"no block kernel {kernel!r}")
        self.quantized, self.qtype, self.kernel = blocks, qtype, kernel
        self._quantized_for = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        """Moving or re-allocating the weight (``to``, ``to_empty``: a level-2 sleep) drops
        the packed copies, which would otherwise hold the old weight's memory."""
        self._packed = self._decode = self._planes = None
        return super()._apply(fn, recurse)

    def decode_weight(self) -> torch.Tensor:
        """The weight in ``kernels.decode_linear``'s layout for its dtype, packed again
        whenever the weight has changed."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._decode is None or self._decode[0] != key:
            self._decode = (key, kernels.decode_pack(w.detach()))
        return self._decode[1]

    def plane_weight(self) -> torch.Tensor:
        """The weight's planes in ``kernels.plane_linear``'s layout, packed again whenever the
        weight has changed."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._planes is None or self._planes[0] != key:
            self._planes = (key, kernels.plane_pack(w.detach()))
        return self._planes[1]

    def route(self, x: torch.Tensor) -> Route:
        """The product ``matmul`` takes for ``x``: ``quantized`` (the GGUF blocks), ``plain``
        (``F.linear``), ``decode`` (``kernels.decode_linear``), ``planes``
        (``kernels.plane_linear``), ``widened`` (``_widened``) or ``onednn`` (the packed
        weight). Decided in one place so that a layer running its own products
        (``PackedLinear.silu_gated``) takes them exactly where ``matmul`` would."""
        w = self.weight
        if (
            self.quantized is not None
            and x.dim() == 2
            and x.shape[0] <= QUANT_ROWS
            and self._quantized_for == (w.data_ptr(), w._version)
        ):
            return "quantized"
        if x.device.type != "cpu" or x.dtype != w.dtype or w.dtype not in _PACKED_DTYPES:
            return "plain"
        few = x.dim() == 2 and x.shape[0] <= DECODE_ROWS
        if few and kernels.decode_linear_for(x.device, w.dtype):
            return "decode"
        if x.dim() == 2 and not few and kernels.plane_linear_for(x.device, w.dtype):
            return "planes"
        if not few and w.dtype == torch.bfloat16 and cpu.widens_bfloat16():
            return "widened"
        return "onednn"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.weight
        route = self.route(x)
        if route == "quantized":
            y = getattr(kernels, self.kernel)(x, self.quantized, self.qtype)
            return y if bias is None else y + bias
        if route == "plain":
            return F.linear(x, w, bias)
        if route == "decode":
            return kernels.decode_linear(x, self.decode_weight(), w.shape[0], bias)
        if route == "planes":
            return kernels.plane_linear(x, self.plane_weight(), w.shape[0], bias)
        if route == "widened":
            return _widened(x, w, bias)
        key = (w.data_ptr(), w._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
        return torch.ops.mkldnn._linear_pointwise(x, self._packed[1], bias, "none", [], "")


def _widened(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bfloat16 product as float32 products of the widened operands, rounded once, as a
    bfloat16 product's float32 sums are (``cpu.widens_bfloat16``: where that is faster). The
    weight is widened per call, not kept, so no float32 copy of every weight stays in memory:
    widening included, the default model's layers took 0.74x oneDNN's bfloat16 time at 128
    rows, 0.57-0.73x at 256-2,048 (two Emerald Rapids cores without AMX)."""
    wide = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), wide).to(torch.bfloat16)


# The most rows multiplied by decode_linear (and a decode chain of it takes): at 96 rows the
# tiles, at 64 the panels were at par with oneDNN's product (the default model's layers, two
# Emerald Rapids cores).
DECODE_ROWS = 64

# The most rows multiplied by GGUF blocks: the kernel's limit, and about the crossover (at 8
# rows the blocks were 1.1x faster on the default model: bench/quant_decode.py --rows 8).
QUANT_ROWS = kernels.QUANT_MAX_ROWS


# The dtypes whose products take the packed weight, at every row count. On Sapphire Rapids
# MKL's sgemm was only as fast at one row and on prefill-sized batches; on Zen 4 (python
# bench/linear_dispatch.py) the packed product is faster there too in float32 (1.2x on a
# 4,096-row prefill, 2x on the lm_head's 49k outputs) and never slower in bf16.
def _packed_dtypes() -> frozenset[torch.dtype]:
    """oneDNN packs float16 weights only on CPUs with native fp16 conversion (avx512_fp16 or
    avx_ne_convert; elsewhere it raises): other CPUs keep F.linear for float16."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.bfloat16, torch.float32}
    if cpu.flags() & {"avx512_fp16", "avx_ne_convert"}:
        dtypes.add(torch.float16)
    return frozenset(dtypes)


_PACKED_DTYPES = _packed_dtypes()


class PackedLinear(Linear):
    """A linear layer whose output rows pack several checkpoint tensors (q|k|v, gate|up).

    One matmul instead of several; the loader fills each shard by name. Under tensor
    parallelism it is column-parallel: ``shard_sizes`` are this rank's rows, and the loader
    takes rank ``tp.rank``'s slice of each checkpoint tensor (split along its output rows).
    """

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    _halves: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        self._halves = None
        return super()._apply(fn, recurse)

    def gates_fused(self, x: torch.Tensor) -> bool:
        """Whether ``silu_gated`` takes ``x``: a gate|up layer's prefill rows (more than a
        decode step's) that ``matmul`` would hand oneDNN or the planes anyway, no adapter
        hooked on it (the planes' pass: no bias, gate and up each whole 32-column blocks)."""
        if self._forward_hooks or x.dim() != 2 or x.shape[0] <= DECODE_ROWS:
            return False
        route = self.route(x)
        planes = route == "planes" and self.bias is None and self.out_features % 64 == 0
        return route == "onednn" or planes

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a gate|up layer in one pass: the ``[gate | up]`` output,
        twice the width, written and read again by a pass of its own, never exists. With the
        planes (float32 on AMX) ``kernels.plane_linear_silu``, silu_and_mul's bits; else two
        oneDNN products, SiLU applied to the gate's output and the product with it to the
        up's while each tile is in cache (the default model's MLP at 4,096 rows: 0.81x the
        time in bfloat16, 0.83x in float32, two cores). There SiLU is taken of the gate's
        float32 sums and ``up`` is not rounded before the product: in bfloat16 one rounding
        step from HuggingFace's order in places, in float32 within its rounding."""
        if self.route(x) == "planes":
            return kernels.plane_linear_silu(x, self.plane_weight(), self.out_features // 2)
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._halves is None or self._halves[0] != key:
            gate, up = w.detach().chunk(2)
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self._halves = (key, reorder(gate, None), reorder(up, None))
        gate_bias, up_bias = (None, None) if self.bias is None else self.bias.chunk(2)
        product = torch.ops.mkldnn._linear_pointwise
        gate = product(x, self._halves[1], gate_bias, "swish", [], "")
        return product.binary(x, gate, self._halves[2], up_bias, "mul")


class RowParallelLinear(Linear):
    """A linear layer whose input columns are split across the TP ranks (o_proj, down_proj).

    Each rank multiplies its slice of the input by its slice of the weight's columns; the
    partial sums are all-reduced, and the (full, replicated) bias is added once afterwards.
    With one rank it is a plain ``nn.Linear``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(
            tp.divide(in_features, "the row-parallel input size"), out_features, bias=bias
        )
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class GatedMLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        local = tp.divide(intermediate, "intermediate_size")
        self.intermediate = local
        self.gate_up_proj = PackedLinear(hidden, {"gate_proj": local, "up_proj": local}, bias, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.gates_fused(x):
            return self.down_proj(self.gate_up_proj.silu_gated(x))
        gate_up = self.gate_up_proj(x)
        if kernels.cpu_kernels_for(gate_up.device, gate_up.dtype):
            return self.down_proj(kernels.silu_and_mul(gate_up))
        if kernels.cuda_ops.cuda_kernels_for(gate_up.device, gate_up.dtype):
            return self.down_proj(kernels.cuda_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
