"""Speculative decoding keeps every output exact: greedy output equals transformers (and the
engine without speculation) token for token on the three tiny architectures, through prefix
hits, preemption, chunked prefill, stop strings, logprobs, grammars, n > 1, sessions and P/D;
seeded sampling draws the same tokens with speculation on or off; the sampled distribution is
the target's (a chi-square test over many seeded draws); no block leaks.

Random-weights models seldom repeat themselves, so besides n-gram lookup most tests verify an
"oracle" proposal: the reference continuation with a token spoiled now and then, so every
step mixes accepted runs, rejections and rows without a proposal.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from tandem.server.engine import LLM, LLMEngine, SamplingParams
from tandem.server.engine.config import ConfigError, EngineConfig
from tandem.server.engine.spec_decode.cost import QUANTIZED_ROW_COST, StepCost
from tandem.server.engine.spec_decode.draft import MAX_SKIP, Draft
from tandem.server.engine.spec_decode.ngram import MAX_NGRAM, propose_ngram
from tandem.server.engine.structured import GrammarSpec

from ..disagg.utils import drain_one, prefill_handoff, run_pulls
from ..hf_reference import hf_greedy, hf_model
from .utils import PROMPTS, drain

NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class Oracle:
    """Proposes each known prompt's reference continuation, spoiling one token of every third
    proposal (so verification both accepts and rejects); nothing for unknown sequences."""

    def __init__(self, prompts: list[list[int]], continuations: list[list[int]]) -> None:
        self.known = list(zip(prompts, continuations))

    def __call__(self, token_ids: list[int], k: int) -> tuple[list[int], int]:
        """The proposal, as a lookup's longest match (``MAX_NGRAM``: not a weak one)."""
        for prompt, cont in self.known:
            if token_ids[: len(prompt)] == prompt and len(token_ids) - len(prompt) <= len(cont):
                done = len(token_ids) - len(prompt)
                if cont[:done] != token_ids[len(prompt) :]:
                    continue
                out = list(cont[done : done + k])
                if done % 3 == 1 and out:
                    out[len(out) // 2] = (out[len(out) // 2] + 1) % 256
                return out, MAX_NGRAM if out else 0
        return [], 0


def spec_llm(model_dir: Path, oracle: Oracle | None = None, **kw: object) -> LLM:
    args: dict = dict(kv_cache_tokens=16384, block_size=16, speculative_method="ngram")
    args.update(kw)
    llm = LLM(str(model_dir), **args)
    if oracle is not None:
        llm.engine.speculator.proposer = oracle
    constant_costs(llm.engine)
    return llm


def constant_costs(engine: LLMEngine) -> None:
    """Plans by the cost model's constants, not by the steps' measured times: what a test
    verifies must not depend on how fast its machine ran the steps."""
    engine.speculator.cost = dataclasses.replace(engine.speculator.cost, curve=None)


def accepted_and_rejected(engine: LLMEngine) -> tuple[int, int]:
    s = engine.stats()
    return s.spec_num_accepted_tokens, s.spec_num_draft_tokens - s.spec_num_accepted_tokens


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_case(request: pytest.FixtureRequest, tiny_models: dict[str, Path]):
    model_dir = tiny_models[request.param]
    tok = LLM(str(model_dir), kv_cache_tokens=1024).tokenizer
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    expected = [hf_greedy(model_dir, ids, NEW_TOKENS)[0] for ids in prompt_ids]
    return model_dir, prompt_ids, expected


def _assert_matches(outputs, expected) -> None:
    for i, (out, exp) in enumerate(zip(outputs, expected)):
        assert out.token_ids == exp, f"prompt {i}: speculative {out.token_ids} != {exp}"


def test_greedy_with_proposals_matches_transformers_with_prefix_hits(arch_case) -> None:
    model_dir, prompt_ids, expected = arch_case
    llm = spec_llm(model_dir, Oracle(prompt_ids, expected))
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    accepted, rejected = accepted_and_rejected(llm.engine)
    assert accepted > 100 and rejected > 10
    outputs = llm.generate(prompt_ids, GREEDY)  # again: every prompt hits the prefix cache
    assert sum(o.num_cached_tokens for o in outputs) > 0
    _assert_matches(outputs, expected)
    llm.engine.kv.pool.check_all_free()


def test_greedy_with_ngram_lookup_matches_transformers(arch_case) -> None:
    model_dir, prompt_ids, expected = arch_case
    llm = spec_llm(model_dir)
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    assert llm.engine.stats().spec_num_drafts > 0


def test_preemption_with_proposals_matches(arch_case) -> None:
    model_dir, prompt_ids, expected = arch_case
    tokens = max(len(p) for p in prompt_ids) + NEW_TOKENS + 16
    llm = spec_llm(
        model_dir,
        Oracle(prompt_ids, expected),
        kv_cache_tokens=tokens,
        block_size=8,
        max_num_seqs=8,
    )
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    assert llm.engine.stats().num_preemptions > 0
    assert accepted_and_rejected(llm.engine)[0] > 0
    llm.engine.kv.pool.check_all_free()


def test_chunked_prefill_and_a_tiny_budget_with_proposals_match(arch_case) -> None:
    model_dir, prompt_ids, expected = arch_case
    llm = spec_llm(
        model_dir,
        Oracle(prompt_ids, expected),
        kv_cache_tokens=8192,
        block_size=4,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
    )
    _assert_matches(llm.generate(prompt_ids, GREEDY), expected)
    assert accepted_and_rejected(llm.engine)[0] > 0


def test_logprobs_with_proposals_equal_those_without(arch_case) -> None:
    model_dir, prompt_ids, expected = arch_case
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    plain = LLM(str(model_dir), kv_cache_tokens=16384).generate(prompt_ids[:4], params)
    spec = spec_llm(model_dir, Oracle(prompt_ids, expected)).generate(prompt_ids[:4], params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and len(b.logprobs) == NEW_TOKENS
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


# ----- on one architecture ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def _pair(model_dir: Path, params: SamplingParams, prompts: list, **kw: object):
    """The outputs without speculation, and with an oracle proposing them."""
    plain = LLM(str(model_dir), kv_cache_tokens=16384, **kw).generate(prompts, params)
    tok = LLM(str(model_dir), kv_cache_tokens=1024).tokenizer
    ids = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
    oracle = Oracle(
        [i for i in ids for _ in plain[0].outputs],
        [c.token_ids for o in plain for c in o.outputs],
    )
    llm = spec_llm(model_dir, oracle, **kw)
    return plain, llm.generate(prompts, params), llm


def test_stop_strings_and_max_tokens_never_emit_past_the_stop(llama: Path) -> None:
    plain = LLM(str(llama), kv_cache_tokens=16384)
    ref = plain.generate(PROMPTS, GREEDY)
    # text from inside a proposal: the stop may end in the middle of an accepted run
    stops = [plain.tokenizer.decode(o.token_ids[9:11]).strip() or "zz" for o in ref]
    oracle = Oracle([plain.tokenizer.encode(p) for p in PROMPTS], [o.token_ids for o in ref])
    spec = spec_llm(llama, oracle)
    for max_tokens in (1, 2, 7, 23):
        params = [
            SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=[s], ignore_eos=True)
            for s in stops
        ]
        for a, b in zip(plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
            assert len(b.token_ids) <= max_tokens


def test_seeded_sampling_draws_the_same_tokens_with_speculation(llama: Path) -> None:
    """n > 1, penalties, top-k/top-p and a logit bias: one uniform per token either way."""
    params = SamplingParams(
        n=3,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        seed=11,
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        logit_bias={5: 2.0},
        min_tokens=5,
    )
    plain, spec, llm = _pair(llama, params, PROMPTS[:5])
    for a, b in zip(plain, spec):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    accepted, rejected = accepted_and_rejected(llm.engine)
    assert accepted > 50 and rejected > 5
    llm.engine.kv.pool.check_all_free()


def test_structured_output_checks_each_proposed_token(llama: Path) -> None:
    spec = GrammarSpec(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        ),
    )
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured=spec)
    plain, spec_out, llm = _pair(llama, params, PROMPTS[:4])
    for a, b in zip(plain, spec_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert accepted_and_rejected(llm.engine)[0] > 0
    # A proposal is cut where the grammar stops allowing it, before the model computes it.
    engine = spec_llm(llama).engine
    seven, brace = engine.tokenizer.encode("7")[-1], engine.tokenizer.encode("}")[-1]
    engine.speculator.proposer = lambda ids, k: ([seven, brace, seven][:k], MAX_NGRAM)
    digits = SamplingParams(
        temperature=0.0, max_tokens=40, structured=GrammarSpec("regex", "[0-9]{60}")
    )
    engine.add_request("g", "x", digits)
    out = drain(engine)["g"].outputs[0]
    ref = LLM(str(llama), kv_cache_tokens=16384).generate(["x"], digits)[0]
    assert out.token_ids == ref.token_ids
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens == stats.spec_num_drafts


def test_rejection_sampling_keeps_the_target_distribution(llama: Path) -> None:
    """The second token's frequencies over 2000 seeds, with a proposal that is often wrong,
    against transformers' probabilities (top-k 4 at temperature 1.5): a chi-square test."""
    prompt = [17, 99, 3, 250, 41]
    top_k, temp, draws = 4, 1.5, 2000
    model = hf_model(str(llama))

    seen: dict[tuple[int, ...], torch.Tensor] = {}

    def dist(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in seen:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float() / temp
            kth = logits.topk(top_k).values[-1]
            seen[tuple(ids)] = torch.softmax(logits.masked_fill(logits < kth, -torch.inf), -1)
        return seen[tuple(ids)]

    first = dist(prompt)
    expected = sum(first[t] * dist(prompt + [t]) for t in first.nonzero().flatten().tolist())
    llm = spec_llm(llama)
    calls = []

    def propose(ids: list[int], k: int) -> tuple[list[int], int]:
        """The likeliest second token, or every other time the least likely of the top 4."""
        if len(ids) != len(prompt) + 1:
            return [], 0
        calls.append(1)
        return [int(dist(ids).topk(top_k).indices[len(calls) % 2 * (top_k - 1)])], MAX_NGRAM

    llm.engine.speculator.proposer = propose
    params = [
        SamplingParams(temperature=temp, top_k=top_k, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(draws)
    ]
    seconds = Counter(o.token_ids[1] for o in llm.generate([prompt] * draws, params))
    accepted, rejected = accepted_and_rejected(llm.engine)
    assert accepted > 200 and rejected > 200
    support = expected.nonzero().flatten().tolist()
    assert set(seconds) <= set(support)
    chi2 = sum(
        (seconds[t] - draws * expected[t].item()) ** 2 / (draws * expected[t].item())
        for t in support
    )
    df = len(support) - 1
    # Wilson-Hilferty: the chi-square quantile at p = 0.001 (z = 3.09); seeded, so it is fixed.
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, seconds)


def test_aborts_mid_speculation_leak_no_blocks(llama: Path) -> None:
    tok = LLM(str(llama), kv_cache_tokens=1024).tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    ref = LLM(str(llama), kv_cache_tokens=16384).generate(ids, GREEDY)
    llm = spec_llm(llama, Oracle(ids, [o.token_ids for o in ref]), kv_cache_tokens=2048)
    abort_at_every_stage(llm.engine, ids)
    llm.engine.kv.pool.check_all_free()


def abort_at_every_stage(engine: LLMEngine, ids: list[list[int]]) -> None:
    """Run ``ids`` (and a session's turn) aborting one request each step, at every stage of
    its proposals, then drain and end the session."""
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.add_request("s", ids[1], GREEDY, session_id="sess")
    for step in range(12):
        engine.step()
        engine.abort_request(f"r{step}")
    assert engine.stats().spec_num_accepted_tokens > 0
    drain(engine)
    assert engine.delete_session("sess")


def test_session_turns_with_speculation_match(llama: Path) -> None:
    tok = LLM(str(llama), kv_cache_tokens=1024).tokenizer
    first = tok.encode(PROMPTS[6])
    plain = LLMEngine(EngineConfig(model=str(llama), kv_cache_tokens=4096))
    spec = spec_llm(llama, kv_cache_tokens=4096).engine
    outs = []
    for engine in (plain, spec):
        engine.add_request("t1", first, GREEDY, session_id="s")
        one = drain(engine)["t1"].outputs[0].token_ids
        engine.add_request("t2", first + one + first[:20], GREEDY, session_id="s")
        outs.append((one, drain(engine)["t2"].outputs[0].token_ids))
    assert outs[0] == outs[1]
    assert spec.stats().spec_num_drafts > 0


def test_a_step_past_the_cost_models_rows_gets_no_proposals(arch_case) -> None:
    """On a compute-bound path (a GGUF model's blocks, at most ``max_rows`` rows) proposals
    only fill the rows left: a full batch decodes one token a step, a lone request speculates;
    outputs stay exact either way."""
    model_dir, prompt_ids, expected = arch_case
    llm = spec_llm(model_dir, Oracle(prompt_ids, expected))
    llm.engine.speculator.cost = StepCost(QUANTIZED_ROW_COST, max_rows=3)
    steps: list[tuple[int, int]] = []  # (rows, proposed tokens) of each step
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append(
            (batch.total_tokens, sum(len(r.sampling.draft.token_ids) for r in batch.requests))
        )
        return batch

    llm.engine.scheduler.schedule = recording
    _assert_matches(llm.generate(prompt_ids[:1], GREEDY), expected[:1])
    assert sum(d for _, d in steps) > 0
    _assert_matches(llm.generate(prompt_ids[1:5], GREEDY), expected[1:5])
    assert all(rows <= 3 for rows, drafted in steps if drafted)
    assert any(rows == 4 and not drafted for rows, drafted in steps)  # four decoding: no room
    llm.engine.kv.pool.check_all_free()


def test_pd_decode_engine_speculates(pd, llama_dir: Path) -> None:
    prefill, _, client = pd
    prompt = list(range(5, 40)) * 2
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = LLM(str(llama_dir), kv_cache_tokens=2048, block_size=8).generate([prompt], params)[0]
    cfg = EngineConfig(
        model=str(llama_dir), kv_cache_tokens=2048, block_size=8, speculative_method="ngram"
    )
    decode = LLMEngine(cfg)
    decode.speculator.proposer = Oracle([prompt], [ref.token_ids])
    constant_costs(decode)
    handle = prefill_handoff(prefill, "p", prompt, params)
    decode.add_request("d", prompt, params, kv_transfer=handle)
    decode.step()
    run_pulls(decode, client)
    out = drain_one(decode, "d")
    assert out.outputs[0].token_ids == ref.token_ids
    assert decode.stats().spec_num_accepted_tokens > 0
    decode.kv.pool.check_all_free()


# ----- the parts ----------------------------------------------------------------------------
def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3) == ([4, 5, 1], 3)
    assert propose_ngram([9, 2, 3, 7, 1, 2, 3, 8, 6, 2, 3], 2) == ([8, 6], 2)  # the latest one
    assert propose_ngram([1, 2, 3, 4, 5, 6, 7], 3) == ([], 0)
    assert propose_ngram([5, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 5) == ([3, 4, 1, 2, 3], 4)  # a period
    assert propose_ngram([7, 7, 7], 4) == ([7, 7, 7, 7], 2)
    # the longest n-gram wins over a later shorter one
    assert propose_ngram([4, 1, 2, 9, 8, 1, 2, 6, 4, 1, 2], 1) == ([9], 3)
    assert propose_ngram([1, 2, 1, 2], 0) == ([], 0)
    # the last token alone: a weak match, what picks a copy up again right after an edit
    assert propose_ngram([5, 6, 7, 8, 9, 3, 6], 2) == ([7, 8], 1)
    assert propose_ngram([5, 6, 7, 8, 9, 3, 6], 2, min_n=2) == ([], 0)


def test_proposal_length_adapts_to_acceptance() -> None:
    d = Draft()
    assert d.next_length(4) == 4
    d.record(4, 1, 4)
    assert d.next_length(4) == 2
    d.record(2, 2, 4)
    assert d.next_length(4) == 4
    skipped = []
    for _ in range(6):
        d.record(1, 0, 4)
        n = 0
        while d.next_length(4) == 0:
            n += 1
        skipped.append(n)
    assert skipped == [1, 3, 7, 15, MAX_SKIP, MAX_SKIP]


def test_the_cost_model_adds_rows_only_while_they_pay() -> None:
    quantized = StepCost(QUANTIZED_ROW_COST, max_rows=8)
    assert quantized.plan(1, [4], [0.8]) == [3]  # the 4th token's 0.41 no longer pays its row
    assert quantized.plan(1, [8], [0.95]) == [7]  # a run that agrees proposes up to the room
    assert quantized.plan(1, [4], [0.15]) == [1]  # a probe only (its backoff spaces them)
    assert quantized.plan(4, [4] * 4, [0.8] * 4) == [1] * 4  # the room, one each
    assert quantized.plan(8, [4] * 8, [0.9] * 8) == [0] * 8  # a full batch: none
    assert quantized.plan(6, [4, 4, 0], [0.3, 0.9, 0.9]) == [1, 1, 0]
    assert quantized.plan(1, [0], [0.9]) == [0]  # backing off
    cheap = StepCost(0.05)  # weight-read bound: no cap on rows
    assert cheap.plan(16, [4] * 16, [0.9] * 16) == [3] * 16
    assert cheap.plan(1, [4], [0.9]) == [4]
    # A draft model's pass costs a third of a step: its deeper positions must pay for it.
    drafted = StepCost(0.05, pass_cost=0.35)
    assert drafted.plan(1, [4], [0.5]) == [1]  # the probe; a second pass would not pay
    assert drafted.plan(1, [4], [0.9]) == [4]
    assert drafted.plan(8, [4] * 8, [0.9] * 8) == [3] * 8  # each pass serves every request


def test_acceptance_estimate_follows_recent_proposals() -> None:
    d = Draft()
    assert d.acceptance == 0.5
    for _ in range(10):
        d.record(4, 4, 4)
    assert d.acceptance > 0.95
    for _ in range(10):
        d.record(4, 0, 4)
    assert d.acceptance < 0.35  # the misses weigh one token each, a full run four


def test_acceptance_is_estimated_apart_after_a_whole_and_after_a_broken_proposal() -> None:
    """An edit copies in runs: after a proposal kept whole the next one mostly is too, while
    the first after a break often misses; one estimate for both would price the runs at the
    breaks' rate."""
    d = Draft()
    for _ in range(8):  # runs of five whole proposals, each broken by an edit
        for proposed, accepted in [(4, 4)] * 5 + [(4, 1), (4, 0), (4, 0)]:
            d.record(proposed, accepted, 4)
    assert not d.whole and d.acceptance < 0.75  # after a break: two of three missed
    d.record(4, 4, 4)
    assert d.whole and d.acceptance > 0.9  # in a run: all but the edit's token agree


def test_a_weak_match_is_priced_by_its_own_estimate_and_never_backs_the_lookup_off() -> None:
    """A 1-gram match guesses: its misses must neither lower the estimate longer matches are
    priced by, nor make the request skip steps, and it gets no free row."""
    d = Draft()
    d.record(4, 3, 4)
    strong = d.acceptance
    d.weak = True
    assert not d.free and d.acceptance == 0.5  # its own prior
    for _ in range(5):
        d.record(2, 0, 4)
    assert d.acceptance < 0.1 and d.skip == 0 and d.misses == 0 and d.verified == 1
    d.weak = False
    assert d.free and d.acceptance == strong  # untouched by the weak misses
    assert d.next_length(4) == 4


def test_config_is_checked_at_the_edge() -> None:
    for bad in (
        dict(speculative_method="eagle"),
        dict(speculative_method="ngram", num_speculative_tokens=0),
        dict(speculative_method="draft", speculative_model="m"),
    ):
        with pytest.raises(ConfigError):
            EngineConfig(model="m", **bad)
