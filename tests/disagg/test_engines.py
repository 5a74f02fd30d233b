"""Prefill/decode disaggregation at the engine level: two engines and the real TCP transport."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from tandem.server.disagg.puller import KVPuller
from tandem.server.engine import LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig

from .utils import drain_one, prefill_handoff, run_pulls

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_disaggregated_greedy_equals_aggregated_and_frees_everything(pd, llama_dir: Path) -> None:
    prefill, decode, client = pd
    prompt = list(range(5, 70))
    both = LLMEngine(EngineConfig(model=str(llama_dir), kv_cache_tokens=2048, block_size=8))
    both.add_request("ref", prompt, GREEDY)
    expected = drain_one(both, "ref").token_ids

    handle = prefill_handoff(prefill, "p", prompt, GREEDY)
    assert prefill.stats().num_leases == 1 and handle["remote_num_tokens"] == len(prompt)
    assert client.layout() == decode.kv_layout
    decode.add_request("d", prompt, GREEDY, kv_transfer=handle, stream=True)
    decode.step()
    run_pulls(decode, client)
    out = drain_one(decode, "d", stream=True)
    assert out.token_ids == expected and out.error is None
    prefill.sweep_leases()  # the release lands at the next sweep
    assert prefill.stats().num_leases == 0
    prefill.kv.pool.check_all_free()
    decode.kv.pool.check_all_free()


def test_decode_prefix_hits_pull_only_the_missing_tail(pd) -> None:
    prefill, decode, client = pd
    shared = list(range(100, 140))  # 5 full blocks of 8
    decode.add_request("warm", shared + [7], SamplingParams(max_tokens=1))
    drain_one(decode, "warm")
    prompt = shared + list(range(200, 220))
    handle = prefill_handoff(prefill, "p", prompt, GREEDY)
    decode.add_request("d", prompt, GREEDY, kv_transfer=handle)
    decode.step()
    (task,) = decode.take_pull_tasks()
    assert len(task.remote_block_ids) == len(handle["remote_block_ids"]) - 5
    client.pull(task.lease_id, task.remote_block_ids, decode.kv_cache, task.local_block_ids)
    decode.complete_pull("d")
    assert drain_one(decode, "d").error is None


def test_unpulled_lease_expires_and_frees_the_prefill_blocks(llama_dir: Path) -> None:
    prefill = LLMEngine(
        EngineConfig(model=str(llama_dir), kv_cache_tokens=1024, block_size=8, kv_lease_seconds=30)
    )
    prefill_handoff(prefill, "p", list(range(5, 40)), GREEDY)
    assert prefill.stats().free_blocks < prefill.stats().total_blocks
    leases = prefill.handoff.leases
    assert leases.sweep() == 0  # not yet: the clock is injected, nothing races it
    assert leases.sweep(now=time.monotonic() + 31) == 1 and leases.num_expired == 1
    prefill.kv.pool.check_all_free()


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_failed_pull_frees_decode_blocks(pd, llama_dir: Path, fallback: str) -> None:
    prefill, _, client = pd
    decode = LLMEngine(
        EngineConfig(
            model=str(llama_dir), kv_cache_tokens=2048, block_size=8, kv_pull_fallback=fallback
        )
    )
    prompt = list(range(5, 50))
    handle = prefill_handoff(prefill, "p", prompt, GREEDY)
    prefill.release_lease(handle["remote_lease_id"])
    prefill.sweep_leases()  # the lease is gone: the pull must fail
    decode.add_request("d", prompt, GREEDY, kv_transfer=handle)
    decode.step()
    run_pulls(decode, client)
    out = drain_one(decode, "d")
    if fallback == "error":
        assert (
            out.finish_reason == "abort" and "KV transfer" in out.error and "unknown" in out.error
        )
    else:
        assert out.error is None and len(out.token_ids) == GREEDY.max_tokens
    decode.kv.pool.check_all_free()


def test_abort_during_pull_frees_blocks_only_after_the_pull(pd) -> None:
    prefill, decode, client = pd
    prompt = list(range(5, 50))
    handle = prefill_handoff(prefill, "p", prompt, GREEDY)
    decode.add_request("d", prompt, GREEDY, kv_transfer=handle)
    decode.step()
    (task,) = decode.take_pull_tasks()
    decode.abort_request("d")
    assert decode.stats().free_blocks < decode.stats().total_blocks  # still being written
    client.pull(task.lease_id, task.remote_block_ids, decode.kv_cache, task.local_block_ids)
    decode.complete_pull("d")
    decode.kv.pool.check_all_free()


def test_layout_mismatch_is_reported_clearly(pd, llama_dir: Path) -> None:
    _, _, client = pd
    other = LLMEngine(EngineConfig(model=str(llama_dir), kv_cache_tokens=1024, block_size=16))
    problem = other.kv_layout.mismatch(client.layout())
    assert problem is not None and "block_size: remote 8 vs local 16" in problem


def test_mismatched_prompt_length_is_refused(pd) -> None:
    prefill, decode, _ = pd
    handle = prefill_handoff(prefill, "p", list(range(5, 30)), GREEDY)
    with pytest.raises(ValueError, match="tokenize differently"):
        decode.add_request("d", list(range(5, 31)), GREEDY, kv_transfer=handle)


@pytest.mark.parametrize("stream", [False, True])
def test_first_token_that_stops_ends_the_decode_without_a_pull(pd, stream: bool) -> None:
    """The prefill's one token already ends the request: the decode engine answers it at once
    (the proxy passes that through) and only releases the lease; no block is pulled or held."""
    prefill, decode, client = pd
    prompt = list(range(5, 50))
    handle = prefill_handoff(prefill, "p", prompt, GREEDY)
    first = handle["first_token_ids"][0]
    stops = GREEDY.clone(stop_token_ids=[first])
    decode.add_request("d", prompt, stops, kv_transfer=handle, stream=stream)
    out = drain_one(decode, "d", stream=stream)
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.error is None
    (task,) = decode.take_pull_tasks()
    assert task.lease_id == handle["remote_lease_id"] and task.remote_block_ids == []
    assert prefill.stats().num_leases == 1
    puller = KVPuller(lambda: decode.kv_layout)  # what the server's engine loop runs
    done: Future = Future()
    puller.submit(task, decode.kv_cache, lambda rid, error: done.set_result((rid, error)))
    assert done.result(timeout=30) == ("d", None)
    puller.close()
    decode.complete_pull("d")  # the request is over: nothing changes
    prefill.sweep_leases()  # the release lands at the next sweep
    assert prefill.stats().num_leases == 0
    prefill.kv.pool.check_all_free()
    decode.kv.pool.check_all_free()
