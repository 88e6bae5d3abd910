"""Exact tests of continuous batching: the scheduler driven by hand with a fake model runner.

The fake runner keeps its own per-request state from the scheduler's diffs alone (as the real
runner does), checks that state against the scheduler's after every ``schedule()``, and samples a
scripted token for a request only once all of its tokens are computed. It also models the KV
cache's contents: every slot remembers the token sequence whose K/V it holds, copy-on-write
copies run before the step (all sources read before any destination is written), every new K/V
of a step is written before any is read (as within each layer of the real model), and every
request's computed context must read back exactly its own tokens.

The tests written before prefix caching run with it off (their block ids assume nothing is
shared); the prefix-caching and fork tests turn it on.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.model_runner.output import ModelRunnerOutput, SampledLogprobs
from engine_worker.request import Request, RequestStatus
from engine_worker.sampling_params import SamplingParams
from engine_worker.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_worker.scheduler.queue import QUEUE_POLICIES, FCFSQueue, PriorityQueue
from engine_worker.scheduler.scheduler import EngineCoreOutput, Scheduler

EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise


def make_request(req_id: str, num_prompt_tokens: int, *, max_tokens: int = 16,
                 arrival_time: float = 0.0, priority: int = 0, first_token: int = 100,
                 cache_salt: str | None = None, num_samples: int = 1, **params) -> Request:
    """Prompt ``first_token, first_token + 1, ...``; ``num_samples`` > 1 forks into children
    ``{req_id}-1, ...`` once the prompt is computed (as the input processor builds n > 1)."""
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    children = tuple((f"{req_id}-{i}", SamplingParams(max_tokens=max_tokens, **params))
                     for i in range(1, num_samples))
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   frozenset({EOS}), max_tokens, arrival_time=arrival_time, priority=priority,
                   cache_salt=cache_salt, fork_children=children)


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4,
                   max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                   max_model_len: int = 1024, policy: str = "fcfs",
                   long_prefill_token_threshold: int = 0,
                   enable_prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(kv_cache_manager=kv,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, policy=policy,
                     long_prefill_token_threshold=long_prefill_token_threshold)


class FakeRunner:
    """Mirrors the real runner's bookkeeping and KV contents; samples scripted tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.block_tables: dict[str, list[int]] = {}
        self.token_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.fork_children: dict[str, tuple[str, ...]] = {}
        # block id -> per slot, the token sequence (up to and including the slot's position)
        # whose K/V the slot holds; None where nothing was written
        self.cache: dict[int, list[tuple[int, ...] | None]] = {}
        self.num_copies = 0

    def execute(self, out: SchedulerOutput,
                pick: Callable[[str], int] = lambda req_id: TOKEN) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            assert req_id in self.block_tables, f"finished {req_id} was never sent to the runner"
            del self.block_tables[req_id], self.token_ids[req_id], self.num_computed[req_id]
            self.fork_children.pop(req_id, None)
        for new in out.new_requests:
            assert new.req_id not in self.block_tables, f"{new.req_id} sent as new twice"
            self.block_tables[new.req_id] = list(new.block_ids)
            self.token_ids[new.req_id] = list(new.prompt_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.fork_children[new.req_id] = tuple(c for c, _ in new.fork_children)
        for cached in out.cached_requests:
            table = self.block_tables[cached.req_id]
            if cached.replace_block_table:
                table[:] = cached.block_ids
            else:
                table.extend(cached.block_ids)
            self.num_computed[cached.req_id] = cached.num_computed_tokens
        self._check_against_scheduler(out)

        # copy-on-write before the step; every source is read before any destination is written
        sources = [list(self._block(src)) for src, _ in out.block_copies]
        for (_, dst), content in zip(out.block_copies, sources):
            self.cache[dst] = content
        self.num_copies += len(out.block_copies)
        # the step writes every new K/V before any attention reads
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            self._write(req_id, self.num_computed[req_id], num_tokens)
        for req_id in self.block_tables:
            request = self.scheduler.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self._check_context(req_id, self.num_computed[req_id]
                                    + out.num_scheduled_tokens.get(req_id, 0))

        sampled = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            if self.num_computed[req_id] + num_tokens >= len(self.token_ids[req_id]):
                samples = [req_id, *self._fork(req_id, num_tokens)]
                for sample_id in samples:  # the samples of one prompt share its logits
                    token = pick(sample_id)
                    self.token_ids[sample_id].append(token)
                    sampled[sample_id] = (token,)
            self.num_computed[req_id] += num_tokens
        return ModelRunnerOutput(sampled, {}, {})

    def _fork(self, parent_id: str, num_tokens: int) -> list[str]:
        """n > 1: the children copy the parent's table and tokens, before its sampled token."""
        children = list(self.fork_children.pop(parent_id, ()))
        for child_id in children:
            assert child_id not in self.block_tables, f"{child_id} forked twice"
            self.block_tables[child_id] = list(self.block_tables[parent_id])
            self.token_ids[child_id] = list(self.token_ids[parent_id])
            self.num_computed[child_id] = self.num_computed[parent_id] + num_tokens
        return children

    def _block(self, block_id: int) -> list[tuple[int, ...] | None]:
        return self.cache.setdefault(block_id, [None] * self.block_size)

    def _write(self, req_id: str, first: int, num_tokens: int) -> None:
        table, tokens = self.block_tables[req_id], self.token_ids[req_id]
        for pos in range(first, first + num_tokens):
            self._block(table[pos // self.block_size])[pos % self.block_size] = tuple(
                tokens[:pos + 1])

    def _check_context(self, req_id: str, num_tokens: int) -> None:
        """The cache holds exactly this request's tokens at its first ``num_tokens`` positions."""
        table, tokens = self.block_tables[req_id], self.token_ids[req_id]
        for pos in range(num_tokens):
            held = self._block(table[pos // self.block_size])[pos % self.block_size]
            assert held == tuple(tokens[:pos + 1]), (
                f"{req_id} position {pos} (block {table[pos // self.block_size]}) holds the K/V "
                f"of {held}, not of its own tokens")

    def _check_against_scheduler(self, out: SchedulerOutput) -> None:
        sched = self.scheduler
        block_size = sched.kv.block_size
        assert set(out.num_scheduled_tokens) == (
            {n.req_id for n in out.new_requests} | {c.req_id for c in out.cached_requests})
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            assert num_tokens >= 1
            assert self.block_tables[req_id] == sched.kv.get_block_ids(req_id)
            assert self.num_computed[req_id] == request.num_computed_tokens
            assert self.token_ids[req_id] == request.all_token_ids
            num_slots = len(self.block_tables[req_id]) * block_size
            needed = request.num_computed_tokens + num_tokens
            assert needed <= num_slots < needed + block_size  # enough, and < 1 block wasted
        for request in sched.running:  # forked children, too, match the scheduler
            if request.req_id in self.block_tables:
                assert self.block_tables[request.req_id] == sched.kv.get_block_ids(
                    request.req_id)


def step(sched: Scheduler, runner: FakeRunner,
         tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step; ``tokens[req_id]`` is what the model samples for that request."""
    tokens = tokens or {}
    out = sched.schedule()
    runner_out = runner.execute(out, lambda req_id: tokens.get(req_id, TOKEN))
    return out, sched.update_from_output(out, runner_out)


def setup(**kwargs) -> tuple[Scheduler, FakeRunner]:
    sched = make_scheduler(**kwargs)
    return sched, FakeRunner(sched)


def running_ids(sched: Scheduler) -> list[str]:
    return [r.req_id for r in sched.running]


def waiting_ids(sched: Scheduler) -> list[str]:
    return [r.req_id for r in sched.waiting]


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert sorted(kv.pool.free_queue.block_ids()) == list(range(kv.num_blocks))
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    stats = kv.stats()
    assert (stats.num_allocated_slots, stats.num_used_slots) == (0, 0)


# ---------------------------------------------------------------- one request, end to end
def test_single_request_prefill_then_decode_then_length_cap():
    sched, runner = setup(block_size=4)
    request = make_request("a", 6, max_tokens=4)
    sched.add_request(request)
    assert (sched.num_waiting, sched.num_running) == (1, 0)

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
    assert sched.kv.num_free_blocks == 0

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
    assert sched.kv.num_free_blocks == 0

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
    assert [c for c, _ in out.new_requests[0].fork_children] == ["p-1", "p-2"]
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
    assert core == []  # mid-prefill: no fork yet
    out, core = step(sched, runner, {"p": 10, "p-1": 11})
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
        assert sched.num_running <= 2


# ------------------------------------------------------------------------ whole workloads
def test_mixed_workload_with_preemptions_returns_every_block():
    sched, runner = setup(num_blocks=10, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    lengths = [(9, 12), (3, 20), (14, 6), (1, 25), (7, 7), (20, 3)]
    requests = [make_request(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(lengths)]
    for request in requests[:3]:
        sched.add_request(request)
    num_steps = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert out.total_num_scheduled_tokens <= 16
        assert sched.num_running <= 4
        num_steps += 1
        if num_steps == 3:
            for request in requests[3:]:
                sched.add_request(request)
    assert sched.num_preemptions > 0
    assert [len(r.output_token_ids) for r in requests] == [m for _, m in lengths]
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert_all_blocks_free(sched)
    assert step(sched, runner)[0].finished_req_ids  # the last ids still reach the runner
    assert runner.block_tables == {}


request_specs = st.lists(
    st.tuples(st.integers(1, 20),  # prompt tokens
              st.integers(1, 12),  # max_tokens
              st.sampled_from([0, 0, 1, 2, 4, 6]),  # arrival step
              st.integers(0, 2),  # priority
              st.one_of(st.none(), st.integers(0, 11)),  # output index that samples EOS
              st.one_of(st.none(), st.integers(0, 8)),  # step to abort at
              st.sampled_from([100, 100, 200]),  # prompt family: equal ones share prefixes
              st.sampled_from([None, "s"]),  # cache salt
              st.sampled_from([1, 1, 2, 3])),  # samples (n)
    min_size=1, max_size=8)


def sample_token(req_id: str) -> int:
    """A token of its own per sample, so no two sequences agree after their prompts."""
    parent, _, child = req_id[1:].partition("-")
    return 1000 + 10 * int(parent) + int(child or 0)


@settings(max_examples=150, deadline=None)
@given(specs=request_specs, block_size=st.sampled_from([1, 2, 4, 8]),
       extra_blocks=st.integers(0, 8), budget=st.integers(1, 24), max_num_seqs=st.integers(1, 5),
       policy=st.sampled_from(["fcfs", "priority"]), threshold=st.sampled_from([0, 3]),
       enable_prefix_caching=st.booleans())
def test_random_workloads_finish_and_return_every_block(specs, block_size, extra_blocks, budget,
                                                        max_num_seqs, policy, threshold,
                                                        enable_prefix_caching):
    # The input processor only admits requests whose peak fits in the whole cache.
    peak = max(spec[0] + spec[1] - 1 for spec in specs)
    num_blocks = -(-peak // block_size) + extra_blocks
    sched, runner = setup(num_blocks=num_blocks, block_size=block_size,
                          max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          policy=policy, long_prefill_token_threshold=threshold,
                          enable_prefix_caching=enable_prefix_caching)
    requests = []
    for i, (p, m, t, prio, _, _, family, salt, n) in enumerate(specs):
        n = min(n, max_num_seqs)  # the input processor rejects n > max_num_seqs
        requests.append(make_request(f"r{i}", p, max_tokens=m, priority=prio,
                                     arrival_time=float(t), first_token=family, cache_salt=salt,
                                     num_samples=n))
    samples = {r.req_id: [r.req_id] + [c for c, _ in r.fork_children] for r in requests}
    all_ids = [sample_id for ids in samples.values() for sample_id in ids]
    num_outputs = dict.fromkeys(all_ids, 0)  # per sample, from the step outputs alone
    final: dict[str, RequestStatus] = {}
    reported_finished: list[str] = []
    for step_index in range(3000):
        for request, spec in zip(requests, specs):
            arrival, abort_at = spec[2], spec[5]
            if arrival == step_index:
                sched.add_request(request)
            if abort_at == step_index and arrival <= step_index:
                for aborted in sched.finish_requests(samples[request.req_id],
                                                     RequestStatus.FINISHED_ABORTED):
                    final[aborted.req_id] = aborted.status
        if step_index > 6 and not sched.has_unfinished_requests():
            break
        eos_at = {sample_id: spec[4] for r, spec in zip(requests, specs)
                  for sample_id in samples[r.req_id]}
        tokens = {i: EOS if eos_at[i] == num_outputs[i] else sample_token(i) for i in all_ids}
        out, core = step(sched, runner, tokens)
        for output in core:
            num_outputs[output.req_id] += len(output.new_token_ids)
            if output.finish_status is not None:
                assert output.req_id not in final, f"{output.req_id} finished twice"
                final[output.req_id] = output.finish_status
        reported_finished.extend(out.finished_req_ids)
        assert out.total_num_scheduled_tokens <= budget
        assert sched.num_running <= max_num_seqs
        assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
        free_ids = sched.kv.pool.free_queue.block_ids()
        tables = [sched.kv.get_block_ids(i) for i in all_ids]
        held = {b for table in tables for b in table}
        assert len(free_ids) == len(set(free_ids)) and not held & set(free_ids)
        assert sorted(free_ids + sorted(held)) == list(range(num_blocks))
        for block in sched.kv.pool.blocks:  # a reference per table holding the block
            assert block.ref_cnt == sum(table.count(block.block_id) for table in tables)
        for block_hash, block in sched.kv.pool.cached.items():
            assert block.block_hash == block_hash
    else:
        pytest.fail("the workload did not finish")
    reported_finished.extend(step(sched, runner)[0].finished_req_ids)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"copies: {runner.num_copies > 0}")
    event(f"hits: {sched.kv.stats().prefix_cache_hits > 0}")

    assert_all_blocks_free(sched)
    assert sched.requests == {} and runner.block_tables == {}
    assert sorted(reported_finished) == sorted(set(reported_finished))  # each reported once
    for request, spec in zip(requests, specs):
        max_tokens, eos_index, num_samples = spec[1], spec[4], min(spec[8], max_num_seqs)
        assert request.status.is_finished
        if request.status == RequestStatus.FINISHED_ABORTED:
            continue
        assert len(samples[request.req_id]) == num_samples
        for sample_id in samples[request.req_id]:
            if final[sample_id] == RequestStatus.FINISHED_ABORTED:
                continue
            if eos_index is not None and eos_index < max_tokens:
                assert final[sample_id] == RequestStatus.FINISHED_STOPPED
                assert num_outputs[sample_id] == eos_index + 1
            else:
                assert final[sample_id] == RequestStatus.FINISHED_LENGTH_CAPPED
                assert num_outputs[sample_id] == max_tokens
