"""vLLM's multi-step scheduling: one scheduling decision for several decode passes.

While every running request decodes and none waits, one decision covers up to
``num_scheduler_steps`` forward passes, each request given cache slots for all of them; the
scheduler's, the output processor's and the engine loop's Python then run once for those
tokens, not once a token. The runner runs the passes (``ModelRunner._execute_steps``); the
slots of passes it did not run stay with the request for its next steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine_worker.kv_cache.manager import Allocation, KVCacheManager
from engine_worker.request import Request

logger = logging.getLogger(__name__)


def run_length(running: Sequence[Request], max_steps: int, max_model_len: int,
               kv: KVCacheManager) -> int:
    """Passes the next step may run (1: a step of one pass). One where a step must be
    scheduled alone: a request is mid-prompt, pools, forks or samples under a grammar (its
    mask is made per token), fewer than 2 passes fit a request's ``max_tokens`` or
    ``max_model_len``, or the free blocks do not hold every slot. (What waits and drafts are
    the caller's to check.)"""
    steps = max_steps
    for request in running:
        if request.num_computed_tokens != request.num_tokens - 1 or \
                request.grammar is not None or request.pooling_params is not None or \
                request.fork_children:
            return 1
        steps = min(steps, request.max_tokens - request.num_output_tokens,
                    max_model_len - request.num_tokens)
    if steps < 2 or sum(kv.num_blocks_to_allocate(r.req_id, r.num_computed_tokens, steps)
                        for r in running) > kv.num_free_blocks:
        return 1
    return steps


def allocate_run(running: Sequence[Request], steps: int,
                 kv: KVCacheManager) -> dict[str, Allocation]:
    """Every request's slots for ``steps`` passes (``run_length`` counted them as free)."""
    allocations = {}
    for request in running:
        allocation = kv.allocate_slots(request.req_id, request.num_computed_tokens, steps,
                                       block_hashes=request.block_hashes)
        assert allocation is not None, "the blocks were counted as free"
        allocations[request.req_id] = allocation
    return allocations


def steps_across_ranks(steps: int, world_size: int) -> int:
    """``num_scheduler_steps`` for an engine of ``world_size`` ranks: across ranks each step
    is one pass (every rank's runner would have to stop a run at the same pass); said once."""
    if steps > 1 and world_size > 1:
        logger.info("num_scheduler_steps %d: one pass a step across %d ranks (multi-step "
                    "runs on one rank only)", steps, world_size)
        return 1
    return steps
