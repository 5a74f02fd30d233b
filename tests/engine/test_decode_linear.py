"""``kernels.decode_linear`` (a decode step's rows times a weight packed for them: AMX tiles in
bfloat16, AVX-512 panels in float32 and in bfloat16 without tiles, as dot pairs or widened)
against float64 and torch's own product, and ``Linear`` taking it for up to ``DECODE_ROWS``
rows (and, for more, bfloat16 widened to float32 where ``cpu.widens_bfloat16``).

bfloat16: the tiles (and the panels) sum float32 products of bfloat16 inputs (exact in
float32) and round the sum once, so the result is within float32 summation error of the
float64 product plus half a bfloat16 step (``2**-8 * |y|``); oneDNN's product sums and rounds
the same way, so nearly every output is the same bits. float32: each output is the inputs' products
summed in order, one FMA each (error at most about ``K * 2**-24 * sum|x * w|``), the same bits
whatever other rows share the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.server.engine import cpu, kernels
from tandem.server.engine.kernels import library
from tandem.server.engine.models.layers import DECODE_ROWS, Linear

from .utils import prefill_route

DTYPES = [torch.bfloat16, torch.float32]


def need(dtype: torch.dtype) -> None:
    if not kernels.decode_linear_for(torch.device("cpu"), dtype):
        pytest.skip(f"decode_linear in {dtype} needs AVX-512")


def onednn(dtype: torch.dtype) -> bool:
    """Whether ``Linear`` multiplies more than ``DECODE_ROWS`` rows by oneDNN's packed weight
    here (else float32 planes on AMX, or bfloat16 widened to float32)."""
    return prefill_route(dtype) == "onednn"


def bound(x: torch.Tensor, w: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    sums = k * 2**-23 * (x.double().abs() @ w.double().abs().T)
    return sums + (2**-8 * exact.abs() if x.dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (100, 70), (33, 48), (17, 32), (40, 33)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_and_torch(dtype, n: int, k: int, rows: int, with_bias: bool) -> None:
    need(dtype)
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    y = kernels.decode_linear(x, kernels.decode_pack(w), n, bias)
    assert y.shape == (rows, n) and y.dtype == dtype
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert ((y.double() - exact).abs() <= bound(x, w, exact) + 1e-30).all()
    if dtype == torch.bfloat16:
        assert (y == F.linear(x, w, bias)).double().mean().item() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(dtype) -> None:
    """Speculation's verification rows and plain decodes must agree on a shared row."""
    need(dtype)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=gen).to(dtype)
    x = torch.randn(DECODE_ROWS, 96, generator=gen).to(dtype)
    packed = kernels.decode_pack(w)
    every = kernels.decode_linear(x, packed, 200, None)
    for r in (0, 5, 17, DECODE_ROWS - 1):
        assert torch.equal(kernels.decode_linear(x[r : r + 1], packed, 200, None)[0], every[r])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_apart_and_a_column_slice(dtype) -> None:
    """x's rows may lie further apart than its width (a slice of a wider tensor)."""
    need(dtype)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 1200, generator=gen).to(dtype)
    w = torch.randn(64, 576, generator=gen).to(dtype)
    packed = kernels.decode_pack(w)
    assert torch.equal(
        kernels.decode_linear(wide[:, :576], packed, 64, None),
        kernels.decode_linear(wide[:, :576].contiguous(), packed, 64, None),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_it_for_a_decode_step_and_follows_the_weight(dtype) -> None:
    need(dtype)
    gen = torch.Generator().manual_seed(2)
    layer = Linear(96, 80, bias=True).to(dtype)
    x = torch.randn(DECODE_ROWS, 96, generator=gen).to(dtype)

    def close(y: torch.Tensor) -> bool:
        exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        return bool(((y.double() - exact).abs() <= bound(x, layer.weight, exact) + 1e-30).all())

    assert close(layer(x))
    assert layer._decode is not None and layer._packed is None
    with torch.no_grad():
        layer.weight.mul_(2)  # written in place: packed again
    assert close(layer(x))
    prefill = torch.randn(DECODE_ROWS + 1, 96, generator=gen).to(dtype)
    exact = F.linear(prefill.double(), layer.weight.double(), layer.bias.double())
    assert ((layer(prefill).double() - exact).abs() <= bound(prefill, layer.weight, exact)).all()
    assert (layer._packed is not None) == onednn(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moving_the_weight_drops_the_copies(dtype) -> None:
    """A level-2 sleep moves the weights to meta: the copies must not keep their memory."""
    need(dtype)
    layer = Linear(96, 80, bias=False).to(dtype)
    layer(torch.randn(4, 96).to(dtype))
    layer(torch.randn(DECODE_ROWS + 1, 96).to(dtype))
    assert layer._decode is not None and (layer._packed is not None) == onednn(dtype)
    layer.to_empty(device=torch.device("meta"))
    assert layer._decode is None and layer._packed is None


@pytest.mark.parametrize("rows", [1, 16, 17, 33, DECODE_ROWS])
@pytest.mark.parametrize("inter, k", [(1536, 576), (64, 48)])
def test_gate_up_with_silu_in_one_pass_is_the_two_passes_bits(
    rows: int, inter: int, k: int
) -> None:
    """``tile_linear_silu`` (the decode chain's gate|up and SiLU * up on AMX tiles) writes
    exactly what ``silu_and_mul`` makes of ``decode_linear``'s [gate | up]."""
    if kernels.decode_kernel(torch.bfloat16)[2] != "tile_linear_silu":
        pytest.skip("tile_linear_silu needs AMX tiles")
    gen = torch.Generator().manual_seed(rows + inter)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = kernels.decode_pack(w)
    want = kernels.silu_and_mul(kernels.decode_linear(x, packed, 2 * inter, None))
    got = torch.empty(rows, inter, dtype=torch.bfloat16)
    library.load().tile_linear_silu(
        x.data_ptr(), k, rows, k, packed.data_ptr(), inter, got.data_ptr(), inter, 2
    )
    assert torch.equal(got, want)


# The bfloat16 panels (product, packing): widened, and dot pairs.
PANELS = [("panel_linear_bf16", "panel_pack_bf16"), ("panel_linear_pairs", "panel_pack_pairs")]


@pytest.mark.parametrize("product, pack", PANELS, ids=[p[0] for p in PANELS])
@pytest.mark.parametrize("n, k", [(960, 576), (100, 70), (17, 32), (40, 33)])
@pytest.mark.parametrize("rows", [1, 6, 7, 33])
def test_bfloat16_panels_match_float64_where_tiles_would_run_too(
    product: str, pack: str, n: int, k: int, rows: int
) -> None:
    """The bfloat16 panels (what bfloat16 decodes take without AMX: dot pairs where they are
    fast, else widened), called whatever ``decode_kernel`` chose: every machine with AVX-512
    (and AVX512-BF16, for the pairs) checks them."""
    lib = library.load()
    if lib is None or not hasattr(lib, product):
        pytest.skip(f"{product} needs AVX-512" + (" and AVX512-BF16" if "pairs" in product else ""))
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = torch.empty(kernels.ops.packed_elements(pack, n, k), dtype=torch.bfloat16)
    getattr(lib, pack)(w.data_ptr(), n, k, packed.data_ptr())
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    getattr(lib, product)(
        x.data_ptr(), k, rows, k, packed.data_ptr(), n, bias.data_ptr(), y.data_ptr(), n, 2
    )
    exact = F.linear(x.double(), w.double(), bias.double())
    assert ((y.double() - exact).abs() <= bound(x, w, exact) + 1e-30).all()
    assert (y == F.linear(x, w, bias)).double().mean().item() > 0.99


@pytest.mark.parametrize("widens", [False, True])
def test_bfloat16_products_past_decode_rows_widened_or_not(
    monkeypatch: pytest.MonkeyPatch, widens: bool
) -> None:
    """More than ``DECODE_ROWS`` bfloat16 rows: oneDNN's packed product, or (where
    ``cpu.widens_bfloat16``) float32 products of the widened operands, rounded once, no
    packed copy kept; either within the bound and nearly every output torch's bits."""
    monkeypatch.setattr(cpu, "widens_bfloat16", lambda: widens)
    gen = torch.Generator().manual_seed(4)
    layer = Linear(576, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(DECODE_ROWS + 30, 576, generator=gen).to(torch.bfloat16)
    y = layer(x)
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert ((y.double() - exact).abs() <= bound(x, layer.weight, exact) + 1e-30).all()
    assert (y == F.linear(x, layer.weight, layer.bias)).double().mean().item() > 0.99
    assert (layer._packed is None) is widens
