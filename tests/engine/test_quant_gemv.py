"""The quantized GEMV against the product with gguf's own dequantized weights, in float64;
the default model (a Q4_1 file) with its weights multiplied as blocks against dequantized.

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

from tandem.server.engine import LLM, SamplingParams, kernels
from tandem.server.engine.default_model import default_model_path
from tandem.server.engine.models.layers import QUANT_ROWS, Linear

from .test_default_model import MAX_TOKENS, PROMPTS

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


@pytest.fixture(scope="module")
def default_engines() -> dict[str, LLM]:
    """The default model with its weights multiplied as blocks (``auto``) and dequantized."""
    path = str(default_model_path())
    return {q: LLM(path, kv_cache_tokens=4096, quantized_weights=q) for q in ("auto", "off")}


def _quantized_layers(llm: LLM) -> int:
    return sum(
        isinstance(m, Linear) and m.quantized is not None
        for m in llm.engine.worker.runner.model.modules()
    )


def test_default_model_generates_the_same_text_from_its_blocks(default_engines) -> None:
    """The default model's test prompts: greedy tokens equal with the blocks and without, the
    chosen tokens' logprobs within 1e-4 (float32 sums in another order through 30 layers;
    the largest difference measured here was 1.1e-5)."""
    quant, dense = default_engines["auto"], default_engines["off"]
    # q|k|v, o, gate|up and down in each of the 30 layers, and the tied lm_head (Q8_0)
    assert _quantized_layers(quant) == 4 * 30 + 1 and _quantized_layers(dense) == 0
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    # one prompt at a time (a batch of 12 decodes past QUANT_ROWS, by the dequantized weights)
    got = [quant.generate([p], params)[0] for p in PROMPTS]
    want = [dense.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    diff = max(
        abs(a.logprob - b.logprob)
        for g, w in zip(got, want)
        for a, b in zip(g.logprobs, w.logprobs)
    )
    assert diff < 1e-4, diff


def test_paris_from_the_blocks(default_engines) -> None:
    quant, dense = default_engines["auto"], default_engines["off"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = quant.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    params = SamplingParams(temperature=0, max_tokens=32)
    answer = quant.generate([prompt], params)[0].text
    assert "Paris" in answer and answer == dense.generate([prompt], params)[0].text


def test_a_layer_takes_its_blocks_for_few_rows_only_and_while_its_weight_is_theirs() -> None:
    """Past ``QUANT_ROWS`` rows, or once the weight is written (``update_weights``), the
    dequantized weight multiplies: the blocks no longer describe it."""
    qtype = GGMLQuantizationType.Q4_0
    blocks = random_blocks(qtype, 48, 64, seed=9)
    layer = Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(dequantize(blocks, qtype)))
    layer.use_quantized(torch.from_numpy(blocks), qtype.value)
    calls = []
    original = kernels.quant_gemv

    def counting(*args: object) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return original(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "quant_gemv", counting)
        for rows in (1, QUANT_ROWS, QUANT_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            layer.weight.mul_(2)
        layer(torch.randn(1, 64))
    assert calls == [1, QUANT_ROWS]
