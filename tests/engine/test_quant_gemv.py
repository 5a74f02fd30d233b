"""The quantized GEMV against the product with gguf's own dequantized weights, in float64.

The kernel rebuilds each weight in float32 exactly as gguf's ``dequantize`` does, so the two
differ only in how the K products are summed: each of 16 lanes sums K/16 products in order,
then 16 lanes are added in a tree, so the float32 error is at most about
``(K/16 + 5) * 2**-24 * sum|x * w|`` (the classic bound for recursive summation). bfloat16
activations are exact in float32; the result's rounding to bfloat16 adds half a step
(at most ``2**-8 * |y|``: bfloat16 keeps 8 significant bits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from tandem.server.engine import kernels

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


@pytest.fixture(autouse=True)
def _need_avx512() -> None:
    if not kernels.quant_gemv_for(torch.device("cpu"), torch.float32):
        pytest.skip("the quantized GEMV needs AVX-512 and a C compiler")


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, k / 32 * block bytes]`` uint8: random quants, scales (and mins) as real files have."""
    rng = np.random.default_rng(seed)
    size = kernels.QUANT_BLOCK_BYTES[qtype.value]
    blocks = rng.integers(0, 256, size=(n * k // kernels.QUANT_BLOCK, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 5e-2, size=(len(blocks), 2)).astype(np.float16)
    scales[:, 1] *= -4  # Q4_1's m: negative, a few steps of d
    heads = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    blocks[:, :heads] = scales.view(np.uint8)[:, :heads]
    return blocks.reshape(n, -1)


def reference(x: torch.Tensor, blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    w = torch.from_numpy(dequantize(blocks, qtype).astype(np.float64))
    return x.double() @ w.T, x.double().abs() @ w.abs().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 576), (257, 576), (131, 1536)])
def test_quant_gemv_is_the_dequantized_product(
    qtype: GGMLQuantizationType, dtype: torch.dtype, n: int, k: int
) -> None:
    blocks = random_blocks(qtype, n, k, seed=n + k)
    for rows in range(1, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = kernels.quant_gemv(x, torch.from_numpy(blocks), qtype.value)
        want, magnitude = reference(x, blocks, qtype)
        assert got.dtype == dtype and got.shape == (rows, n)
        bound = (k / 16 + 5) * 2**-24 * magnitude
        if dtype == torch.bfloat16:
            bound = bound * 2 + 2**-8 * want.abs()
        assert ((got.double() - want).abs() <= bound).all(), (rows, qtype.name)


def test_strided_rows_read_in_place() -> None:
    """x may be a view whose rows are further apart (a slice of a wider activation)."""
    qtype = GGMLQuantizationType.Q4_1
    blocks = random_blocks(qtype, 65, 128, seed=3)
    wide = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    x = wide[:, 10:138]
    got = kernels.quant_gemv(x, torch.from_numpy(blocks), qtype.value)
    want, magnitude = reference(x, blocks, qtype)
    assert ((got.double() - want).abs() <= (128 / 16 + 5) * 2**-24 * magnitude).all()
