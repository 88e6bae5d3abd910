"""The pool of KV blocks: reference counts, a free queue with O(1) removal, and the prefix cache.

A *block* is one page of the KV cache holding ``block_size`` token slots in every layer. The
pool knows nothing about requests; the ``KVCacheManager`` maps requests to blocks.

Prefix cache: a full, computed block may carry its chained hash (``quire.block_hash``) and be
found again by it. A freed block keeps its hash while it waits in the free queue, so it can be
hit again (and leaves the queue); it loses the hash only when it is taken for new data, which
is the eviction, reported as ``BlockRemoved``.

Free queue layout (an intrusive doubly linked list threaded through the blocks themselves)::

    head <-> b7 <-> b2 <-> b9 <-> tail        popleft() takes from the head (evict first),
                                              append() adds at the tail (evict last).

Any block can be unlinked from the middle in O(1), which prefix caching needs when a freed but
still cached block is hit again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_worker.kv_cache.events import KVEventRecorder


class KVBlock:
    """One KV page. ``ref_cnt`` counts the requests holding it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel ends; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, "block already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next to be taken) to tail; for tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All KV blocks of one engine. Blocks are handed out from the head of the free queue."""

    def __init__(self, num_blocks: int, events: KVEventRecorder | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> the block holding it
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks (ref_cnt becomes 1), evicting their cached content;
        raise if there are too few."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks, only {self.num_free_blocks} free")
        out, evicted = [], []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.block_removed(evicted)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to (cached) blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail
        in the given order (so callers pass a request's tail blocks first: evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: int) -> bool:
        """Make a computed full block findable by its hash. False if another block already
        holds that hash (this one then stays anonymous and is simply freed later)."""
        assert block.block_hash is None and block.ref_cnt > 0
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, block: KVBlock) -> None:
        """Drop the block's hash (silently: callers report evictions themselves)."""
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.all_cleared()
        return True
