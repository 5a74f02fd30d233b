"""A step in which one request fails fails that request alone (issue 26, item 1).

A fault is injected into one row of a real step (its logits become NaN), and the batch is
compared, token for token, with the same batch run without it: every other request generates
exactly what it did, the faulty one ends with ``finish_reason: error`` and its error, and
every block goes back to the pool.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.server.engine import LLMEngine, RequestOutput, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.sampler import LOGITS_NOT_FINITE, NO_TOKEN_ALLOWED
from tandem.server.engine.scheduler import ScheduledBatch
from tandem.server.engine.structured import GrammarError, GrammarSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = {"a": "the cache holds", "b": "every key gets", "c": "tokens are drawn", "bad": "x y z"}


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(llama_dir), kv_cache_tokens=2048, max_model_len=256, max_num_seqs=8)
    )


def _run(engine: LLMEngine, params: dict[str, SamplingParams]) -> dict[str, RequestOutput]:
    """Add every request, then step until all finish; the final output of each (deltas of a
    streamed one merged)."""
    for rid, p in params.items():
        engine.add_request(rid, PROMPTS[rid], p, stream=rid == "bad")
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = (
                outs[out.request_id].merge(out) if out.request_id in outs else out
            )
    engine.kv.pool.check_all_free()
    return outs


def _poison_row(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, group_id: str, at_step: int
) -> None:
    """From step ``at_step`` on, the logits of ``group_id``'s rows are NaN."""
    execute: Callable = engine.worker.execute
    steps = itertools.count()

    def poisoned(batch: ScheduledBatch) -> tuple:
        logits, hidden, sampling = execute(batch)
        if next(steps) >= at_step:
            with torch.inference_mode():  # the model's logits are inference tensors
                for i, req in enumerate(sampling):
                    if req.group_id == group_id:
                        logits[i] = float("nan")
        return logits, hidden, sampling

    monkeypatch.setattr(engine.worker, "execute", poisoned)


@pytest.mark.parametrize("n", [1, 2])
def test_a_faulty_row_fails_its_request_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    params = {rid: GREEDY for rid in PROMPTS}
    params["bad"] = SamplingParams(temperature=0.7, seed=3, n=n, max_tokens=10, ignore_eos=True)
    clean = _run(engine, params)
    _poison_row(engine, monkeypatch, "bad", at_step=4)
    faulty = _run(engine, params)
    for rid in ("a", "b", "c"):
        assert faulty[rid].token_ids == clean[rid].token_ids and len(clean[rid].token_ids) == 10
        assert faulty[rid].finish_reason == "length" and faulty[rid].error is None
    bad = faulty["bad"]
    assert bad.finished and bad.error_code == LOGITS_NOT_FINITE and "not finite" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"] * n
    first = bad.outputs[0].token_ids  # what it drew before the fault stays its own
    assert 0 < len(first) < 10 and first == clean["bad"].outputs[0].token_ids[: len(first)]


def test_hostile_parameters_run_beside_greedy_requests_unchanged(engine: LLMEngine) -> None:
    clean = _run(engine, {rid: GREEDY for rid in ("a", "b", "c")})
    hostile = [
        SamplingParams(temperature=1e-300, max_tokens=10, ignore_eos=True),
        SamplingParams(repetition_penalty=1e-300, max_tokens=10, ignore_eos=True),
        SamplingParams(repetition_penalty=1e300, temperature=1e300, max_tokens=10, seed=1),
    ]
    for params in hostile:
        outs = _run(engine, {"a": GREEDY, "b": GREEDY, "c": GREEDY, "bad": params})
        assert all(outs[r].token_ids == clean[r].token_ids for r in ("a", "b", "c"))
        assert outs["bad"].error is None and outs["bad"].finish_reason in ("stop", "length")
        assert all(0 <= t < engine.model_config.vocab_size for t in outs["bad"].token_ids)


def test_a_grammar_with_no_way_on_fails_its_request_alone(engine: LLMEngine) -> None:
    """One choice, then min_tokens forbids the end the grammar insists on: no token is left."""
    clean = _run(engine, {"a": GREEDY, "b": GREEDY})
    stuck = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        min_tokens=39,
        structured=GrammarSpec("choice", json.dumps(["yes"])),
    )
    outs = _run(engine, {"a": GREEDY, "b": GREEDY, "bad": stuck})
    assert outs["a"].token_ids == clean["a"].token_ids
    assert outs["b"].token_ids == clean["b"].token_ids
    bad = outs["bad"]
    assert bad.finish_reason == "error" and bad.error_code == NO_TOKEN_ALLOWED
    assert engine.tokenizer.decode(bad.token_ids) == "yes"


def test_a_grammar_that_allows_no_first_token_is_refused_at_compile_time(
    engine: LLMEngine,
) -> None:
    spec = GrammarSpec("regex", r"[^\s\S]")  # compiles; no string matches it
    with pytest.raises(GrammarError, match="allows no first token"):
        engine.grammars.submit(spec).result()
    with pytest.raises(GrammarError):  # the request's 400, before it is queued
        engine.add_request("bad", "x", SamplingParams(max_tokens=4, structured=spec))
    assert not engine.has_unfinished_requests()
