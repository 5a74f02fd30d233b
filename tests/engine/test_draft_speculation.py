"""Draft-model speculation (``--speculative-method draft``) keeps every output exact: greedy
output equals transformers token for token on the three tiny architectures with prefix hits
and preemption, seeded sampling draws the same tokens with it on or off, and neither the
target's blocks nor the draft's leak, aborts mid-speculation included.

The drafts are made as ``tandem make-draft`` makes them: the target's first layer (it guesses
some tokens right and many wrong), or the target itself (it guesses all of them, which shows
its KV is kept in step: one stale position and its guesses would go wrong).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tandem.server.engine import LLM, LLMEngine, SamplingParams
from tandem.server.engine.config import ConfigError, EngineConfig
from tandem.server.engine.spec_decode.layer_draft import make_layer_draft
from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

from .test_spec_decode import (  # noqa: F401
    GREEDY,
    NEW_TOKENS,
    _assert_matches,
    abort_at_every_stage,
    arch_case,
)
from .utils import PROMPTS


def draft_llm(model_dir: Path, draft: Path, **kw: object) -> LLM:
    """An engine speculating with ``draft``; its passes counted free, so proposals run long
    (a tiny draft's embeddings weigh about what the target's whole weights do), and its plans
    by the cost model's constants, not the steps' measured times."""
    args: dict = dict(kv_cache_tokens=16384, block_size=16)
    args.update(kw)
    llm = LLM(str(model_dir), speculative_method="draft", speculative_model=str(draft), **args)
    spec = llm.engine.speculator
    assert 0 < spec.cost.pass_cost <= 1  # the draft's weights against the target's
    spec.cost = replace(spec.cost, pass_cost=0.0, curve=None)  # constants: no timing
    return llm


def check_no_leaks(engine: LLMEngine) -> None:
    engine.kv.pool.check_all_free()
    engine.speculator.draft_model.pool.check_all_free()


@pytest.fixture(scope="module")
def layer_draft(arch_case, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    model_dir = arch_case[0]
    return make_layer_draft(model_dir, tmp_path_factory.mktemp("draft") / model_dir.name, 1)


def test_greedy_with_a_layer_draft_matches_transformers_with_prefix_hits(
    arch_case,  # noqa: F811
    layer_draft: Path,
) -> None:
    model_dir, prompt_ids, expected = arch_case
    llm = draft_llm(model_dir, layer_draft)
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
    outputs = llm.generate(prompt_ids, GREEDY)  # again: every prompt hits the prefix cache
    assert sum(o.num_cached_tokens for o in outputs) > 0
    _assert_matches(outputs, expected)
    check_no_leaks(llm.engine)


def test_a_self_draft_is_accepted_throughout(arch_case) -> None:  # noqa: F811
    model_dir, prompt_ids, expected = arch_case
    llm = draft_llm(model_dir, model_dir)
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0
    check_no_leaks(llm.engine)


def test_preemption_with_a_draft_matches(arch_case, layer_draft: Path) -> None:  # noqa: F811
    model_dir, prompt_ids, expected = arch_case
    tokens = max(len(p) for p in prompt_ids) + NEW_TOKENS + 16
    llm = draft_llm(model_dir, layer_draft, kv_cache_tokens=tokens, block_size=8, max_num_seqs=8)
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().spec_num_drafts > 0
    check_no_leaks(llm.engine)


def test_seeded_sampling_with_a_draft_draws_the_same_tokens(tiny_models: dict[str, Path]) -> None:
    llama = tiny_models["llama"]
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.95, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True
    )
    plain = LLM(str(llama), kv_cache_tokens=16384).generate(PROMPTS[:4], params)
    llm = draft_llm(llama, llama)
    spec = llm.generate(PROMPTS[:4], params)
    for a, b in zip(plain, spec):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    check_no_leaks(llm.engine)


def test_aborts_mid_speculation_free_the_drafts_blocks(tiny_models: dict[str, Path]) -> None:
    llama = tiny_models["llama"]
    engine = draft_llm(llama, llama, kv_cache_tokens=2048).engine
    abort_at_every_stage(engine, [engine.tokenizer.encode(p) for p in PROMPTS])
    check_no_leaks(engine)


def test_a_draft_must_share_the_vocabulary_and_exist(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    llama = tiny_models["llama"]
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(vocab_size=512))
    with pytest.raises(ConfigError, match="vocabulary"):
        draft_llm(llama, other)
    for bad in (
        dict(speculative_method="draft"),
        dict(speculative_method="ngram", speculative_model=str(llama)),
        dict(speculative_method="draft", speculative_model=str(tmp_path / "missing")),
    ):
        with pytest.raises(ConfigError):
            EngineConfig(model=str(llama), **bad)


def test_make_draft_keeps_the_first_layers(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    llama = tiny_models["llama"]
    draft = make_layer_draft(llama, tmp_path / "d", 1)
    ref = LLM(str(llama), kv_cache_tokens=1024)
    one = LLM(str(draft), kv_cache_tokens=1024)
    assert one.engine.model_config.num_hidden_layers == 1
    assert one.tokenizer.encode(PROMPTS[1]) == ref.tokenizer.encode(PROMPTS[1])
    with pytest.raises(ValueError):
        make_layer_draft(llama, tmp_path / "e", 2)  # as deep as the model: not a draft
