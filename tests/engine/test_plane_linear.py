"""``kernels.plane_linear`` (float32 products on AMX tiles, each operand three bfloat16 planes)
against float64 and torch's float32 product, and ``Linear`` taking it for more than a decode
step's rows.

Each float32 splits exactly into three bfloat16 planes; the six plane products kept carry
everything above 2^-24 of each product and the tiles sum them in float32, so the error stays
within float32 summation's bound (``K * 2**-23 * sum|x * w|``) and, on the model's shapes, no
larger than that of oneDNN's float32 product, which it replaces (max and mean), its mean no
larger than ``F.linear``'s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.server.engine import kernels
from tandem.server.engine.models.layers import DECODE_ROWS, Linear

from .test_decode_linear import bound

pytestmark = pytest.mark.skipif(
    not kernels.plane_linear_for(torch.device("cpu"), torch.float32),
    reason="plane_linear needs AMX tiles",
)


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (100, 70), (33, 48), (40, 33)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 65, 130, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_within_float32s_bound(n: int, k: int, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen) if with_bias else None
    y = kernels.plane_linear(x, kernels.plane_pack(w), n, bias)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert ((y.double() - exact).abs() <= bound(x, w, exact) + 1e-30).all()


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (3072, 576)])
def test_as_exact_as_the_float32_products_it_replaces(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(300, k, generator=gen) * 2
    exact = F.linear(x.double(), w.double())

    def error(y: torch.Tensor) -> torch.Tensor:
        return (y.double() - exact).abs()

    mine = error(kernels.plane_linear(x, kernels.plane_pack(w), n, None))
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    onednn = error(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    assert mine.max() <= onednn.max() and mine.mean() <= onednn.mean()
    assert mine.mean() <= error(F.linear(x, w)).mean()


def test_a_strided_input_and_rows_of_every_scale() -> None:
    """Rows taken from a wider tensor: zeros, float32's largest and smallest scales whose third
    plane stays normal, and exact bfloat16 values (one plane)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=gen)
    wide = torch.randn(80, 200, generator=gen)
    wide[0] = 0.0
    wide[1] *= 1e36
    wide[2] *= 1e-30
    wide[3] = wide[3].bfloat16().float()
    x = wide[:, 4:100]
    y = kernels.plane_linear(x, kernels.plane_pack(w), 64, None)
    exact = F.linear(x.double(), w.double())
    assert ((y.double() - exact).abs() <= bound(x, w, exact) + 1e-300).all()
    assert (y[0] == 0).all()


@pytest.mark.parametrize("rows", [1, 16, 17, 65, 300])
@pytest.mark.parametrize("inter, k", [(1536, 576), (64, 48)])
def test_gate_up_with_silu_in_one_pass_matches_the_two_passes(
    rows: int, inter: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    w = torch.randn(2 * inter, k, generator=gen) * 0.1
    x = torch.randn(rows, k, generator=gen)
    packed = kernels.plane_pack(w)
    two_passes = kernels.silu_and_mul(kernels.plane_linear(x, packed, 2 * inter, None))
    one_pass = kernels.plane_linear_silu(x, packed, inter)
    assert ((one_pass - two_passes).abs() <= 2**-19 * two_passes.abs()).all()  # exp_approx


def test_linear_takes_it_for_prefill_rows_and_follows_the_weight() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = Linear(96, 80, bias=True)
    x = torch.randn(DECODE_ROWS + 1, 96, generator=gen)

    def close(y: torch.Tensor) -> bool:
        exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        return bool(((y.double() - exact).abs() <= bound(x, layer.weight, exact) + 1e-30).all())

    assert layer.route(x) == "planes" and layer.route(x[:DECODE_ROWS]) == "decode"
    assert close(layer(x))
    first = layer._planes
    assert first is not None and layer._packed is None
    with torch.no_grad():
        layer.weight.mul_(2)  # written in place: packed again
    assert close(layer(x)) and layer._planes is not first
    layer.to_empty(device=torch.device("meta"))
    assert layer._planes is None
