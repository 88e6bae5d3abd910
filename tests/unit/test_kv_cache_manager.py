"""Exact tests of the KV cache manager: block tables per request, all-or-nothing allocation,
tail-first release, and slot accounting; plus a property test over random allocate/free runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_worker.kv_cache.manager import KVCacheManager, KVCacheStats, cdiv


REQ_IDS = ("a", "b", "c", "r0", "r1", "r2", "r3")


def snapshot(kv: KVCacheManager):
    """Everything observable about the manager and its pool."""
    return (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks],
            {r: kv.get_block_ids(r) for r in REQ_IDS}, kv.stats())


@pytest.mark.parametrize("a, b, expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2),
                                            (8, 4, 2), (9, 4, 3), (7, 1, 7)])
def test_cdiv(a, b, expected):
    assert cdiv(a, b) == expected


def test_allocate_hands_out_blocks_in_free_queue_order():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 10) == [0, 1, 2]  # ceil(10 / 4) = 3 blocks
    assert kv.allocate_slots("b", 4) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_block_ids("b") == [3]
    assert kv.num_free_blocks == 4
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7]


def test_allocate_grows_a_table_by_only_the_missing_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 3) == [0]
    assert kv.allocate_slots("a", 4) == []  # still fits in block 0
    assert kv.allocate_slots("b", 1) == [1]
    assert kv.allocate_slots("a", 5) == [2]  # crosses into a second block
    assert kv.allocate_slots("a", 13) == [3, 4]
    assert kv.get_block_ids("a") == [0, 2, 3, 4]
    assert kv.get_block_ids("b") == [1]


def test_allocate_for_fewer_tokens_than_held_keeps_the_table():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 8)
    assert kv.allocate_slots("a", 2) == []
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.stats().num_used_slots == 8  # the high-water mark is kept


def test_allocate_returns_none_and_changes_nothing_for_a_new_request():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 9)  # blocks 0 1 2
    before = snapshot(kv)
    assert kv.allocate_slots("b", 5) is None  # needs 2, 1 free
    assert snapshot(kv) == before
    assert kv.get_block_ids("b") == []


def test_allocate_returns_none_and_changes_nothing_for_a_growing_request():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 5)  # blocks 0 1
    kv.allocate_slots("b", 4)  # block 2
    before = snapshot(kv)
    assert kv.allocate_slots("a", 13) is None  # needs 2 more, 1 free
    assert snapshot(kv) == before
    assert kv.get_block_ids("a") == [0, 1]
    # exactly enough still succeeds, taking the last free block
    assert kv.allocate_slots("a", 12) == [3]
    assert kv.num_free_blocks == 0


def test_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate_slots("a", 6)  # 0 1 2
    kv.allocate_slots("b", 2)  # 3
    kv.free("a")
    assert kv.pool.free_queue.block_ids() == [4, 5, 2, 1, 0]
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 1, 0, 0]
    assert kv.get_block_ids("a") == []
    kv.free("b")
    assert kv.pool.free_queue.block_ids() == [4, 5, 2, 1, 0, 3]
    assert kv.num_free_blocks == 6


def test_freed_blocks_are_reused_after_older_free_blocks_tail_block_first():
    kv = KVCacheManager(num_blocks=5, block_size=1)
    kv.allocate_slots("a", 3)  # 0 1 2; free: 3 4
    kv.free("a")  # free: 3 4 2 1 0
    assert kv.allocate_slots("b", 4) == [3, 4, 2, 1]
    assert kv.get_block_ids("b") == [3, 4, 2, 1]


def test_free_of_unknown_request_is_a_no_op():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 4)
    before = snapshot(kv)
    kv.free("nobody")
    assert snapshot(kv) == before


def test_free_twice_is_a_no_op():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 8)
    kv.free("a")
    before = snapshot(kv)
    kv.free("a")
    assert snapshot(kv) == before


def test_stats_count_allocated_and_used_slots():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.stats() == KVCacheStats(num_blocks=10, num_free_blocks=10, num_allocated_slots=0,
                                      num_used_slots=0)
    kv.allocate_slots("a", 5)  # 2 blocks, 3 slots wasted
    kv.allocate_slots("b", 4)  # 1 block, none wasted
    kv.allocate_slots("c", 9)  # 3 blocks, 3 wasted
    stats = kv.stats()
    assert stats == KVCacheStats(num_blocks=10, num_free_blocks=4, num_allocated_slots=24,
                                 num_used_slots=18)
    assert stats.usage == pytest.approx(0.6)
    kv.free("c")
    assert kv.stats() == KVCacheStats(num_blocks=10, num_free_blocks=7, num_allocated_slots=12,
                                      num_used_slots=9)


@pytest.mark.parametrize("num_tokens", range(1, 17))
def test_waste_per_request_is_below_block_size(num_tokens):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate_slots("a", num_tokens)
    stats = kv.stats()
    waste = stats.num_allocated_slots - stats.num_used_slots
    assert 0 <= waste < kv.block_size
    assert waste == (-num_tokens) % 4


def test_manager_exposes_pool_sizes():
    kv = KVCacheManager(num_blocks=7, block_size=8)
    assert kv.num_blocks == 7
    assert kv.num_blocks_for(0) == 0
    assert kv.num_blocks_for(8) == 1
    assert kv.num_blocks_for(9) == 2


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
    stats = kv.stats()
    assert stats.num_free_blocks == len(free_ids)
    assert stats.num_allocated_slots == len(held) * kv.block_size
    assert stats.num_used_slots == sum(model_tokens.values())


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4, 8]), ops=operations)
def test_random_allocate_free_keeps_every_block_accounted_for(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    model_tokens: dict[str, int] = {}  # what each request holds, per this test's own bookkeeping
    for op, req_index, num_tokens in ops:
        req_id = f"r{req_index}"
        if op == "alloc":
            before = snapshot(kv)
            free_before = kv.pool.free_queue.block_ids()
            table_before = kv.get_block_ids(req_id)
            num_new = max(0, cdiv(num_tokens, block_size) - len(table_before))
            result = kv.allocate_slots(req_id, num_tokens)
            if num_new > len(free_before):
                assert result is None
                assert snapshot(kv) == before
            else:
                assert result == free_before[:num_new]
                assert kv.get_block_ids(req_id) == table_before + result
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
    assert kv.num_free_blocks == num_blocks
    assert kv.stats() == KVCacheStats(num_blocks=num_blocks, num_free_blocks=num_blocks,
                                      num_allocated_slots=0, num_used_slots=0)
