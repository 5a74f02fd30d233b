"""The engine's request-level API: errors, sessions, sleep."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.server.engine import (
    EngineBusyError,
    EngineSleepingError,
    InvalidParamError,
    LLMEngine,
    PromptTooLongError,
    SamplingParams,
)
from tandem.server.engine.config import ConfigError, EngineConfig

from .utils import drain


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(llama_dir), kv_cache_tokens=2048, max_model_len=256, max_num_seqs=4)
    )


def test_bad_requests_are_refused_with_the_field_named(engine: LLMEngine) -> None:
    with pytest.raises(PromptTooLongError) as e:
        engine.add_request("long", list(range(3, 300)), SamplingParams())
    assert "maximum context length is 256" in str(e.value)
    with pytest.raises(PromptTooLongError) as e:
        engine.add_request("long2", [5] * 200, SamplingParams(max_tokens=100))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidParamError) as e:
        engine.add_request("vocab", [5, 10**6], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParamError):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidParamError) as e:
        engine.add_request("many", [5], SamplingParams(n=5))
    assert e.value.param == "n"
    for kwargs in (
        {"max_tokens": -1},
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"logprobs": 21},
        {"top_k": 0},
    ):
        with pytest.raises(InvalidParamError):
            SamplingParams(**kwargs)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ConfigError):
        EngineConfig(model="x", block_size=12)


def test_max_num_seqs_bounds_the_running_set(engine: LLMEngine) -> None:
    for i in range(10):
        engine.add_request(f"q{i}", [5 + i, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 4
    engine.kv.pool.check_all_free()


def test_session_second_turn_prefills_only_new_tokens(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    turn1 = engine.tokenizer.encode("Sessions keep a conversation's blocks between turns.")
    engine.add_request("t1", turn1, params, session_id="chat")
    first = drain(engine)["t1"]
    assert len(engine.sessions) == 1
    held = engine.stats()
    assert held.free_blocks < held.total_blocks  # the session keeps its blocks
    history = turn1 + first.token_ids
    turn2 = history + engine.tokenizer.encode(" And the next turn only prefills what is new.")
    engine.add_request("t2", turn2, params, session_id="chat")
    second = drain(engine)["t2"]
    computed_before = len(history) - 1  # the last sampled token's K/V was never computed
    assert second.num_cached_tokens == computed_before
    engine.kv.pool.reset_prefix_cache()  # the stateless reference must not lean on any cache
    engine.add_request("stateless", turn2, params)
    assert drain(engine)["stateless"].token_ids == second.token_ids
    assert engine.sessions.delete("chat") and len(engine.sessions) == 0
    engine.kv.pool.check_all_free()


def test_session_with_a_diverging_prompt_recomputes_from_the_divergence(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(10, 50)), params, session_id="s")
    drain(engine)
    engine.add_request("b", list(range(10, 30)) + [99] * 10, params, session_id="s")
    with pytest.raises(InvalidParamError):
        engine.add_request("c", [5, 6], params, session_id="s")  # one turn at a time
    out = drain(engine)["b"]
    assert out.num_cached_tokens == 20
    engine.add_request("ref", list(range(10, 30)) + [99] * 10, params)
    assert drain(engine)["ref"].token_ids == out.token_ids
    assert engine.sessions.expire(0.0) == 1
    engine.kv.pool.check_all_free()


def test_sleep_releases_memory_and_wake_up_restores_generation(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("before", [5, 6, 7, 8], params)
    expected = drain(engine)["before"].token_ids
    engine.add_request("busy", [5, 6], params)
    with pytest.raises(EngineBusyError):
        engine.sleep(1)
    engine.abort_request("busy")
    for level in (1, 2):
        engine.sleep(level)
        assert engine.is_sleeping and engine.kv_cache.data.numel() == 0
        with pytest.raises(EngineSleepingError):
            engine.add_request("asleep", [5, 6, 7, 8], params)
        engine.wake_up()
        engine.add_request(f"after{level}", [5, 6, 7, 8], params)
        assert drain(engine)[f"after{level}"].token_ids == expected
