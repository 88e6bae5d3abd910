"""PrefixIndex (precise, from KV events) and ApproximateIndex (from routing history)."""

from __future__ import annotations

import random

import pytest

from quire.block_hash import hash_block_tokens
from quire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheDiff,
                             KVCacheMirror, KVCacheSnapshot, KVEventBatch)
from router.prefix_index import ApproximateIndex, PrefixIndex

BLOCK_SIZE = 4


def hashes(token_ids, salt=None):
    return hash_block_tokens(token_ids, BLOCK_SIZE, cache_salt=salt)


def stored(block_hashes):
    return BlockStored(block_hashes=tuple(block_hashes), parent_block_hash=None,
                       token_ids=(0,) * (BLOCK_SIZE * len(block_hashes)), block_size=BLOCK_SIZE)


def batch(seq, *events):
    return KVEventBatch(seq=seq, timestamp_s=float(seq), events=tuple(events))


PROMPT = hashes(list(range(32)))  # 8 chained blocks


def test_match_counts_leading_blocks_only():
    index = PrefixIndex()
    index.reset_from_snapshot("a", KVCacheSnapshot(seq=0, block_hashes=frozenset(PROMPT[:5])))
    # b holds blocks 0, 1 and 3..7 but not 2: only its first two count
    index.reset_from_snapshot("b", KVCacheSnapshot(
        seq=0, block_hashes=frozenset(PROMPT[:2] + PROMPT[3:])))
    # c holds the tail without the head: nothing counts
    index.reset_from_snapshot("c", KVCacheSnapshot(seq=0, block_hashes=frozenset(PROMPT[1:])))
    assert index.match(PROMPT) == {"a": 5, "b": 2}
    assert index.match(PROMPT[:1]) == {"a": 1, "b": 1}
    assert index.match([]) == {}
    assert index.match(hashes(list(range(100, 132)))) == {}


def test_salt_isolates_prefixes():
    index = PrefixIndex()
    index.apply("a", batch(1, stored(hashes(list(range(32)), salt="tenant-1"))))
    assert index.match(PROMPT) == {}
    assert index.match(hashes(list(range(32)), salt="tenant-1")) == {"a": 8}


def random_batches(rng, num_batches):
    pool = hashes(list(range(400)))
    result = []
    for seq in range(1, num_batches + 1):
        events = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.55:
                start = rng.randrange(len(pool))
                events.append(stored(pool[start:start + rng.randint(1, 6)]))
            elif kind < 0.95:
                events.append(BlockRemoved(block_hashes=tuple(rng.sample(pool, rng.randint(1, 5)))))
            else:
                events.append(AllBlocksCleared())
        result.append(batch(seq, *events))
    return result, pool


@pytest.mark.parametrize("seed", range(5))
def test_snapshot_plus_events_equals_mirror(seed):
    rng = random.Random(seed)
    batches, pool = random_batches(rng, 60)
    reference = KVCacheMirror()
    for b in batches[:20]:
        assert reference.apply(b)
    snapshot = KVCacheSnapshot(seq=reference.seq, block_hashes=frozenset(reference.block_hashes))

    index = PrefixIndex()
    index.reset_from_snapshot("e1", snapshot)
    index.apply("e2", batches[0])  # a second engine shares the reverse map
    for b in batches[20:]:
        assert reference.apply(b)
        assert index.apply("e1", b)
        assert index.block_hashes("e1") == reference.block_hashes
    assert reference.seq == 60
    # replaying an already applied batch is ignored, as by the mirror
    assert index.apply("e1", batches[-3])
    assert index.block_hashes("e1") == reference.block_hashes
    # match agrees with a brute-force scan of the mirror
    for start in range(0, len(pool), 7):
        query = pool[start:start + 12]
        expected = 0
        while expected < len(query) and query[expected] in reference.block_hashes:
            expected += 1
        assert index.match(query).get("e1", 0) == expected
    assert index.apply("e1", batch(61))  # the index is at batch 60, as the mirror is


def test_events_in_one_batch_apply_in_order():
    index = PrefixIndex()
    assert index.apply("a", batch(1, stored(PROMPT[:4]), BlockRemoved(block_hashes=(PROMPT[2],)),
                                  stored(PROMPT[4:6])))
    assert index.block_hashes("a") == set(PROMPT[:2] + PROMPT[3:6])
    assert index.match(PROMPT) == {"a": 2}
    assert index.apply("a", batch(2, AllBlocksCleared(), stored(PROMPT[:1])))
    assert index.match(PROMPT) == {"a": 1}


def test_gap_marks_stale_until_snapshot():
    index = PrefixIndex()
    assert index.apply("a", batch(1, stored(PROMPT[:3])))
    assert index.apply("b", batch(1, stored(PROMPT[:2])))
    assert index.apply("a", batch(3, stored(PROMPT[3:4]))) is False  # batch 2 was lost
    assert index.apply("a", batch(2)) is False  # stale: not even the lost batch applies now
    assert index.match(PROMPT) == {"b": 2}  # a stale engine is not guessed at
    assert index.block_hashes("a") == frozenset()
    assert index.apply("a", batch(4, stored(PROMPT[:8]))) is False  # still stale
    assert index.match(PROMPT) == {"b": 2}

    index.reset_from_snapshot("a", KVCacheSnapshot(seq=4, block_hashes=frozenset(PROMPT[:6])))
    assert index.match(PROMPT) == {"a": 6, "b": 2}
    assert index.apply("a", batch(5, BlockRemoved(block_hashes=(PROMPT[5],))))
    assert index.match(PROMPT) == {"a": 5, "b": 2}


def test_snapshot_replaces_previous_entry():
    index = PrefixIndex()
    index.apply("a", batch(1, stored(PROMPT[:8])))
    index.reset_from_snapshot("a", KVCacheSnapshot(seq=7, block_hashes=frozenset(PROMPT[:1])))
    assert index.match(PROMPT) == {"a": 1}
    assert index.apply("a", batch(7, stored(PROMPT)))  # at or below the snapshot: ignored
    assert index.match(PROMPT) == {"a": 1}
    assert index.apply("a", batch(8, stored(PROMPT[1:2])))  # the next one applies
    assert index.match(PROMPT) == {"a": 2}


def test_remove_engine():
    index = PrefixIndex()
    index.apply("a", batch(1, stored(PROMPT[:4])))
    index.apply("b", batch(1, stored(PROMPT[:3])))
    index.remove_engine("a")
    assert index.match(PROMPT) == {"b": 3}
    assert index.engine_ids() == {"b"}
    index.remove_engine("b")
    index.remove_engine("never-seen")
    assert index.match(PROMPT) == {}
    assert index._engines_by_hash == {}  # no orphaned reverse entries


def test_removing_blocks_leaves_no_orphans():
    index = PrefixIndex()
    index.apply("a", batch(1, stored(PROMPT)))
    index.apply("a", batch(2, BlockRemoved(block_hashes=tuple(PROMPT))))
    index.apply("b", batch(1, stored(PROMPT)))
    index.apply("b", batch(2, AllBlocksCleared()))
    assert index._engines_by_hash == {}


# --------------------------------------------------------------------------- approximate
def test_approximate_match_and_lru_bound():
    index = ApproximateIndex(max_blocks_per_engine=6)
    first = hashes(list(range(16)))  # 4 blocks
    second = hashes(list(range(100, 116)))  # 4 blocks
    index.record("a", first)
    assert index.match(first) == {"a": 4}

    index.record("a", second)
    # bounded at 6: the two least recently used go, and those are the *tail* of ``first``
    assert index.match(first) == {"a": 2}
    assert index.match(second) == {"a": 4}

    index.record("a", first[:1])  # touching first[0] makes it the most recently used
    third = hashes(list(range(200, 212)))  # evicts first[1], second[3], second[2]
    index.record("a", third)
    assert index.match(first) == {"a": 1}
    assert index.match(second) == {"a": 2}
    assert index.match(third) == {"a": 3}


def test_approximate_engines_are_independent_and_removable():
    index = ApproximateIndex(max_blocks_per_engine=3)
    index.record("a", PROMPT[:2])
    index.record("b", PROMPT[:5])  # bound keeps b's first 3
    assert index.match(PROMPT) == {"a": 2, "b": 3}
    index.remove_engine("b")
    assert index.match(PROMPT) == {"a": 2}
    index.remove_engine("a")
    assert index._engines_by_hash == {}


def test_approximate_bound_validated():
    with pytest.raises(ValueError, match="max_blocks_per_engine"):
        ApproximateIndex(max_blocks_per_engine=0)


def test_mirror_diff_is_net_within_a_batch():
    mirror = KVCacheMirror.from_snapshot(KVCacheSnapshot(seq=0, block_hashes=frozenset({1, 2})))
    diff = mirror.apply_diff(batch(1, stored([3, 4]), BlockRemoved(block_hashes=(4, 1)),
                                   stored([1, 5])))
    assert (diff.added, diff.removed) == ({3, 5}, set())  # 4 came and went; 1 went and came
    assert mirror.block_hashes == {1, 2, 3, 5}
    diff = mirror.apply_diff(batch(2, AllBlocksCleared(), stored([2])))
    assert (diff.added, diff.removed) == (set(), {1, 3, 5})
    assert mirror.apply_diff(batch(2, stored([9]))) == KVCacheDiff(frozenset(), frozenset())
    assert mirror.apply_diff(batch(4)) is None  # batch 3 is missing
    assert (mirror.seq, mirror.block_hashes) == (2, {2})
    with pytest.raises(TypeError, match="unknown KV event"):
        mirror.apply_diff(batch(3, "not an event"))


def test_a_placement_counts_at_once_until_confirmed_or_lapsed():
    """Speculative claims: a placed prompt's blocks match on its engine before any KV event;
    the engine's BlockStored confirms them (they then outlive the TTL), unconfirmed ones
    lapse ``ttl_s`` after they were last claimed, and a removal drops them."""
    index = PrefixIndex(speculative_ttl_s=3.0)
    index.claim("a", PROMPT[:6], now_s=100.0)
    assert index.match(PROMPT, now_s=100.0) == {"a": 6}
    assert index.match(PROMPT) == {}  # confirmed blocks only
    assert index.unconfirmed("a") == frozenset(PROMPT[:6])
    index.apply("a", batch(1, stored(PROMPT[:4])))  # the engine computed four of them
    assert index.unconfirmed("a") == frozenset(PROMPT[4:6])
    index.claim("a", PROMPT[:6], now_s=102.0)  # the next request of the burst renews
    assert index.unconfirmed("a") == frozenset(PROMPT[4:6])  # confirmed ones are not claimed
    assert index.match(PROMPT, now_s=104.9) == {"a": 6}
    assert index.match(PROMPT, now_s=105.0) == {"a": 4}  # lapsed; the confirmed four stay
    index.claim("b", PROMPT[:3], now_s=200.0)
    index.apply("b", batch(1, stored(PROMPT[:1]), BlockRemoved((PROMPT[0],))))
    # block 0 was stored and evicted again within the batch: b holds nothing
    assert index.match(PROMPT, now_s=200.0) == {"a": 4}
    index.claim("c", PROMPT[:2], now_s=300.0)
    index.reset_from_snapshot("c", KVCacheSnapshot(seq=5, block_hashes=frozenset(PROMPT[:1])))
    assert index.match(PROMPT, now_s=300.0) == {"a": 4, "c": 2}  # a snapshot keeps claims
    index.remove_engine("c")
    assert index.match(PROMPT, now_s=300.0) == {"a": 4} and index.unconfirmed("c") == frozenset()


def test_a_claim_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s"):
        PrefixIndex(speculative_ttl_s=0)
