"""The Triton kernels and CUDA graphs on a real GPU. Skipped without one (these machines and
CI have none: there the kernels run under the interpreter, tests/unit/attention, and are
compiled for sm_80/sm_90 without running). Run with `pytest -m gpu tests/gpu` on a GPU."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

triton = pytest.importorskip("triton")

from engine_worker.backends.reference import TorchAttentionBackend  # noqa: E402
from engine_worker.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine_worker.model_runner.graphs import CudaGraphDecoder, DecodeBuffers  # noqa: E402
from tests.unit.attention.test_triton_attention import _step  # noqa: E402

NUM_BLOCKS = 40


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 128, 256])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64), (16, 16, 80)])
def test_triton_attention_on_gpu_matches_reference(dtype, block_size, heads):
    num_heads, num_kv_heads, head_dim = heads
    rng = random.Random(block_size * 31 + num_heads)
    torch.manual_seed(0)
    shapes = [(0, 1), (300, 1), (1000, 1), (0, 200), (513, 77)]
    blocks_needed = sum(-(-(c + n) // block_size) for c, n in shapes)
    num_blocks = max(NUM_BLOCKS, blocks_needed + 4)
    import tests.unit.attention.test_triton_attention as t
    t.NUM_BLOCKS, saved = num_blocks, t.NUM_BLOCKS
    try:
        meta = _step(rng, shapes, block_size)
    finally:
        t.NUM_BLOCKS = saved
    meta = type(meta)(**{f: (getattr(meta, f).cuda() if isinstance(getattr(meta, f), torch.Tensor)
                             else getattr(meta, f)) for f in meta.__slots__})
    n = int(meta.query_start_loc[-1])
    dev = torch.device("cuda")
    q = torch.randn(n, num_heads, head_dim, device=dev).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, device=dev).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, device=dev).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=dev).to(dtype)
    ref_cache = cache.float()
    got = TritonAttentionBackend().forward(q, k, v, cache, meta, head_dim ** -0.5)
    want = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), ref_cache,
                                           meta.__class__(**{f: getattr(meta, f) for f in
                                                             meta.__slots__}), head_dim ** -0.5)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_cuda_graph_replay_equals_eager():
    """A toy forward captured at each size replays exactly what it computes eagerly, on the
    buffers' current contents."""
    dev = torch.device("cuda")
    buffers = DecodeBuffers(max_batch=16, max_blocks_per_seq=4, device=dev)
    weight = torch.randn(64, 64, device=dev)

    def forward(input_ids, positions, kv_caches, meta):
        x = torch.nn.functional.one_hot(input_ids % 64, 64).float() @ weight
        return x + positions[:, None] + meta.seq_lens[:, None]

    decoder = CudaGraphDecoder(forward, buffers, sizes=(1, 2, 4, 8, 16), block_size=16)
    decoder.capture([])
    tables = np.array([[1, 2], [3, 0], [0, 0]], np.int32)
    step = buffers.fill(np.array([5, 6, 7]), np.array([17, 3, 0]), tables, 16, padded=4)
    got = decoder.run(step).clone()
    want = forward(step.input_ids, step.positions, [], step.meta)[:3]
    torch.testing.assert_close(got, want)
