"""The fake model runner and helpers that drive the scheduler by hand in its exact tests.

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

from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.request import Request, RequestStatus
from engine_worker.sampling_params import SamplingParams
from engine_worker.scheduler.scheduler import Scheduler
from engine_worker.step_types import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

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
                   enable_prefix_caching: bool = False,
                   short_prompts_first: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(kv_cache_manager=kv,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, policy=policy,
                     long_prefill_token_threshold=long_prefill_token_threshold,
                     short_prompts_first=short_prompts_first)


class FakeRunner:
    """Mirrors the real runner's bookkeeping and KV contents; samples scripted tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.block_tables: dict[str, list[int]] = {}
        self.token_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # block id -> per slot, the token sequence (up to and including the slot's position)
        # whose K/V the slot holds; None where nothing was written
        self.cache: dict[int, list[tuple[int, ...] | None]] = {}
        self.num_copies = 0

    def execute(self, out: SchedulerOutput,
                pick: Callable[[str], int] = lambda req_id: TOKEN) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            assert req_id in self.block_tables, f"finished {req_id} was never sent to the runner"
            del self.block_tables[req_id], self.token_ids[req_id], self.num_computed[req_id]
        for new in out.new_requests:
            assert new.req_id not in self.block_tables, f"{new.req_id} sent as new twice"
            self.block_tables[new.req_id] = list(new.block_ids)
            self.token_ids[new.req_id] = list(new.prompt_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
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
        forks = {parent: [f.req_id for f in group]
                 for parent, group in out.forks_by_parent().items()}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            if self.num_computed[req_id] + num_tokens >= len(self.token_ids[req_id]):
                samples = [req_id, *self._fork(req_id, num_tokens, forks.pop(req_id, []))]
                for sample_id in samples:  # the samples of one prompt share its logits
                    token = pick(sample_id)
                    self.token_ids[sample_id].append(token)
                    sampled[sample_id] = (token,)
            self.num_computed[req_id] += num_tokens
        assert not forks, f"forks of requests that sample nothing this step: {sorted(forks)}"
        return ModelRunnerOutput(sampled, {}, {})

    def _fork(self, parent_id: str, num_tokens: int, children: list[str]) -> list[str]:
        """n > 1: the children copy the parent's table and tokens, before its sampled token."""
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
    assert kv.stats().num_free_blocks == kv.stats().num_blocks
    assert sorted(kv.pool.free_queue.block_ids()) == list(range(kv.pool.num_blocks))
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    stats = kv.stats()
    assert (stats.num_allocated_slots, stats.num_used_slots) == (0, 0)


