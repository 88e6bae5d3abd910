"""Collects the KV events of one engine and seals them into numbered batches.

Events accumulate while a step runs; ``seal()`` (called once per step, and before a snapshot)
turns them into the next ``KVEventBatch``. Batches wait in a bounded outbox until a consumer
takes them; a consumer that fell behind the outbox sees a gap and re-snapshots.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from quire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot,
                             KVEvent, KVEventBatch)


class KVEventRecorder:
    def __init__(self, medium: str, max_batches: int = 10_000) -> None:
        self.medium = medium
        self._pending: list[KVEvent] = []
        self._outbox: deque[KVEventBatch] = deque(maxlen=max_batches)
        self.seq = 0  # of the last sealed batch

    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None,
                     token_ids: list[int], block_size: int, extra_keys: tuple[str, ...],
                     lora_name: str | None = None) -> None:
        self._pending.append(BlockStored(
            block_hashes=tuple(block_hashes), parent_block_hash=parent_block_hash,
            token_ids=tuple(token_ids), block_size=block_size, extra_keys=extra_keys,
            medium=self.medium, lora_name=lora_name))

    def block_removed(self, block_hashes: Iterable[int]) -> None:
        self._pending.append(BlockRemoved(block_hashes=tuple(block_hashes), medium=self.medium))

    def all_cleared(self) -> None:
        self._pending.append(AllBlocksCleared(medium=self.medium))

    def seal(self) -> KVEventBatch | None:
        """Close the events so far into the next batch (None when there were none)."""
        if not self._pending:
            return None
        self.seq += 1
        batch = KVEventBatch(seq=self.seq, timestamp_s=time.time(), events=tuple(self._pending))
        self._pending.clear()
        self._outbox.append(batch)
        return batch

    def take(self) -> list[KVEventBatch]:
        """Every sealed batch not yet taken, oldest first."""
        batches = list(self._outbox)
        self._outbox.clear()
        return batches

    def snapshot(self, cached_hashes: Iterable[int]) -> KVCacheSnapshot:
        """The cached set as of the last sealed batch (pending events are sealed first)."""
        self.seal()
        return KVCacheSnapshot(seq=self.seq, block_hashes=frozenset(cached_hashes))
