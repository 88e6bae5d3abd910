"""Exact tests of the KV cache manager: block tables per request, all-or-nothing allocation,
tail-first release, and slot accounting; forks and copy-on-write; plus a property test over
random allocate/free runs. Prefix-cache hits have their own module (test_prefix_cache.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_worker.kv_cache.manager import Allocation, KVCacheManager, KVCacheStats, cdiv


REQ_IDS = ("a", "b", "c", "r0", "r1", "r2", "r3")


def snapshot(kv: KVCacheManager):
    """Everything observable about the manager and its pool."""
    return (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks],
            {r: kv.get_block_ids(r) for r in REQ_IDS}, kv.stats(), dict(kv.pool.cached))


def manager(num_blocks: int, block_size: int) -> KVCacheManager:
    """Without prefix caching: no block is ever cached or shared unless forked."""
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)


def alloc(kv: KVCacheManager, req_id: str, num_computed_tokens: int,
          num_new_tokens: int) -> list[int] | None:
    """``allocate_slots`` for a request that shares nothing: new block ids, or None."""
    allocation = kv.allocate_slots(req_id, num_computed_tokens, num_new_tokens)
    if allocation is None:
        return None
    assert allocation.copies == ()
    return list(allocation.new_block_ids)


def stats(num_blocks: int, num_free_blocks: int, num_allocated_slots: int,
          num_used_slots: int) -> KVCacheStats:
    return KVCacheStats(num_blocks=num_blocks, num_free_blocks=num_free_blocks,
                        num_allocated_slots=num_allocated_slots, num_used_slots=num_used_slots,
                        num_cached_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0)


@pytest.mark.parametrize("a, b, expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2),
                                            (8, 4, 2), (9, 4, 3), (7, 1, 7)])
def test_cdiv(a, b, expected):
    assert cdiv(a, b) == expected


def test_allocate_hands_out_blocks_in_free_queue_order():
    kv = manager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 0, 10) == Allocation((0, 1, 2))  # ceil(10 / 4) = 3 blocks
    assert kv.allocate_slots("b", 0, 4) == Allocation((3,))
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_block_ids("b") == [3]
    assert kv.stats().num_free_blocks == 4
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7]


def test_allocate_grows_a_table_by_only_the_missing_blocks():
    kv = manager(num_blocks=8, block_size=4)
    assert alloc(kv, "a", 0, 3) == [0]
    assert alloc(kv, "a", 3, 1) == []  # still fits in block 0
    assert alloc(kv, "b", 0, 1) == [1]
    assert alloc(kv, "a", 4, 1) == [2]  # crosses into a second block
    assert alloc(kv, "a", 5, 8) == [3, 4]
    assert kv.get_block_ids("a") == [0, 2, 3, 4]
    assert kv.get_block_ids("b") == [1]


def test_allocate_for_fewer_tokens_than_held_keeps_the_table():
    kv = manager(num_blocks=4, block_size=4)
    alloc(kv, "a", 0, 8)
    assert alloc(kv, "a", 0, 2) == []
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.stats().num_used_slots == 8  # the high-water mark is kept


def test_allocate_returns_none_and_changes_nothing_for_a_new_request():
    kv = manager(num_blocks=4, block_size=4)
    alloc(kv, "a", 0, 9)  # blocks 0 1 2
    before = snapshot(kv)
    assert kv.allocate_slots("b", 0, 5) is None  # needs 2, 1 free
    assert snapshot(kv) == before
    assert kv.get_block_ids("b") == []


def test_allocate_returns_none_and_changes_nothing_for_a_growing_request():
    kv = manager(num_blocks=4, block_size=4)
    alloc(kv, "a", 0, 5)  # blocks 0 1
    alloc(kv, "b", 0, 4)  # block 2
    before = snapshot(kv)
    assert kv.allocate_slots("a", 5, 8) is None  # needs 2 more, 1 free
    assert snapshot(kv) == before
    assert kv.get_block_ids("a") == [0, 1]
    # exactly enough still succeeds, taking the last free block
    assert alloc(kv, "a", 5, 7) == [3]
    assert kv.stats().num_free_blocks == 0


def test_free_releases_tail_first():
    kv = manager(num_blocks=6, block_size=2)
    alloc(kv, "a", 0, 6)  # 0 1 2
    alloc(kv, "b", 0, 2)  # 3
    kv.free("a")
    assert kv.pool.free_queue.block_ids() == [4, 5, 2, 1, 0]
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 1, 0, 0]
    assert kv.get_block_ids("a") == []
    kv.free("b")
    assert kv.pool.free_queue.block_ids() == [4, 5, 2, 1, 0, 3]
    assert kv.stats().num_free_blocks == 6


def test_freed_blocks_are_reused_after_older_free_blocks_tail_block_first():
    kv = manager(num_blocks=5, block_size=1)
    alloc(kv, "a", 0, 3)  # 0 1 2; free: 3 4
    kv.free("a")  # free: 3 4 2 1 0
    assert alloc(kv, "b", 0, 4) == [3, 4, 2, 1]
    assert kv.get_block_ids("b") == [3, 4, 2, 1]


def test_free_of_unknown_request_is_a_no_op():
    kv = manager(num_blocks=3, block_size=4)
    alloc(kv, "a", 0, 4)
    before = snapshot(kv)
    kv.free("nobody")
    assert snapshot(kv) == before


def test_free_twice_is_a_no_op():
    kv = manager(num_blocks=3, block_size=4)
    alloc(kv, "a", 0, 8)
    kv.free("a")
    before = snapshot(kv)
    kv.free("a")
    assert snapshot(kv) == before


def test_stats_count_allocated_and_used_slots():
    kv = manager(num_blocks=10, block_size=4)
    assert kv.stats() == stats(num_blocks=10, num_free_blocks=10, num_allocated_slots=0,
                               num_used_slots=0)
    alloc(kv, "a", 0, 5)  # 2 blocks, 3 slots wasted
    alloc(kv, "b", 0, 4)  # 1 block, none wasted
    alloc(kv, "c", 0, 9)  # 3 blocks, 3 wasted
    current = kv.stats()
    assert current == stats(num_blocks=10, num_free_blocks=4, num_allocated_slots=24,
                            num_used_slots=18)
    assert current.usage == pytest.approx(0.6)
    kv.free("c")
    assert kv.stats() == stats(num_blocks=10, num_free_blocks=7, num_allocated_slots=12,
                               num_used_slots=9)


@pytest.mark.parametrize("num_tokens", range(1, 17))
def test_waste_per_request_is_below_block_size(num_tokens):
    kv = manager(num_blocks=16, block_size=4)
    alloc(kv, "a", 0, num_tokens)
    current = kv.stats()
    waste = current.num_allocated_slots - current.num_used_slots
    assert 0 <= waste < kv.block_size
    assert waste == (-num_tokens) % 4


def test_manager_exposes_pool_sizes():
    kv = KVCacheManager(num_blocks=7, block_size=8)
    assert kv.enable_prefix_caching  # on unless turned off
    assert kv.stats().num_blocks == 7
    assert kv.num_blocks_for(0) == 0
    assert kv.num_blocks_for(8) == 1
    assert kv.num_blocks_for(9) == 2


# ------------------------------------------------------------------- forks and copy-on-write
def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_fork_shares_the_whole_table_and_the_first_write_copies_the_shared_partial_block():
    kv = manager(num_blocks=8, block_size=4)
    assert alloc(kv, "a", 0, 6) == [0, 1]  # block 1 holds positions 4 5 of 8 slots
    kv.fork("a", "b")
    assert kv.get_block_ids("b") == [0, 1]
    assert refs(kv) == [2, 2, 0, 0, 0, 0, 0, 0]
    assert kv.pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7]
    assert kv.stats().num_blocks - kv.stats().num_free_blocks == 2  # distinct blocks in use
    assert kv.stats().num_used_slots == 12  # 6 tokens in each table

    # a writes position 6 into shared block 1: a private copy (block 2) replaces it in a's table
    assert kv.allocate_slots("a", 6, 1) == Allocation((), ((1, 2),))
    assert kv.get_block_ids("a") == [0, 2]
    assert kv.get_block_ids("b") == [0, 1]
    assert refs(kv) == [2, 1, 1, 0, 0, 0, 0, 0]
    # b is now block 1's only holder and writes into it in place
    assert kv.allocate_slots("b", 6, 1) == Allocation(())
    assert kv.get_block_ids("b") == [0, 1]
    assert kv.allocate_slots("b", 7, 2) == Allocation((3,))  # position 8 opens a block
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7]

    kv.free("a")  # block 2 is released; block 0 is still b's
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2]
    assert refs(kv) == [1, 1, 0, 1, 0, 0, 0, 0]
    kv.free("b")  # tail first: 3, 1, 0
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert refs(kv) == [0] * 8


def test_fork_of_full_blocks_needs_no_copy():
    kv = manager(num_blocks=6, block_size=4)
    alloc(kv, "a", 0, 8)  # 0 1, both full
    kv.fork("a", "b")
    assert kv.allocate_slots("a", 8, 1) == Allocation((2,))
    assert kv.allocate_slots("b", 8, 1) == Allocation((3,))
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert refs(kv) == [2, 2, 1, 1, 0, 0]


def test_every_sibling_but_the_last_gets_a_copy():
    kv = manager(num_blocks=8, block_size=4)
    alloc(kv, "a", 0, 5)  # 0 1
    kv.fork("a", "b")
    kv.fork("a", "c")
    assert refs(kv)[:2] == [3, 3]
    assert kv.allocate_slots("c", 5, 1) == Allocation((), ((1, 2),))
    assert kv.allocate_slots("a", 5, 1) == Allocation((), ((1, 3),))
    assert kv.allocate_slots("b", 5, 1) == Allocation(())
    assert [kv.get_block_ids(r) for r in "abc"] == [[0, 3], [0, 1], [0, 2]]
    assert refs(kv)[:4] == [3, 1, 1, 1]


def test_copy_and_new_block_in_one_allocation_take_blocks_in_free_queue_order():
    kv = manager(num_blocks=8, block_size=4)
    alloc(kv, "a", 0, 6)  # 0 1
    kv.fork("a", "b")
    # positions 6..9: the copy of block 1 is taken first (block 2), then block 3 for 8 9
    assert kv.allocate_slots("a", 6, 4) == Allocation((3,), ((1, 2),))
    assert kv.get_block_ids("a") == [0, 2, 3]


def test_copy_on_write_that_does_not_fit_returns_none_and_changes_nothing():
    kv = manager(num_blocks=3, block_size=4)
    alloc(kv, "a", 0, 6)  # 0 1
    kv.fork("a", "b")
    alloc(kv, "c", 0, 4)  # 2: the pool is full
    before = snapshot(kv)
    assert kv.allocate_slots("a", 6, 1) is None  # the copy needs a free block
    assert snapshot(kv) == before
    kv.free("c")
    assert kv.allocate_slots("a", 6, 1) == Allocation((), ((1, 2),))


def test_forked_child_frees_independently_of_its_parent():
    kv = manager(num_blocks=4, block_size=2)
    alloc(kv, "a", 0, 4)  # 0 1
    kv.fork("a", "b")
    kv.free("a")
    assert kv.get_block_ids("b") == [0, 1]
    assert refs(kv) == [1, 1, 0, 0]
    assert kv.pool.free_queue.block_ids() == [2, 3]
    kv.free("b")
    assert kv.pool.free_queue.block_ids() == [2, 3, 1, 0]


# ---------------------------------------------------------------------- property test
NUM_REQS = 4

operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, NUM_REQS - 1), st.integers(0, 40)),
        st.tuples(st.just("free"), st.integers(0, NUM_REQS - 1), st.just(0)),
    ),
    max_size=60)


def check_invariants(kv: KVCacheManager, model_tokens: dict[str, int]) -> None:
    pool = kv.pool
    free_ids = pool.free_queue.block_ids()
    held = [i for r in range(NUM_REQS) for i in kv.get_block_ids(f"r{r}")]
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert len(held) == len(set(held)), "a block is held by two requests"
    assert not set(free_ids) & set(held), "a block is both free and in use"
    assert len(free_ids) + len(held) == pool.num_blocks
    assert sorted(free_ids + held) == list(range(pool.num_blocks))
    for block in pool.blocks:
        assert block.ref_cnt == (1 if block.block_id in held else 0)
    for req_id, num_tokens in model_tokens.items():
        num_slots = len(kv.get_block_ids(req_id)) * kv.block_size
        assert 0 <= num_slots - num_tokens < kv.block_size
    current = kv.stats()
    assert current.num_free_blocks == len(free_ids)
    assert current.num_allocated_slots == len(held) * kv.block_size
    assert current.num_used_slots == sum(model_tokens.values())
    assert current.num_cached_blocks == 0 and kv.pool.cached == {}  # nothing was published


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4, 8]), ops=operations,
       enable_prefix_caching=st.booleans())
def test_random_allocate_free_keeps_every_block_accounted_for(num_blocks, block_size, ops,
                                                              enable_prefix_caching):
    # With nothing published to the prefix cache, caching on or off behaves identically.
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size,
                        enable_prefix_caching=enable_prefix_caching)
    model_tokens: dict[str, int] = {}  # what each request holds, per this test's own bookkeeping
    for op, req_index, num_tokens in ops:
        req_id = f"r{req_index}"
        if op == "alloc":
            before = snapshot(kv)
            free_before = kv.pool.free_queue.block_ids()
            table_before = kv.get_block_ids(req_id)
            num_new = max(0, cdiv(num_tokens, block_size) - len(table_before))
            num_computed = min(model_tokens.get(req_id, 0), num_tokens)
            result = kv.allocate_slots(req_id, num_computed, num_tokens - num_computed)
            if num_new > len(free_before):
                assert result is None
                assert snapshot(kv) == before
            else:
                assert result == Allocation(tuple(free_before[:num_new]))
                assert kv.get_block_ids(req_id) == table_before + free_before[:num_new]
                model_tokens[req_id] = max(num_tokens, model_tokens.get(req_id, 0))
        else:
            free_before = kv.pool.free_queue.block_ids()
            table_before = kv.get_block_ids(req_id)
            kv.free(req_id)
            assert kv.pool.free_queue.block_ids() == free_before + table_before[::-1]
            model_tokens.pop(req_id, None)
        check_invariants(kv, model_tokens)
    for req_index in range(NUM_REQS):
        kv.free(f"r{req_index}")
    assert kv.stats().num_free_blocks == num_blocks
    assert kv.stats() == stats(num_blocks=num_blocks, num_free_blocks=num_blocks,
                               num_allocated_slots=0, num_used_slots=0)
