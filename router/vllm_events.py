"""vLLM's KV events (its ZMQ publisher) turned into the router's own block hashes.

vLLM names a block by a hash whose seed is its own (random per process unless pinned), so the
router never tries to compute vLLM's hashes. Every ``BlockStored`` carries the blocks' token ids
and the parent block's (vLLM) hash; the router rebuilds the chain in *its* hash domain
(``quire.block_hash``, at the event's block size) and keeps a map from vLLM's hashes to its
own, which ``BlockRemoved`` and later parents are looked up in. A block whose parent the router
never saw (it joined mid-stream and the replay buffer no longer holds the parent) cannot be
placed in a chain and is skipped: the approximate index covers for it.

Wire (``vllm.distributed.kv_events``): PUB frames ``(topic, seq: 8 bytes big-endian,
msgpack [ts, [event, ...], dp_rank])``, events as maps tagged by ``"type"``; a ROUTER socket
answers ``[b"", start_seq]`` with the buffered batches from ``start_seq`` on and an end marker
(sequence -1). On connect the feed subscribes first, then asks for a replay from 0 (vLLM's
buffer: its recent history), then applies live batches after the last replayed one; a gap in
the live sequence asks for a replay of the gap, and a gap the replay cannot fill clears the
engine's index (``on_lost``), which then rebuilds from new events. A live sequence number that
goes back means the engine restarted (a new vLLM process numbers from 0): the index restarts
empty and takes the new process's replay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quire.block_hash import ROOT_HASH, hash_block
from quire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEvent,
                             KVEventBatch)

logger = logging.getLogger(__name__)

END_SEQ = -1


def _salt_keys(extra: Sequence | None) -> tuple[str, ...]:
    """vLLM's per-block extra keys -> the router's. vLLM lists the cache salt as a plain
    string; the router's chain carries it as ``salt:<value>`` on the first block."""
    if not extra:
        return ()
    return tuple(f"salt:{key}" for key in extra if isinstance(key, str))


@dataclass(slots=True)
class VllmBlockTranslator:
    """vLLM block hashes -> the router's, rebuilt from token ids and parent links."""

    to_router: dict[object, int] = field(default_factory=dict)  # vLLM hash (int | bytes)

    def translate(self, events: Sequence[dict]) -> tuple[KVEvent, ...]:
        out: list[KVEvent] = []
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif kind == "BlockRemoved":
                hashes = tuple(h for h in (self.to_router.pop(v, None)
                                           for v in event.get("block_hashes", ())) if h is not None)
                if hashes:
                    out.append(BlockRemoved(hashes))
            elif kind == "AllBlocksCleared":
                self.to_router.clear()
                out.append(AllBlocksCleared())
        return tuple(out)

    def _stored(self, event: dict) -> BlockStored | None:
        parent_v = event.get("parent_block_hash")
        parent = ROOT_HASH if parent_v is None else self.to_router.get(parent_v)
        if parent is None:
            return None  # its chain started before we listened
        block_size = int(event["block_size"])
        tokens = list(event["token_ids"])
        extra = event.get("extra_keys") or []
        # vLLM lists a LoRA adapter's name among every block's extra keys; the router's chain
        # carries it once, as ``lora:<name>`` on the first block (quire.block_hash)
        lora = event.get("lora_name")
        hashes = []
        first_parent = None if parent_v is None else parent
        for i, vllm_hash in enumerate(event["block_hashes"]):
            block = tokens[i * block_size:(i + 1) * block_size]
            if len(block) != block_size:
                break  # malformed: fewer token ids than blocks
            keys = _salt_keys([k for k in (extra[i] if i < len(extra) else None) or ()
                               if k != lora])
            if lora and i == 0 and parent_v is None:
                keys += (f"lora:{lora}",)
            parent = hash_block(parent, block, keys)
            self.to_router[vllm_hash] = parent
            hashes.append(parent)
        if not hashes:
            return None
        return BlockStored(tuple(hashes), first_parent, tuple(tokens[:len(hashes) * block_size]),
                           block_size, lora_name=lora or None)


def decode_frames(frames: Sequence[bytes]) -> tuple[int, float, list[dict]]:
    """(seq, ts, events) of one PUB message ``(topic, seq, payload)``."""
    import msgpack

    _, seq, payload = frames
    ts, events, *_ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return int.from_bytes(seq, "big", signed=True), float(ts), list(events)


class VllmKVEventFeed:
    """Follows one vLLM engine's KV events and hands the pool router-domain batches, numbered
    1, 2, 3... (as a Quire engine's are) after an empty snapshot. ``run`` until cancelled."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, *,
                 on_reset: Callable[[], None], on_batch: Callable[[KVEventBatch], bool],
                 topic: str = "kv", replay_timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_reset = on_reset  # the engine's index restarts from empty
        self.on_batch = on_batch  # False: the pool lost the thread; we reset
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.translator = VllmBlockTranslator()
        self._out_seq = 0
        self._last_seq: int | None = None  # vLLM's last applied sequence number

    def _reset(self) -> None:
        self.translator = VllmBlockTranslator()
        self._out_seq = 0
        self.on_reset()

    def _apply(self, seq: int, ts: float, events: list[dict]) -> None:
        self._last_seq = seq
        translated = self.translator.translate(events)
        if not translated:
            return
        self._out_seq += 1
        if not self.on_batch(KVEventBatch(self._out_seq, ts, translated)):
            self._reset()

    async def _replay(self, ctx, start_seq: int) -> list[tuple[int, float, list[dict]]]:
        """Buffered batches from ``start_seq`` on (empty without a replay endpoint)."""
        import zmq

        if not self.replay_endpoint:
            return []
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out = []
        try:
            await sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                # [b"", topic, seq, payload]; the end marker's sequence number is -1
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
                if int.from_bytes(frames[2], "big", signed=True) == END_SEQ:
                    return out
                out.append(decode_frames(frames[1:]))
        except asyncio.TimeoutError:
            logger.warning("KV-event replay from %s timed out", self.replay_endpoint)
            return out
        finally:
            sock.close()

    async def _start_over(self, ctx) -> None:
        """Empty the engine's entry, then apply the history its replay socket still holds."""
        self._reset()
        self._last_seq = None
        for seq, ts, events in await self._replay(ctx, 0):
            self._apply(seq, ts, events)

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self._start_over(ctx)
            last_live: int | None = None  # the live stream's last sequence number
            while True:
                seq, ts, events = decode_frames(await sub.recv_multipart())
                if last_live is not None and seq <= last_live:
                    # one process numbers its live batches in increasing order: going back
                    # means the engine restarted (vLLM numbers from 0 again, its cache empty)
                    logger.warning("KV events from %s: sequence went back from %d to %d (the "
                                   "engine restarted); index reset", self.endpoint, last_live,
                                   seq)
                    await self._start_over(ctx)
                    last_live = None
                    if self._last_seq is not None and seq <= self._last_seq:
                        continue  # the new process's replay buffer already held it
                last_live = seq
                if self._last_seq is not None and seq <= self._last_seq:
                    continue  # already replayed
                if self._last_seq is not None and seq != self._last_seq + 1:
                    missed = await self._replay(ctx, self._last_seq + 1)
                    missed = [m for m in missed if m[0] < seq]
                    if not missed or missed[0][0] != self._last_seq + 1 or \
                            missed[-1][0] != seq - 1:
                        logger.warning("KV events from %s: batches %d..%d lost; index reset",
                                       self.endpoint, self._last_seq + 1, seq - 1)
                        self._reset()
                    else:
                        for m in missed:
                            self._apply(*m)
                self._apply(seq, ts, events)
        finally:
            sub.close()
            ctx.term()

