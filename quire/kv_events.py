"""KV-cache events: how an engine tells subscribers (routers) which blocks it holds.

Shapes follow vLLM's events, which llm-d and Dynamo consume: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, batched with a timestamp and a sequence number. A subscriber that takes a
``KVCacheSnapshot`` (which names the last batch it includes) and then applies every later batch
in order holds exactly the engine's set of cached block hashes; a gap in sequence numbers means
it must take a new snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose K/V were computed and are now findable by hash, in chain order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None  # None when the first block starts a sequence
    token_ids: tuple[int, ...]  # block_size tokens per block, concatenated
    block_size: int
    extra_keys: tuple[str, ...] = ()  # those of the first block (cache salt)
    lora_name: str | None = None
    medium: str = "cpu"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted: their hashes no longer find anything."""

    block_hashes: tuple[int, ...]
    medium: str = "cpu"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str = "cpu"


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int  # 1, 2, 3... per engine; consecutive
    timestamp_s: float  # wall clock (time.time()) when the batch was sealed
    events: tuple[KVEvent, ...]


@dataclass(frozen=True, slots=True)
class KVCacheSnapshot:
    """Every cached block hash after the batch numbered ``seq`` (0: before any batch)."""

    seq: int
    block_hashes: frozenset[int]
    incarnation_id: str = ""  # the engine process it comes from ("": not reported)


@dataclass(frozen=True, slots=True)
class KVCacheDiff:
    """What one batch changed in a mirror's block set, net: a block stored and removed again
    within the batch is in neither."""

    added: frozenset[int]
    removed: frozenset[int]


_NO_CHANGE = KVCacheDiff(frozenset(), frozenset())


@dataclass(slots=True)
class KVCacheMirror:
    """A subscriber's copy of one engine's cached block set: the one place KV events are
    applied (the router's prefix index keeps one per engine)."""

    seq: int = 0
    block_hashes: set[int] = field(default_factory=set)

    @classmethod
    def from_snapshot(cls, snapshot: KVCacheSnapshot) -> KVCacheMirror:
        return cls(seq=snapshot.seq, block_hashes=set(snapshot.block_hashes))

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply the next batch. Older batches are ignored; returns False on a gap (the mirror
        is then stale and needs a fresh snapshot)."""
        return self.apply_diff(batch) is not None

    def apply_diff(self, batch: KVEventBatch) -> KVCacheDiff | None:
        """``apply``, returning what changed: None on a gap (nothing applied), no change for
        a batch already applied."""
        if batch.seq <= self.seq:
            return _NO_CHANGE
        if batch.seq != self.seq + 1:
            return None
        added: set[int] = set()
        removed: set[int] = set()
        for event in batch.events:
            match event:
                case BlockStored(block_hashes=hashes):
                    for block_hash in hashes:
                        if block_hash not in self.block_hashes:
                            self.block_hashes.add(block_hash)
                            _move(block_hash, removed, added)
                case BlockRemoved(block_hashes=hashes):
                    for block_hash in hashes:
                        if block_hash in self.block_hashes:
                            self.block_hashes.remove(block_hash)
                            _move(block_hash, added, removed)
                case AllBlocksCleared():
                    for block_hash in self.block_hashes:
                        _move(block_hash, added, removed)
                    self.block_hashes.clear()
                case _:
                    raise TypeError(f"unknown KV event {type(event).__name__}")
        self.seq = batch.seq
        return KVCacheDiff(frozenset(added), frozenset(removed))


def _move(block_hash: int, undo: set[int], into: set[int]) -> None:
    """Net bookkeeping: a change that undoes an earlier one in the batch cancels it."""
    if block_hash in undo:
        undo.remove(block_hash)
    else:
        into.add(block_hash)


# ------------------------------------------------------------------- wire (quire.v1) forms
def batch_to_proto(batch: KVEventBatch):
    from quire.v1 import kv_cache_pb2 as pb

    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(pb.KVEvent(block_stored=pb.BlockStored(
                block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
                token_ids=event.token_ids, block_size=event.block_size,
                extra_keys=event.extra_keys, lora_name=event.lora_name, medium=event.medium)))
        elif isinstance(event, BlockRemoved):
            events.append(pb.KVEvent(block_removed=pb.BlockRemoved(
                block_hashes=event.block_hashes, medium=event.medium)))
        else:
            events.append(pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared(medium=event.medium)))
    return pb.KVEventBatch(seq=batch.seq, timestamp_s=batch.timestamp_s, events=events)


def batch_from_proto(message) -> KVEventBatch:
    events: list[KVEvent] = []
    for event in message.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            e = event.block_stored
            events.append(BlockStored(
                block_hashes=tuple(e.block_hashes),
                parent_block_hash=e.parent_block_hash if e.HasField("parent_block_hash") else None,
                token_ids=tuple(e.token_ids), block_size=e.block_size,
                extra_keys=tuple(e.extra_keys),
                lora_name=e.lora_name if e.HasField("lora_name") else None, medium=e.medium))
        elif kind == "block_removed":
            events.append(BlockRemoved(block_hashes=tuple(event.block_removed.block_hashes),
                                       medium=event.block_removed.medium))
        else:
            events.append(AllBlocksCleared(medium=event.all_blocks_cleared.medium))
    return KVEventBatch(seq=message.seq, timestamp_s=message.timestamp_s, events=tuple(events))


def snapshot_to_proto(snapshot: KVCacheSnapshot):
    from quire.v1 import kv_cache_pb2 as pb

    return pb.KVCacheSnapshot(seq=snapshot.seq, block_hashes=sorted(snapshot.block_hashes),
                              incarnation_id=snapshot.incarnation_id)


def snapshot_from_proto(message) -> KVCacheSnapshot:
    return KVCacheSnapshot(seq=message.seq, block_hashes=frozenset(message.block_hashes),
                           incarnation_id=message.incarnation_id)
