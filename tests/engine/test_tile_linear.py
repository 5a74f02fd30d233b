"""``kernels.tile_linear`` (bfloat16 products of a few rows in AMX tiles) against float64 and
against torch's own bfloat16 product, and ``Linear`` taking it for a decode step's rows.

The tiles sum float32 products of bfloat16 inputs (exact in float32) 32 inputs at a time and
round the sum once, so the result is within float32 summation error of the float64 product
plus half a bfloat16 step (``2**-8 * |y|``); torch's oneDNN product sums and rounds the same
way, so nearly every output is the same bits (the rest one bfloat16 step apart).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.server.engine import kernels
from tandem.server.engine.models.layers import TILE_ROWS, Linear


@pytest.fixture(autouse=True)
def _need_amx() -> None:
    if not kernels.tile_linear_for(torch.device("cpu"), torch.bfloat16):
        pytest.skip("tile_linear needs a CPU with AMX (Sapphire Rapids or later)")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (100, 70), (33, 48), (17, 32)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_and_torch(n: int, k: int, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    y = kernels.tile_linear(x, kernels.tile_pack(w), n, bias)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    exact = reference(x, w, bias)
    bound = 2**-8 * exact.abs() + k * 2**-23 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - exact).abs() <= bound).all()
    same = (y == F.linear(x, w, bias)).double().mean().item()
    assert same > 0.99


def test_rows_apart_and_a_column_slice() -> None:
    """x's rows may lie further apart than its width (a slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 1200, generator=gen).bfloat16()
    w = torch.randn(64, 576, generator=gen).bfloat16()
    packed = kernels.tile_pack(w)
    assert torch.equal(
        kernels.tile_linear(wide[:, :576], packed, 64, None),
        kernels.tile_linear(wide[:, :576].contiguous(), packed, 64, None),
    )


def test_linear_takes_tiles_for_a_decode_step_and_follows_the_weight() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = Linear(96, 80, bias=True).to(torch.bfloat16)
    x = torch.randn(TILE_ROWS, 96, generator=gen).bfloat16()
    y = layer(x)
    assert layer._tiled is not None and layer._packed is None
    assert (y == F.linear(x, layer.weight, layer.bias)).double().mean().item() > 0.99
    with torch.no_grad():
        layer.weight.mul_(2)  # written in place: the tiles are packed again
    y2 = layer(x)
    assert (y2 == F.linear(x, layer.weight, layer.bias)).double().mean().item() > 0.99
    layer(torch.randn(TILE_ROWS + 1, 96, generator=gen).bfloat16())  # a prefill: oneDNN's
    assert layer._packed is not None
