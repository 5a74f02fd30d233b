"""Scheduling decisions, without a model: budgets, chunks, admission, preemption, abort."""

from __future__ import annotations

from tandem.server.engine.kv_cache_manager import KVCacheManager
from tandem.server.engine.request import RequestStatus
from tandem.server.engine.scheduler import Scheduler

from .utils import make_request


def run_step(s: Scheduler):
    """Pretend the model ran: advance each scheduled request and sample one token at its end."""
    batch = s.schedule()
    s.update(batch)
    for req in batch.requests:
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(7)
    return batch


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    s = Scheduler(KVCacheManager(64, 4, True), max_num_seqs=8, max_num_batched_tokens=10)
    s.add(make_request(list(range(25)), "long"))
    sizes = [run_step(s).num_new_tokens for _ in range(4)]
    assert sizes == [[10], [10], [5], [1]]


def test_decodes_are_scheduled_before_prefills_and_budget_is_respected() -> None:
    s = Scheduler(KVCacheManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=12)
    s.add(make_request(list(range(5)), "a", 0))
    run_step(s)
    s.add(make_request(list(range(30)), "b", 1))
    batch = run_step(s)
    assert [r.request_id for r in batch.requests] == ["a", "b"]
    assert batch.num_new_tokens == [1, 11]
    assert batch.total_tokens <= 12


def test_admission_stops_when_blocks_run_out() -> None:
    s = Scheduler(KVCacheManager(5, 4, False), max_num_seqs=8, max_num_batched_tokens=100)
    s.add(make_request(list(range(12)), "a", 0))  # 3 blocks
    s.add(make_request(list(range(8)), "b", 1))  # 2 more: only 1 left
    batch = run_step(s)
    assert [r.request_id for r in batch.requests] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_max_num_seqs_caps_the_running_set() -> None:
    s = Scheduler(KVCacheManager(64, 4, False), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(make_request([1, 2, 3], f"r{i}", i))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_newest_request_is_preempted_and_recomputed_later() -> None:
    s = Scheduler(KVCacheManager(4, 4, False), max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_request([1, 2, 3], "old", 0), make_request([4, 5, 6], "new", 1)
    s.add(old)
    s.add(new)
    run_step(s)  # each holds 1 block (+1 free)
    for _ in range(2):
        run_step(s)  # decodes grow into second blocks
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert (
        new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and not new.block_ids
    )
    assert s.waiting[0] is new


def test_abort_frees_blocks_at_once_wherever_the_request_is() -> None:
    kv = KVCacheManager(16, 4, True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    running, waiting = (
        make_request(list(range(20)), "run", 0),
        make_request(list(range(9)), "wait", 1),
    )
    s.add(running)
    s.add(waiting)
    run_step(s)  # "run" is mid-prefill, "wait" not admitted (budget)
    assert running.block_ids and running.status is RequestStatus.RUNNING
    s.finish(running, RequestStatus.FINISHED_ABORTED)
    s.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert not s.running and not s.waiting
    kv.pool.check_all_free()


def test_a_request_admitted_in_the_same_step_hits_the_blocks_scheduled_before_it() -> None:
    kv = KVCacheManager(16, 4, True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = make_request(shared + [9, 10, 11], "a", 0), make_request(shared + [12], "b", 1)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.num_new_tokens == [11, 1]
    assert a.block_ids == [1, 2, 3] and b.block_ids == [1, 2, 4]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0


def test_blocks_of_a_chunk_are_published_only_as_far_as_the_chunk_goes() -> None:
    kv = KVCacheManager(16, 4, True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    s.add(make_request(list(range(1, 13)), "a", 0))
    run_step(s)  # 6 of 12 tokens: only the first block is full
    assert kv.pool.num_cached == 1
    late = make_request(list(range(1, 13)) + [99], "late", 1)
    assert kv.find_cached_prefix(late).block_ids == [1]


def test_proposals_fit_the_budget_and_free_blocks_and_are_never_published() -> None:
    """Speculation's hook: a decoding request computes its proposal within what is left of the
    budget, only into free blocks (never preempting, never taking a session's), and the
    prefix cache publishes only its verified tokens' blocks."""
    kv = KVCacheManager(6, 4, True)  # 5 usable blocks
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    asked = []

    def propose(reqs, rows, budget):
        assert rows == len(reqs) == 1  # the step's rows so far: the one decode
        asked.append(budget)
        return [[9] * min(budget, 5)]

    s.propose = propose
    a = make_request([1, 2, 3, 4, 5, 6, 7], "a", 0)
    s.add(a)
    run_step(s)  # the prefill: no proposal
    assert asked == [] and a.num_tokens == 8 and len(a.block_ids) == 2
    batch = s.schedule()
    # 1 + 5 tokens (positions 7..12) fit the budget of 8 and 2 more blocks
    assert asked == [7] and batch.num_new_tokens == [6] and a.sampling.draft.token_ids == [9] * 5
    assert len(a.block_ids) == 4
    assert len(a.block_hashes) == 2  # published up to its 8 verified tokens: blocks 0 and 1
    s.update(batch)
    assert a.num_computed_tokens == 8  # the proposal counts once it is verified
    a.sampling.draft.token_ids = []
    a.output_token_ids.append(9)  # the model's own next token, nothing accepted
    kv.trim(a)
    assert len(a.block_ids) == 3 and kv.pool.num_free == 2
    held = kv.pool.allocate(2)  # the pool is short: a proposal needs a block nobody has
    batch = s.schedule()
    assert batch.num_new_tokens == [1] and not batch.preempted and a.sampling.draft.token_ids == []
    kv.pool.free(held)
