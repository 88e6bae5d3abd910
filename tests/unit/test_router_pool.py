"""EnginePool's membership and index choice, without engines: channels are created lazily and
nothing here dials them."""

from __future__ import annotations

import asyncio

from quire.kv_events import KVCacheSnapshot
from router.discovery import Endpoint, StaticDiscovery
from router.pool import EnginePool


def _pool() -> EnginePool:
    return EnginePool(StaticDiscovery([]), approx_index_blocks=64)


def _cached(pool: EnginePool, block_hashes) -> dict[str, int]:
    """What the balancer would see: leading blocks held, per engine holding any."""
    return {s.engine_id: s.cached_blocks for s in pool.candidates(block_hashes)
            if s.cached_blocks}


def test_reconcile_adds_removes_and_replaces_moved_engines():
    async def scenario():
        pool = _pool()
        await pool.reconcile(frozenset({Endpoint("a", "10.0.0.1:1"), Endpoint("b", "10.0.0.2:1")}))
        assert sorted(pool.clients) == ["a", "b"]
        first_a = pool.clients["a"]
        pool.record("b", [1, 2, 3])
        # b leaves (its approximate entries go with it); a moves to another address
        await pool.reconcile(frozenset({Endpoint("a", "10.0.0.9:1")}))
        assert sorted(pool.clients) == ["a"] and pool.clients["a"] is not first_a
        assert pool.clients["a"].address == "10.0.0.9:1"
        await pool.reconcile(frozenset({Endpoint("a", "10.0.0.9:1"), Endpoint("b", "10.0.0.2:1")}))
        assert _cached(pool, [1, 2, 3]) == {}  # b came back with no history
        await pool.stop()
    asyncio.run(scenario())


def test_match_uses_the_kv_feed_where_alive_and_routing_history_elsewhere():
    async def scenario():
        pool = _pool()
        await pool.reconcile(frozenset({Endpoint("live", "h:1"), Endpoint("blind", "h:2")}))
        live = pool.clients["live"]
        pool.kv_snapshot(live, KVCacheSnapshot(seq=1, block_hashes=frozenset({11, 12})))
        pool.record("live", [11, 12, 13])  # history never overrides a live feed
        pool.record("blind", [11, 12, 13])
        assert _cached(pool, [11, 12, 13, 14]) == {"live": 2, "blind": 3}
        pool.kv_feed_lost(live)  # its feed broke: history takes over
        assert _cached(pool, [11, 12, 13, 14]) == {"live": 3, "blind": 3}
        assert [s.engine_id for s in pool.candidates([11], exclude={"live"})] == ["blind"]
        await pool.stop()
    asyncio.run(scenario())


def test_no_engine_serves_before_admission():
    async def scenario():
        pool = _pool()
        await pool.reconcile(frozenset({Endpoint("a", "127.0.0.1:9")}))
        assert pool.serving() == [] and pool.identity is None
        assert not await pool.wait_serving(1, timeout_s=0.2)
        await pool.stop()
    asyncio.run(scenario())
