"""Exact scheduler tests with prefix caching and n > 1 forks, and regressions found by them.
"""

from __future__ import annotations

from engine_worker.request import RequestStatus
from engine_worker.scheduler.scheduler import Scheduler
from engine_worker.step_types import CachedRequestData, EngineCoreOutput, NewRequestData
from tests.unit.scheduler_harness import (EOS, TOKEN, FakeRunner, assert_all_blocks_free,
                                          make_request, running_ids, setup, step)


# ------------------------------------------------------------------------- prefix caching
def cached_setup(**kwargs) -> tuple[Scheduler, FakeRunner]:
    return setup(enable_prefix_caching=True, **kwargs)


def test_a_later_request_starts_from_the_cached_prefix():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 10, max_tokens=1))
    out, core = step(sched, runner)
    assert out.new_requests[0].block_ids == (0, 1, 2)
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,),
                                     finish_status=RequestStatus.FINISHED_LENGTH_CAPPED)]
    # a's blocks are free but still cached; its head block is evicted last
    assert sched.kv.pool.free_queue.block_ids()[-3:] == [2, 1, 0]
    assert sorted(b.block_id for b in sched.kv.pool.cached.values()) == [0, 1]

    b = make_request("b", 11, max_tokens=1)  # the same first 10 tokens: two full blocks
    sched.add_request(b)
    out, core = step(sched, runner)
    assert out.new_requests == (NewRequestData(
        req_id="b", prompt_token_ids=tuple(range(100, 111)), sampling_params=b.sampling_params,
        block_ids=(0, 1, 3), num_computed_tokens=8),)
    assert out.num_scheduled_tokens == {"b": 3}
    assert out.block_copies == ()
    assert core == [EngineCoreOutput(req_id="b", new_token_ids=(TOKEN,),
                                     finish_status=RequestStatus.FINISHED_LENGTH_CAPPED,
                                     num_cached_tokens=8)]
    stats = sched.kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert_all_blocks_free(sched)


def test_fully_cached_prompt_recomputes_its_last_token_in_a_copy():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 8, max_tokens=1))
    step(sched, runner)  # blocks 0 1, cached, then freed
    sched.add_request(make_request("b", 8, max_tokens=3))
    out, core = step(sched, runner)
    # b hits both blocks; position 7 is written into a private copy of block 1
    assert out.block_copies == ((1, 2),)
    assert out.new_requests[0].block_ids == (0, 2)
    assert out.new_requests[0].num_computed_tokens == 7
    assert out.num_scheduled_tokens == {"b": 1}
    assert core[0].num_cached_tokens == 7
    assert runner.num_copies == 1
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:3]] == [1, 0, 1]
    out, _ = step(sched, runner)  # position 8 opens a block; nothing copied again
    assert out.cached_requests == (CachedRequestData("b", False, (3,), 8),)
    assert out.block_copies == ()


def test_two_requests_in_one_step_share_the_blocks_the_first_is_computing():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 9))
    sched.add_request(make_request("b", 10))
    out, core = step(sched, runner)
    # b hits a's two full blocks in the same step: every K/V of the step is written before any
    # is read, so b's attention reads the values a computes
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.new_requests] == [
        ("a", (0, 1, 2), 0), ("b", (0, 1, 3), 8)]
    assert out.num_scheduled_tokens == {"a": 9, "b": 2}
    assert out.block_copies == ()
    assert [c.num_cached_tokens for c in core] == [0, 8]
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:4]] == [2, 2, 1, 1]


def test_preempted_request_is_readmitted_from_its_surviving_cached_blocks():
    sched, runner = cached_setup(num_blocks=5, block_size=4)
    for req_id, first in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(make_request(req_id, 8 if req_id == "c" else 4, first_token=first))
    out, _ = step(sched, runner)
    assert [n.block_ids for n in out.new_requests] == [(0,), (1,), (2, 3)]

    # a takes the last free block; b needs one more, so c is preempted (3 then 2 freed) and b
    # takes block 3, evicting c's second block; c's first block survives in the queue
    out, _ = step(sched, runner, {"a": EOS, "b": EOS})
    assert out.preempted_req_ids == {"c"}
    assert out.cached_requests == (CachedRequestData("a", False, (4,), 4),
                                   CachedRequestData("b", False, (3,), 4))
    assert sched.kv.pool.free_queue.block_ids() == [2, 4, 0, 3, 1]

    out, core = step(sched, runner)
    # c's 9 tokens: block 2 is a hit (4 tokens), the other 5 are recomputed into 4 and 0
    assert out.finished_req_ids == {"a", "b"}
    assert out.cached_requests == (CachedRequestData("c", True, (2, 4, 0), 4),)
    assert out.num_scheduled_tokens == {"c": 5}
    assert core == [EngineCoreOutput(req_id="c", new_token_ids=(TOKEN,))]  # first hit: 0
    stats = sched.kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 + 4 + 8 + 9, 4)


def test_cache_salt_keeps_equal_prompts_apart():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 9, max_tokens=1, cache_salt="tenant-a"))
    step(sched, runner)
    sched.add_request(make_request("b", 9, max_tokens=1, cache_salt="tenant-b"))
    sched.add_request(make_request("c", 9, max_tokens=1))
    out, _ = step(sched, runner)
    assert [n.num_computed_tokens for n in out.new_requests] == [0, 0]
    sched.add_request(make_request("d", 9, max_tokens=1, cache_salt="tenant-a"))
    out, _ = step(sched, runner)
    assert out.new_requests[0].num_computed_tokens == 8


def test_prompt_logprobs_skip_the_cache():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 9, max_tokens=1))
    step(sched, runner)
    sched.add_request(make_request("b", 9, max_tokens=1, prompt_logprobs=0))
    out, _ = step(sched, runner)
    assert out.new_requests[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"b": 9}


# ----------------------------------------------------------------------------- n > 1 forks
def test_n_samples_fork_after_the_prompt_and_copy_the_shared_partial_block_on_write():
    sched, runner = setup(block_size=4)
    parent = make_request("p", 6, max_tokens=3, num_samples=3)
    sched.add_request(parent)
    out, core = step(sched, runner, {"p": 10, "p-1": 11, "p-2": 12})
    assert [(f.parent_req_id, f.req_id) for f in out.forks] == [("p", "p-1"), ("p", "p-2")]
    # one prefill, three first tokens drawn from its logits
    assert core == [EngineCoreOutput("p", (10,)), EngineCoreOutput("p-1", (11,)),
                    EngineCoreOutput("p-2", (12,))]
    assert running_ids(sched) == ["p", "p-1", "p-2"]
    assert [sched.kv.get_block_ids(r) for r in ("p", "p-1", "p-2")] == [[0, 1]] * 3
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:2]] == [3, 3]
    assert sched.requests["p-2"].all_token_ids == list(range(100, 106)) + [12]

    # all three write position 6 into shared block 1: the first two get copies, the last
    # is then its only holder and writes in place; the runner never saw the children as new
    out, core = step(sched, runner)
    assert out.new_requests == ()
    assert out.block_copies == ((1, 2), (1, 3))
    assert out.cached_requests == (CachedRequestData("p", True, (0, 2), 6),
                                   CachedRequestData("p-1", True, (0, 3), 6),
                                   CachedRequestData("p-2", False, (), 6))
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:4]] == [3, 1, 1, 1]
    assert [c.req_id for c in core] == ["p", "p-1", "p-2"]

    step(sched, runner)  # third token each: all finish
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    assert step(sched, runner)[0].finished_req_ids == {"p", "p-1", "p-2"}
    assert runner.block_tables == {}


def test_fork_after_a_chunked_prompt_and_a_full_last_block_copies_nothing():
    sched, runner = setup(block_size=4, max_num_batched_tokens=5)
    sched.add_request(make_request("p", 8, max_tokens=2, num_samples=2))
    out, core = step(sched, runner)
    assert core == [] and out.forks == ()  # mid-prefill: no fork yet
    out, core = step(sched, runner, {"p": 10, "p-1": 11})
    assert [(f.parent_req_id, f.req_id) for f in out.forks] == [("p", "p-1")]
    assert [c.new_token_ids for c in core] == [(10,), (11,)]
    out, _ = step(sched, runner)
    assert out.block_copies == ()
    assert out.cached_requests == (CachedRequestData("p", False, (2,), 8),
                                   CachedRequestData("p-1", False, (3,), 8))
    assert_all_blocks_free(sched)


def test_forked_samples_share_a_cached_prompt():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 9, max_tokens=1))
    step(sched, runner)
    sched.add_request(make_request("p", 9, max_tokens=2, num_samples=2))
    out, core = step(sched, runner, {"p": 10, "p-1": 11})
    assert out.new_requests[0].num_computed_tokens == 8
    assert [c.num_cached_tokens for c in core] == [8, 8]
    assert sched.kv.get_block_ids("p") == sched.kv.get_block_ids("p-1") == [0, 1, 3]
    step(sched, runner)
    assert_all_blocks_free(sched)


def test_preempted_fork_child_is_resumed_with_its_whole_table():
    sched, runner = setup(num_blocks=3, block_size=2)
    sched.add_request(make_request("p", 2, max_tokens=4, num_samples=2))
    step(sched, runner, {"p": 10, "p-1": 11})  # block 0, shared once forked
    out, _ = step(sched, runner)
    # position 2 opens a block for each sample; the pool is then full
    assert out.cached_requests == (CachedRequestData("p", False, (1,), 2),
                                   CachedRequestData("p-1", False, (2,), 2))
    step(sched, runner)  # position 3 fits
    out, _ = step(sched, runner)
    # position 4: p needs a block, and the child (admitted last) is preempted for it
    assert out.preempted_req_ids == {"p-1"}
    assert out.cached_requests == (CachedRequestData("p", False, (2,), 4),)
    # p's fourth token ends it, so every block is free again, p's tail first
    assert "p" not in sched.requests
    assert sched.kv.pool.free_queue.block_ids() == [2, 1, 0]
    out, core = step(sched, runner)
    # the child's 2 + 3 tokens are recomputed into a fresh table
    assert out.finished_req_ids == {"p"}
    assert out.cached_requests == (CachedRequestData("p-1", True, (2, 1, 0), 0),)
    assert out.num_scheduled_tokens == {"p-1": 5}
    assert core == [EngineCoreOutput("p-1", (TOKEN,),
                                     finish_status=RequestStatus.FINISHED_LENGTH_CAPPED)]
    assert_all_blocks_free(sched)


# ------------------------------------------------- regressions (bugs found and fixed)
def test_a_copy_on_write_never_reads_a_block_this_step_has_yet_to_compute():
    sched, runner = cached_setup(block_size=4)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))  # the same 8 tokens, admitted in the same step
    step(sched, runner)  # the fake runner checks b's context after the step


def test_a_request_that_fits_the_whole_cache_is_admitted_again_when_fully_cached():
    sched, runner = cached_setup(num_blocks=2, block_size=4)
    sched.add_request(make_request("a", 8, max_tokens=1))  # peak 8 tokens: the whole cache
    step(sched, runner)
    sched.add_request(make_request("b", 8, max_tokens=1))
    for _ in range(5):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
    assert not sched.has_unfinished_requests(), "b is never scheduled"


def test_aborting_a_parent_mid_step_tells_the_runner_to_drop_its_forked_children():
    sched, runner = setup()
    sched.add_request(make_request("p", 2, num_samples=2))
    out = sched.schedule()
    runner_out = runner.execute(out)
    assert set(runner_out.sampled_token_ids) == {"p", "p-1"}
    sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_out) == []
    assert_all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"p", "p-1"}


def test_forks_respect_max_num_seqs():
    sched, runner = setup(max_num_seqs=2)
    sched.add_request(make_request("p", 3, num_samples=3))
    sched.add_request(make_request("q", 3))
    for _ in range(3):
        out, _ = step(sched, runner)
        assert len(out.num_scheduled_tokens) <= 2
        assert sched.stats().num_running <= 2
