"""The decode chain (every layer of a small decode step in one C call) against the modules.

It chains the kernels the modules call and rounds where they round, so a model's greedy
tokens and their logprobs are the same bit for bit with it and without it, in float32 and
bfloat16, for each block format; steps it does not take (prefills, more rows than the
quantized kernel, models with q/k norm) run the modules.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.server.engine import LLM, SamplingParams, decode_chain, kernels
from tandem.server.engine.attention.torch_backend import SHARED_PAGES, shared_start
from tandem.server.engine.decode_chain import DecodeChain
from tandem.server.engine.default_model import default_model_path
from tandem.server.engine.models.layers import DECODE_ROWS

from .test_spec_decode import Oracle
from .utils import encoder, write_gguf

PROMPTS = ["Hello there, how are you", "The cat sat on", "Once upon a time, in a land far"]


@pytest.fixture(autouse=True)
def _need_chain(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    if not kernels.quant_gemv_for(torch.device("cpu"), torch.float32):
        pytest.skip("the decode chain needs the AVX-512 C kernels")


def _engine(tiny_models, tmp_path, arch: str, qtype: Q, dtype: str, mode: str = "auto") -> LLM:
    path = tmp_path / f"{arch}-{qtype.name}.gguf"
    write_gguf(tiny_models[arch], path, encoder(qtype))
    return LLM(str(path), dtype=dtype, kv_cache_tokens=2048, quantized_weights=mode)


def _generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    llm.engine.kv.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _rows_of_each_call(chain: DecodeChain) -> list[int]:
    """The rows of each step ``chain`` runs from now on, in order."""
    calls: list[int] = []
    original = chain.run

    def counted(*args: object) -> torch.Tensor:
        calls.append(len(args[0]))
        return original(*args)

    chain.run = counted
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("arch", "qtype"), [("llama", Q.Q4_1), ("llama", Q.Q8_0), ("qwen2", Q.Q4_0)]
)
@pytest.mark.parametrize("mode", ["auto", "int8"])
def test_chain_equals_the_modules_bit_for_bit(
    tiny_models, tmp_path, arch, qtype, dtype, mode
) -> None:
    """Under ``int8`` both paths take each layer's int8 kernel: equal to each other still."""
    llm = _engine(tiny_models, tmp_path, arch, qtype, dtype, mode)
    runner = llm.engine.worker.runner
    assert runner._chain is not None
    calls = _rows_of_each_call(runner._chain)
    got = _generate(llm, PROMPTS)
    assert calls and set(calls) <= {1, 2, 3}  # decode steps of the batch ran as a chain
    runner._chain = None
    assert _generate(llm, PROMPTS) == got


def test_steps_past_the_chain_run_the_modules(tiny_models, tmp_path) -> None:
    """Nine rows: past the quantized kernel's eight, so past the chain; the same tokens."""
    llm = _engine(tiny_models, tmp_path, "llama", Q.Q4_1, "float32")
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    chain = llm.engine.worker.runner._chain
    assert chain.takes([1] * 8, [10] * 8) and not chain.takes([1] * 9, [10] * 9)
    assert not chain.takes([1, 4], [10, 4])  # a fresh prompt in the step
    assert chain.takes([1, 5], [10, 20])  # a decode and a verification of 4 proposals
    assert not chain.takes([5, 4], [10, 20])  # nine tokens
    got = _generate(llm, prompts)
    llm.engine.worker.runner._chain = None
    assert _generate(llm, prompts) == got


def test_models_with_q_k_norm_keep_the_modules(tiny_models, tmp_path) -> None:
    llm = _engine(tiny_models, tmp_path, "qwen3", Q.Q8_0, "float32")
    assert llm.engine.worker.runner._chain is None


def test_dequantized_weights_chain_by_decode_linear(tiny_models, tmp_path) -> None:
    """Without blocks, a float32 model's linears chain packed for decode_linear (panels)."""
    if not kernels.decode_linear_for(torch.device("cpu"), torch.float32):
        pytest.skip("decode_linear needs AVX-512")
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_models["llama"], path, encoder(Q.Q4_1))
    llm = LLM(str(path), kv_cache_tokens=2048, quantized_weights="off")
    chain = llm.engine.worker.runner._chain
    assert chain is not None and chain.decode_linears and chain.max_rows == DECODE_ROWS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a q|k|v bias, added in the product
def test_decode_linear_chain_equals_the_modules_bit_for_bit(tiny_models, arch, dtype) -> None:
    """Any checkpoint chains by decode_linear (bfloat16 on AMX, float32 on AVX-512), up to
    DECODE_ROWS rows a step."""
    if not kernels.decode_linear_for(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"decode_linear in {dtype} needs AMX (bfloat16) or AVX-512 (float32)")
    _chain_by_decode_linear_equals_the_modules(
        LLM(str(tiny_models[arch]), dtype=dtype, kv_cache_tokens=4096)
    )


@pytest.mark.parametrize(
    "names", kernels.ops.DECODE_KERNELS[torch.bfloat16][1:], ids=lambda names: names[0]
)
def test_bfloat16_panels_chain_equals_the_modules_bit_for_bit(
    tiny_models, monkeypatch, names: tuple[str, str, None]
) -> None:
    """Each bfloat16 panel product (dot pairs, widened) chained where the tiles would be
    chosen too: every machine with the product checks the chain through it."""
    if not hasattr(kernels.library.load(), names[0]):
        pytest.skip(f"{names[0]} needs AVX-512 (and AVX512-BF16 for dot pairs)")
    chosen = kernels.ops.decode_kernel

    def forced(dtype: torch.dtype) -> tuple[str, str, str | None] | None:
        return names if dtype == torch.bfloat16 else chosen(dtype)

    monkeypatch.setattr(kernels.ops, "decode_kernel", forced)
    monkeypatch.setattr(kernels, "decode_kernel", forced)
    llm = LLM(str(tiny_models["qwen2"]), dtype="bfloat16", kv_cache_tokens=4096)
    _chain_by_decode_linear_equals_the_modules(llm)


def _chain_by_decode_linear_equals_the_modules(llm: LLM) -> None:
    """``llm``'s chain takes up to DECODE_ROWS rows by decode_linear, and 21 rows a step give
    the modules' tokens and logprobs bit for bit."""
    runner = llm.engine.worker.runner
    chain = runner._chain
    assert chain is not None and chain.decode_linears
    assert chain.takes([1] * DECODE_ROWS, [10] * DECODE_ROWS)
    assert not chain.takes([1] * (DECODE_ROWS + 1), [10] * (DECODE_ROWS + 1))
    calls = _rows_of_each_call(chain)
    prompts = [f"{p} {i}" for i in range(7) for p in PROMPTS]  # 21 rows a decode step
    got = _generate(llm, prompts)
    assert calls and max(calls) == len(prompts)
    runner._chain = None
    assert _generate(llm, prompts) == got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_attends_shared_pages_once_as_the_modules_do(monkeypatch, dtype) -> None:
    """Decodes that begin with the same pages (a long common prefix) attend to them once in
    the chain too (the default model, dequantized: heads of 64, which shared_attention takes),
    once enough rows share enough tokens (``SHARED_PAGES``)."""
    if not kernels.shared_attention_for(torch.device("cpu"), dtype, 64):
        pytest.skip("shared pages are attended once in float32 on AVX-512, bfloat16 on AMX")
    least = SHARED_PAGES[dtype]
    llm = LLM(
        default_model_path(), dtype=str(dtype)[6:], kv_cache_tokens=8192, quantized_weights="off"
    )
    runner = llm.engine.worker.runner
    chain = runner._chain
    assert chain is not None and chain.shared_pages == least
    shared = []

    def recorded(*args: object) -> int:
        shared.append(shared_start(*args))
        return shared[-1]

    monkeypatch.setattr(decode_chain, "shared_start", recorded)
    prefix = "You are a careful assistant. Answer briefly and plainly. " * (least.tokens // 8)
    prompts = [f"{prefix}Question {i}: name a colour." for i in range(least.rows + 2)]
    got = _generate(llm, prompts)
    assert max(shared) * runner.kv_cache.block_size >= least.tokens
    runner._chain = None
    assert _generate(llm, prompts) == got


@pytest.mark.parametrize("level", [1, 2])
def test_the_chain_is_dropped_on_sleep_and_built_again_on_wake(
    tiny_models, tmp_path, level
) -> None:
    """It points at the KV cache and the weights: both move across a sleep."""
    llm = _engine(tiny_models, tmp_path, "llama", Q.Q4_1, "float32")
    runner = llm.engine.worker.runner
    want = _generate(llm, PROMPTS)
    llm.engine.sleep(level)
    assert runner._chain is None
    llm.engine.wake_up()
    assert runner._chain is not None
    assert _generate(llm, PROMPTS) == want


def test_speculation_verifies_through_the_chain(tiny_models, tmp_path) -> None:
    """Verification rows (a sequence's last token and its proposals) run as a chain too, each
    token attending up to its own position: the same greedy tokens as without speculation
    (proposals from the reference continuation, one token in three spoiled: ``Oracle``)."""
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_models["llama"], path, encoder(Q.Q4_1))
    plain = LLM(str(path), kv_cache_tokens=2048)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    want = [t for t, _ in _generate(plain, prompts)]
    spec = LLM(str(path), kv_cache_tokens=2048, speculative_method="ngram")
    spec.engine.speculator.proposer = Oracle(prompts, want)
    chain = spec.engine.worker.runner._chain
    widths = []
    original = chain.run

    def counted(*args: object) -> torch.Tensor:
        widths.append(max(args[3]))  # query_lens
        return original(*args)

    chain.run = counted
    assert [t for t, _ in _generate(spec, prompts)] == want
    assert max(widths) > 1  # proposals were verified in the chain
