"""Leases on a prefill engine's blocks, without a model or a clock: granted, looked up,
released (taking effect at the engine thread's sweep), expired, and every block back in the
pool exactly once."""

from __future__ import annotations

from tandem.server.engine.block_pool import BlockPool
from tandem.server.engine.leases import LeaseStore

TTL = 30.0


def store(num_blocks: int = 8) -> LeaseStore:
    return LeaseStore(BlockPool(num_blocks, None), ttl_seconds=TTL)


def test_a_lease_holds_its_blocks_until_the_sweep_after_its_release() -> None:
    leases = store()
    blocks = leases.pool.allocate(3)
    assert blocks == [1, 2, 3]
    lease = leases.grant(blocks)
    assert len(leases) == 1 and leases.blocks(lease) == [1, 2, 3]
    assert leases.ask_release(lease)
    assert leases.blocks(lease) is None  # the transport sees it gone at once...
    assert leases.pool.num_free == 4 and len(leases) == 1  # ...the pool only at the sweep
    assert leases.pool.allocate(4) == [4, 5, 6, 7]  # the leased blocks are not handed out
    assert leases.sweep(now=0.0) == 1
    assert len(leases) == 0 and leases.num_expired == 0
    assert sorted(leases.pool.allocate(3)) == [1, 2, 3]


def test_a_lease_is_its_own_copy_of_the_block_list() -> None:
    leases = store()
    blocks = leases.pool.allocate(2)
    lease = leases.grant(blocks)
    blocks.append(99)
    leases.blocks(lease).append(98)
    assert leases.blocks(lease) == [1, 2]


def test_a_lease_expires_at_its_ttl_and_counts_as_expired() -> None:
    leases = store()
    lease = leases.grant(leases.pool.allocate(2))
    expiry = leases.next_expiry()
    assert leases.sweep(now=expiry - 0.001) == 0
    assert leases.blocks(lease) == [1, 2]
    assert leases.sweep(now=expiry) == 1
    assert leases.num_expired == 1 and leases.blocks(lease) is None
    leases.pool.check_all_free()


def test_next_expiry_is_the_soonest_lease_and_none_without_leases() -> None:
    leases = store()
    assert leases.next_expiry() is None
    first = leases.grant(leases.pool.allocate(1))
    soonest = leases.next_expiry()
    leases.grant(leases.pool.allocate(1))
    assert leases.next_expiry() == soonest
    leases.ask_release(first)
    leases.sweep(now=soonest - 1)
    assert leases.next_expiry() >= soonest  # the later lease's (same clock tick or after)
    leases.clear()
    assert leases.next_expiry() is None


def test_a_released_lease_that_also_expired_frees_its_blocks_once_and_is_not_expired() -> None:
    leases = store()
    lease = leases.grant(leases.pool.allocate(3))
    assert leases.ask_release(lease)
    assert leases.ask_release(lease)  # asked twice (a retried release): still one free
    assert leases.sweep(now=leases.next_expiry() + 1) == 1
    assert leases.num_expired == 0
    leases.pool.check_all_free()
    assert leases.sweep(now=float("inf")) == 0
    assert not leases.ask_release(lease)  # gone: nothing left to release


def test_unknown_leases_are_neither_found_nor_released() -> None:
    leases = store()
    assert leases.blocks("nope") is None
    assert not leases.ask_release("nope")


def test_each_grant_is_a_distinct_lease() -> None:
    leases = store()
    a, b = leases.grant(leases.pool.allocate(1)), leases.grant(leases.pool.allocate(1))
    assert a != b and leases.blocks(a) == [1] and leases.blocks(b) == [2]
    leases.ask_release(a)
    assert leases.sweep(now=0.0) == 1 and leases.blocks(b) == [2]


def test_clear_frees_every_lease_at_once_released_or_not() -> None:
    leases = store()
    kept = leases.grant(leases.pool.allocate(2))
    released = leases.grant(leases.pool.allocate(2))
    leases.ask_release(released)
    leases.clear()
    assert len(leases) == 0 and leases.blocks(kept) is None
    assert leases.num_expired == 1  # the unreleased one ran out
    leases.pool.check_all_free()


def test_shared_blocks_stay_with_their_other_holder_when_a_lease_ends() -> None:
    leases = store()
    blocks = leases.pool.allocate(2)
    leases.pool.share(blocks[:1])  # a prefix hit of another request holds block 1 too
    leases.ask_release(leases.grant(blocks))
    leases.sweep(now=0.0)
    assert leases.pool.ref_count(1) == 1 and leases.pool.ref_count(2) == 0
