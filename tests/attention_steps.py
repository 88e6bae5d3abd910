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


def make_step(rng: random.Random, shapes, block_size: int, num_blocks: int):
    """The step's ``AttentionMetadata``; blocks drawn at random from ``num_blocks``."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    states = []
    for context_len, query_len in shapes:
        total = context_len + query_len
        block_ids = [free.pop() for _ in range(-(-total // block_size))]
        states.append(RunnerRequestState(
            req_id=str(rng.random()), token_ids=[0] * total, num_prompt_tokens=total,
            params=None, block_ids=block_ids, num_computed_tokens=context_len, generator=None))
    _, _, meta, _ = build_step_inputs(states, [n for _, n in shapes], block_size,
                                      torch.device("cpu"))
    return meta
