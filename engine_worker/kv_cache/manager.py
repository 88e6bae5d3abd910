"""Maps requests to KV blocks: block tables, prefix-cache hits, forks and copy-on-write.

A request holding ``num_tokens`` tokens in the cache owns ``ceil(num_tokens / block_size)``
blocks, so at most ``block_size - 1`` slots are ever wasted per request (in its last block).

Publishing: a block is registered in the prefix cache when it is allocated for the step that
fills it, so a request admitted later in the same step already hits it (within each layer the
step writes every new K/V before any attention reads, so the hit reads computed values). The
``BlockStored`` event follows only once the step has computed the block
(``cache_full_blocks``); a request preempted or aborted before then unregisters its pending
blocks, so nothing half-written is ever found or announced.

Sharing: a block may sit in several block tables (prefix-cache hits, ``fork`` for n > 1). A
block that is shared or cached is never written again; a request about to write into one gets
a private copy first (copy-on-write), and the step carries the (src, dst) copies to the runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_worker.kv_cache.block_pool import BlockPool, KVBlock
from engine_worker.kv_cache.events import KVEventRecorder
from quire.block_hash import first_block_extra_keys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of cache occupancy; ``num_used_slots`` counts slots holding a token."""

    num_blocks: int
    num_free_blocks: int
    num_allocated_slots: int
    num_used_slots: int
    num_cached_blocks: int
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens found cached

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate_slots`` changed: blocks appended, and copy-on-write copies (src, dst)
    that the runner must perform before the step (the table changed in place then)."""

    new_block_ids: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    blocks: tuple[KVBlock, ...]
    num_tokens: int  # tokens whose K/V the hit provides (at most num_tokens - 1 of the request)
    block_size: int = field(default=1, compare=False)

    @property
    def needs_copy(self) -> bool:
        """The whole prompt hit: its last token is recomputed inside the last hit block,
        which must first be copied (a cached block is never written)."""
        return self.num_tokens < len(self.blocks) * self.block_size

    def shortened(self) -> CachedPrefix:
        """The same hit without its last block: nothing to copy, one block to compute."""
        blocks = self.blocks[:-1]
        return CachedPrefix(blocks, len(blocks) * self.block_size, self.block_size)


NO_PREFIX = CachedPrefix((), 0)


class KVCacheManager:
    """Allocates and frees blocks per request. Owned by the scheduler alone."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventRecorder | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.pool = BlockPool(num_blocks, events)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_num_tokens: dict[str, int] = {}
        self._req_num_registered: dict[str, int] = {}  # leading blocks hashed or skipped
        self._req_pending: dict[str, list[int]] = {}  # registered, not yet computed (indices)
        self._pending_block_ids: set[int] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> CachedPrefix:
        """The longest run of the request's full blocks already cached. At least the last
        token is always left to compute, because its logits are needed."""
        if not self.enable_prefix_caching:
            return NO_PREFIX
        blocks = []
        for block_hash in block_hashes:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        prefix = CachedPrefix(tuple(blocks), min(len(blocks) * self.block_size, num_tokens - 1),
                              self.block_size)
        if prefix.needs_copy and self._is_pending(blocks[-1]):
            # the copy would run before this step computes the block: take one block less
            return prefix.shortened()
        return prefix

    def cached_block_hashes(self) -> frozenset[int]:
        """Every block hash the prefix cache holds now (what a KV-event subscriber starts
        from)."""
        return frozenset(self.pool.cached)

    def _is_pending(self, block: KVBlock) -> bool:
        return block.block_id in self._pending_block_ids

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def register_full_blocks(self, req_id: str, block_hashes: Sequence[int],
                             num_tokens: int) -> None:
        """Register the request's blocks full within its first ``num_tokens`` slots that
        ``block_hashes`` names and that are not registered yet (a multi-step run's, whose
        tokens were unknown when it was given its slots); ``cache_full_blocks`` confirms them."""
        if self.enable_prefix_caching and block_hashes:
            self._register(req_id, block_hashes, num_tokens)

    def _register(self, req_id: str, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Register the blocks that will be full after this step under their hashes."""
        first = self._req_num_registered.get(req_id, 0)
        last = min(num_tokens // self.block_size, len(block_hashes))
        table = self._req_blocks[req_id]
        pending = self._req_pending.setdefault(req_id, [])
        for i in range(first, last):
            if table[i].block_hash is None and self.pool.cache_block(table[i], block_hashes[i]):
                pending.append(i)
                self._pending_block_ids.add(table[i].block_id)
        self._req_num_registered[req_id] = max(first, last)

    def cache_full_blocks(self, req_id: str, block_hashes: Sequence[int],
                          num_computed_tokens: int, token_ids: Sequence[int],
                          cache_salt: str | None, lora_name: str | None = None) -> None:
        """Confirm the request's registered blocks that the finished step computed, and
        announce them (``BlockStored``, one event per run of consecutive blocks)."""
        pending = self._req_pending.get(req_id)
        if not pending:
            return
        num_full = num_computed_tokens // self.block_size
        done = [i for i in pending if i < num_full]
        self._req_pending[req_id] = [i for i in pending if i >= num_full]
        table = self._req_blocks[req_id]
        self._pending_block_ids.difference_update(table[i].block_id for i in done)
        start = 0
        for k in range(1, len(done) + 1):
            if k == len(done) or done[k] != done[k - 1] + 1:
                run = done[start:k]
                self._emit_stored([block_hashes[i] for i in run], run[0], block_hashes,
                                  token_ids, cache_salt, lora_name)
                start = k

    def has_pending(self, req_id: str) -> bool:
        return bool(self._req_pending.get(req_id))

    def discard_pending(self) -> None:
        """A step failed: nothing it was to compute may stay findable."""
        for req_id in list(self._req_pending):
            self._unregister_pending(req_id)

    def _unregister_pending(self, req_id: str) -> None:
        table = self._req_blocks.get(req_id, [])
        for i in self._req_pending.pop(req_id, []):
            self._pending_block_ids.discard(table[i].block_id)
            self.pool.uncache(table[i])

    def _emit_stored(self, run: list[int], start: int, block_hashes: Sequence[int],
                     token_ids: Sequence[int], cache_salt: str | None,
                     lora_name: str | None) -> None:
        if self.events is None:
            return
        bs = self.block_size
        self.events.block_stored(
            run, parent_block_hash=block_hashes[start - 1] if start else None,
            token_ids=list(token_ids[start * bs:(start + len(run)) * bs]), block_size=bs,
            extra_keys=first_block_extra_keys(cache_salt, lora_name) if start == 0 else (),
            lora_name=lora_name)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------- allocation
    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       prefix: CachedPrefix = NO_PREFIX,
                       block_hashes: Sequence[int] = ()) -> Allocation | None:
        """Make room for ``num_new_tokens`` more tokens after ``num_computed_tokens``.

        ``prefix`` (on admission only) puts cached blocks at the head of the table;
        ``block_hashes`` (the request's full-block hashes) lets the blocks this step fills be
        registered in the prefix cache. Returns None, changing nothing, when the pool has too
        few free blocks.
        """
        table = self._req_blocks.get(req_id, [])
        assert not (prefix.blocks and table), "a cached prefix is only taken on admission"
        candidate = table + list(prefix.blocks)
        touched = {id(b) for b in prefix.blocks}
        num_free_touched = sum(1 for b in prefix.blocks if b.ref_cnt == 0)
        cow = self._to_copy(candidate, num_computed_tokens, touched)
        num_total = num_computed_tokens + num_new_tokens
        num_needed = max(0, self.num_blocks_for(num_total) - len(candidate))
        if num_needed + len(cow) > self.pool.num_free_blocks - num_free_touched:
            return None
        self.pool.touch(prefix.blocks)
        if prefix.blocks:
            self._req_num_registered[req_id] = len(prefix.blocks)
        copies = []
        for i in cow:
            fresh = self.pool.get_new_blocks(1)[0]  # before freeing, so it is not the source
            copies.append((candidate[i].block_id, fresh.block_id))
            self.pool.free_blocks([candidate[i]])
            candidate[i] = fresh
        if cow:  # a fresh copy may become full (and findable) again
            self._req_num_registered[req_id] = min(cow[0], self._req_num_registered.get(req_id, 0))
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed else []
        self._req_blocks[req_id] = candidate + new_blocks
        self._req_num_tokens[req_id] = max(num_total, self._req_num_tokens.get(req_id, 0))
        if self.enable_prefix_caching and block_hashes:
            self._register(req_id, block_hashes, num_total)
        return Allocation(tuple(b.block_id for b in new_blocks), tuple(copies))

    def _to_copy(self, table: list, num_computed_tokens: int, touched=frozenset()) -> list[int]:
        """Indices of the blocks a step writes into that are shared or cached: they are
        copied first (``touched``: ids of blocks the step itself takes a reference to)."""
        return [i for i in range(num_computed_tokens // self.block_size, len(table))
                if table[i].ref_cnt + (id(table[i]) in touched) > 1
                or table[i].block_hash is not None]

    def num_blocks_to_allocate(self, req_id: str, num_computed_tokens: int,
                               num_new_tokens: int) -> int:
        """Free blocks ``allocate_slots`` (without a prefix) would take for these slots now:
        the new ones and the copies. Several requests' sum within ``num_free_blocks`` means
        every one of their allocations succeeds."""
        table = self._req_blocks.get(req_id, [])
        num_total = num_computed_tokens + num_new_tokens
        return max(0, self.num_blocks_for(num_total) - len(table)) + \
            len(self._to_copy(table, num_computed_tokens))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def trim(self, req_id: str, num_tokens: int) -> bool:
        """Keep only the slots of the first ``num_tokens`` tokens: the blocks past them (a
        speculative step's rejected drafts') go back to the pool. True if a block was freed.
        Those blocks were never registered in the prefix cache: only blocks full of the
        request's own tokens are, and the request's tokens all lie within ``num_tokens``."""
        table = self._req_blocks[req_id]
        self._req_num_tokens[req_id] = num_tokens
        keep = self.num_blocks_for(num_tokens)
        if keep >= len(table):
            return False
        tail = table[keep:]
        assert all(b.block_hash is None for b in tail), "a registered block past the tokens"
        del table[keep:]
        self.pool.free_blocks(reversed(tail))
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's whole block table, shared (one more reference each)."""
        table = list(self._req_blocks[parent_id])
        self.pool.touch(table)
        self._req_blocks[child_id] = table
        self._req_num_tokens[child_id] = self._req_num_tokens[parent_id]
        self._req_num_registered[child_id] = self._req_num_registered.get(parent_id, 0)

    def free(self, req_id: str) -> None:
        """Release every block of ``req_id``, tail first so later blocks are evicted first."""
        self._unregister_pending(req_id)
        blocks = self._req_blocks.pop(req_id, [])
        self._req_num_tokens.pop(req_id, None)
        self._req_num_registered.pop(req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def stats(self) -> KVCacheStats:
        num_allocated = sum(len(b) for b in self._req_blocks.values()) * self.block_size
        return KVCacheStats(num_blocks=self.pool.num_blocks,
                            num_free_blocks=self.pool.num_free_blocks,
                            num_allocated_slots=num_allocated,
                            num_used_slots=sum(self._req_num_tokens.values()),
                            num_cached_blocks=len(self.pool.cached),
                            prefix_cache_queries=self.prefix_cache_queries,
                            prefix_cache_hits=self.prefix_cache_hits)
