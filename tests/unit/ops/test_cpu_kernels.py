"""The compiled CPU kernels (csrc/cpu) against their PyTorch references.

The kernels build on first use with -march=native; where they cannot (no compiler, no AVX-512)
these tests are skipped with the builder's reason, and the engine uses the references.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_worker.attention import CpuPagedAttentionBackend, TorchAttentionBackend
from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.model_runner.runner import RunnerRequestState
from engine_worker.ops import cpu_ops_unavailable_reason

pytestmark = pytest.mark.skipif(cpu_ops_unavailable_reason() is not None,
                                reason=f"CPU kernels: {cpu_ops_unavailable_reason()}")

NUM_BLOCKS = 96


def _state(rng: random.Random, context_len: int, query_len: int, block_size: int,
           free_blocks: list[int]) -> RunnerRequestState:
    num_blocks = -(-(context_len + query_len) // block_size)
    block_ids = [free_blocks.pop() for _ in range(num_blocks)]
    return RunnerRequestState(
        req_id=str(rng.random()), token_ids=[0] * (context_len + query_len),
        num_prompt_tokens=context_len + query_len, params=None, block_ids=block_ids,
        num_computed_tokens=context_len, generator=None)


def _step(rng, shapes, block_size):
    """Requests as (context_len, query_len), decodes first, blocks scattered in the pool."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    states = [_state(rng, c, n, block_size, free) for c, n in shapes]
    _, _, meta, _ = build_step_inputs(states, [n for _, n in shapes], block_size,
                                      torch.device("cpu"))
    return meta


STEPS = {
    "decodes": [(0, 1), (5, 1), (16, 1), (47, 1), (130, 1)],
    "prefill_from_empty": [(0, 37)],
    "chunked_prefill_with_context": [(48, 33), (17, 16)],
    "mixed": [(3, 1), (200, 1), (0, 70), (31, 9), (64, 1 + 64)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8, 32])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_paged_attention_matches_reference(step, heads, block_size, dtype):
    rng = random.Random(hash((step, heads, block_size)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    num_heads, num_kv_heads = heads
    head_dim = 64 if num_heads != 4 else 32
    meta = _step(rng, STEPS[step], block_size)
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim).to(dtype)
    ref_cache = cache.clone()
    scale = head_dim ** -0.5

    got = CpuPagedAttentionBackend().forward(q, k, v, cache, meta, scale)
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale)

    assert torch.equal(cache, ref_cache)  # the same K/V written to the same slots
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_paged_attention_reads_only_its_own_blocks():
    """Garbage (NaN) everywhere outside the requests' blocks must not reach the output."""
    rng = random.Random(7)
    meta = _step(rng, STEPS["mixed"], 16)
    num_tokens = int(meta.query_start_loc[-1])
    used = set(meta.block_tables.flatten().tolist())
    cache = torch.full((2, NUM_BLOCKS, 16, 3, 64), float("nan"))
    for b in used:
        cache[:, b] = torch.randn(2, 16, 3, 64)
    # positions past each request's length inside its last block stay NaN as well
    q, k, v = torch.randn(num_tokens, 9, 64), torch.randn(num_tokens, 3, 64), torch.randn(
        num_tokens, 3, 64)
    for i, n in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i]
        for pos in range(n, -(-n // 16) * 16):
            cache[:, table[pos // 16], pos % 16] = float("nan")
    out = CpuPagedAttentionBackend().forward(q, k, v, cache, meta, 0.125)
    assert not out.isnan().any()


def test_write_kv_rejects_out_of_range_slot():
    cache = torch.zeros(2, 4, 16, 3, 64)
    k = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.quire.write_kv(cache, k, k, torch.tensor([4 * 16]))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 35)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch(rows, shape, bias):
    in_features, out_features = shape
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    got = torch.ops.quire.skinny_linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # both accumulate in fp32 and round once; only the summation order differs
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def test_skinny_linear_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        torch.ops.quire.skinny_linear(torch.zeros(9, 64).bfloat16(), torch.zeros(8, 64).bfloat16(),
                                      None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.quire.skinny_linear(torch.zeros(1, 48).bfloat16(), torch.zeros(8, 48).bfloat16(),
                                      None)
