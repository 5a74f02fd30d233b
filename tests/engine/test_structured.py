"""Constrained decoding in the engine on a tiny random-weights model: only the grammar makes
the output valid, so every output that finishes with ``stop`` matching its schema is the proof."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from tandem.server.engine import LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.structured import GrammarError, GrammarSpec

from ..disagg.utils import drain_one, prefill_handoff, run_pulls
from .utils import drain

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"type": "string", "enum": ["cache", "sampler"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"oncall": {"type": "boolean"}},
            "required": ["oncall"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


def make(model_dir: Path, **kw: object) -> LLMEngine:
    cfg = dict(model=str(model_dir), kv_cache_tokens=4096, max_model_len=512, max_num_seqs=16)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    return make(llama_dir)


def valid_stops(outs: list) -> int:
    n = 0
    for c in outs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
            n += 1
    return n


def test_json_schema_n4_mixed_batch_and_logprobs(engine: LLMEngine) -> None:
    """n=4 (a matcher per sequence) beside an unconstrained request in the same steps."""
    params = SamplingParams(
        n=4, temperature=1.0, seed=1, max_tokens=200, structured=SPEC, logprobs=2
    )
    engine.add_request("c", "Describe a component:", params)
    engine.add_request("free", "Describe a component:", SamplingParams(max_tokens=20, seed=1))
    done = drain(engine)
    outs = done["c"].outputs
    assert len(outs) == 4
    assert valid_stops(outs) >= 3
    for c in outs:  # logprobs from the masked distribution: forbidden tokens never appear
        for lp in c.logprobs:
            assert lp.logprob > float("-inf")
            assert lp.top[0][1] > float("-inf")
    assert done["free"].outputs[0].finish_reason is not None


def test_regex_choice_json_and_grammar(engine: LLMEngine) -> None:
    cases = {
        "re": GrammarSpec("regex", r"[a-z]{3}-[0-9]{2}"),
        "ch": GrammarSpec("choice", json.dumps(["yes", "no", "maybe so"])),
        "js": GrammarSpec("json"),
        "gr": GrammarSpec("grammar", 'root ::= "(" [0-9]+ ")"'),
    }
    for rid, spec in cases.items():
        engine.add_request(rid, "Answer:", SamplingParams(max_tokens=100, seed=2, structured=spec))
    done = drain(engine)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", done["re"].outputs[0].text)
    assert done["ch"].outputs[0].text in ("yes", "no", "maybe so")
    if done["js"].outputs[0].finish_reason == "stop":
        json.loads(done["js"].outputs[0].text)
    g = done["gr"].outputs[0]
    assert re.fullmatch(r"\(\d+\)" if g.finish_reason == "stop" else r"\(\d*", g.text)


def test_length_cutoff_returns_the_partial_json(engine: LLMEngine) -> None:
    engine.add_request("cut", "x", SamplingParams(max_tokens=3, seed=0, structured=SPEC))
    out = drain(engine)["cut"].outputs[0]
    assert out.finish_reason == "length"
    assert out.text.startswith("{") and len(out.token_ids) == 3


def test_uncompilable_schema_is_refused_naming_the_problem(engine: LLMEngine) -> None:
    bad = GrammarSpec("regex", "(unclosed")
    with pytest.raises(GrammarError) as e:
        engine.add_request("bad", "x", SamplingParams(structured=bad))
        drain(engine)
        engine.add_request("bad2", "x", SamplingParams(structured=bad))  # cached failure: at once
    assert "regex" in str(e.value)


def test_preemption_keeps_every_matcher_valid(llama_dir: Path) -> None:
    """A KV cache too small for the batch forces preemption and recompute mid-output."""
    small = make(llama_dir, kv_cache_tokens=256, block_size=16, max_num_seqs=8)
    for i in range(8):
        small.add_request(
            f"p{i}", f"Component {i}:", SamplingParams(max_tokens=120, seed=i, structured=SPEC)
        )
    done = drain(small)
    assert small.stats().num_preemptions > 0
    outs = [done[f"p{i}"].outputs[0] for i in range(8)]
    assert valid_stops(outs) >= 6


def test_pd_prefill_samples_under_the_grammar_and_decode_resumes(pd, llama_dir: Path) -> None:
    """The prefill engine's one token obeys the grammar; the decode engine's matcher starts
    from it, and the whole output equals an aggregated run's token for token (same seed)."""
    prefill, decode, client = pd
    prompt = list(range(5, 40))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=120, structured=SPEC)
    both = make(llama_dir, block_size=8)
    both.add_request("ref", prompt, params)
    expected = drain_one(both, "ref")
    handle = prefill_handoff(prefill, "p", prompt, params)
    decode.grammars.submit(SPEC).result()  # as the API does: compiled before it is added
    decode.add_request("d", prompt, params, kv_transfer=handle)
    decode.step()
    run_pulls(decode, client)
    out = drain_one(decode, "d")
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert valid_stops(out.outputs) == 1


def test_grammar_starts_after_the_thinking(engine: LLMEngine) -> None:
    """With ``after_token_ids`` the matcher neither masks nor advances until they appear."""
    from tandem.server.engine.structured import apply_grammar_masks

    think_end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False))
    spec = GrammarSpec("regex", "ok", after_token_ids=think_end)
    seq = engine.grammars.sequence(engine.grammars.submit(spec).result(), spec)
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(1, vocab)
    apply_grammar_masks(logits, [seq])
    assert torch.isfinite(logits).all()  # thinking: free
    out = list(engine.tokenizer.encode("hmm", add_special_tokens=False))
    for t in think_end:
        out.append(t)
        seq.advance(out)
    assert seq.active
    apply_grammar_masks(logits, [seq])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all("ok".startswith(engine.tokenizer.decode([t])) for t in allowed)


def test_session_turns_each_follow_their_grammar(engine: LLMEngine) -> None:
    """A session's second turn reuses the first's KV blocks; its matcher starts afresh."""
    first = list(range(10, 60))
    params = SamplingParams(max_tokens=150, seed=4, structured=SPEC)
    engine.add_request("t1", first, params, session_id="s")
    out1 = drain(engine)["t1"]
    second = first + list(out1.outputs[0].token_ids) + list(range(70, 90))
    engine.add_request("t2", second, params.clone(seed=5), session_id="s")
    out2 = drain(engine)["t2"]
    assert out2.num_cached_tokens > 0
    assert valid_stops(out1.outputs + out2.outputs) == 2
    engine.sessions.delete("s")


def test_a_step_mixing_constrained_and_free_rows_masks_only_the_constrained(
    engine: LLMEngine,
) -> None:
    """The model returns inference tensors; a step with a grammar row and a free row masks the
    first in place and leaves the second alone (it once raised outside inference mode)."""
    from tandem.server.engine.structured import apply_grammar_masks

    spec = GrammarSpec("regex", "ok")
    seq = engine.grammars.sequence(engine.grammars.submit(spec).result(), spec)
    vocab = engine.model_config.vocab_size
    with torch.inference_mode():
        logits = torch.zeros(2, vocab)
    apply_grammar_masks(logits, [seq, None])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and len(allowed) < vocab
    assert engine.tokenizer.decode([allowed[0]]) in ("o", "ok")
    assert torch.isfinite(logits[1]).all()
