"""Continuous batching: every step re-forms the batch under a token and a sequence budget.

Order of a step:
1. running requests, oldest admission first: one decode token each, or the next prefill chunk;
   when the KV pool is out of blocks, preempt the policy's victim (its blocks freed, its tokens
   recomputed later) until the request fits;
2. if nothing was preempted, admit waiting requests while budget, ``max_num_seqs`` and free
   blocks allow; a request starts from its longest cached prefix, and a prompt longer than the
   remaining budget is prefilled in chunks. With LoRA, a request whose adapter would make the
   running set exceed ``max_loras`` distinct adapters waits (vLLM's ``curr_loras`` rule) and
   later ones may pass it, but only for ``LORA_MAX_SKIPPED_STEPS`` steps: after that nothing
   passes it until its adapter fits, so no adapter starves. With ``short_prompts_first``, a
   prompt that would cost more than the rest of the step together waits one step while the
   shorter prompts behind it run (``_short_prompts_to_pass``).
With a ``Speculator``, a request in its decode phase may also verify draft tokens in step 1:
they are budgeted as extra tokens of its step (and given up before anything is preempted for
them); after the step the rejected drafts' slots are given back (``KVCacheManager.trim``).
After the step, newly full and computed blocks are published to the prefix cache. An n > 1
request forks into its samples, which share its blocks, in the step that completes its prompt:
the scheduler decides the fork when it forms the batch and sends it to the runner as
``SchedulerOutput.forks``; the runner only applies it.
Multi-step (``num_scheduler_steps`` > 1): while every running request decodes and nothing
waits, one decision gives each request slots for several tokens and the runner runs that many
passes (``scheduler.multi_step``).
"""

from __future__ import annotations

import itertools
import logging

from engine_worker.grammar import grammar_bitmask
from engine_worker.kv_cache.manager import NO_PREFIX, Allocation, KVCacheManager
from engine_worker.request import Request, RequestStatus
from engine_worker.scheduler.multi_step import allocate_run, run_length
from engine_worker.scheduler.queue import QUEUE_POLICIES
from engine_worker.spec_decode.speculator import Speculator
from engine_worker.step_types import (NO_TOKEN, CachedRequestData, EngineCoreOutput,
                                      ForkedRequestData, ModelRunnerOutput, NewRequestData,
                                      SampledLogprobs, SchedulerOutput, SchedulerStats)
from quire.block_hash import ROOT_HASH, hash_block_tokens
from quire.errors import FieldError

logger = logging.getLogger(__name__)

# steps a waiting request may be passed by later ones because its adapter did not fit
LORA_MAX_SKIPPED_STEPS = 8


class Scheduler:
    """Decides which requests run each step and how many tokens each computes."""

    def __init__(self, *, kv_cache_manager: KVCacheManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, short_prompts_first: bool = False,
                 speculator: Speculator | None = None, max_loras: int | None = None,
                 pooling_batched_tokens: int | None = None, num_scheduler_steps: int = 1
                 ) -> None:
        """``speculator``: proposes draft tokens for decoding requests (None: no speculative
        decoding). ``max_loras``: distinct LoRA adapters the running set may hold.
        ``pooling_batched_tokens``: the step's token budget while every unfinished request is
        a pooling request (None: ``max_num_batched_tokens``); see ``_step_budget``.
        ``num_scheduler_steps``: most forward passes of one multi-step decode (see
        ``_multi_step``; 1: none)."""
        self.num_scheduler_steps = num_scheduler_steps
        self.max_loras = max_loras
        self._lora_skipped_steps: dict[str, int] = {}  # req_id -> steps passed over
        self.kv = kv_cache_manager
        self.speculator = speculator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pooling_batched_tokens = max(max_num_batched_tokens, pooling_batched_tokens or 0)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.short_prompts_first = short_prompts_first
        self.num_prompts_passed = 0  # long prompts that waited a step for shorter ones
        self.waiting = QUEUE_POLICIES[policy]()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()  # to tell the runner next step
        self._runner_knows: set[str] = set()
        self._to_resume: set[str] = set()  # preempted while the runner held their state
        self._trimmed: set[str] = set()  # blocks given back: the runner gets the whole table
        # forks sent in the step whose outputs are not yet applied: parent -> child ids
        self._in_flight_forks: dict[str, tuple[str, ...]] = {}
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        # the last step stopped admitting for batch room (SchedulerStats.batch_full)
        self.batch_full = False

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a validated request; it is considered from the next ``schedule()`` on."""
        assert request.req_id not in self.requests, f"duplicate request id {request.req_id}"
        self._extend_block_hashes(request)
        if request.reads_prefix_cache:
            request.num_found_cached_tokens = self.kv.find_cached_prefix(
                request.block_hashes, request.num_tokens).num_tokens
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def _extend_block_hashes(self, request: Request) -> None:
        if not self.kv.enable_prefix_caching:
            return
        hashes = request.block_hashes
        if request.num_tokens // self.kv.block_size > len(hashes):
            hashes.extend(hash_block_tokens(
                request.all_token_ids, self.kv.block_size, cache_salt=request.cache_salt,
                parent_hash=hashes[-1] if hashes else ROOT_HASH, start_block=len(hashes),
                lora_name=request.lora_name))

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

    def stats(self) -> SchedulerStats:
        """Counts as of now; ``num_preemptions`` is the running total."""
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_queued_tokens=sum(self._queued_tokens(r) for r in self.requests.values()),
            num_preemptions=self.num_preemptions,
            spec_decoding=self.speculator.stats() if self.speculator is not None else None,
            batch_full=self.batch_full and bool(len(self.waiting)),
            num_prompts_passed=self.num_prompts_passed)

    @staticmethod
    def _queued_tokens(request: Request) -> int:
        """Tokens the request still needs computed: a waiting one's prompt less the prefix
        the cache held on its arrival (a router weighing this engine's queue must not count
        a hot prefix's cached tokens as work), an admitted one's uncomputed tokens."""
        if request.num_computed_tokens == 0:
            return request.num_tokens - request.num_found_cached_tokens
        return request.num_tokens - request.num_computed_tokens

    # ----------------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """Form this step's batch. See the module docstring for the order."""
        multi = self._multi_step()
        if multi is not None:
            return multi
        budget = self._step_budget()
        num_scheduled: dict[str, int] = {}
        allocations: dict[str, Allocation] = {}
        preempted: list[Request] = []
        drafts: dict[str, tuple[int, ...]] = {}
        draft_budget = 0 if self.speculator is None else \
            self.speculator.step_draft_budget(len(self.running))

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            draft = self._propose(request, min(budget - num_new, draft_budget)) \
                if draft_budget else ()
            while True:
                allocation = self.kv.allocate_slots(request.req_id, request.num_computed_tokens,
                                                    num_new + len(draft),
                                                    block_hashes=request.block_hashes)
                if allocation is not None:
                    break
                if draft:  # drafts are never worth a preemption: verify none instead
                    draft = ()
                    continue
                victim = self.waiting.pick_victim(self.running)
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim.req_id in num_scheduled:  # undo what this step gave it
                    budget += num_scheduled.pop(victim.req_id)
                    allocations.pop(victim.req_id, None)
                    drafts.pop(victim.req_id, None)
                if victim_index < i:
                    i -= 1
                if victim is request:
                    break
            if allocation is None:
                continue  # the request preempted itself; self.running[i] is the next one
            if draft:
                drafts[request.req_id] = draft
                num_new += len(draft)
                draft_budget -= len(draft)
            num_scheduled[request.req_id] = num_new
            allocations[request.req_id] = allocation
            budget -= num_new
            i += 1

        self.batch_full = bool(preempted)
        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, allocations)

        return self._build_output(num_scheduled, allocations, preempted, drafts)

    def _multi_step(self) -> SchedulerOutput | None:
        """A multi-step run (``scheduler.multi_step``), or None where this step is one pass:
        also whenever something waits (its prefill must not wait the run out) or drafts are
        proposed."""
        if self.num_scheduler_steps < 2 or self.speculator is not None or len(self.waiting) \
                or not self.running or len(self.running) > self.max_num_batched_tokens:
            return None
        steps = run_length(self.running, self.num_scheduler_steps, self.max_model_len, self.kv)
        if steps < 2:
            return None
        allocations = allocate_run(self.running, steps, self.kv)
        self.batch_full = False
        return self._build_output({r.req_id: 1 for r in self.running}, allocations, [], {},
                                  num_steps=steps)

    def _step_budget(self) -> int:
        """The step's token budget. While only pooling requests are unfinished no decode
        waits behind a long step, so it may take the larger pooling budget: fewer, wider steps
        (fewer thread fork/joins and weight passes per token)."""
        if self.pooling_batched_tokens > self.max_num_batched_tokens and self.requests and \
                all(r.pooling_params is not None for r in self.requests.values()):
            return self.pooling_batched_tokens
        return self.max_num_batched_tokens

    def _propose(self, request: Request, budget: int) -> tuple[int, ...]:
        """Draft tokens for a request that decodes this step (its last token is the only one
        to compute), within the step's budget and what max_tokens and max_model_len leave."""
        if request.num_computed_tokens != request.num_tokens - 1 or \
                not request.output_token_ids or request.fork_children or \
                request.grammar is not None:  # its matcher cannot roll rejected drafts back yet
            return ()
        room = min(budget, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        if room <= 0:
            return ()
        return self.speculator.propose(request.req_id, request.prompt_token_ids,
                                       request.output_token_ids, room)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       allocations: dict[str, Allocation]) -> int:
        # samples of running n > 1 requests that will join the batch when they fork
        num_seqs = len(self.running) + sum(len(r.fork_children) for r in self.running)
        loras = {r.lora_name for r in self.running if r.lora_name is not None}
        passed_over: list[Request] = []
        held: list[Request] = []  # long prompts waiting this step for shorter ones to run
        left = -1  # admissions left in this step (-1: no limit)
        step_tokens = sum(num_scheduled.values())
        admitted: list[int] = []  # tokens of the prompts admitted so far this step
        while len(self.waiting) and budget > 0 and left != 0:
            request = self.waiting.peek()
            if self.short_prompts_first and not held:
                held, num_short = self._short_prompts_to_pass(request, budget, step_tokens,
                                                              admitted)
                if held:
                    for long in held:
                        self.waiting.remove(long)
                        long.passed_by_shorter = True
                    self.num_prompts_passed += len(held)
                    left = num_short
                    continue
            if num_seqs + 1 + len(request.fork_children) > self.max_num_seqs:
                self.batch_full = True
                break
            if not self._lora_fits(request, loras):
                skipped = self._lora_skipped_steps.get(request.req_id, 0) + 1
                self._lora_skipped_steps[request.req_id] = skipped
                if skipped > LORA_MAX_SKIPPED_STEPS:
                    break  # it has waited long enough: nothing passes it any more
                passed_over.append(self.waiting.pop())
                continue
            allocation, num_computed, num_new, prefix = self._allocate_on_admission(request,
                                                                                   budget)
            if allocation is None:
                self.batch_full = True
                break  # head of line waits for blocks; later arrivals do not jump it
            self.waiting.pop()
            self.kv.record_prefix_query(request.num_tokens, prefix.num_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = prefix.num_tokens
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.admit_seq = next(self._admit_counter)
            self.running.append(request)
            self._lora_skipped_steps.pop(request.req_id, None)
            if request.lora_name is not None:
                loras.add(request.lora_name)
            num_seqs += 1 + len(request.fork_children)
            num_scheduled[request.req_id] = num_new
            allocations[request.req_id] = allocation
            budget -= num_new
            step_tokens += num_new
            admitted.append(num_new)
            if left > 0:
                left -= 1
        # back at the head in their order: the ones passed over for their adapter (they came
        # first), then the held prompts
        for request in reversed(passed_over + held):
            self.waiting.add_preempted(request)
        return budget

    def _short_prompts_to_pass(self, head: Request, budget: int, step_tokens: int,
                               admitted: list[int]) -> tuple[list[Request], int]:
        """Whether ``head`` waits a step so that shorter prompts do not wait for it: the
        prompts to hold back (``head`` and those in its window no shorter) and how many of the
        shorter ones behind it to admit; ``([], 0)`` when it joins the step as usual.

        The step's prompts all give their first token when it ends, so joining it, ``head``
        makes every shorter prompt of it wait for its tokens: those admitted before it
        (``admitted``: their tokens) and those behind it in its window (the waiting prompts
        that fit in the budget it leaves). Held, it waits one step of the others. It waits
        only where it is the longest of its window, there is a shorter prompt to gain and its
        own tokens outweigh everything else the step computes (the running requests' and the
        shorter prompts'), so a step that batches prompts of like length is never split and
        one with decodes only never delays it; and each prompt is held at most once, so none
        starves. vLLM V0 let short prompts pass long ones for the same reason
        (``max_long_partial_prefills``)."""
        long = self._queued_tokens(head)
        if long <= step_tokens or not self._may_hold(head):
            return [], 0
        num_before = sum(tokens < long for tokens in admitted)
        held, num_short, short_tokens, window = [head], 0, 0, budget - long
        for request in itertools.islice(iter(self.waiting), 1, None):
            tokens = self._queued_tokens(request)
            if tokens > window:
                break
            window -= tokens
            if tokens > long:
                return [], 0  # a longer prompt behind it: that one is weighed when it comes
            if tokens < long and request.priority <= head.priority:
                num_short += 1
                short_tokens += tokens
            elif self._may_hold(request):
                held.append(request)  # as long, or of a worse priority: it waits too
            else:
                return [], 0  # held once already: it runs now, and head with it
        if num_before + num_short and long > step_tokens + short_tokens:
            return held, num_short
        return [], 0

    @staticmethod
    def _may_hold(request: Request) -> bool:
        """A prompt not yet begun, never preempted and never held before."""
        return request.num_computed_tokens == 0 and not request.num_preemptions and \
            not request.passed_by_shorter

    def _lora_fits(self, request: Request, loras: set[str]) -> bool:
        return request.lora_name is None or request.lora_name in loras or \
            self.max_loras is None or len(loras) < self.max_loras

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The distinct adapters of the running requests and of the waiting ones (vLLM's
        ``running_lora_adapters`` / ``waiting_lora_adapters``), each in queue order."""
        running = dict.fromkeys(r.lora_name for r in self.running if r.lora_name is not None)
        waiting = dict.fromkeys(r.lora_name for r in self.waiting if r.lora_name is not None)
        return tuple(running), tuple(waiting)

    def lora_in_use(self, lora_name: str) -> int:
        """Unfinished requests running under the adapter."""
        return sum(r.lora_name == lora_name for r in self.requests.values())

    def _allocate_on_admission(self, request: Request, budget: int):
        prefix = NO_PREFIX
        # prompt logprobs and mean pooling need every prompt position computed: no cache reads
        if request.num_computed_tokens == 0 and request.reads_prefix_cache:
            prefix = self.kv.find_cached_prefix(request.block_hashes, request.num_tokens)
        while True:
            num_computed = request.num_computed_tokens or prefix.num_tokens
            num_new = min(request.num_tokens - num_computed, budget)
            if 0 < self.long_prefill_token_threshold < num_new:
                num_new = self.long_prefill_token_threshold
            allocation = self.kv.allocate_slots(request.req_id, num_computed, num_new, prefix,
                                                request.block_hashes)
            if allocation is not None or not prefix.needs_copy:
                return allocation, num_computed, num_new, prefix
            prefix = prefix.shortened()  # the copy did not fit: recompute the last block instead

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

    def _build_output(self, num_scheduled: dict[str, int], allocations: dict[str, Allocation],
                      preempted: list[Request], drafts: dict[str, tuple[int, ...]],
                      num_steps: int = 1) -> SchedulerOutput:
        new_reqs, cached_reqs, copies, forks, grammars = [], [], [], [], []
        for req_id, num_new in num_scheduled.items():
            request = self.requests[req_id]
            allocation = allocations[req_id]
            copies.extend(allocation.copies)
            if request.grammar is not None and \
                    request.num_computed_tokens + num_new >= request.num_tokens:
                grammars.append((req_id, request.grammar))  # it samples this step
            if request.fork_children and \
                    request.num_computed_tokens + num_new >= request.num_tokens:
                # the step completes the prompt: the parent samples, and its samples fork
                forks.extend(ForkedRequestData(parent_req_id=req_id, req_id=child_id,
                                               sampling_params=params)
                             for child_id, params in request.fork_children)
            if req_id not in self._runner_knows:
                self._runner_knows.add(req_id)
                new_reqs.append(NewRequestData(
                    req_id=req_id, prompt_token_ids=tuple(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=tuple(self.kv.get_block_ids(req_id)),
                    num_computed_tokens=request.num_computed_tokens,
                    pooling_params=request.pooling_params, lora_name=request.lora_name))
                continue
            replace = req_id in self._to_resume or req_id in self._trimmed or \
                bool(allocation.copies)
            self._to_resume.discard(req_id)
            self._trimmed.discard(req_id)
            cached_reqs.append(CachedRequestData(
                req_id=req_id, replace_block_table=replace,
                block_ids=tuple(self.kv.get_block_ids(req_id)) if replace
                else allocation.new_block_ids,
                num_computed_tokens=request.num_computed_tokens))
        finished = frozenset(self._finished_req_ids)
        self._finished_req_ids.clear()
        out = SchedulerOutput(
            new_requests=tuple(new_reqs), cached_requests=tuple(cached_reqs),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=frozenset(r.req_id for r in preempted),
            finished_req_ids=finished, block_copies=tuple(copies), forks=tuple(forks),
            grammar_bitmask=grammar_bitmask(grammars), spec_token_ids=drafts,
            num_steps=num_steps)
        self._in_flight_forks = {parent: tuple(f.req_id for f in group)
                                 for parent, group in out.forks_by_parent().items()}
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed counts, publish full blocks, apply the step's forks, append
        sampled tokens, apply stop rules, free finished requests."""
        outputs = []
        self._in_flight_forks = {}
        forks = scheduler_output.forks_by_parent()
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            sampled = runner_output.sampled_token_ids.get(req_id, ())
            draft = scheduler_output.spec_token_ids.get(req_id)
            if draft:
                self._settle_drafts(request, num_tokens, draft, len(sampled))
            elif scheduler_output.num_steps > 1:  # each pass computed one token
                request.num_computed_tokens += len(sampled)
            else:
                request.num_computed_tokens += num_tokens
            if self.kv.has_pending(req_id):  # all_token_ids copies: only when needed
                self.kv.cache_full_blocks(req_id, request.block_hashes,
                                          request.num_computed_tokens, request.all_token_ids,
                                          request.cache_salt, request.lora_name)
            if request.pooling_params is not None:
                if req_id in runner_output.pooled:
                    outputs.append(self._finish_pooling(request, runner_output.pooled[req_id]))
                continue
            siblings = [request]
            if req_id in forks:
                siblings += self._fork(request, forks[req_id])
            for sibling in siblings:
                out = self._append_sampled(
                    sibling, runner_output.sampled_token_ids.get(sibling.req_id, ()),
                    runner_output.logprobs.get(sibling.req_id),
                    runner_output.prompt_logprobs.get(req_id) if sibling is request else None,
                    publish_run=scheduler_output.num_steps > 1)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _settle_drafts(self, request: Request, num_tokens: int, draft: tuple[int, ...],
                       num_sampled: int) -> None:
        """After a verified step: the request's cache holds its last token and the accepted
        drafts (``num_sampled - 1``); the rejected drafts' slots and blocks are given back."""
        num_rejected = len(draft) + 1 - num_sampled
        request.num_computed_tokens += num_tokens - num_rejected
        self.speculator.record(request.req_id, len(draft), num_sampled - 1)
        if num_rejected and self.kv.trim(request.req_id, request.num_computed_tokens):
            self._trimmed.add(request.req_id)

    def _finish_pooling(self, request: Request, pooled: tuple[float, ...]) -> EngineCoreOutput:
        """A pooling request's prompt is computed: its vector is its one output."""
        self.running.remove(request)
        self._free(request, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(req_id=request.req_id, new_token_ids=(),
                                finish_status=RequestStatus.FINISHED_STOPPED, pooled=pooled,
                                num_cached_tokens=request.num_cached_tokens)

    def _fork(self, parent: Request, forks: list[ForkedRequestData]) -> list[Request]:
        children = []
        for fork in forks:
            child = parent.fork(fork.req_id, fork.sampling_params)
            child.admit_seq = next(self._admit_counter)
            self.kv.fork(parent.req_id, fork.req_id)
            self.requests[fork.req_id] = child
            self.running.append(child)
            self._runner_knows.add(fork.req_id)  # the runner applied the fork
            children.append(child)
        parent.fork_children = ()
        return children

    def _append_sampled(self, request: Request, sampled, logprobs, prompt_logprobs,
                        publish_run: bool = False) -> EngineCoreOutput | None:
        """``publish_run``: the step was a multi-step run, whose tokens were unknown when its
        slots were given: the blocks it filled are registered and published here, once the
        tokens are (before a finished request's blocks are freed)."""
        new_tokens: list[int] = []
        status = error = None
        for token_id in sampled:
            if token_id == NO_TOKEN:  # its constraints together allowed no token
                status, error = RequestStatus.FINISHED_ABORTED, no_token_error(request)
                logger.debug("request %s ends: %s", request.req_id, error)  # (the client's)
                break
            request.output_token_ids.append(token_id)
            new_tokens.append(token_id)
            status = request.check_stop(self.max_model_len)
            if status is not None:
                break
        self._extend_block_hashes(request)
        if publish_run and self.kv.enable_prefix_caching:
            # (past a stop token the run computed positions of no token: no hash names them)
            self.kv.register_full_blocks(request.req_id, request.block_hashes,
                                         request.num_computed_tokens)
            if self.kv.has_pending(request.req_id):
                self.kv.cache_full_blocks(request.req_id, request.block_hashes,
                                          request.num_computed_tokens,
                                          request.all_token_ids, request.cache_salt,
                                          request.lora_name)
        if not new_tokens and prompt_logprobs is None and error is None:
            return None
        if logprobs is not None and len(logprobs.ranks) > len(new_tokens):  # stopped early
            logprobs = SampledLogprobs(token_ids=logprobs.token_ids[:len(new_tokens)],
                                       logprobs=logprobs.logprobs[:len(new_tokens)],
                                       ranks=logprobs.ranks[:len(new_tokens)])
        out = EngineCoreOutput(
            req_id=request.req_id, new_token_ids=tuple(new_tokens), finish_status=status,
            stop_reason=request.stop_reason,
            new_logprobs=(logprobs,) if logprobs is not None and new_tokens else (),
            new_prompt_logprobs=prompt_logprobs, num_cached_tokens=request.num_cached_tokens,
            error=error)
        if status is not None:
            self.running.remove(request)
            self._free(request, status)
        return out

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._lora_skipped_steps.pop(request.req_id, None)
        self.kv.free(request.req_id)
        del self.requests[request.req_id]
        self._to_resume.discard(request.req_id)
        self._trimmed.discard(request.req_id)
        if self.speculator is not None:
            self.speculator.forget(request.req_id, request.output_token_ids)
        if request.req_id in self._runner_knows:
            self._runner_knows.discard(request.req_id)
            self._finished_req_ids.add(request.req_id)
            # ended mid-step: the runner forked the samples this step sent it
            self._finished_req_ids.update(self._in_flight_forks.pop(request.req_id, ()))


def no_token_error(request: Request) -> FieldError:
    """Why a request got no token: the constraints it sent together allow none after its
    output so far (min_tokens' bans never do: an allowed list lifts them, and a grammar
    turns them off). Named by the first it set (vLLM's fields), the grammar last."""
    params = request.sampling_params
    fields = [name for name, on in (
        ("bad_words", bool(params.bad_words_token_ids or params.bad_words)),
        ("allowed_token_ids", params.allowed_token_ids is not None),
        ("structured_outputs", request.grammar is not None)) if on]
    return FieldError(fields[0] if fields else "allowed_token_ids",
                      f"{' and '.join(fields)} together left no token that may come after "
                      f"{request.num_output_tokens} generated tokens")
