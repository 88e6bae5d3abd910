"""Maps requests to KV blocks: the block table of every running request.

A request holding ``num_tokens`` tokens in the cache owns ``ceil(num_tokens / block_size)``
blocks, so at most ``block_size - 1`` slots are ever wasted per request (in its last block).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_worker.kv_cache.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of cache occupancy; ``num_used_slots`` counts slots holding a token."""

    num_blocks: int
    num_free_blocks: int
    num_allocated_slots: int
    num_used_slots: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class KVCacheManager:
    """Allocates and frees blocks per request. Owned by the scheduler alone."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_num_tokens: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, req_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow ``req_id``'s block table to hold ``num_total_tokens`` tokens.

        Returns the ids of newly allocated blocks (possibly empty), or ``None`` when the pool
        has too few free blocks, in which case nothing changes.
        """
        held = len(self._req_blocks.get(req_id, ()))
        num_new = self.num_blocks_for(num_total_tokens) - held
        if num_new > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.get_new_blocks(num_new) if num_new > 0 else []
        self._req_blocks.setdefault(req_id, []).extend(new_blocks)
        self._req_num_tokens[req_id] = max(num_total_tokens, self._req_num_tokens.get(req_id, 0))
        return [b.block_id for b in new_blocks]

    def free(self, req_id: str) -> None:
        """Release every block of ``req_id``, tail first so later blocks are reused first."""
        blocks = self._req_blocks.pop(req_id, [])
        self._req_num_tokens.pop(req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def stats(self) -> KVCacheStats:
        num_allocated = sum(len(b) for b in self._req_blocks.values()) * self.block_size
        return KVCacheStats(num_blocks=self.pool.num_blocks,
                            num_free_blocks=self.pool.num_free_blocks,
                            num_allocated_slots=num_allocated,
                            num_used_slots=sum(self._req_num_tokens.values()))
