"""``AttentionMetadata.token_range``: a step cut into pieces at any token boundaries (through a
request's prefill chunk too) and run one piece after another attends exactly as the whole
step does, each piece reading the K/V the pieces before it wrote. That is what a pipeline
stage does with its micro-batches (models/llama.py)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_worker.backends.reference import TorchAttentionBackend
from tests.attention_steps import STEPS, make_step, random_inputs

BLOCK_SIZE, NUM_BLOCKS = 16, 64
HEADS = (4, 2, 16)


def _cuts(num_tokens: int, rng: random.Random) -> list[int]:
    inner = sorted(rng.sample(range(1, num_tokens), min(3, num_tokens - 1)))
    return [0, *inner, num_tokens]


@pytest.mark.parametrize("name", sorted(STEPS))
def test_pieces_run_in_order_attend_exactly_as_the_whole_step(name):
    rng = random.Random(name)
    torch.manual_seed(len(name))
    meta = make_step(rng, STEPS[name], BLOCK_SIZE, NUM_BLOCKS)
    q, k, v, cache = random_inputs(meta, HEADS, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    backend = TorchAttentionBackend()
    whole_cache = cache.clone()
    expected = backend.forward(q, k, v, whole_cache, meta, 0.25)
    num_tokens = q.shape[0]
    bounds = _cuts(num_tokens, rng)
    got = []
    for start, end in zip(bounds, bounds[1:]):
        piece = meta.token_range(start, end)
        assert int(piece.query_start_loc[-1]) == end - start
        got.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, piece,
                                   0.25))
    # the same K/V written, the same outputs (each row attends over the same keys, in the
    # same order: only the batching of the rows differs)
    assert torch.equal(cache, whole_cache)
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-5, atol=1e-6)


def test_a_piece_keeps_its_requests_rows_and_lengths():
    meta = make_step(random.Random(0), STEPS["mixed"], BLOCK_SIZE, NUM_BLOCKS)
    # tokens: 2 decodes, then prefills of 70, 9 and 65 tokens (starting at tokens 2, 72, 81)
    piece = meta.token_range(1, 40)  # the second decode and the first 38 of the 70
    assert piece.num_decode_tokens == 1
    assert piece.query_start_loc.tolist() == [0, 1, 39]
    assert piece.seq_lens.tolist() == [201, 38]
    assert torch.equal(piece.block_tables, meta.block_tables[1:3])
    (chunk,) = piece.prefills
    assert (chunk.query_start, chunk.query_len, chunk.context_len) == (1, 38, 0)
    later = meta.token_range(40, 90)  # the other 32 of the 70, all 9, 9 of the 65
    assert later.num_decode_tokens == 0
    assert [(c.query_start, c.query_len, c.context_len) for c in later.prefills] == [
        (0, 32, 38), (32, 9, 31), (41, 9, 64)]
    assert later.seq_lens.tolist() == [70, 40, 73]
    assert torch.equal(later.slot_mapping, meta.slot_mapping[40:90])
