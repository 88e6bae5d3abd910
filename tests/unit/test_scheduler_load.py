"""What the scheduler says of its load after a step (``Scheduler.stats``), which a router
learns the engine's batch from. See scheduler_harness.py."""

from __future__ import annotations

from tests.unit.scheduler_harness import make_request, running_ids, setup, step, waiting_ids


def test_batch_full_only_when_requests_wait_for_batch_room():
    """``stats().batch_full`` (a router learns an engine's batch from it): requests waiting
    for the step's token budget are a prefill backlog, not a full batch; waiting for
    ``max_num_seqs`` or for KV blocks is."""
    sched, runner = setup(block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    for i in range(4):  # 4 prompts of 8 tokens, 16 a step
        sched.add_request(make_request(f"p{i}", 8, max_tokens=4))
    assert not sched.stats().batch_full  # nothing scheduled yet
    step(sched, runner)
    assert (running_ids(sched), waiting_ids(sched)) == (["p0", "p1"], ["p2", "p3"])
    assert not sched.stats().batch_full  # p2, p3 wait for the budget only

    sched, runner = setup(block_size=4, max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"s{i}", 4, max_tokens=4))
    step(sched, runner)
    assert waiting_ids(sched) == ["s2"] and sched.stats().batch_full  # max_num_seqs

    sched, runner = setup(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(f"k{i}", 6, max_tokens=4))
    step(sched, runner)
    assert waiting_ids(sched) == ["k2"] and sched.stats().batch_full  # out of KV blocks
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert not sched.stats().batch_full  # nothing waits any more


def test_queued_tokens_leave_out_the_prefix_the_cache_holds():
    """``stats().num_queued_tokens`` is the work a router weighs this engine's queue by: a
    waiting request whose prompt starts with cached blocks counts only its uncached tail (a
    hot system prompt queued ten deep is not ten prefills), an admitted one its uncomputed
    tokens, and a prompt that runs without the cache (prompt logprobs) all of them."""
    sched, runner = setup(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    sched.add_request(make_request("warm", 10, max_tokens=1))
    assert sched.stats().num_queued_tokens == 10
    step(sched, runner)  # computes and caches the first two blocks (8 tokens)
    assert sched.stats().num_queued_tokens == 0
    for i in range(3):  # the same first 10 tokens, then one of their own: 3 to compute each
        sched.add_request(make_request(f"hot{i}", 11, max_tokens=2))
    sched.add_request(make_request("cold", 11, max_tokens=2, first_token=500))
    sched.add_request(make_request("logprobs", 11, max_tokens=2, prompt_logprobs=1))
    assert waiting_ids(sched) == ["hot0", "hot1", "hot2", "cold", "logprobs"]
    assert sched.stats().num_queued_tokens == 3 * 3 + 11 + 11
    step(sched, runner)  # all prefilled and sampled once: one token each left to compute
    assert waiting_ids(sched) == [] and sched.stats().num_queued_tokens == 5
