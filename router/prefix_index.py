"""Which engine holds which KV blocks: the router's answer to "how much of this prompt is cached where".

Two indexes share one ``match`` interface (engine id -> number of *leading* request blocks cached):

- ``PrefixIndex`` is precise. Each engine's entry is a mirror of that engine's KV-event feed
  (a ``KVCacheSnapshot`` followed by every later ``KVEventBatch`` in order), so it knows about
  evictions. A gap in sequence numbers drops the engine's entry and marks it stale until the
  next snapshot: a stale engine is simply absent from ``match``, never guessed at.
  Blocks a request was just *placed* on count at once as unconfirmed (speculative): a burst
  of one new prefix then lands together instead of scattering before the first KV event. The
  engine's ``BlockStored`` confirms them; unconfirmed ones lapse after
  ``SPECULATIVE_TTL_S``.
- ``ApproximateIndex`` is the fallback for engines whose feed is down. It remembers the blocks
  the router itself sent to each engine, bounded per engine (LRU), because it cannot see
  evictions and must assume old blocks are gone.

Both keep a reverse map ``block hash -> engine ids`` so ``match`` costs O(matched prefix length x
engines holding it), never O(engines x cached blocks). Block hashes are the engine's own
(``quire.block_hash``), so a hit here is a hit in the engine's prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from quire.kv_events import KVCacheMirror, KVCacheSnapshot, KVEventBatch

# How long a placed request's blocks count as cached on its engine before the engine's KV
# event confirms them. The event follows the step that computes the prefill, so it comes
# within a load interval plus a prefill once the request runs; every later placement of the
# same prefix (and the request's own first token) renews the claim, so a queue in front of
# the prefill does not make it lapse mid-burst. 3 s is far above that on a busy engine and
# short enough that a request which never ran (failed, cancelled, engine gone) stops drawing
# its prefix's traffic within seconds.
SPECULATIVE_TTL_S = 3.0


def _match(engines_by_hash: Mapping[int, set[str]], block_hashes: Sequence[int],
           also: Mapping[int, set[str]] | None = None) -> dict[str, int]:
    """Leading-block counts over ``engines_by_hash`` (and ``also``, when given).
    Engines holding none of the prefix are absent from the result."""
    counts: dict[str, int] = {}
    alive: set[str] | None = None  # engines that hold every block so far
    for num_blocks, block_hash in enumerate(block_hashes, start=1):
        holders = engines_by_hash.get(block_hash)
        if also and block_hash in also:
            holders = also[block_hash] | holders if holders else also[block_hash]
        if not holders:
            break
        alive = set(holders) if alive is None else alive & holders
        if not alive:
            break
        for engine_id in alive:
            counts[engine_id] = num_blocks
    return counts


def _link(engines_by_hash: dict[int, set[str]], engine_id: str,
          block_hashes: Iterable[int]) -> None:
    for block_hash in block_hashes:
        engines_by_hash.setdefault(block_hash, set()).add(engine_id)


def _unlink(engines_by_hash: dict[int, set[str]], engine_id: str,
            block_hashes: Iterable[int]) -> None:
    for block_hash in block_hashes:
        holders = engines_by_hash[block_hash]
        holders.discard(engine_id)
        if not holders:
            del engines_by_hash[block_hash]


class PendingBlocks:
    """Blocks claimed for engines by placements, not yet confirmed by their KV events; each
    claim lapses ``ttl_s`` after it was last made. Times are the caller's (monotonic seconds)."""

    def __init__(self, ttl_s: float = SPECULATIVE_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        # per engine: block hash -> expiry, soonest first (one TTL for all: renewing a claim
        # moves it to the end, so the order stays the expiry order)
        self._engines: dict[str, OrderedDict[int, float]] = {}
        self.engines_by_hash: dict[int, set[str]] = {}

    def claim(self, engine_id: str, block_hashes: Iterable[int], now_s: float) -> None:
        claims = self._engines.setdefault(engine_id, OrderedDict())
        expiry = now_s + self.ttl_s
        for block_hash in block_hashes:
            if block_hash in claims:
                claims.move_to_end(block_hash)
            else:
                _link(self.engines_by_hash, engine_id, (block_hash,))
            claims[block_hash] = expiry

    def settle(self, engine_id: str, block_hashes: Iterable[int]) -> None:
        """The engine reported these blocks (stored: confirmed; removed: gone)."""
        claims = self._engines.get(engine_id)
        if not claims:
            return
        for block_hash in block_hashes:
            if claims.pop(block_hash, None) is not None:
                _unlink(self.engines_by_hash, engine_id, (block_hash,))

    def expire(self, now_s: float) -> None:
        for engine_id, claims in self._engines.items():
            while claims:
                block_hash, expiry = next(iter(claims.items()))
                if expiry > now_s:
                    break
                del claims[block_hash]
                _unlink(self.engines_by_hash, engine_id, (block_hash,))

    def remove_engine(self, engine_id: str) -> None:
        _unlink(self.engines_by_hash, engine_id, self._engines.pop(engine_id, ()))

    def block_hashes(self, engine_id: str) -> frozenset[int]:
        return frozenset(self._engines.get(engine_id, ()))


class PrefixIndex:
    """Precise per-engine sets of cached block hashes, kept fresh from KV events.

    Each engine's entry is a ``quire.kv_events.KVCacheMirror`` (the one place events are
    applied); the index adds the reverse map and the stale marks.
    """

    def __init__(self, speculative_ttl_s: float = SPECULATIVE_TTL_S) -> None:
        self._engines: dict[str, KVCacheMirror] = {}
        self._stale: set[str] = set()
        self._engines_by_hash: dict[int, set[str]] = {}
        self._pending = PendingBlocks(speculative_ttl_s)

    # -------------------------------------------------------------------- feed
    def reset_from_snapshot(self, engine_id: str, snapshot: KVCacheSnapshot) -> None:
        """Replace the engine's entry by ``snapshot`` (also clears a stale mark). Unconfirmed
        claims stay: requests placed before the snapshot may still be computing them."""
        self._drop_mirror(engine_id)
        mirror = KVCacheMirror.from_snapshot(snapshot)
        self._engines[engine_id] = mirror
        _link(self._engines_by_hash, engine_id, mirror.block_hashes)
        self._pending.settle(engine_id, mirror.block_hashes)

    def claim(self, engine_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        """A request with ``block_hashes`` was placed on the engine: its blocks count as
        cached there (unconfirmed) until its KV events confirm them or the claim lapses."""
        mirror = self._engines.get(engine_id)
        held = mirror.block_hashes if mirror is not None else ()
        self._pending.claim(engine_id, (h for h in block_hashes if h not in held), now_s)

    def apply(self, engine_id: str, batch: KVEventBatch) -> bool:
        """Apply the engine's next batch; returns False on a gap (or while stale).

        An engine never seen starts at seq 0 with nothing cached, as a fresh ``KVCacheMirror``
        does. Batches already applied (``seq`` at or below the entry's) are ignored. On a gap the
        engine's blocks are dropped and it is stale until ``reset_from_snapshot``: a partial view
        would claim blocks that may since have been evicted.
        """
        if engine_id in self._stale:
            return False
        mirror = self._engines.setdefault(engine_id, KVCacheMirror())
        diff = mirror.apply_diff(batch)
        if diff is None:
            self._drop_mirror(engine_id)
            self._stale.add(engine_id)
            return False
        _unlink(self._engines_by_hash, engine_id, diff.removed)
        _link(self._engines_by_hash, engine_id, diff.added)
        for event in batch.events:  # stored or removed, the engine has answered for them
            self._pending.settle(engine_id, getattr(event, "block_hashes", ()))
        return True

    def _drop_mirror(self, engine_id: str) -> None:
        self._stale.discard(engine_id)
        mirror = self._engines.pop(engine_id, None)
        if mirror is not None:
            _unlink(self._engines_by_hash, engine_id, mirror.block_hashes)

    def remove_engine(self, engine_id: str) -> None:
        """Forget the engine: its blocks, its stale mark and its unconfirmed claims."""
        self._drop_mirror(engine_id)
        self._pending.remove_engine(engine_id)

    # ------------------------------------------------------------------ queries
    def engine_ids(self) -> frozenset[str]:
        return frozenset(self._engines)

    def block_hashes(self, engine_id: str) -> frozenset[int]:
        mirror = self._engines.get(engine_id)
        return frozenset(mirror.block_hashes) if mirror is not None else frozenset()

    def unconfirmed(self, engine_id: str) -> frozenset[int]:
        """The engine's claimed blocks its KV events have not confirmed (yet)."""
        return self._pending.block_hashes(engine_id)

    def match(self, block_hashes: Sequence[int], now_s: float | None = None) -> dict[str, int]:
        """Number of leading ``block_hashes`` cached on each engine (absent: none, or stale),
        counting unconfirmed claims still alive at ``now_s`` (None: confirmed blocks only)."""
        if now_s is None:
            return _match(self._engines_by_hash, block_hashes)
        self._pending.expire(now_s)
        return _match(self._engines_by_hash, block_hashes, self._pending.engines_by_hash)


class ApproximateIndex:
    """Blocks the router routed to each engine, at most ``max_blocks_per_engine`` each (LRU).

    ``record`` touches a request's blocks tail first, so its leading blocks are the most recently
    used: when the bound bites, a prefix loses its tail before its head (as the engine's own
    free queue evicts), and what remains still matches as a leading prefix.
    """

    def __init__(self, max_blocks_per_engine: int) -> None:
        if max_blocks_per_engine < 1:
            raise ValueError(f"max_blocks_per_engine must be >= 1, got {max_blocks_per_engine}")
        self.max_blocks_per_engine = max_blocks_per_engine
        # per engine: block hash -> None, least recently used first
        self._engines: dict[str, OrderedDict[int, None]] = {}
        self._engines_by_hash: dict[int, set[str]] = {}

    def record(self, engine_id: str, block_hashes: Sequence[int]) -> None:
        """Note that a request with ``block_hashes`` was just routed to ``engine_id``."""
        lru = self._engines.setdefault(engine_id, OrderedDict())
        for block_hash in reversed(block_hashes):
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = None
                _link(self._engines_by_hash, engine_id, (block_hash,))
        while len(lru) > self.max_blocks_per_engine:
            evicted, _ = lru.popitem(last=False)
            _unlink(self._engines_by_hash, engine_id, (evicted,))

    def remove_engine(self, engine_id: str) -> None:
        _unlink(self._engines_by_hash, engine_id, self._engines.pop(engine_id, ()))

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Number of leading ``block_hashes`` recorded for each engine (absent: none)."""
        return _match(self._engines_by_hash, block_hashes)
