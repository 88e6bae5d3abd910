"""Attention steps for kernel tests: requests as (context_len, query_len), decodes first, their
blocks scattered through the pool, turned into the runner's real metadata."""

from __future__ import annotations

import random

import torch

from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.model_runner.runner import RunnerRequestState

# (context_len, query_len): decodes first, then prefill chunks, some over cached context
STEPS = {
    "decodes": [(0, 1), (5, 1), (16, 1), (47, 1), (130, 1)],
    "one_long_decode": [(300, 1)],  # alone and long: its kv heads split across threads
    "prefill_from_empty": [(0, 37)],
    "chunked_prefill_with_context": [(48, 33), (17, 16)],
    "mixed": [(3, 1), (200, 1), (0, 70), (31, 9), (64, 1 + 64)],
}


def make_step(rng: random.Random, shapes, block_size: int, num_blocks: int,
              block_ids_of: list[list[int]] | None = None):
    """The step's ``AttentionMetadata``; blocks drawn at random from ``num_blocks``, or each
    request's given in ``block_ids_of``."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    states = []
    for i, (context_len, query_len) in enumerate(shapes):
        total = context_len + query_len
        block_ids = (list(block_ids_of[i]) if block_ids_of is not None
                     else [free.pop() for _ in range(-(-total // block_size))])
        states.append(RunnerRequestState(
            req_id=str(rng.random()), token_ids=[0] * total, num_prompt_tokens=total,
            params=None, block_ids=block_ids, num_computed_tokens=context_len, generator=None))
    _, _, meta, _ = build_step_inputs(states, [n for _, n in shapes], block_size,
                                      torch.device("cpu"))
    return meta


def random_inputs(meta, heads: tuple[int, int, int], num_blocks: int, block_size: int,
                  dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """A step's random q [tokens, heads, head_dim] and k, v [tokens, kv_heads, head_dim] in
    ``dtype``, and a random cache [2, num_blocks, block_size, kv_heads, head_dim] in
    ``cache_dtype`` (default ``dtype``); ``heads`` is (heads, kv_heads, head_dim)."""
    num_heads, num_kv_heads, head_dim = heads
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    return q, k, v, cache.to(cache_dtype or dtype)


def nan_outside_requests(meta, num_blocks: int, block_size: int, num_kv_heads: int,
                         head_dim: int) -> torch.Tensor:
    """An fp32 cache that is NaN everywhere but the step's requests' positions (random there):
    outside their blocks, and past each request's length inside its last block."""
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for b in set(meta.block_tables.flatten().tolist()):
        cache[:, b] = torch.randn(2, block_size, num_kv_heads, head_dim)
    for i, n in enumerate(meta.seq_lens.tolist()):
        for pos in range(n, -(-n // block_size) * block_size):
            cache[:, meta.block_tables[i, pos // block_size], pos % block_size] = float("nan")
    return cache
