"""``GatedMLP`` on CPU: a prefill's rows take SiLU and the product with up in one pass
(``PackedLinear.silu_gated``: oneDNN post-ops, or the float32 planes' pass on AMX), a decode
step's and an adapter's the [gate | up] product, both against the float64 MLP. float32 within its rounding; bfloat16 within a few rounding steps of
its outputs (each product is rounded once, SiLU's input is not)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.server.engine.models.layers import DECODE_ROWS, GatedMLP

from .utils import prefill_route

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # of the output's largest magnitude


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
    route = prefill_route(dtype) if rows > DECODE_ROWS else "decode"
    gate_up = module.gate_up_proj
    assert (gate_up._halves is not None) == (route == "onednn")
    assert (gate_up._planes is not None) == (route == "planes")
    if route in ("onednn", "planes"):  # the joint oneDNN copy of gate|up is never made
        assert gate_up._packed is None


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writing_or_moving_the_weight_drops_the_fused_copies(dtype: torch.dtype) -> None:
    """The fused pass's copy of gate|up (oneDNN's halves, or the planes) follows the weight."""
    copy = {"onednn": "_halves", "planes": "_planes"}.get(prefill_route(dtype))
    if copy is None:
        pytest.skip("no fused pass for prefill rows here")
    module = mlp(dtype, bias=False)
    x = torch.randn(DECODE_ROWS + 1, 96).to(dtype)
    with torch.inference_mode():
        module(x)
    first = getattr(module.gate_up_proj, copy)
    assert first is not None
    with torch.no_grad():
        module.gate_up_proj.weight.mul_(2)  # written in place: the copy follows it
    with torch.inference_mode():
        assert close(module(x), exact(module, x))
    assert getattr(module.gate_up_proj, copy) is not first
    module.to_empty(device=torch.device("meta"))
    assert getattr(module.gate_up_proj, copy) is None


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
    assert (layer._planes is not None) == (route == "planes")
    assert layer.gates_fused(x) == (rows > DECODE_ROWS and route in ("onednn", "planes"))
    if rows > DECODE_ROWS:
        assert route == prefill_route(dtype)
    assert layer.route(x.double()) == "plain"
