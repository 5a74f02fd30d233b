"""``GatedMLP`` on CPU: a prefill's rows take SiLU and the product with up as oneDNN post-ops
(``PackedLinear.silu_gated``), a decode step's and an adapter's the [gate | up] product, both
against the float64 MLP. float32 within its rounding; bfloat16 within a few rounding steps of
its outputs (each product is rounded once, SiLU's input is not)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.server.engine import cpu
from tandem.server.engine.models.layers import DECODE_ROWS, GatedMLP

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # of the output's largest magnitude


def onednn(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and not (
        dtype == torch.bfloat16 and cpu.widens_bfloat16()
    )


def mlp(dtype: torch.dtype, bias: bool) -> GatedMLP:
    gen = torch.Generator().manual_seed(7)
    module = GatedMLP(96, 160, bias)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module.to(dtype)


def exact(module: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP in float64."""
    w = module.gate_up_proj.weight.double()
    b = module.gate_up_proj.bias
    gate_up = F.linear(x.double(), w, None if b is None else b.double())
    gate, up = gate_up.chunk(2, dim=-1)
    down = module.down_proj
    return F.linear(
        F.silu(gate) * up, down.weight.double(), None if down.bias is None else down.bias.double()
    )


def close(y: torch.Tensor, want: torch.Tensor) -> bool:
    return (y.double() - want).abs().max().item() <= TOLERANCE[y.dtype] * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [3, DECODE_ROWS, DECODE_ROWS + 1, 300])
def test_matches_float64_on_either_path(dtype: torch.dtype, bias: bool, rows: int) -> None:
    module = mlp(dtype, bias)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    with torch.inference_mode():
        assert close(module(x), exact(module, x))
    fused = rows > DECODE_ROWS and onednn(dtype)
    assert (module.gate_up_proj._halves is not None) == fused
    if fused:  # the joint copy of gate|up is never made
        assert module.gate_up_proj._packed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hooked_layer_keeps_its_gate_up_output(dtype: torch.dtype) -> None:
    """An adapter's forward hook reads and replaces gate_up_proj's output: with a hook the
    product runs whole, so the hook sees [gate | up] and what it returns counts."""
    module = mlp(dtype, bias=False)
    seen = []

    def hook(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        seen.append(out.shape)
        return torch.zeros_like(out)

    module.gate_up_proj.register_forward_hook(hook)
    x = torch.randn(DECODE_ROWS + 1, 96).to(dtype)
    with torch.inference_mode():
        y = module(x)
    assert seen == [(DECODE_ROWS + 1, 320)]
    assert module.gate_up_proj._halves is None
    assert torch.equal(y, torch.zeros_like(y))  # silu(0) * 0, times down_proj, no bias


def test_writing_or_moving_the_weight_drops_the_halves() -> None:
    if not onednn(torch.float32):
        pytest.skip("oneDNN's packed products")
    module = mlp(torch.float32, bias=False)
    x = torch.randn(DECODE_ROWS + 1, 96)
    with torch.inference_mode():
        module(x)
    first = module.gate_up_proj._halves
    assert first is not None
    with torch.no_grad():
        module.gate_up_proj.weight.mul_(2)  # written in place: the halves follow it
    with torch.inference_mode():
        assert close(module(x), exact(module, x))
    assert module.gate_up_proj._halves is not first
    module.to_empty(device=torch.device("meta"))
    assert module.gate_up_proj._halves is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, DECODE_ROWS, DECODE_ROWS + 1, 300])
def test_route_names_the_product_matmul_takes(dtype: torch.dtype, rows: int) -> None:
    """``Linear.route`` is what ``matmul`` does (the copy it packs says which product ran), and
    the fused path asks it: the two cannot drift apart."""
    layer = mlp(dtype, bias=False).gate_up_proj
    x = torch.randn(rows, 96).to(dtype)
    route = layer.route(x)
    with torch.inference_mode():
        layer.matmul(x, None)
    assert (layer._packed is not None) == (route == "onednn")
    assert (layer._decode is not None) == (route == "decode")
    assert layer.gates_in_onednn(x) == (rows > DECODE_ROWS and route == "onednn")
    if rows > DECODE_ROWS and torch.backends.mkldnn.is_available():
        assert route == ("onednn" if onednn(dtype) else "widened")
    assert layer.route(x.double()) == "plain"
