"""Sessions keep a conversation's KV blocks between turns, without a model: turns run
through the real scheduler and KV cache manager (block size 4), and block ids are exact
where the pool's LRU order determines them."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.server.engine.kv_cache_manager import KVCacheManager
from tandem.server.engine.request import Request, RequestStatus
from tandem.server.engine.sampling_params import InvalidParamError
from tandem.server.engine.scheduler import Scheduler
from tandem.server.engine.sessions import SessionStore

from .utils import make_request

BS = 4


class EngineParts:
    """The parts of the engine a session touches, driven by hand."""

    def __init__(self, num_blocks: int = 16, max_blocks: int = 100, **caps: Any) -> None:
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
        self.scheduler = Scheduler(self.kv, max_num_seqs=8, max_num_batched_tokens=64)
        self.store = SessionStore(self.kv, max_blocks, **caps)
        self.kv.reclaim = self.store.reclaim
        self.pool = self.kv.pool

    def start(self, sid: str, prompt: list[int], reply: list[int]) -> Request:
        """A turn that has sampled ``reply`` (its last token not yet computed), still running."""
        req = make_request(prompt, f"{sid}#{len(prompt)}")
        self.store.attach(sid, req)
        self.scheduler.add(req)
        for token in reply:
            batch = self.scheduler.schedule()
            assert req in batch.requests
            self.scheduler.update(batch)
            req.output_token_ids.append(token)
        return req

    def finish(self, sid: str, req: Request, keep_blocks: bool = True) -> None:
        """As the engine ends a turn: a stop keeps its blocks in the session, an abort not."""
        self.store.detach(sid, req, keep_blocks)
        status = RequestStatus.FINISHED_STOPPED if keep_blocks else RequestStatus.FINISHED_ABORTED
        self.scheduler.finish(req, status)

    def turn(self, sid: str, prompt: list[int], reply: list[int]) -> Request:
        req = self.start(sid, prompt, reply)
        self.finish(sid, req)
        return req


def live(store: SessionStore, *session_ids: str) -> list[str]:
    """Which of ``session_ids`` the store still has."""
    return [sid for sid in session_ids if sid in store]


class Clock:
    """The store's clock, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> Clock:
    return Clock()


HISTORY = [1, 2, 3, 4, 5, 6]  # turn 1's prompt; its reply is [7, 8]


def test_a_finished_turn_leaves_its_blocks_in_the_session() -> None:
    e = EngineParts()
    first = e.turn("s", HISTORY, [7, 8])  # 7 tokens computed: 2 blocks
    assert first.block_ids == [] and "s" in e.store and len(e.store) == 1
    assert e.store.held_blocks == 2
    assert e.pool.ref_count(1) == e.pool.ref_count(2) == 1 and e.pool.num_free == 13


def test_the_next_turn_takes_over_the_blocks_of_its_prefix_and_computes_only_the_rest() -> None:
    e = EngineParts()
    e.turn("s", HISTORY, [7, 8])
    nxt = make_request([*HISTORY, 7, 8, 9, 10], "s#2")
    e.store.attach("s", nxt)
    assert nxt.block_ids == [1, 2] and e.store.held_blocks == 0
    assert nxt.num_computed_tokens == nxt.num_cached_tokens == 7  # the reply's last token is new
    assert len(nxt.block_hashes) == 1  # the one full block
    e.scheduler.add(nxt)
    batch = e.scheduler.schedule()
    assert batch.num_new_tokens == [3] and nxt.block_ids == [1, 2, 3]


def test_blocks_past_the_shared_prefix_go_back_to_the_pool() -> None:
    e = EngineParts()
    e.turn("s", [*HISTORY, 7, 8, 9, 10], [11])  # 10 tokens computed: blocks 1, 2, 3
    assert e.pool.num_free == 12
    nxt = make_request([1, 2, 3, 4, 99, 98], "s#2")  # agrees on the first block only
    e.store.attach("s", nxt)
    assert nxt.block_ids == [1] and nxt.num_computed_tokens == 4
    assert e.pool.num_free == 14 and e.pool.ref_count(2) == e.pool.ref_count(3) == 0


def test_a_partly_matching_block_nobody_else_holds_is_kept_and_leaves_the_prefix_cache() -> None:
    e = EngineParts()
    e.turn("s", [1, 2, 3, 4, 5, 6, 7, 8], [9, 10])  # blocks 1, 2 (published), 3
    assert e.pool.num_cached == 2
    nxt = make_request([1, 2, 3, 4, 5, 6, 77, 78, 79], "s#2")  # diverges inside block 2
    e.store.attach("s", nxt)
    assert nxt.block_ids == [1, 2] and nxt.num_computed_tokens == 6
    assert e.pool.num_cached == 1  # block 2's tail is about to change
    e.scheduler.add(nxt)
    e.scheduler.schedule()
    assert nxt.block_ids == [1, 2, 4]
    other = make_request([1, 2, 3, 4, 5, 6, 7, 8, 50], "other")
    assert e.kv.find_cached_prefix(other).block_ids == [1]  # never block 2's new content


def test_a_partly_matching_block_another_request_holds_is_recomputed_not_overwritten() -> None:
    e = EngineParts()
    e.turn("s", [1, 2, 3, 4, 5, 6, 7, 8], [9, 10])  # blocks 1, 2, 3
    other = make_request([1, 2, 3, 4, 5, 6, 7, 8, 50], "other")
    e.scheduler.add(other)
    e.scheduler.schedule()  # a prefix hit: shares blocks 1 and 2, a new block 4
    assert other.block_ids == [1, 2, 4] and e.pool.ref_count(2) == 2
    nxt = make_request([1, 2, 3, 4, 5, 6, 77, 78, 79], "s#2")
    e.store.attach("s", nxt)
    assert nxt.block_ids == [1] and nxt.num_computed_tokens == nxt.num_cached_tokens == 4
    assert e.pool.ref_count(2) == 1 and e.pool.ref_count(3) == 0
    e.scheduler.add(nxt)
    batch = e.scheduler.schedule()
    assert batch.num_new_tokens[batch.requests.index(nxt)] == 5  # positions 4..8 again
    assert nxt.block_ids == [1, 5, 6] and other.block_ids == [1, 2, 4]


def test_an_aborted_turn_ends_the_session_and_frees_its_blocks() -> None:
    e = EngineParts()
    e.turn("s", HISTORY, [7, 8])
    nxt = e.start("s", [*HISTORY, 7, 8, 9], [10, 11])
    assert nxt.block_ids == [1, 2, 3]
    e.finish("s", nxt, keep_blocks=False)
    assert "s" not in e.store and len(e.store) == 0 and e.store.held_blocks == 0
    e.pool.check_all_free()


def test_a_session_deleted_during_its_turn_frees_the_turns_blocks_when_it_ends() -> None:
    e = EngineParts()
    req = e.start("s", HISTORY, [7])
    assert e.store.delete("s") and "s" not in e.store
    e.finish("s", req)
    assert len(e.store) == 0
    e.pool.check_all_free()


def test_idle_sessions_over_max_blocks_give_back_the_finishing_keys_own_first() -> None:
    e = EngineParts(max_blocks=4)
    e.turn("b:1", [21, 22, 23, 24, 25], [26])  # blocks 1, 2: the least recently used
    e.turn("a:1", [31, 32, 33, 34, 35], [36])  # blocks 3, 4
    assert e.store.held_blocks == 4
    e.turn("a:2", [41, 42, 43, 44, 45], [46])  # blocks 5, 6: 6 held > 4
    assert e.store.held_blocks == 4
    assert [e.pool.ref_count(b) for b in range(1, 7)] == [1, 1, 0, 0, 1, 1]
    assert "a:1" in e.store  # a session that lost its blocks stays a session
    again = make_request([31, 32, 33, 34, 35, 36, 37], "a:1#2")
    e.store.attach("a:1", again)
    assert again.block_ids == [] and again.num_computed_tokens == 0
    e.scheduler.add(again)
    e.scheduler.schedule()  # its first block is still in the prefix cache
    assert again.block_ids == [3, 7] and again.num_cached_tokens == 4


def test_the_finishing_keys_newest_session_goes_before_another_keys_older_one() -> None:
    e = EngineParts(max_blocks=3)
    e.turn("b:1", [21, 22, 23, 24, 25], [26])  # blocks 1, 2
    e.turn("a:1", [31, 32, 33, 34, 35], [36])  # blocks 3, 4: 4 held > 3, a:1's own go
    assert e.store.held_blocks == 2
    assert [e.pool.ref_count(b) for b in range(1, 5)] == [1, 1, 0, 0]


def test_a_short_pool_reclaims_idle_sessions_blocks_least_recently_used_first() -> None:
    e = EngineParts(num_blocks=8)  # 7 usable
    e.turn("a:1", [1, 2, 3, 4, 5], [6])  # blocks 1, 2
    e.turn("b:1", [11, 12, 13, 14, 15], [16])  # blocks 3, 4
    e.scheduler.add(make_request(list(range(100, 120)), "big"))  # 5 blocks, 3 free
    assert e.scheduler.schedule().num_new_tokens == [20]
    assert e.scheduler.running[-1].block_ids == [5, 6, 7, 2, 1]  # a:1's, tail first
    assert e.pool.ref_count(3) == e.pool.ref_count(4) == 1  # b:1 kept its blocks
    assert e.store.held_blocks == 2 and len(e.store) == 2


def test_a_key_at_its_cap_forgets_its_least_recently_used_idle_session() -> None:
    e = EngineParts(max_per_key=2)
    e.turn("a:1", [1, 2, 3, 4, 5], [6])  # blocks 1, 2
    e.turn("b:1", [11, 12, 13, 14, 15], [16])
    e.turn("a:2", [21, 22, 23, 24, 25], [26])
    e.start("a:3", [31], [32])
    assert live(e.store, "a:1", "b:1", "a:2", "a:3") == ["b:1", "a:2", "a:3"]
    assert e.pool.ref_count(1) == e.pool.ref_count(2) == 0


def test_a_key_at_its_cap_never_forgets_a_busy_session() -> None:
    e = EngineParts(max_per_key=2)
    e.start("a:1", [1, 2, 3], [4])  # still running
    e.turn("a:2", [11, 12, 13], [14])
    e.start("a:3", [21], [22])
    assert live(e.store, "a:1", "a:2", "a:3") == ["a:1", "a:3"]
    e.start("a:4", [31], [32])  # nothing idle to forget: the cap gives way
    assert len(e.store) == 3


@pytest.mark.parametrize(
    ("opener", "forgotten"),
    [
        ("a:2", "a:1"),  # the opening key's own idle session, though b:1 is older
        ("c:1", "b:1"),  # a new key: the oldest idle session of the key holding the most
    ],
)
def test_a_full_store_forgets_the_opening_keys_idle_session_else_the_largest_keys(
    opener: str, forgotten: str
) -> None:
    e = EngineParts(max_sessions=3)
    e.turn("b:1", [1], [2])
    e.turn("a:1", [3], [4])
    e.turn("b:2", [5], [6])
    e.start(opener, [7], [8])
    assert forgotten not in e.store and len(e.store) == 3 and opener in e.store


def test_sessions_idle_longer_than_the_ttl_expire_and_free_their_blocks(clock: Clock) -> None:
    e = EngineParts(clock=clock.monotonic)
    clock.now = 100.0
    e.turn("old", [1, 2, 3, 4, 5], [6])  # blocks 1, 2
    clock.now = 150.0
    e.turn("new", [11, 12, 13, 14, 15], [16])  # blocks 3, 4
    busy = e.start("busy", [21], [22])
    clock.now = 200.0
    assert e.store.expire(idle_seconds=75.0) == 1  # idle since before 125
    assert live(e.store, "old", "new", "busy") == ["new", "busy"]
    assert e.store.held_blocks == 2
    assert e.pool.ref_count(1) == e.pool.ref_count(2) == 0
    assert e.store.expire(idle_seconds=0.0) == 1  # a running turn's session never expires
    assert live(e.store, "new", "busy") == ["busy"]
    e.finish("busy", busy)
    e.store.clear()
    e.pool.check_all_free()


def test_a_new_turn_renews_its_session_against_the_ttl(clock: Clock) -> None:
    e = EngineParts(clock=clock.monotonic)
    e.turn("s", [1, 2, 3, 4, 5], [6])
    clock.now = 100.0
    e.turn("s", [1, 2, 3, 4, 5, 6, 7], [8])
    assert e.store.expire(idle_seconds=50.0) == 0 and "s" in e.store


def test_delete_frees_the_sessions_blocks_and_says_whether_there_was_one() -> None:
    e = EngineParts()
    e.turn("s", HISTORY, [7, 8])
    assert e.store.delete("s")
    assert not e.store.delete("s") and e.store.held_blocks == 0
    e.pool.check_all_free()


def test_clear_forgets_idle_sessions_but_not_a_running_turns() -> None:
    e = EngineParts()
    e.turn("idle", [1, 2, 3], [4])
    e.start("busy", [5, 6, 7], [8])
    e.store.clear()
    assert live(e.store, "idle", "busy") == ["busy"]


def test_a_session_runs_one_sequence_at_a_time() -> None:
    e = EngineParts()
    e.store.check_can_attach("s", 1)
    with pytest.raises(InvalidParamError) as n:
        e.store.check_can_attach("s", 2)
    assert n.value.param == "n"
    e.start("s", [1, 2], [3])
    assert e.store.is_busy("s")
    with pytest.raises(InvalidParamError) as busy:
        e.store.check_can_attach("s", 1)
    assert busy.value.param == "session_id"
