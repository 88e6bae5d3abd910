"""The Triton kernels (engine_worker/attention/triton_kernels.py) against the reference.

Without a GPU they run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before any kernel module is imported), which checks their numerics but not their speed, races
or out-of-bounds reads; test_triton_compile.py compiles them for real GPUs. Shapes stay tiny:
the interpreter takes about 10 ms per tile iteration.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

pytest.importorskip("triton")

from engine_worker.backends.reference import TorchAttentionBackend  # noqa: E402
from engine_worker.attention.triton_backend import (TritonAttentionBackend,  # noqa: E402
                                                    triton_write_kv)
from tests.attention_steps import make_step, nan_outside_requests, random_inputs  # noqa: E402

NUM_BLOCKS = 40


def _step(rng: random.Random, shapes, block_size: int):
    return make_step(rng, shapes, block_size, NUM_BLOCKS)


# (context_len, query_len): decodes first, then prefill chunks, some over cached context
STEPS = {
    "decodes": [(0, 1), (20, 1), (47, 1)],
    "mixed": [(9, 1), (40, 1), (0, 21), (33, 6)],
    # speculative decoding: a decode beside verifications of 4 and 2 drafts (5- and 3-token
    # queries over cached context, one across a block boundary)
    "verify": [(40, 1), (30, 5), (17, 3)],
}
CASES = [
    # (step, num_heads, num_kv_heads, head_dim, block_size, dtype)
    ("mixed", 8, 1, 64, 16, torch.float32),  # GQA 8:1
    ("mixed", 2, 2, 64, 32, torch.float32),  # 1:1
    ("mixed", 3, 1, 80, 16, torch.float16),  # head_dim not a power of two
    ("decodes", 4, 2, 128, 32, torch.float16),
    ("mixed", 4, 2, 64, 16, torch.bfloat16),  # up-cast to fp32 under the interpreter
    ("verify", 4, 2, 64, 16, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}:{c[2]}-d{c[3]}-b{c[4]}-"
                         f"{str(c[5]).removeprefix('torch.')}")
def test_triton_attention_matches_reference(case):
    step, num_heads, num_kv_heads, head_dim, block_size, dtype = case
    # a seed the same in every process (hash() of a str or a dtype is not)
    rng = random.Random(zlib.crc32(repr(case).encode()))
    torch.manual_seed(rng.randrange(1 << 30))
    meta = _step(rng, STEPS[step], block_size)
    q, k, v, cache = random_inputs(meta, (num_heads, num_kv_heads, head_dim), NUM_BLOCKS,
                                   block_size, dtype)
    ref_cache = cache.float()  # the reference runs in fp32 on the same (rounded) inputs
    scale = head_dim ** -0.5

    got = TritonAttentionBackend().forward(q, k, v, cache, meta, scale)
    want = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), ref_cache, meta,
                                           scale)

    assert torch.equal(cache.float(), ref_cache)  # the same K/V in the same slots
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_triton_attention_reads_only_its_own_blocks():
    """NaN everywhere outside the requests' blocks, and past each request's length inside its
    last block, must not reach the output (masked loads, not masked scores, keep it out)."""
    rng = random.Random(3)
    block_size = 16
    meta = _step(rng, STEPS["mixed"], block_size)
    cache = nan_outside_requests(meta, NUM_BLOCKS, block_size, 1, 64)
    q, k, v, _ = random_inputs(meta, (4, 1, 64), NUM_BLOCKS, block_size, torch.float32)
    out = TritonAttentionBackend().forward(q, k, v, cache, meta, 0.125)
    assert not out.isnan().any()


def test_triton_write_kv_skips_negative_slots():
    cache = torch.zeros(2, 4, 16, 2, 64)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    triton_write_kv(cache, k, v, torch.tensor([5, -1, 63]))
    flat = cache.view(2, 64, 2, 64)
    torch.testing.assert_close(flat[0, 5], k[0])
    torch.testing.assert_close(flat[1, 63], v[2])
    assert flat[:, [i for i in range(64) if i not in (5, 63)]].abs().sum() == 0


def test_triton_attention_takes_views_into_a_fused_qkv_output():
    """q, k and v as the model hands them (views into one QKV row, no copies made): the
    output and the cache equal those of contiguous copies."""
    rng = random.Random(11)
    torch.manual_seed(11)
    meta = _step(rng, STEPS["mixed"], 16)
    q, k, v, cache = random_inputs(meta, (4, 2, 64), NUM_BLOCKS, 16, torch.float32)
    n = q.shape[0]
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    qv, kv, vv = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    qv, kv, vv = qv.view(n, 4, 64), kv.view(n, 2, 64), vv.view(n, 2, 64)
    assert not qv.is_contiguous()
    view_cache = cache.clone()
    got = TritonAttentionBackend().forward(qv, kv, vv, view_cache, meta, 0.125)
    want = TritonAttentionBackend().forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                            cache, meta, 0.125)
    assert got.is_contiguous()
    assert torch.equal(view_cache, cache)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
