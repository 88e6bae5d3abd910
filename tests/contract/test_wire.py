"""The wire contract: committed stubs match proto/, and KV events survive the wire."""

from __future__ import annotations

import subprocess
import sys

from quire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot,
                             KVEventBatch, batch_from_proto, batch_to_proto, snapshot_from_proto,
                             snapshot_to_proto)


def test_committed_stubs_match_the_protos():
    result = subprocess.run([sys.executable, "-m", "quire.codegen", "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_kv_event_batches_round_trip_through_protobuf():
    batch = KVEventBatch(seq=7, timestamp_s=1700000000.25, events=(
        BlockStored(block_hashes=(2**64 - 1, 5), parent_block_hash=None,
                    token_ids=tuple(range(8)), block_size=4, extra_keys=("salt:a",)),
        BlockStored(block_hashes=(9,), parent_block_hash=5, token_ids=(1, 2, 3, 4),
                    block_size=4, lora_name="adapter", medium="cuda"),
        BlockRemoved(block_hashes=(2**64 - 1,)),
        AllBlocksCleared()))
    wire = batch_to_proto(batch).SerializeToString()
    from quire.v1 import kv_cache_pb2

    assert batch_from_proto(kv_cache_pb2.KVEventBatch.FromString(wire)) == batch
    snapshot = KVCacheSnapshot(seq=3, block_hashes=frozenset({1, 2**63}))
    assert snapshot_from_proto(kv_cache_pb2.KVCacheSnapshot.FromString(
        snapshot_to_proto(snapshot).SerializeToString())) == snapshot
