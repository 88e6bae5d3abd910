"""vLLM's KV events in the router's hash domain: the chain rebuilt from token ids and parent
links equals what the router computes for a request, whatever vLLM's own hashes are."""

from __future__ import annotations

import asyncio

import pytest

from quire.block_hash import hash_block_tokens
from quire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheMirror
from router.vllm_events import VllmBlockTranslator

BS = 4
TOKENS = list(range(100, 116))  # four blocks


def stored(vllm_hashes, parent, tokens, extra=None):
    event = {"type": "BlockStored", "block_hashes": vllm_hashes, "parent_block_hash": parent,
             "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "CPU",
             "lora_name": None}
    if extra is not None:
        event["extra_keys"] = extra
    return event


def test_chain_across_events_equals_the_routers_request_hashes():
    t = VllmBlockTranslator()
    # vLLM's hashes are opaque (bytes or ints, any seed); two events continue one chain
    first = t.translate([stored([b"\x01", b"\x02"], None, TOKENS[:8])])
    second = t.translate([stored([777, 778], b"\x02", TOKENS[8:])])
    want = hash_block_tokens(TOKENS, BS)
    assert first[0].block_hashes + second[0].block_hashes == tuple(want)
    assert second[0].parent_block_hash == want[1]
    assert first[0].parent_block_hash is None


def test_cache_salt_and_block_size():
    t = VllmBlockTranslator()
    (event,) = t.translate([stored([1, 2], None, TOKENS[:8], extra=[["s1"], None])])
    assert event.block_hashes == tuple(hash_block_tokens(TOKENS[:8], BS, cache_salt="s1"))
    assert event.block_hashes != tuple(hash_block_tokens(TOKENS[:8], BS))


def test_removed_cleared_and_unknown_parents():
    t = VllmBlockTranslator()
    t.translate([stored([1, 2], None, TOKENS[:8])])
    want = hash_block_tokens(TOKENS, BS)
    # a block whose parent was never seen cannot be placed: skipped, not guessed
    assert t.translate([stored([9], 12345, TOKENS[8:12])]) == ()
    assert t.translate([{"type": "BlockRemoved", "block_hashes": [2, 99], "medium": "CPU"}]) == \
        (BlockRemoved((want[1],)),)
    assert t.translate([{"type": "AllBlocksCleared"}]) == (AllBlocksCleared(),)
    assert t.to_router == {}


def test_feed_follows_a_real_publisher_with_replay(tmp_path):
    """The feed against a real ZMQ publisher on vLLM's wire (Quire's own, which the tests
    in tests/e2e/test_kv_events_zmq.py check against vLLM's decoder): history before the feed
    joined comes from the replay socket; the mirror ends equal to the router's own hashes."""
    pytest.importorskip("zmq")
    from engine_worker.server.kv_events_zmq import ZmqKVEventPublisher
    from quire.kv_events import KVEventBatch
    from router.vllm_events import VllmKVEventFeed

    pub = ZmqKVEventPublisher(f"ipc://{tmp_path}/e.sock", f"ipc://{tmp_path}/r.sock")
    # published before anyone listens: only the replay can recover it
    pub.publish(KVEventBatch(1, 1.0, (BlockStored((501, 502), None, tuple(TOKENS[:8]), BS),)))
    mirror = KVCacheMirror()
    resets = []

    def on_reset():
        resets.append(1)
        mirror.seq, mirror.block_hashes = 0, set()

    async def main():
        feed = VllmKVEventFeed(pub.endpoint, pub.replay_endpoint, on_reset=on_reset,
                               on_batch=mirror.apply)
        task = asyncio.create_task(feed.run())
        want = set(hash_block_tokens(TOKENS[:8], BS))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if mirror.block_hashes == want:
                break
        assert mirror.block_hashes == want
        # live events continue the chain (published until the subscription has joined)
        pub.publish(KVEventBatch(2, 2.0, (BlockStored((503,), 502, tuple(TOKENS[8:12]), BS),)))
        pub.publish(KVEventBatch(3, 3.0, (BlockRemoved((501,)),)))
        want = set(hash_block_tokens(TOKENS[:12], BS)[1:])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if mirror.block_hashes == want:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert mirror.block_hashes == want

    try:
        asyncio.run(main())
    finally:
        pub.close()
    assert len(resets) == 1  # once, at the start


def test_feed_starts_over_when_the_engine_restarts(tmp_path):
    """A restarted engine numbers its batches from 1 again and its cache is empty: the feed
    sees the live sequence go back, resets the engine's entry and takes the new process's
    replay, so none of the old process's blocks stay indexed."""
    pytest.importorskip("zmq")
    from engine_worker.server.kv_events_zmq import ZmqKVEventPublisher
    from quire.kv_events import KVEventBatch
    from router.vllm_events import VllmKVEventFeed

    endpoints = (f"ipc://{tmp_path}/e.sock", f"ipc://{tmp_path}/r.sock")
    mirror = KVCacheMirror()
    resets = []

    def on_reset():
        resets.append(1)
        mirror.seq, mirror.block_hashes = 0, set()

    async def until(want, tries: int = 4) -> bool:
        for _ in range(tries):
            if mirror.block_hashes == want:
                return True
            await asyncio.sleep(0.05)
        return False

    async def main():
        first = ZmqKVEventPublisher(*endpoints)
        feed = VllmKVEventFeed(first.endpoint, first.replay_endpoint, on_reset=on_reset,
                               on_batch=mirror.apply)
        task = asyncio.create_task(feed.run())
        try:
            old = set(hash_block_tokens(TOKENS[:12], BS))
            for seq in range(1, 200):  # until the subscription has joined
                first.publish(KVEventBatch(seq, float(seq), (BlockStored(
                    (501, 502, 503), None, tuple(TOKENS[:12]), BS),) if seq == 1 else ()))
                if await until(old) and seq > 3:
                    break
            assert await until(old, 200)
            first.close()
            second = ZmqKVEventPublisher(*endpoints)  # the same endpoints, a new process
            try:
                new_tokens = tuple(range(700, 708))
                second.publish(KVEventBatch(1, 1.0, (BlockStored((9, 10), None, new_tokens,
                                                                 BS),)))
                new = set(hash_block_tokens(new_tokens, BS))
                for seq in range(2, 200):
                    second.publish(KVEventBatch(seq, float(seq), ()))
                    if await until(new):
                        break
                assert await until(new, 200)
            finally:
                second.close()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert len(resets) >= 2  # at the start, and when the engine came back
