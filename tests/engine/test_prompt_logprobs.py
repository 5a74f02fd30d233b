"""Prompt logprobs (vLLM's ``prompt_logprobs``) equal transformers' log-softmax over the
prompt's own forward pass, token for token, however the prompt is scheduled: whole, in
chunks, beside other requests, after the same prompt was cached, with ``n > 1``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.server.engine import LLM, SamplingParams

from ..hf_reference import hf_model
from .utils import PROMPTS

TOP = 3
# float32 on CPU agrees with transformers to 2e-5; a GPU's kernels sum in another order.
TOL = 1e-4 if torch.cuda.is_available() else 2e-5


def _reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: [len(ids), vocab]."""
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(out, ids: list[int], ref: torch.Tensor) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        lp, row = lps[p], ref[p - 1]
        assert lp.token_id == ids[p]
        assert abs(lp.logprob - row[ids[p]].item()) < TOL, (p, lp.logprob, row[ids[p]].item())
        assert lp.rank == int((row > row[ids[p]]).sum()) + 1
        top_ids = [t for t, _ in lp.top]
        assert len(top_ids) == TOP and set(top_ids) == set(row.topk(TOP).indices.tolist())


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 24},  # long prompts in chunks, batched with the others
        {"enable_prefix_caching": True},
    ],
    ids=["whole", "chunked", "prefix-cache"],
)
def test_prompt_logprobs_equal_transformers(tiny_models: dict[str, Path], engine_args) -> None:
    model_dir = tiny_models["llama"]
    llm = LLM(str(model_dir), kv_cache_tokens=8192, block_size=16, **engine_args)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS if len(llm.tokenizer.encode(p)) > 1]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(ids, plain)  # a warm prefix cache must not stand in for the logits
    outs = llm.generate(ids, params)
    for out, prompt in zip(outs, ids):
        _check(out, prompt, _reference(model_dir, prompt))
    assert all(o.prompt_logprobs is None for o in llm.generate(ids[:2], plain))


def test_only_the_leader_of_n_reports_them(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["qwen3"]
    llm = LLM(str(model_dir), kv_cache_tokens=8192, block_size=16)
    ids = llm.tokenizer.encode(PROMPTS[6])
    (out,) = llm.generate(
        [ids], SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=3, prompt_logprobs=TOP)
    )
    assert len(out.outputs) == 3
    _check(out, ids, _reference(model_dir, ids))


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
