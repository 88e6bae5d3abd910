"""Exact tests of automatic prefix caching in the KV cache manager: hits, sharing, copy-on-write,
LRU eviction, reset, forks, cache salts, and the exact KV events each step seals.

Every test drives ``KVCacheManager(num_blocks=8, block_size=4)`` as the scheduler does: admit
(``find_cached_prefix`` then ``allocate_slots``), compute the step, then ``cache_full_blocks``
and ``seal()`` the step's events.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine_worker.kv_cache.events import KVEventRecorder
from engine_worker.kv_cache.manager import (NO_PREFIX, Allocation, CachedPrefix, KVCacheManager,
                                            KVCacheStats)
from quire.block_hash import hash_block_tokens
from quire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheMirror,
                             KVEventBatch)

BS = 4
TA = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
TB = TA[:8] + [50, 51, 52]  # shares TA's two full blocks
TD = list(range(200, 216))  # 16 unrelated tokens
TE = list(range(300, 305))


def hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    return hash_block_tokens(tokens, BS, cache_salt=salt)


HA, HB, HD, HE = hashes(TA), hashes(TB), hashes(TD), hashes(TE)


@dataclass
class Seq:
    """The test's own view of one request: its tokens and how many are computed."""

    req_id: str
    tokens: list[int]
    salt: str | None = None
    num_computed: int = 0

    @property
    def hashes(self) -> list[int]:
        return hashes(self.tokens, self.salt)


class Driver:
    """Drives the manager one request-step at a time, sealing events after each step."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.events = KVEventRecorder("cpu")
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=BS,
                                 enable_prefix_caching=True, events=self.events)
        self.batches: list[KVEventBatch] = []

    def admit(self, seq: Seq, num_new: int | None = None) -> tuple[CachedPrefix, Allocation | None]:
        prefix = self.kv.find_cached_prefix(seq.hashes, len(seq.tokens))
        num_new = len(seq.tokens) - prefix.num_tokens if num_new is None else num_new
        allocation = self.kv.allocate_slots(seq.req_id, prefix.num_tokens, num_new, prefix,
                                            block_hashes=seq.hashes)
        if allocation is not None:
            self.kv.record_prefix_query(len(seq.tokens), prefix.num_tokens)
            seq.num_computed = prefix.num_tokens
            self._compute(seq, num_new)
        return prefix, allocation

    def step(self, seq: Seq, num_new: int) -> Allocation | None:
        allocation = self.kv.allocate_slots(seq.req_id, seq.num_computed, num_new,
                                            block_hashes=seq.hashes)
        if allocation is not None:
            self._compute(seq, num_new)
        return allocation

    def _compute(self, seq: Seq, num_new: int) -> None:
        seq.num_computed += num_new
        self.kv.cache_full_blocks(seq.req_id, seq.hashes, seq.num_computed, seq.tokens,
                                  seq.salt)
        self.seal()

    def seal(self) -> KVEventBatch | None:
        batch = self.events.seal()
        self.batches.extend(self.events.take())
        return batch

    def events_since(self, seq: int) -> list[tuple[int, tuple]]:
        return [(b.seq, b.events) for b in self.batches if b.seq > seq]

    def refs(self) -> list[int]:
        return [b.ref_cnt for b in self.kv.pool.blocks]

    def cached(self) -> dict[int, int]:
        return {h: b.block_id for h, b in self.kv.pool.cached.items()}

    def free_ids(self) -> list[int]:
        return self.kv.pool.free_queue.block_ids()


def stored(block_hashes, parent, token_ids, extra_keys=()) -> BlockStored:
    return BlockStored(block_hashes=tuple(block_hashes), parent_block_hash=parent,
                       token_ids=tuple(token_ids), block_size=BS, extra_keys=tuple(extra_keys),
                       medium="cpu")


def removed(*block_hashes) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium="cpu")


def run_shared_prefix_scenario(d: Driver) -> dict[str, Seq]:
    """A computes 10 tokens, B shares its two full blocks, C is fully cached; all three end."""
    a, b, c = Seq("A", TA), Seq("B", TB), Seq("C", TA[:8])
    d.admit(a)
    d.admit(b)
    d.admit(c)
    for seq in (a, b, c):
        d.kv.free(seq.req_id)
    return {"A": a, "B": b, "C": c}


# ----------------------------------------------------------------------- the scenario
def test_hit_share_copy_on_write_and_lru_eviction_with_exact_events():
    d = Driver()
    kv = d.kv

    # A: 10 tokens, nothing cached yet; its two full blocks are published in one event
    a = Seq("A", TA)
    prefix, allocation = d.admit(a)
    assert prefix == NO_PREFIX
    assert allocation == Allocation((0, 1, 2))
    assert d.cached() == {HA[0]: 0, HA[1]: 1}
    assert d.batches[0].seq == 1
    assert d.events_since(0) == [(1, (stored(HA, None, TA[:8]),))]

    # B: the same first 8 tokens hit both blocks, which it now shares with A
    b = Seq("B", TB)
    assert HB[:2] == HA
    prefix, allocation = d.admit(b)
    assert (prefix.num_tokens, [blk.block_id for blk in prefix.blocks]) == (8, [0, 1])
    assert allocation == Allocation((3,))  # positions 8..10 go to a fresh block
    assert kv.get_block_ids("B") == [0, 1, 3]
    assert d.refs() == [2, 2, 1, 1, 0, 0, 0, 0]
    assert d.events_since(1) == []  # nothing newly stored

    # C: the whole prompt is cached, so the last token is recomputed: writing position 7 into
    # cached block 1 first copies it to a fresh block (4)
    c = Seq("C", TA[:8])
    prefix, allocation = d.admit(c)
    assert (prefix.num_tokens, len(prefix.blocks)) == (7, 2)
    assert allocation == Allocation((), ((1, 4),))
    assert kv.get_block_ids("C") == [0, 4]
    assert d.refs() == [3, 2, 1, 1, 1, 0, 0, 0]
    assert d.cached() == {HA[0]: 0, HA[1]: 1}  # block 4 duplicates HA[1]: not cached again
    assert d.events_since(1) == []
    assert kv.stats() == KVCacheStats(
        num_blocks=8, num_free_blocks=3, num_allocated_slots=8 * BS, num_used_slots=10 + 11 + 8,
        num_cached_blocks=2, prefix_cache_queries=10 + 11 + 8, prefix_cache_hits=0 + 8 + 7)

    # frees: each request's tail first; shared blocks join the queue when their last holder goes
    kv.free("A")
    assert d.free_ids() == [5, 6, 7, 2]
    kv.free("B")
    assert d.free_ids() == [5, 6, 7, 2, 3, 1]
    kv.free("C")
    assert d.free_ids() == [5, 6, 7, 2, 3, 1, 4, 0]
    assert d.refs() == [0] * 8
    assert d.cached() == {HA[0]: 0, HA[1]: 1}  # freed, still findable
    assert d.events_since(1) == []

    # D takes the never-cached blocks first: nothing evicted
    dd = Seq("D", TD)
    _, allocation = d.admit(dd)
    assert allocation == Allocation((5, 6, 7, 2))
    assert d.events_since(1) == [(2, (stored(HD, None, TD),))]
    # E needs two more: 3 (anonymous) then 1, which evicts A's tail block before its head
    e = Seq("E", TE)
    _, allocation = d.admit(e)
    assert allocation == Allocation((3, 1))
    assert d.events_since(2) == [(3, (removed(HA[1]), stored(HE, None, TE[:4])))]
    assert d.cached() == {HA[0]: 0, **{h: i for h, i in zip(HD, (5, 6, 7, 2))}, HE[0]: 3}
    assert d.free_ids() == [4, 0]

    # only A's first block is left to hit
    prefix = kv.find_cached_prefix(HB, len(TB))
    assert ([blk.block_id for blk in prefix.blocks], prefix.num_tokens) == ([0], 4)

    # a reset is refused while blocks are in use, then clears everything
    assert not kv.reset_prefix_cache()
    assert d.seal() is None
    kv.free("D")
    kv.free("E")
    assert kv.reset_prefix_cache()
    d.seal()
    assert d.events_since(3) == [(4, (AllBlocksCleared(medium="cpu"),))]
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix(HA, len(TA)) == NO_PREFIX
    # after the reset, taking blocks evicts nothing
    assert d.free_ids() == [4, 0, 2, 7, 6, 5, 1, 3]
    _, allocation = d.admit(Seq("F", TA))
    assert allocation == Allocation((4, 0, 2))
    assert d.events_since(4) == [(5, (stored(HA, None, TA[:8]),))]


def test_hit_reuses_a_free_cached_block_from_the_middle_of_the_queue():
    d = Driver()
    run_shared_prefix_scenario(d)
    assert d.free_ids() == [5, 6, 7, 2, 3, 1, 4, 0]
    b = Seq("B2", TB)
    prefix, allocation = d.admit(b)
    assert [blk.block_id for blk in prefix.blocks] == [0, 1]
    assert allocation == Allocation((5,))
    assert d.free_ids() == [6, 7, 2, 3, 4]  # 0 and 1 left the queue; 5 was taken
    assert d.refs() == [1, 1, 0, 0, 0, 1, 0, 0]
    assert len(d.batches) == 1  # a hit stores nothing new


def test_prefix_hit_that_does_not_fit_changes_nothing():
    d = Driver(num_blocks=4)
    a = Seq("A", TA[:8])
    d.admit(a)  # blocks 0 1, both cached
    d.kv.free("A")  # free: 2 3 1 0
    filler = Seq("X", TD[:8])
    d.admit(filler)  # takes 2 3
    before = (d.free_ids(), d.refs(), d.cached(), d.kv.stats())
    # 12 tokens: hits 0 1 (both free, so they count against the free pool) and needs a third
    prefix, allocation = d.admit(Seq("B", TA[:8] + [9, 9, 9, 9]))
    assert len(prefix.blocks) == 2
    assert allocation is None
    assert (d.free_ids(), d.refs(), d.cached(), d.kv.stats()) == before


def test_stats_count_hit_tokens_and_cached_blocks():
    d = Driver()
    run_shared_prefix_scenario(d)
    stats = d.kv.stats()
    assert (stats.num_cached_blocks, stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        2, 29, 15)
    assert stats.num_free_blocks == 8 and stats.num_used_slots == 0


# -------------------------------------------------------------------------------- forks
def test_fork_shares_blocks_and_the_first_write_into_the_shared_partial_block_copies_it():
    d = Driver()
    parent = Seq("P", TA[:6])  # one full block and two tokens of a second
    _, allocation = d.admit(parent)
    assert allocation == Allocation((0, 1))
    assert d.events_since(0) == [(1, (stored(HA[:1], None, TA[:4]),))]
    d.kv.fork("P", "Q")
    child = Seq("Q", list(parent.tokens), num_computed=parent.num_computed)
    assert d.kv.get_block_ids("Q") == [0, 1]
    assert d.refs()[:3] == [2, 2, 0]

    # each sample appends a different token; the parent writes first and gets a copy
    parent.tokens.append(70)
    child.tokens.append(80)
    assert d.step(parent, 1) == Allocation((), ((1, 2),))
    assert d.kv.get_block_ids("P") == [0, 2]
    assert d.refs()[:3] == [2, 1, 1]
    # the child now holds block 1 alone and writes into it in place
    assert d.step(child, 1) == Allocation(())
    assert d.kv.get_block_ids("Q") == [0, 1]

    # both fill their second block with different tokens: two different hashes, parent 0
    parent.tokens.append(71)
    child.tokens.append(81)
    assert d.step(parent, 1) == Allocation(())
    assert d.step(child, 1) == Allocation(())
    hp, hq = parent.hashes[1], child.hashes[1]
    assert hp != hq
    assert d.cached() == {HA[0]: 0, hp: 2, hq: 1}
    assert d.events_since(1) == [
        (2, (stored([hp], HA[0], parent.tokens[4:8]),)),
        (3, (stored([hq], HA[0], child.tokens[4:8]),)),
    ]


def test_fork_of_a_request_on_full_blocks_copies_nothing():
    d = Driver()
    parent = Seq("P", TA[:8])
    d.admit(parent)
    d.kv.fork("P", "Q")
    parent.tokens.append(70)
    assert d.step(parent, 1) == Allocation((2,))
    d.kv.free("P")
    assert d.refs()[:3] == [1, 1, 0]  # the child still holds the prompt's blocks
    assert d.free_ids()[-1] == 2
    d.kv.free("Q")
    assert d.free_ids()[-2:] == [1, 0]


# --------------------------------------------------------------------------- cache salt
def test_cache_salt_isolates_requests_with_equal_tokens():
    d = Driver()
    d.admit(Seq("A", TA))
    salted = Seq("S", TA, salt="tenant-a")
    assert set(salted.hashes).isdisjoint(HA)
    prefix, allocation = d.admit(salted)
    assert prefix == NO_PREFIX
    assert allocation == Allocation((3, 4, 5))
    assert d.events_since(1) == [
        (2, (stored(salted.hashes, None, TA[:8], ("salt:tenant-a",)),))]
    # the same salt hits, a different one does not
    assert len(d.kv.find_cached_prefix(hashes(TB, "tenant-a"), len(TB)).blocks) == 2
    assert d.kv.find_cached_prefix(hashes(TB, "tenant-b"), len(TB)) == NO_PREFIX
    assert len(d.kv.find_cached_prefix(HB, len(TB)).blocks) == 2


def test_prefix_caching_off_never_hits_or_publishes():
    events = KVEventRecorder("cpu")
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, events=events)
    kv.allocate_slots("A", 0, 10, NO_PREFIX, block_hashes=HA)
    kv.cache_full_blocks("A", HA, 10, TA, None)
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix(HA, len(TA)) == NO_PREFIX
    assert events.seal() is None


# ------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_publishes_each_block_after_the_step_that_fills_it():
    d = Driver()
    a = Seq("A", TD[:14])
    d.admit(a, num_new=3)  # nothing full yet
    assert d.events_since(0) == []
    assert d.step(a, 6) == Allocation((1, 2))  # positions 3..8: blocks 0 and 1 become full
    assert d.events_since(0) == [(1, (stored(HD[:2], None, TD[:8]),))]
    assert d.step(a, 5) == Allocation((3,))  # positions 9..13: block 2 full
    assert d.events_since(1) == [(2, (stored(HD[2:3], HD[1], TD[8:12]),))]
    # a hit stops at the first block not cached
    prefix = d.kv.find_cached_prefix(HD, len(TD))
    assert [blk.block_id for blk in prefix.blocks] == [0, 1, 2]


# -------------------------------------------------------------------------------- mirror
def test_mirror_from_a_mid_scenario_snapshot_tracks_the_cached_set():
    d = Driver()
    d.admit(Seq("A", TA))
    d.admit(Seq("B", TB))
    snapshot = d.events.snapshot(d.kv.cached_block_hashes())
    assert snapshot.seq == 1
    assert snapshot.block_hashes == frozenset(HA[:2])
    seen = len(d.batches)

    for req_id in ("A", "B"):
        d.kv.free(req_id)
    d.admit(Seq("D", TD))
    d.admit(Seq("E", list(range(300, 316))))  # 16 tokens: evicts A's blocks, tail first
    assert d.batches[-1].events[0] == removed(HA[1], HA[0])
    d.kv.free("D")
    d.kv.free("E")
    assert d.kv.reset_prefix_cache()
    d.seal()
    d.admit(Seq("F", TB))

    mirror = KVCacheMirror.from_snapshot(snapshot)
    for batch in d.batches[seen:]:
        assert mirror.apply(batch)
    assert mirror.block_hashes == d.kv.cached_block_hashes()
    assert mirror.seq == d.events.seq
    # replaying an old batch is ignored
    assert mirror.apply(d.batches[0])
    assert mirror.block_hashes == d.kv.cached_block_hashes()


def test_mirror_reports_a_gap_and_stays_unchanged():
    d = Driver(num_blocks=16)
    d.admit(Seq("A", TA))
    d.admit(Seq("D", TD))
    d.admit(Seq("E", TE))
    first, _, third = d.batches
    mirror = KVCacheMirror()
    assert mirror.apply(first)
    assert not mirror.apply(third)  # batch 2 is missing
    assert (mirror.seq, mirror.block_hashes) == (1, set(HA[:2]))


def test_snapshot_seals_pending_events_first():
    events = KVEventRecorder("cpu")
    kv = KVCacheManager(num_blocks=8, block_size=BS, events=events)
    kv.allocate_slots("A", 0, 8, NO_PREFIX, block_hashes=HA)
    kv.cache_full_blocks("A", HA, 8, TA, None)
    snapshot = events.snapshot(kv.cached_block_hashes())
    assert (snapshot.seq, snapshot.block_hashes) == (1, frozenset(HA[:2]))
    [batch] = events.take()
    assert batch.events == (stored(HA[:2], None, TA[:8]),)
    assert events.take() == []


@pytest.mark.parametrize("num_batches", [1, 3])
def test_recorder_outbox_is_bounded_and_a_lagging_consumer_sees_a_gap(num_batches):
    events = KVEventRecorder("cpu", max_batches=2)
    for i in range(num_batches + 2):
        events.block_removed([i])
        events.seal()
    kept = events.take()
    assert [b.seq for b in kept] == [num_batches + 1, num_batches + 2]
    mirror = KVCacheMirror()
    assert mirror.apply(kept[0]) is False


# ------------------------------------------------- regressions (bugs found and fixed)
def test_a_hit_on_a_block_this_step_computes_is_never_the_source_of_a_copy():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    # A is allocated for the step that computes its 8 tokens: its blocks are findable already
    kv.allocate_slots("A", 0, 8, NO_PREFIX, block_hashes=HA)
    # C, admitted later in the same step, has the same 8 tokens
    prefix = kv.find_cached_prefix(HA, 8)
    allocation = kv.allocate_slots("C", prefix.num_tokens, 8 - prefix.num_tokens, prefix, HA)
    assert allocation is not None
    being_computed = set(kv.get_block_ids("A"))
    assert [src for src, _ in allocation.copies if src in being_computed] == []


def test_a_fully_cached_prompt_fits_wherever_an_uncached_one_does():
    """The copy of the last hit block needs one block more than computing from scratch; when
    it does not fit, the hit without its last block does (the scheduler's fallback)."""
    d = Driver(num_blocks=2)
    d.admit(Seq("A", TA[:8]))
    d.kv.free("A")
    assert d.kv.stats().num_free_blocks == 2  # enough for the 8 tokens without the cache
    prefix = d.kv.find_cached_prefix(HA, 8)
    assert prefix.needs_copy and prefix.num_tokens == 7
    assert d.kv.allocate_slots("B", 7, 1, prefix, HA) is None  # hit + copy: 3 blocks
    shorter = prefix.shortened()
    assert (shorter.num_tokens, shorter.needs_copy) == (4, False)
    allocation = d.kv.allocate_slots("B", 4, 4, shorter, HA)
    assert allocation is not None and allocation.copies == ()
