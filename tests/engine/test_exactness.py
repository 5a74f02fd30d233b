"""Greedy generation equals HuggingFace transformers token for token, in every scheduling regime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.server.engine import LLM, SamplingParams

from ..hf_reference import hf_greedy
from .utils import PROMPTS

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_case(request: pytest.FixtureRequest, tiny_models: dict[str, Path]):
    model_dir = tiny_models[request.param]
    llm = LLM(str(model_dir), kv_cache_tokens=16384, block_size=16)
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(model_dir, ids, NEW_TOKENS)[0] for ids in prompt_ids]
    return model_dir, llm, prompt_ids, expected


def _assert_matches(outputs, expected) -> None:
    for i, (out, exp) in enumerate(zip(outputs, expected)):
        assert out.token_ids == exp, f"prompt {i}: engine {out.token_ids} != transformers {exp}"
        assert len(out.token_ids) == NEW_TOKENS


def test_outputs_are_varied(arch_case) -> None:
    """A reference that repeats one token would make every exactness test below vacuous."""
    _, _, _, expected = arch_case
    for tokens in expected:
        assert len(set(tokens)) >= 8, tokens
    assert len({tuple(t) for t in expected}) == len(expected)


def test_batched_greedy_matches_transformers(arch_case) -> None:
    _, llm, prompt_ids, expected = arch_case
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)


def test_warm_prefix_cache_hits_and_matches(arch_case) -> None:
    _, llm, prompt_ids, expected = arch_case
    llm.generate(prompt_ids, GREEDY)
    before = llm.engine.kv.prefix_cache.hits
    outputs = llm.generate(prompt_ids, GREEDY)
    assert llm.engine.kv.prefix_cache.hits > before
    assert sum(o.num_cached_tokens for o in outputs) > 0
    _assert_matches(outputs, expected)


def test_prompts_sharing_a_start_hit_each_other_within_their_first_step(arch_case) -> None:
    """The second and third prompt read the shared blocks the first one computes in the same
    step (published at scheduling time), and still match transformers."""
    model_dir, llm, prompt_ids, _ = arch_case
    shared = prompt_ids[6]
    prompts = [shared + p for p in prompt_ids[:3]]
    expected = [hf_greedy(model_dir, ids, NEW_TOKENS)[0] for ids in prompts]
    llm.engine.kv.pool.reset_prefix_cache()
    outputs = llm.generate(prompts, GREEDY)
    full_blocks = len(shared) // 16 * 16
    assert full_blocks >= 32
    assert [o.num_cached_tokens for o in outputs] == [0, full_blocks, full_blocks]
    _assert_matches(outputs, expected)


def test_preemption_under_a_tiny_block_pool_matches(arch_case) -> None:
    model_dir, _, prompt_ids, expected = arch_case
    # room for the longest sequence and little more, so eight of them must take turns
    tokens = max(len(p) for p in prompt_ids) + NEW_TOKENS + 16
    llm = LLM(str(model_dir), kv_cache_tokens=tokens, block_size=8, max_num_seqs=8)
    outputs = llm.generate(prompt_ids, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    _assert_matches(outputs, expected)
    llm.engine.kv.pool.check_all_free()


def test_chunked_prefill_under_a_tiny_token_budget_matches(arch_case) -> None:
    model_dir, _, prompt_ids, expected = arch_case
    budget = 7
    assert max(len(p) for p in prompt_ids) > 3 * budget  # long prompts must be split
    llm = LLM(
        str(model_dir),
        kv_cache_tokens=8192,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)


def test_logprobs_match_transformers_log_softmax(arch_case) -> None:
    model_dir, llm, prompt_ids, _ = arch_case
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompt_ids[:4], params)
    for ids, out in zip(prompt_ids[:4], outputs):
        tokens, logits = hf_greedy(model_dir, ids, 12)
        ref = torch.log_softmax(logits, dim=-1)
        assert out.token_ids == tokens
        assert len(out.logprobs) == 12
        for step, lp in enumerate(out.logprobs):
            assert lp.token_id == tokens[step]
            assert abs(lp.logprob - ref[step, lp.token_id].item()) < 1e-4
            top_ids = [t for t, _ in lp.top]
            assert top_ids == ref[step].topk(5).indices.tolist()
            for t, v in lp.top:
                assert abs(v - ref[step, t].item()) < 1e-4
