"""The fused CUDA layer kernels (``kernels/cuda_ops.py``) against the PyTorch code they replace.

Each takes random 16-bit inputs on the GPU and must land within 16-bit rounding of the
PyTorch reference computed in float32 from the same inputs. On CPU ``cuda_kernels_for``
says no, so the layers keep their reference path (checked here without a GPU too).
"""

from __future__ import annotations

import pytest
import torch

from tandem.server.engine.kernels import cuda_ops
from tandem.server.engine.models.layers import RMSNorm
from tandem.server.engine.models.rope import RotaryEmbedding, _apply

DTYPES = [torch.bfloat16, torch.float16]
needs_gpu = pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and cuda_ops.cuda_kernels_for(torch.device("cuda"), torch.bfloat16)
    ),
    reason="needs CUDA and flashinfer",
)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_cpu_tensors_keep_the_reference_path() -> None:
    assert not cuda_ops.cuda_kernels_for(torch.device("cpu"), torch.bfloat16)
    assert not cuda_ops.cuda_kernels_for(torch.device("cuda"), torch.float32)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1024), (37, 8, 128)])  # hidden rows; per-head q/k norm
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    norm = RMSNorm(shape[-1], 1e-6).to("cuda", dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(shape, device="cuda").to(dtype) * 3
    want = norm.reference(x.float().to(dtype))
    got = norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_err(got, want) < 1e-2


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_one_launch(dtype: torch.dtype) -> None:
    norm = RMSNorm(1024, 1e-6).to("cuda", dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x, residual = (torch.randn(37, 1024, device="cuda").to(dtype) * 3 for _ in range(2))
    want_sum = x + residual  # rounded once, as torch's add rounds
    want = norm.reference(want_sum)
    got, got_sum = norm.add(x.clone(), residual.clone())
    assert torch.equal(got_sum, want_sum)
    assert rel_err(got, want) < 1e-2


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = torch.randn(37, 2 * 768, device="cuda").to(dtype)
    gate, up = gate_up.float().split(768, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert rel_err(cuda_ops.silu_and_mul(gate_up), want) < 1e-2


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_in_place(dtype: torch.dtype, rotary_fraction: float) -> None:
    params = {"rope_theta": 1e6, "partial_rotary_factor": rotary_fraction}
    rotary = RotaryEmbedding(params, 128, 4096).to("cuda")
    positions = torch.randint(0, 4096, (37,), device="cuda")
    qkv = torch.randn(37, (8 + 2 + 2) * 128, device="cuda").to(dtype)
    q = qkv[:, : 8 * 128].view(37, 8, 128)  # views into one packed projection, as in the model
    k = qkv[:, 8 * 128 : 10 * 128].view(37, 2, 128)
    cos, sin, _ = rotary.tables(positions, torch.float32)
    want_q, want_k = (_apply(t.float(), cos, sin, rotary.rotary_dim) for t in (q, k))
    v_before = qkv[:, 10 * 128 :].clone()
    got_q, got_k = rotary(rotary.tables(positions, dtype), q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert rel_err(got_q, want_q) < 1e-2 and rel_err(got_k, want_k) < 1e-2
    assert torch.equal(qkv[:, 10 * 128 :], v_before)  # v untouched
