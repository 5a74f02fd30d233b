"""Incremental detokenization and stop conditions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.server.engine import LLM, LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), kv_cache_tokens=4096)


def test_incremental_text_never_breaks_utf8_and_ends_equal_to_full_decode(llm: LLM) -> None:
    tok = llm.tokenizer
    texts = ["Emoji 🚀🎉🤖✅ and 東京の天気 и Привет", "plain ascii", "∑ᵢ xᵢ² ≥ 0 π≈3.14"]
    rng = random.Random(0)
    sequences = [tok.encode(t) for t in texts] + [
        [rng.randrange(3, 1024) for _ in range(60)] for _ in range(20)
    ]
    for ids in sequences:
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add([t]) for t in ids]
        pieces.append(detok.finish())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        if ids in sequences[:3]:
            assert all(
                "\ufffd" not in p for p in pieces
            )  # valid text never shows a replacement char


def test_multibyte_characters_are_split_across_tokens_in_this_tokenizer(llm: LLM) -> None:
    """Guards the test above: the emoji must really span several byte tokens."""
    ids = llm.tokenizer.encode("🚀")
    assert len(ids) > 1
    assert "\ufffd" in llm.tokenizer.decode(ids[:1])


def _split_stop_case(llm: LLM) -> tuple[str, str, str]:
    """A prompt, a stop string that starts inside one token's text and ends two tokens later,
    and the text before it, taken from the model's own greedy output."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tok = llm.tokenizer
    for prompt in [
        "The cat",
        "Hello",
        "The scheduler",
        "A block",
        "Streaming responses",
        "Once upon",
    ]:
        ids = llm.generate(prompt, params)[0].token_ids
        pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
        for i in range(1, len(ids) - 3):
            window = pieces[i : i + 4]
            if any("\ufffd" in w for w in window) or not all(
                window[j + 1].startswith(window[j]) for j in range(3)
            ):
                continue
            if len(window[1]) - len(window[0]) >= 2 and len(window[3]) > len(window[2]):
                begin = len(window[0]) + 1
                return prompt, window[3][begin:], window[3][:begin]
    raise AssertionError("no clean window in the model's outputs")


def test_stop_string_split_across_tokens_is_found(llm: LLM) -> None:
    prompt, stop, before = _split_stop_case(llm)
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, base)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == before
    kept = llm.generate(prompt, base.clone(include_stop_str_in_output=True))[0]
    assert kept.text == before + stop


def test_streamed_text_holds_back_a_possible_stop_prefix(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), kv_cache_tokens=4096))
    engine.add_request(
        "s",
        "The cat",
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["\u2603never"]),
        stream=True,
    )
    seen = [""]  # the text as a client has it after each delta
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(seen[-1] + out.text)
    seen = seen[1:]
    assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1))  # only ever grows
    full = seen[-1]
    assert any(len(s) <= len(full) - len("\u2603never") + 1 for s in seen[:-1])


def test_stop_token_ids_eos_min_tokens_and_max_tokens(llm: LLM) -> None:
    base = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(
        "Hello", SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.outputs[0].stop_reason == stop_tok
    late = llm.generate(
        "Hello",
        SamplingParams(
            temperature=0.0, max_tokens=16, stop_token_ids=[stop_tok], min_tokens=first + 1
        ),
    )[0]
    assert len(late.token_ids) > first + 1
    eos = next(iter(llm.engine.eos_token_ids))
    forced = llm.generate(
        "Hello", SamplingParams(temperature=0.0, max_tokens=16, logit_bias={eos: 100.0})
    )[0]
    assert forced.token_ids == [eos] and forced.finish_reason == "stop" and forced.text == ""
    ignored = llm.generate(
        "Hello",
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={eos: 100.0}),
    )[0]
    assert ignored.token_ids == [eos] * 5 and ignored.finish_reason == "length"
