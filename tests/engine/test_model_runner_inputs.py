"""One step flattened for the model, without a model: ``prepare_inputs`` on batches the real
scheduler makes (block size 4), down to each token's position and KV slot."""

from __future__ import annotations

from tandem.server.engine.kv_cache_manager import KVCacheManager
from tandem.server.engine.model_runner import StepInputs, prepare_inputs
from tandem.server.engine.pooling import PoolingParams
from tandem.server.engine.request import PoolingState, RequestStatus
from tandem.server.engine.scheduler import Scheduler

from .utils import make_request

BS = 4


def scheduler(budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(32, BS, True), max_num_seqs=8, max_num_batched_tokens=budget)


def test_a_mixed_batch_flattens_a_decode_a_prefix_hit_and_a_prefill_chunk() -> None:
    s = scheduler()
    decode = make_request([10, 11, 12, 13, 14], "decode", 0)
    source = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], "source", 1)
    s.add(decode)
    s.add(source)
    s.update(s.schedule())  # decode: blocks 1, 2; source: blocks 3, 4 (cached), 5
    decode.output_token_ids.append(50)
    source.output_token_ids.append(60)
    s.finish(source, RequestStatus.FINISHED_STOPPED)
    hit = make_request([1, 2, 3, 4, 5, 6, 7, 8, 20, 21], "hit", 2)
    chunk = make_request(list(range(100, 120)), "chunk", 3)
    s.add(hit)
    s.add(chunk)
    batch = s.schedule()
    assert batch.requests == [decode, hit, chunk] and batch.num_new_tokens == [1, 2, 13]

    inputs, sampling = prepare_inputs(batch, BS)
    assert inputs == StepInputs(
        input_ids=[50, 20, 21, *range(100, 113)],
        positions=[5, 8, 9, *range(13)],
        # position p of a sequence lives at slot table[p // 4] * 4 + p % 4
        slots=[2 * 4 + 1, 6 * 4 + 0, 6 * 4 + 1, *range(7 * 4, 10 * 4 + 1)],
        query_lens=[1, 2, 13],
        kv_lens=[6, 10, 13],
        block_tables=[[1, 2], [3, 4, 6], [7, 8, 9, 10]],
        logits_rows=[0, 2],  # the chunk's prompt goes on: no token to sample yet
        hidden_rows=[],
    )
    assert sampling == [decode, hit]
    assert not inputs.is_decode and inputs.num_seqs == 3


def test_a_decode_only_batch_is_one_row_per_sequence() -> None:
    s = scheduler()
    a, b = make_request([1, 2, 3, 4], "a", 0), make_request([5, 6], "b", 1)
    s.add(a)
    s.add(b)
    s.update(s.schedule())  # a: block 1, b: block 2
    a.output_token_ids.append(70)
    b.output_token_ids.append(71)
    inputs, sampling = prepare_inputs(s.schedule(), BS)  # a grows into block 3
    assert (inputs.input_ids, inputs.positions, inputs.slots) == ([70, 71], [4, 2], [12, 10])
    assert inputs.block_tables == [[1, 3], [2]] and inputs.kv_lens == [5, 3]
    assert inputs.logits_rows == [0, 1] and sampling == [a, b]
    assert inputs.is_decode


def test_a_preempted_request_recomputes_its_prompt_and_generated_tokens() -> None:
    s = scheduler()
    req = make_request([1, 2, 3], "r")
    req.output_token_ids = [40, 41]  # sampled before its preemption; nothing computed now
    s.add(req)
    inputs, sampling = prepare_inputs(s.schedule(), BS)
    assert inputs.input_ids == [1, 2, 3, 40, 41] and inputs.positions == [0, 1, 2, 3, 4]
    assert inputs.slots == [4, 5, 6, 7, 8] and inputs.logits_rows == [4]
    assert sampling == [req]


def test_the_chunks_of_a_long_prompt_sample_only_at_its_end() -> None:
    s = scheduler(budget=6)
    req = make_request(list(range(1, 11)), "r")
    s.add(req)
    first, _ = prepare_inputs(batch := s.schedule(), BS)
    s.update(batch)
    last, sampling = prepare_inputs(s.schedule(), BS)
    assert (first.positions, first.logits_rows) == ([0, 1, 2, 3, 4, 5], [])
    assert (last.positions, last.kv_lens, last.logits_rows) == ([6, 7, 8, 9], [10], [3])
    assert last.slots == [10, 11, 12, 13] and sampling == [req]


def test_a_pooled_request_reads_hidden_rows_and_gets_no_logits() -> None:
    s = scheduler()
    gen = make_request([1, 2], "gen", 0)
    pooled = make_request([5, 6, 7], "emb", 1)
    pooled.pooling = PoolingState(PoolingParams(kind="mean"))
    last = make_request([8, 9], "last", 2)
    last.pooling = PoolingState(PoolingParams(kind="last"))
    for r in (gen, pooled, last):
        s.add(r)
    inputs, sampling = prepare_inputs(s.schedule(), BS)
    assert inputs.input_ids == [1, 2, 5, 6, 7, 8, 9]
    assert inputs.hidden_rows == [2, 3, 4, 6]  # every row of "emb", the last of "last"
    assert inputs.logits_rows == [1] and sampling == [gen]
