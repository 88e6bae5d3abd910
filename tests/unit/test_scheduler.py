"""Exact tests of continuous batching: budgets, chunking, arrival, preemption, policies,
aborts and stop rules (prefix caching off, so block ids are exact). See scheduler_harness.py.
"""

from __future__ import annotations

from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.pooling_params import PoolingParams
from engine_worker.request import Request, RequestStatus
from engine_worker.scheduler.queue import QUEUE_POLICIES, FCFSQueue, PriorityQueue
from engine_worker.scheduler.scheduler import Scheduler
from engine_worker.step_types import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                      NewRequestData, SampledLogprobs, SchedulerOutput)
from tests.unit.scheduler_harness import (EOS, TOKEN, FakeRunner, assert_all_blocks_free,
                                          make_request, running_ids, setup, step, waiting_ids)


# ---------------------------------------------------------------- one request, end to end
def test_single_request_prefill_then_decode_then_length_cap():
    sched, runner = setup(block_size=4)
    request = make_request("a", 6, max_tokens=4)
    sched.add_request(request)
    assert (sched.stats().num_waiting, sched.stats().num_running) == (1, 0)

    out, core = step(sched, runner)
    assert out.new_requests == (NewRequestData(
        req_id="a", prompt_token_ids=tuple(range(100, 106)),
        sampling_params=request.sampling_params, block_ids=(0, 1), num_computed_tokens=0),)
    assert out.cached_requests == ()
    assert out.num_scheduled_tokens == {"a": 6}
    assert out.total_num_scheduled_tokens == 6
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,))]
    assert request.status == RequestStatus.RUNNING
    assert (request.num_computed_tokens, request.num_tokens) == (6, 7)

    out, core = step(sched, runner)  # position 6 still fits in block 1
    assert out.new_requests == ()
    assert out.cached_requests == (CachedRequestData("a", False, (), 6),)
    assert out.num_scheduled_tokens == {"a": 1}
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,))]

    out, core = step(sched, runner)  # position 7 fills block 1
    assert out.cached_requests == (CachedRequestData("a", False, (), 7),)

    out, core = step(sched, runner)  # position 8 needs a third block
    assert out.cached_requests == (CachedRequestData("a", False, (2,), 8),)
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,),
                                     finish_status=RequestStatus.FINISHED_LENGTH_CAPPED)]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [TOKEN] * 4
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    assert sched.kv.pool.free_queue.block_ids()[-3:] == [2, 1, 0]  # freed tail first

    out, core = step(sched, runner)
    assert out.is_empty
    assert out.finished_req_ids == {"a"}
    assert core == []
    assert step(sched, runner)[0].finished_req_ids == frozenset()  # reported once


def test_empty_scheduler_emits_an_empty_step():
    sched, runner = setup()
    out, core = step(sched, runner)
    assert out == SchedulerOutput(new_requests=(), cached_requests=(), num_scheduled_tokens={},
                                  total_num_scheduled_tokens=0, preempted_req_ids=frozenset(),
                                  finished_req_ids=frozenset())
    assert out.is_empty and core == []


# ------------------------------------------------------------------- budget and chunking
def test_long_prompt_is_chunked_by_the_token_budget():
    sched, runner = setup(block_size=4, max_num_batched_tokens=4)
    sched.add_request(make_request("a", 10))

    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.new_requests[0].block_ids == (0,)
    assert core == []  # mid-prefill: nothing sampled

    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.cached_requests == (CachedRequestData("a", False, (1,), 4),)
    assert core == []

    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.cached_requests == (CachedRequestData("a", False, (2,), 8),)
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,))]

    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_requests == (CachedRequestData("a", False, (), 10),)


def _pooling_request(req_id: str, num_prompt_tokens: int) -> Request:
    return Request(req_id, list(range(100, 100 + num_prompt_tokens)), None, frozenset({EOS}), 1,
                   pooling_params=PoolingParams(normalize=True))


def test_pooling_only_steps_take_the_pooling_budget_and_mixed_steps_do_not():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(kv_cache_manager=kv, max_num_batched_tokens=8, max_num_seqs=8,
                      max_model_len=1024, pooling_batched_tokens=20)
    for req_id in "ab":
        sched.add_request(_pooling_request(req_id, 12))
    # only pooling requests unfinished: 20 tokens, the second prompt chunked
    assert sched.schedule().num_scheduled_tokens == {"a": 12, "b": 8}

    mixed = Scheduler(kv_cache_manager=KVCacheManager(64, 4, enable_prefix_caching=False),
                      max_num_batched_tokens=8, max_num_seqs=8, max_model_len=1024,
                      pooling_batched_tokens=20)
    mixed.add_request(_pooling_request("a", 12))
    mixed.add_request(make_request("g", 3))
    # a generation request is unfinished: the ordinary budget, so no decode waits longer
    assert mixed.schedule().num_scheduled_tokens == {"a": 8}


def test_pooling_budget_never_lowers_the_ordinary_one():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(kv_cache_manager=kv, max_num_batched_tokens=16, max_num_seqs=8,
                      max_model_len=1024, pooling_batched_tokens=4)
    sched.add_request(_pooling_request("a", 12))
    assert sched.schedule().num_scheduled_tokens == {"a": 12}


def test_long_prefill_token_threshold_caps_each_chunk():
    sched, runner = setup(block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=3)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 2))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 3, "b": 2}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 3, "b": 1}
    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 2, "b": 1}
    assert [c.req_id for c in core] == ["a", "b"]


def test_decodes_are_scheduled_before_waiting_prefills():
    sched, runner = setup(block_size=4, max_num_batched_tokens=4)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    out, _ = step(sched, runner)
    # a takes 3 of the 4 tokens; b is admitted with the 1 left over
    assert out.num_scheduled_tokens == {"a": 3, "b": 1}
    assert running_ids(sched) == ["a", "b"]

    sched.add_request(make_request("c", 8))
    out, _ = step(sched, runner)
    # a decodes first, b continues its prefill, and c is admitted with what is left
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 2), ("c", 1)]
    assert [n.req_id for n in out.new_requests] == ["c"]

    out, _ = step(sched, runner)
    # a and b decode; c's prefill gets the remaining 2 tokens of the budget
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 2)]
    assert out.total_num_scheduled_tokens == 4


def test_budget_spent_by_decodes_leaves_waiting_requests_waiting():
    sched, runner = setup(max_num_batched_tokens=2, max_num_seqs=8)
    sched.add_request(make_request("a", 1))
    sched.add_request(make_request("b", 1))
    step(sched, runner)
    sched.add_request(make_request("c", 1))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert waiting_ids(sched) == ["c"]


def test_budget_is_never_exceeded_with_many_requests():
    sched, runner = setup(block_size=4, max_num_batched_tokens=7, num_blocks=256)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 5 + i, max_tokens=3))
    totals = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        totals.append(out.total_num_scheduled_tokens)
    assert max(totals) == 7
    # 45 prompt tokens + 2 decodes each (the third token is sampled by the last decode)
    assert sum(totals) == sum(5 + i for i in range(6)) + 6 * 2
    assert_all_blocks_free(sched)


# --------------------------------------------------------------------- sequences and arrival
def test_max_num_seqs_limits_the_running_set():
    sched, runner = setup(max_num_seqs=2)
    sched.add_request(make_request("a", 2))
    sched.add_request(make_request("b", 2))
    sched.add_request(make_request("c", 2))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 2, "b": 2}
    assert waiting_ids(sched) == ["c"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert waiting_ids(sched) == ["c"]
    out, core = step(sched, runner, {"a": EOS})  # a stops; c takes its seat next step
    assert core[0].finish_status == RequestStatus.FINISHED_STOPPED
    assert waiting_ids(sched) == ["c"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 1, "c": 2}
    assert out.finished_req_ids == {"a"}
    assert running_ids(sched) == ["b", "c"]


def test_request_arriving_during_decode_joins_the_next_step():
    sched, runner = setup()
    sched.add_request(make_request("a", 4))
    step(sched, runner)
    step(sched, runner)
    sched.add_request(make_request("b", 5))
    out, core = step(sched, runner)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 5)]
    assert [c.req_id for c in out.cached_requests] == ["a"]
    assert [n.req_id for n in out.new_requests] == ["b"]
    assert [c.req_id for c in core] == ["a", "b"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_head_of_line_request_waiting_for_blocks_is_not_jumped():
    sched, runner = setup(num_blocks=3, block_size=4)
    sched.add_request(make_request("a", 8))  # blocks 0 1
    step(sched, runner)
    sched.add_request(make_request("big", 8))  # needs 2 blocks, 1 free
    sched.add_request(make_request("small", 1))  # would fit in 1 block
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    assert waiting_ids(sched) == ["big", "small"]


# ------------------------------------------------------------------------------ preemption
def test_fcfs_preempts_the_latest_admitted_and_resumes_it_with_its_full_table():
    sched, runner = setup(num_blocks=4, block_size=4)
    for req_id, num_prompt in (("a", 4), ("b", 4), ("c", 8)):
        sched.add_request(make_request(req_id, num_prompt))
    out, _ = step(sched, runner)
    assert [n.block_ids for n in out.new_requests] == [(0,), (1,), (2, 3)]
    assert sched.kv.stats().num_free_blocks == 0

    # a and b each need a second block: c (admitted last) is preempted, blocks freed 3 then 2
    c = sched.requests["c"]
    out, core = step(sched, runner)
    assert out.preempted_req_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.cached_requests == (CachedRequestData("a", False, (3,), 4),
                                   CachedRequestData("b", False, (2,), 4))
    assert c.status == RequestStatus.PREEMPTED
    assert (c.num_computed_tokens, c.num_preemptions, sched.num_preemptions) == (0, 1, 1)
    assert c.output_token_ids == [TOKEN]  # kept: recomputed, not resampled
    assert sched.kv.get_block_ids("c") == []
    assert running_ids(sched) == ["a", "b"]
    assert waiting_ids(sched) == ["c"]

    out, core = step(sched, runner, {"a": EOS, "b": EOS})
    assert sched.kv.pool.free_queue.block_ids() == [3, 0, 2, 1]
    assert waiting_ids(sched) == ["c"]

    out, core = step(sched, runner)
    assert out.finished_req_ids == {"a", "b"}
    assert out.new_requests == ()
    # 8 prompt tokens + 1 output token are recomputed into a fresh, complete block table
    assert out.cached_requests == (CachedRequestData("c", True, (3, 0, 2), 0),)
    assert out.num_scheduled_tokens == {"c": 9}
    assert core == [EngineCoreOutput(req_id="c", new_token_ids=(TOKEN,))]
    assert c.output_token_ids == [TOKEN, TOKEN]

    out, _ = step(sched, runner)  # later steps send only what changed again
    assert out.cached_requests == (CachedRequestData("c", False, (), 9),)
    step(sched, runner)
    step(sched, runner)
    out, _ = step(sched, runner)  # position 12 opens a fourth block
    assert out.cached_requests == (CachedRequestData("c", False, (1,), 12),)


def test_preempted_request_goes_to_the_front_of_the_fcfs_queue():
    sched, runner = setup(num_blocks=2, block_size=2, max_num_seqs=2)
    sched.add_request(make_request("a", 2))  # block 0
    sched.add_request(make_request("b", 1))  # block 1
    sched.add_request(make_request("w", 1))  # waits: max_num_seqs
    step(sched, runner)
    out, _ = step(sched, runner)
    # a's decode (position 2) needs a block: b, admitted after a, gives up block 1
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_requests == (CachedRequestData("a", False, (1,), 2),)
    assert waiting_ids(sched) == ["b", "w"]


def test_request_that_is_itself_the_latest_admitted_preempts_itself():
    sched, runner = setup(num_blocks=3, block_size=4)
    sched.add_request(make_request("a", 3))  # block 0
    sched.add_request(make_request("b", 8))  # blocks 1 2
    step(sched, runner)
    out, _ = step(sched, runner)
    # a's decode fits in block 0; b needs a third block and is its own (latest) victim
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert out.cached_requests == (CachedRequestData("a", False, (), 3),)
    assert sched.kv.get_block_ids("a") == [0]
    assert sched.kv.pool.free_queue.block_ids() == [2, 1]


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched, runner = setup(policy="priority", num_blocks=3, block_size=2)
    sched.add_request(make_request("a", 2, priority=0))  # block 0
    sched.add_request(make_request("b", 3, priority=5))  # blocks 1 2
    step(sched, runner)
    sched.add_request(make_request("w", 1, priority=0))  # heads the queue once b is back
    out, _ = step(sched, runner)
    # a needs a block: b is preempted (freeing 2 then 1) and a takes block 2. Block 1 would
    # hold w, but a step that preempted admits nothing.
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert sched.kv.pool.free_queue.block_ids() == [1]
    assert waiting_ids(sched) == ["w", "b"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "w": 1}
    assert out.new_requests[0].block_ids == (1,)
    assert waiting_ids(sched) == ["b"]


# --------------------------------------------------------------------------- priorities
def test_priority_policy_admits_by_priority_then_arrival():
    sched, runner = setup(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("low", 1, priority=2, arrival_time=0.0, max_tokens=1))
    sched.add_request(make_request("mid", 1, priority=1, arrival_time=1.0, max_tokens=1))
    sched.add_request(make_request("high-late", 1, priority=0, arrival_time=3.0, max_tokens=1))
    sched.add_request(make_request("high-early", 1, priority=0, arrival_time=2.0, max_tokens=1))
    assert waiting_ids(sched) == ["high-early", "high-late", "mid", "low"]
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        order.extend(out.num_scheduled_tokens)
    assert order == ["high-early", "high-late", "mid", "low"]


def test_priority_policy_preempts_the_worst_priority_and_undoes_its_step():
    sched, runner = setup(policy="priority", num_blocks=3, block_size=2)
    sched.add_request(make_request("bulk", 2, priority=5))
    step(sched, runner)  # bulk: block 0, admitted first
    sched.add_request(make_request("vip", 2, priority=0))
    step(sched, runner)  # bulk decodes into block 1; vip admitted into block 2
    assert running_ids(sched) == ["bulk", "vip"]
    assert sched.kv.stats().num_free_blocks == 0

    out, _ = step(sched, runner)
    # bulk's decode (position 3, block 1) is scheduled first; vip then needs a block and the
    # worst-priority request, bulk, is preempted, which takes back bulk's token from the step
    assert out.preempted_req_ids == {"bulk"}
    assert out.num_scheduled_tokens == {"vip": 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.cached_requests == (CachedRequestData("vip", False, (1,), 2),)
    assert sched.kv.get_block_ids("vip") == [2, 1]
    assert running_ids(sched) == ["vip"]
    assert waiting_ids(sched) == ["bulk"]


def test_priority_victim_breaks_ties_by_latest_arrival():
    early = make_request("early", 1, priority=1, arrival_time=1.0)
    late = make_request("late", 1, priority=1, arrival_time=2.0)
    best = make_request("best", 1, priority=0, arrival_time=3.0)
    for seq, r in enumerate((late, best, early)):
        r.admit_seq = seq
    assert PriorityQueue.pick_victim([late, best, early]) is late


def test_priority_preempted_request_rejoins_in_priority_order():
    queue = PriorityQueue()
    queue.add(make_request("b", 1, priority=0, arrival_time=2.0))
    queue.add_preempted(make_request("p", 1, priority=1, arrival_time=0.0))
    queue.add(make_request("a", 1, priority=0, arrival_time=5.0))
    assert [r.req_id for r in queue] == ["b", "a", "p"]


# ------------------------------------------------------------------------------- queues
def test_fcfs_queue_operations():
    queue = QUEUE_POLICIES["fcfs"]()
    assert isinstance(queue, FCFSQueue)
    a, b, c, p = (make_request(x, 1) for x in "abcp")
    for r in (a, b, c):
        queue.add(r)
    queue.add_preempted(p)
    assert [r.req_id for r in queue] == ["p", "a", "b", "c"]
    assert queue.peek() is p and len(queue) == 4
    queue.remove(b)
    assert queue.pop() is p
    assert [r.req_id for r in queue] == ["a", "c"]


def test_fcfs_victim_is_the_most_recently_admitted():
    reqs = [make_request(x, 1) for x in "abc"]
    for seq, r in zip((3, 9, 5), reqs):
        r.admit_seq = seq
    assert FCFSQueue.pick_victim(reqs) is reqs[1]


def test_priority_queue_operations():
    queue = QUEUE_POLICIES["priority"]()
    assert isinstance(queue, PriorityQueue)
    same1 = make_request("same1", 1, priority=1, arrival_time=1.0)
    same2 = make_request("same2", 1, priority=1, arrival_time=1.0)  # equal key: insertion order
    top = make_request("top", 1, priority=-1, arrival_time=9.0)
    for r in (same1, same2, top):
        queue.add(r)
    assert [r.req_id for r in queue] == ["top", "same1", "same2"]
    assert queue.peek() is top
    queue.remove(same1)
    assert len(queue) == 2
    assert queue.pop() is top
    assert queue.pop() is same2
    assert len(queue) == 0


# ------------------------------------------------------------------------------- abort
def test_abort_running_request_frees_blocks_and_reports_it_next_step():
    sched, runner = setup(block_size=4)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 3))
    step(sched, runner)
    assert sched.kv.get_block_ids("a") == [0, 1]
    finished = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in finished] == ["a"]
    assert finished[0].status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.get_block_ids("a") == []
    assert sched.kv.pool.free_queue.block_ids()[-2:] == [1, 0]
    assert running_ids(sched) == ["b"]
    assert sched.finish_requests(["a", "nobody"], RequestStatus.FINISHED_ABORTED) == []

    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    assert "a" not in runner.block_tables


def test_abort_between_schedule_and_update_drops_the_results():
    sched, runner = setup()
    sched.add_request(make_request("a", 2))
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_out) == []
    assert_all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"a"}


def test_abort_waiting_request_that_the_runner_never_saw():
    sched, runner = setup(max_num_seqs=1)
    sched.add_request(make_request("a", 2))
    sched.add_request(make_request("b", 2))
    step(sched, runner)
    finished = sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.status for r in finished] == [RequestStatus.FINISHED_ABORTED]
    assert waiting_ids(sched) == []
    out, _ = step(sched, runner)
    assert out.finished_req_ids == frozenset()  # nothing for the runner to drop


def test_abort_preempted_request_reports_it_to_the_runner():
    sched, runner = setup(num_blocks=2, block_size=2)
    sched.add_request(make_request("a", 2))
    sched.add_request(make_request("b", 2))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == {"b"}
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert waiting_ids(sched) == []
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}


# -------------------------------------------------------------------------- stop rules
def run_to_end(sched: Scheduler, runner: FakeRunner, script: list[int]) -> Request:
    """Drive one request to its end, sampling ``script`` in order (then TOKEN)."""
    (request,) = sched.requests.values()
    script = list(script)
    while sched.has_unfinished_requests():
        step(sched, runner, {request.req_id: script.pop(0) if script else TOKEN})
    return request


def test_stop_on_eos():
    sched, runner = setup()
    sched.add_request(make_request("a", 3))
    request = run_to_end(sched, runner, [5, 6, EOS, 8])
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, 6, EOS]
    assert request.stop_reason is None
    assert_all_blocks_free(sched)


def test_stop_on_stop_token_id_records_the_reason():
    sched, runner = setup()
    sched.add_request(make_request("a", 3, stop_token_ids=[42]))
    out_last = None
    for token in (5, 42):
        _, core = step(sched, runner, {"a": token})
        out_last = core[-1]
    assert out_last == EngineCoreOutput(req_id="a", new_token_ids=(42,),
                                        finish_status=RequestStatus.FINISHED_STOPPED,
                                        stop_reason=42)


def test_stop_on_max_tokens():
    sched, runner = setup()
    sched.add_request(make_request("a", 3, max_tokens=3))
    request = run_to_end(sched, runner, [])
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [TOKEN] * 3


def test_max_tokens_one_finishes_after_the_prefill():
    sched, runner = setup()
    sched.add_request(make_request("a", 5, max_tokens=1))
    out, core = step(sched, runner)
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,),
                                     finish_status=RequestStatus.FINISHED_LENGTH_CAPPED)]
    assert_all_blocks_free(sched)


def test_min_tokens_holds_back_eos_and_stop_token_ids():
    sched, runner = setup()
    sched.add_request(make_request("a", 3, min_tokens=3, stop_token_ids=[42]))
    request = run_to_end(sched, runner, [EOS, 42, EOS, 9])
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [EOS, 42, EOS]


def test_ignore_eos_runs_to_max_tokens():
    sched, runner = setup()
    sched.add_request(make_request("a", 3, max_tokens=3, ignore_eos=True))
    request = run_to_end(sched, runner, [EOS, EOS, EOS])
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [EOS, EOS, EOS]


def test_eos_on_the_last_allowed_token_counts_as_stop():
    sched, runner = setup()
    sched.add_request(make_request("a", 3, max_tokens=2))
    request = run_to_end(sched, runner, [5, EOS])
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_stop_at_max_model_len():
    sched, runner = setup(max_model_len=6)
    sched.add_request(make_request("a", 4, max_tokens=16))
    request = run_to_end(sched, runner, [])
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.num_tokens == 6


def test_finish_reasons():
    assert [s.is_finished for s in RequestStatus] == [False, False, False, True, True, True]
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.RUNNING.finish_reason is None


def test_logprobs_are_passed_through():
    sched, runner = setup()
    sched.add_request(make_request("a", 2, logprobs=1, prompt_logprobs=0))
    out = sched.schedule()
    sampled_lp = SampledLogprobs(token_ids=((TOKEN, 3),), logprobs=((-0.1, -2.0),), ranks=(1,))
    prompt_lp = SampledLogprobs(token_ids=((101,),), logprobs=((-1.5,),), ranks=(4,))
    core = sched.update_from_output(out, ModelRunnerOutput({"a": (TOKEN,)}, {"a": sampled_lp},
                                                           {"a": prompt_lp}))
    assert core == [EngineCoreOutput(req_id="a", new_token_ids=(TOKEN,),
                                     new_logprobs=(sampled_lp,), new_prompt_logprobs=prompt_lp)]

