"""Exact tests of the KV block pool: block ids handed out, free-queue order, ref counts, and
the prefix-cache side of the pool (cached hashes, eviction, reset, their events)."""

from __future__ import annotations

import sys

import pytest

from engine_worker.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine_worker.kv_cache.events import KVEventRecorder
from quire.kv_events import AllBlocksCleared, BlockRemoved


def make_queue(num_blocks: int) -> tuple[list[KVBlock], FreeBlockQueue]:
    blocks = [KVBlock(i) for i in range(num_blocks)]
    return blocks, FreeBlockQueue(blocks)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------------------------- FreeBlockQueue
def test_free_queue_keeps_insertion_order():
    blocks, queue = make_queue(5)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_free_queue_popleft_takes_from_head_and_unlinks():
    blocks, queue = make_queue(3)
    first = queue.popleft()
    assert first is blocks[0]
    assert first.prev_free is None and first.next_free is None
    assert queue.block_ids() == [1, 2]
    assert queue.num_free_blocks == 2


def test_free_queue_append_goes_to_tail():
    blocks, queue = make_queue(3)
    b0 = queue.popleft()
    queue.append(b0)
    assert queue.block_ids() == [1, 2, 0]
    assert queue.num_free_blocks == 3


def test_free_queue_popleft_on_empty_raises():
    _, queue = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert queue.num_free_blocks == 0
    assert queue.block_ids() == []


@pytest.mark.parametrize("victim, expected", [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]),
                                              (4, [0, 1, 2, 3])])
def test_free_queue_remove_head_middle_tail(victim, expected):
    blocks, queue = make_queue(5)
    queue.remove(blocks[victim])
    assert queue.block_ids() == expected
    assert queue.num_free_blocks == 4
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    # the list is still consistent walking backwards
    node, backwards = queue._tail.prev_free, []
    while node is not queue._head:
        backwards.append(node.block_id)
        node = node.prev_free
    assert backwards == expected[::-1]


def test_free_queue_remove_middle_relinks_only_neighbours():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    # blocks further away keep their links untouched
    assert blocks[0].next_free is blocks[1]
    assert blocks[4].prev_free is blocks[3]


def _lines_executed(func, *args) -> int:
    """Count Python line events inside ``func`` (and anything it calls): a deterministic cost."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        func(*args)
    finally:
        sys.settrace(previous)
    return count


def test_free_queue_remove_from_middle_is_constant_time():
    small_blocks, small = make_queue(8)
    large_blocks, large = make_queue(20_000)
    cost_small = _lines_executed(small.remove, small_blocks[4])
    cost_large = _lines_executed(large.remove, large_blocks[10_000])
    assert cost_small == cost_large
    assert large.num_free_blocks == 19_999


def test_free_queue_remove_then_reinsert_at_tail():
    blocks, queue = make_queue(4)
    queue.remove(blocks[1])
    queue.append(blocks[1])
    assert queue.block_ids() == [0, 2, 3, 1]


def test_free_queue_rejects_double_append_and_removing_unqueued_block():
    blocks, queue = make_queue(2)
    with pytest.raises(AssertionError, match="already queued"):
        queue.append(blocks[0])
    taken = queue.popleft()
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(taken)
    assert queue.block_ids() == [1]


# ------------------------------------------------------------------------------ BlockPool
def test_pool_starts_with_every_block_free_in_id_order():
    pool = BlockPool(6)
    assert pool.num_blocks == 6
    assert pool.num_free_blocks == 6
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_rejects_non_positive_size(num_blocks):
    with pytest.raises(ValueError, match=r"^num_blocks: "):
        BlockPool(num_blocks)


def test_pool_hands_out_blocks_from_head_with_ref_count_one():
    pool = BlockPool(5)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    assert pool.free_queue.block_ids() == [3, 4]
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert pool.num_free_blocks == 0


def test_pool_get_zero_blocks_is_a_no_op():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert pool.free_queue.block_ids() == [0, 1]


def test_pool_refuses_to_overdraw_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="cannot take 2 blocks, only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 0]


def test_pool_free_appends_to_tail_in_given_order():
    pool = BlockPool(6)
    got = pool.get_new_blocks(4)  # 0 1 2 3; free: 4 5
    pool.free_blocks(reversed(got))  # a request's tail block first
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6
    # blocks still free before the release are reused first, then the released tail block
    assert ids(pool.get_new_blocks(3)) == [4, 5, 3]


def test_pool_free_of_shared_block_only_drops_a_reference():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt += 1  # a second holder (as prefix caching would add)
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert pool.free_queue.block_ids() == [1, 2]
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.block_ids() == [1, 2, 0]


def test_pool_double_free_is_caught():
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.block_ids() == [1, 0]


# --------------------------------------------------------------------------- prefix cache
def recorded(pool: BlockPool) -> list:
    """Every event recorded so far, sealed into one batch."""
    batch = pool.events.seal()
    return [] if batch is None else list(batch.events)


def test_pool_caches_a_block_under_its_hash_once():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 111)
    assert (a.block_hash, pool.cached) == (111, {111: a})
    assert not pool.cache_block(b, 111)  # the hash already names block a
    assert b.block_hash is None
    assert pool.cached == {111: a}


def test_freed_cached_block_keeps_its_hash_until_taken_again():
    pool = BlockPool(3, KVEventRecorder("cpu"))
    a, b = pool.get_new_blocks(2)  # 0 1; free: 2
    pool.cache_block(a, 10)
    pool.cache_block(b, 11)
    pool.free_blocks([b, a])
    assert pool.free_queue.block_ids() == [2, 1, 0]
    assert pool.cached == {10: a, 11: b}
    assert recorded(pool) == []  # freeing evicts nothing
    # taking blocks evicts from the head: block 2 holds nothing, block 1 loses hash 11
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert b.block_hash is None
    assert pool.cached == {10: a}
    assert recorded(pool) == [BlockRemoved((11,), medium="cpu")]


def test_one_removed_event_per_take_in_eviction_order():
    pool = BlockPool(4, KVEventRecorder("cpu"))
    blocks = pool.get_new_blocks(4)
    for block in blocks:
        pool.cache_block(block, 100 + block.block_id)
    pool.free_blocks(reversed(blocks))  # free: 3 2 1 0
    assert ids(pool.get_new_blocks(3)) == [3, 2, 1]
    assert recorded(pool) == [BlockRemoved((103, 102, 101), medium="cpu")]
    assert list(pool.cached) == [100]


def test_touch_pulls_a_free_cached_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.cache_block(blocks[2], 7)
    pool.free_blocks(blocks)  # free: 0 1 2 3 4
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 1
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    pool.touch([blocks[2]])  # a second holder: no queue change
    assert blocks[2].ref_cnt == 2
    assert pool.num_free_blocks == 4
    pool.free_blocks([blocks[2]])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    pool.free_blocks([blocks[2]])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4, 2]  # back at the tail: evicted last
    assert pool.cached == {7: blocks[2]}


def test_reset_prefix_cache_only_when_no_block_is_in_use():
    pool = BlockPool(3, KVEventRecorder("cuda"))
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()  # b is still held
    assert pool.cached == {1: a, 2: b}
    assert recorded(pool) == []
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.cached == {}
    assert (a.block_hash, b.block_hash) == (None, None)
    assert pool.free_queue.block_ids() == [2, 0, 1]  # the queue order is kept
    assert recorded(pool) == [AllBlocksCleared(medium="cuda")]
    # taking the formerly cached blocks now evicts nothing
    pool.get_new_blocks(3)
    assert recorded(pool) == []


def test_pool_without_a_recorder_still_evicts():
    pool = BlockPool(1)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, 5)
    pool.free_blocks([block])
    assert pool.get_new_blocks(1) == [block]
    assert pool.cached == {} and block.block_hash is None
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
