"""Continuous batching: every step re-forms the batch under a token and a sequence budget.

Order of a step:
1. running requests, oldest admission first: one decode token each, or the next prefill chunk;
   when the KV pool is out of blocks, preempt the policy's victim (its blocks freed, its tokens
   recomputed later) until the request fits;
2. if nothing was preempted, admit waiting requests while budget, ``max_num_seqs`` and free
   blocks allow; a prompt longer than the remaining budget is prefilled in chunks.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.model_runner.output import ModelRunnerOutput, SampledLogprobs
from engine_worker.request import Request, RequestStatus
from engine_worker.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_worker.scheduler.queue import QUEUE_POLICIES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finish_status: RequestStatus | None = None
    stop_reason: int | str | None = None
    new_logprobs: tuple[SampledLogprobs, ...] = ()
    new_prompt_logprobs: SampledLogprobs | None = None


class Scheduler:
    """Decides which requests run each step and how many tokens each computes."""

    def __init__(self, *, kv_cache_manager: KVCacheManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0) -> None:
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting = QUEUE_POLICIES[policy]()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()  # to tell the runner next step
        self._runner_knows: set[str] = set()
        self._to_resume: set[str] = set()  # preempted while the runner held their state
        self._admit_counter = itertools.count()
        self.num_preemptions = 0

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a validated request; it is considered from the next ``schedule()`` on."""
        assert request.req_id not in self.requests, f"duplicate request id {request.req_id}"
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids, status: RequestStatus) -> list[Request]:
        """End requests from outside a step (abort, stop string); frees their blocks."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """Form this step's batch. See the module docstring for the order."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        block_ids: dict[str, list[int]] = {}
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            while True:
                new_blocks = self.kv.allocate_slots(request.req_id,
                                                    request.num_computed_tokens + num_new)
                if new_blocks is not None:
                    break
                victim = self.waiting.pick_victim(self.running)
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim.req_id in num_scheduled:  # undo what this step gave it
                    budget += num_scheduled.pop(victim.req_id)
                    block_ids.pop(victim.req_id, None)
                if victim_index < i:
                    i -= 1
                if victim is request:
                    break
            if new_blocks is None:
                continue  # the request preempted itself; self.running[i] is the next one
            num_scheduled[request.req_id] = num_new
            block_ids[request.req_id] = new_blocks
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, block_ids)

        return self._build_output(num_scheduled, block_ids, preempted)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       block_ids: dict[str, list[int]]) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            num_new = self._num_new_tokens(request, budget)
            new_blocks = self.kv.allocate_slots(request.req_id,
                                                request.num_computed_tokens + num_new)
            if new_blocks is None:
                break  # head of line waits for blocks; later arrivals do not jump it
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.admit_seq = next(self._admit_counter)
            self.running.append(request)
            num_scheduled[request.req_id] = num_new
            block_ids[request.req_id] = new_blocks
            budget -= num_new
        return budget

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.req_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._to_resume.add(request.req_id)
        self.waiting.add_preempted(request)
        logger.debug("preempted %s (%d tokens to recompute)", request.req_id, request.num_tokens)

    def _build_output(self, num_scheduled: dict[str, int], block_ids: dict[str, list[int]],
                      preempted: list[Request]) -> SchedulerOutput:
        new_reqs, cached_reqs = [], []
        for req_id in num_scheduled:
            request = self.requests[req_id]
            if req_id not in self._runner_knows:
                self._runner_knows.add(req_id)
                new_reqs.append(NewRequestData(
                    req_id=req_id, prompt_token_ids=tuple(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=tuple(self.kv.get_block_ids(req_id)),
                    num_computed_tokens=request.num_computed_tokens))
            else:
                resumed = req_id in self._to_resume
                self._to_resume.discard(req_id)
                cached_reqs.append(CachedRequestData(
                    req_id=req_id, resumed=resumed,
                    block_ids=tuple(self.kv.get_block_ids(req_id) if resumed
                                    else block_ids[req_id]),
                    num_computed_tokens=request.num_computed_tokens))
        finished = frozenset(self._finished_req_ids)
        self._finished_req_ids.clear()
        return SchedulerOutput(
            new_requests=tuple(new_reqs), cached_requests=tuple(cached_reqs),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=frozenset(r.req_id for r in preempted),
            finished_req_ids=finished)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, apply stop rules, free finished."""
        outputs = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_tokens
            sampled = runner_output.sampled_token_ids.get(req_id, ())
            logprobs = runner_output.logprobs.get(req_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            new_tokens: list[int] = []
            status = None
            for token_id in sampled:
                request.output_token_ids.append(token_id)
                new_tokens.append(token_id)
                status = request.check_stop(self.max_model_len)
                if status is not None:
                    break
            if not new_tokens and prompt_logprobs is None:
                continue
            outputs.append(EngineCoreOutput(
                req_id=req_id, new_token_ids=tuple(new_tokens), finish_status=status,
                stop_reason=request.stop_reason,
                new_logprobs=(logprobs,) if logprobs is not None and new_tokens else (),
                new_prompt_logprobs=prompt_logprobs))
            if status is not None:
                self.running.remove(request)
                self._free(request, status)
        return outputs

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.req_id)
        del self.requests[request.req_id]
        self._to_resume.discard(request.req_id)
        if request.req_id in self._runner_knows:
            self._runner_knows.discard(request.req_id)
            self._finished_req_ids.add(request.req_id)
