"""Quire's KV events on vLLM's ZMQ wire, for consumers built for vLLM (llm-d's indexer, Dynamo).

vLLM's publisher (``vllm.distributed.kv_events.ZmqEventPublisher``) sends each batch as three
frames on a PUB socket: the topic, an 8-byte big-endian sequence number (0, 1, 2, ...), and
a msgpack payload ``[ts, [event, ...], data_parallel_rank]`` in which every event is a map
tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). A ROUTER
socket answers replay requests ``[identity, b"", start_seq (8 bytes)]`` with every buffered
batch from ``start_seq`` on, then an end marker whose sequence number is -1. This module
writes the same frames from Quire's ``KVEventBatch``; the tests decode them with vLLM's own
decoder.

The PUB socket is *bound* here (subscribers connect), to the address given: the pod IP or
loopback, never a wildcard unless asked for.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from quire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def vllm_event(event: KVEvent) -> dict:
    """One Quire event as vLLM's msgpack map (fields without a default are always present,
    as msgspec's ``omit_defaults`` encodes them)."""
    if isinstance(event, BlockStored):
        out = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
               "parent_block_hash": event.parent_block_hash,
               "token_ids": list(event.token_ids), "block_size": event.block_size,
               "lora_id": None, "medium": event.medium.upper(), "lora_name": event.lora_name}
        if event.extra_keys or event.lora_name:
            # vLLM: one entry per block, the LoRA adapter's name in each; Quire's own keys
            # (the cache salt) are the first block's
            lora = [event.lora_name] if event.lora_name else []
            first = [k for k in event.extra_keys if not k.startswith("lora:")] + lora
            out["extra_keys"] = [first or None] + [lora or None] * (len(event.block_hashes) - 1)
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                "medium": event.medium.upper()}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: KVEventBatch, data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([batch.timestamp_s, [vllm_event(e) for e in batch.events],
                          data_parallel_rank])


class ZmqKVEventPublisher:
    """Publishes KV event batches on vLLM's wire from a thread of its own, so the engine loop
    only enqueues. Keeps the last ``buffer_batches`` encoded batches for replay."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "kv",
                 buffer_batches: int = 10_000) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else None)
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        logger.info("Publishing KV events on vLLM's ZMQ wire at %s (replay: %s)",
                    self.endpoint, self.replay_endpoint or "off")

    def publish(self, batch: KVEventBatch) -> None:
        self._queue.put(batch)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = self._next_seq
            self._next_seq += 1
            payload = encode_batch(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-event replay request (%d frames)",
                           len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
