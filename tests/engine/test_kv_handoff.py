"""The P/D handoff's bookkeeping, without a model or a transport: which requests are
disaggregated, a prefill's blocks put under a lease with the handle the decode side reads,
and a decode request waiting for blocks, queueing its pull and taking the pull's outcome.
The parts are the engine's own (``LLMEngine`` wires them the same way), block size 4."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.server.engine.config import EngineConfig
from tandem.server.engine.kv_cache_manager import KVCacheManager
from tandem.server.engine.kv_handoff import KVHandoff
from tandem.server.engine.kv_transfer import KVLayout, PullTask, RemotePrefill, handoff_params
from tandem.server.engine.request import Request, RequestStatus
from tandem.server.engine.sampling_params import InvalidParamError, SamplingParams
from tandem.server.engine.scheduler import Scheduler
from tandem.server.engine.stopping import Stop, stop_by_token

from .utils import make_request

BS = 4
PROMPT = list(range(1, 11))  # 10 tokens: 3 blocks
REMOTE_BLOCKS = [7, 8, 9]
FIRST_TOKEN = 42


def make_handoff(num_blocks: int = 16, **config: Any) -> KVHandoff:
    cfg = EngineConfig(model="unused", block_size=BS, **config)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    return KVHandoff(cfg, kv, scheduler, KVLayout(2, 2, 8, BS, "float32"))


def remote_handle(num_tokens: int = len(PROMPT), **changes: Any) -> dict[str, Any]:
    """What a prefill engine hands out for ``PROMPT`` (``handoff_params``)."""
    p = handoff_params(
        "prefill-engine", REMOTE_BLOCKS, num_tokens, "lease-1", "10.0.0.1:7000", [FIRST_TOKEN], 30
    )
    return {**p, **changes}


def decode_request(h: KVHandoff, wait: bool = True) -> Request:
    """A decode-role request as the engine queues it: the prefill's first token taken as its
    own, then (unless that token ended it) waiting for blocks to pull into."""
    params, state = h.parse(remote_handle(), SamplingParams(), None, len(PROMPT))
    req = make_request(PROMPT, "d", params=params)
    req.handoff = state
    req.output_token_ids.append(state.remote_prefill.first_token_ids[0])
    if wait:
        h.wait_for_blocks(req)
    return req


# ----- which requests are disaggregated ----------------------------------------------------
@pytest.mark.parametrize("kv_transfer", [None, {}, {"do_remote_decode": False}])
def test_a_request_without_a_p_d_role_is_left_as_it_is(kv_transfer: Any) -> None:
    params = SamplingParams(max_tokens=9)
    assert make_handoff().parse(kv_transfer, params, "s", 3) == (params, None)


def test_a_prefill_role_request_runs_one_token_whatever_it_asked_for() -> None:
    asked = SamplingParams(max_tokens=50, min_tokens=5, temperature=0.3)
    params, state = make_handoff().parse({"do_remote_decode": True}, asked, None, 10)
    assert (params.max_tokens, params.min_tokens, params.temperature) == (1, 0, 0.3)
    assert asked.max_tokens == 50  # the caller's params are not changed
    assert state.remote_decode and state.remote_prefill is None


def test_a_decode_role_request_gets_the_prefills_handle() -> None:
    params, state = make_handoff().parse(remote_handle(), SamplingParams(), None, len(PROMPT))
    assert params.max_tokens == 16 and not state.remote_decode
    assert state.remote_prefill == RemotePrefill(
        "prefill-engine", REMOTE_BLOCKS, 10, "lease-1", "10.0.0.1:7000", [FIRST_TOKEN]
    )


@pytest.mark.parametrize(
    ("kv_transfer", "params", "session", "why"),
    [
        ({"do_remote_decode": True}, SamplingParams(n=2), None, "n=1"),
        ({"do_remote_decode": True}, SamplingParams(), "s", "no session"),
        (remote_handle(num_tokens=9), SamplingParams(), None, "tokenize differently"),
        ({"do_remote_prefill": True, "remote_engine_id": "p"}, SamplingParams(), None, "handle"),
        (remote_handle(remote_block_ids="x,y"), SamplingParams(), None, "handle"),
        (remote_handle(first_token_ids=[1, 2]), SamplingParams(), None, "first_token_ids"),
    ],
)
def test_a_bad_handoff_request_is_refused(
    kv_transfer: dict, params: SamplingParams, session: str | None, why: str
) -> None:
    with pytest.raises(InvalidParamError, match=why) as err:
        make_handoff().parse(kv_transfer, params, session, len(PROMPT))
    assert err.value.param == "kv_transfer_params"


def test_kv_transfer_under_tensor_parallelism_is_refused() -> None:
    h = make_handoff(tensor_parallel_size=2)
    with pytest.raises(InvalidParamError, match="tensor_parallel_size"):
        h.parse({"do_remote_decode": True}, SamplingParams(), None, 10)


# ----- prefill side ------------------------------------------------------------------------
def prefill(h: KVHandoff) -> Request:
    """A prefill-role request run to its one token and finished as the engine does."""
    params, state = h.parse({"do_remote_decode": True}, SamplingParams(), None, len(PROMPT))
    req = make_request(PROMPT, "p", params=params, max_tokens=params.max_tokens)
    req.handoff = state
    h.scheduler.add(req)
    h.scheduler.update(h.scheduler.schedule())
    req.output_token_ids.append(FIRST_TOKEN)
    assert stop_by_token(req, FIRST_TOKEN, 1000) == Stop(RequestStatus.FINISHED_LENGTH)
    h.grant_lease(req)
    h.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    return req


def test_a_finished_prefill_keeps_its_blocks_under_a_lease_and_hands_out_the_handle() -> None:
    h = make_handoff()
    h.address = "127.0.0.1:7000"
    req = prefill(h)
    params = req.handoff.kv_transfer_params
    lease = params["remote_lease_id"]
    assert params == {
        "do_remote_prefill": True,
        "remote_engine_id": h.engine_id,
        "remote_block_ids": [1, 2, 3],
        "remote_num_tokens": 10,
        "remote_lease_id": lease,
        "remote_addr": "127.0.0.1:7000",
        "first_token_ids": [FIRST_TOKEN],
        "lease_expires_in": 30.0,
    }
    assert req.block_ids == [] and h.leases.blocks(lease) == [1, 2, 3]
    assert h.kv.pool.num_free == 12  # finishing freed nothing: the lease holds them
    assert h.release_lease(lease) and h.leases.sweep() == 1
    h.kv.pool.check_all_free()


def test_a_prefills_handle_is_what_a_decode_engine_accepts() -> None:
    handle = prefill(make_handoff()).handoff.kv_transfer_params
    _, state = make_handoff().parse(handle, SamplingParams(), None, len(PROMPT))
    assert state.remote_prefill.block_ids == [1, 2, 3]
    assert state.remote_prefill.first_token_ids == [FIRST_TOKEN]


def test_an_unreleased_lease_frees_its_blocks_when_it_expires() -> None:
    h = make_handoff(kv_lease_seconds=5.0)
    prefill(h)
    assert h.leases.sweep(now=h.leases.next_expiry()) == 1 and h.leases.num_expired == 1
    h.kv.pool.check_all_free()


# ----- decode side -------------------------------------------------------------------------
def test_a_decode_request_gets_blocks_then_queues_its_pull() -> None:
    h = make_handoff()
    req = decode_request(h)
    assert h.take_pull_tasks() == [] and h.waiting == [req]
    h.admit()
    assert h.waiting == [] and h.pulling == {"d": req} and req.handoff.pull_in_flight
    assert req.block_ids == [1, 2, 3] and req.num_computed_tokens == 0
    assert h.take_pull_tasks() == [
        PullTask("d", "10.0.0.1:7000", "lease-1", "prefill-engine", [7, 8, 9], [1, 2, 3])
    ]
    assert h.take_pull_tasks() == []  # handed out once


def test_a_decode_request_waits_while_the_pool_is_short() -> None:
    h = make_handoff(num_blocks=4)  # 3 usable
    hog = make_request([90], "hog")
    assert h.kv.allocate(hog, 1)
    req = decode_request(h)
    h.admit()
    assert h.waiting == [req] and req.block_ids == [] and h.take_pull_tasks() == []
    h.kv.free(hog)
    h.admit()
    assert h.waiting == [] and req.block_ids == [2, 3, 1]  # the freed block last
    assert [t.local_block_ids for t in h.take_pull_tasks()] == [[2, 3, 1]]


def test_a_local_prefix_hit_pulls_only_the_tail() -> None:
    h = make_handoff()
    local = make_request(PROMPT[:8] + [99], "local")  # cached here before: blocks 1, 2
    assert h.kv.allocate(local, 9)
    h.kv.cache_full_blocks(local, 9)
    h.kv.free(local)
    req = decode_request(h)
    h.admit()
    assert req.block_ids == [1, 2, 4] and req.num_cached_tokens == 8
    (task,) = h.take_pull_tasks()
    assert (task.remote_block_ids, task.local_block_ids) == ([9], [4])


def test_a_landed_pull_computes_the_prompt_and_queues_the_request_first() -> None:
    h = make_handoff()
    h.scheduler.add(make_request([50, 51], "queued"))
    req = decode_request(h)
    h.admit()
    assert h.complete_pull("d", None) is None
    assert not req.handoff.pull_in_flight and h.pulling == {}
    assert req.num_computed_tokens == 10 and h.kv.pool.num_cached == 2
    assert h.scheduler.waiting[0] is req
    batch = h.scheduler.schedule()
    assert batch.num_new_tokens[0] == 1  # only the prefill's first token is computed here
    assert h.complete_pull("d", None) is None  # reported twice: nothing more happens


def test_a_failed_pull_ends_the_request_with_its_error_and_frees_its_blocks() -> None:
    h = make_handoff()
    req = decode_request(h)
    h.admit()
    assert h.complete_pull("d", "connection reset") is req
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert req.output.error_code == "kv_transfer_error"
    assert "prefill-engine" in req.output.error and "connection reset" in req.output.error
    assert req.times.finished is not None and req.block_ids == []
    assert len(h.scheduler) == 0
    h.kv.pool.check_all_free()


def test_a_failed_pull_with_the_recompute_fallback_prefills_locally() -> None:
    h = make_handoff(kv_pull_fallback="recompute")
    req = decode_request(h)
    h.admit()
    assert h.complete_pull("d", "connection reset") is None
    assert req.output.error is None and req.num_computed_tokens == 0
    assert h.scheduler.waiting[0] is req
    assert h.scheduler.schedule().num_new_tokens == [11]  # prompt and first token


def test_a_request_aborted_during_its_pull_frees_its_blocks_when_the_pull_ends() -> None:
    h = make_handoff()
    req = decode_request(h)
    h.admit()
    assert h.abort(req)  # the pull still writes into its blocks
    assert req.status is RequestStatus.FINISHED_ABORTED and req.block_ids == [1, 2, 3]
    assert h.complete_pull("d", None) is None
    assert req.block_ids == [] and len(h.scheduler) == 0
    h.kv.pool.check_all_free()


def test_a_request_aborted_while_waiting_for_blocks_leaves_the_queue() -> None:
    h = make_handoff()
    req = decode_request(h)
    assert not h.abort(req)
    assert h.waiting == []
    h.admit()
    assert h.take_pull_tasks() == []


def test_a_request_ended_by_its_first_token_only_releases_the_lease() -> None:
    h = make_handoff()
    h.release_unpulled(decode_request(h, wait=False))
    assert h.take_pull_tasks() == [
        PullTask("d", "10.0.0.1:7000", "lease-1", "prefill-engine", [], [])
    ]
    h.kv.pool.check_all_free()
