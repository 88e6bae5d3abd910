"""The scheduler's view of one sequence. Owned and mutated by the scheduler alone."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from engine_worker.pooling_params import PoolingParams
from engine_worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_worker.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: its tokens, how far the KV cache has computed them, and its state.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the request needs a
    forward pass over ``num_tokens - num_computed_tokens`` more tokens before it can sample.
    A pooling request (``pooling_params`` set, ``sampling_params`` None) samples nothing: it
    ends when its prompt is computed, with its pooled vector. ``reads_prefix_cache`` False:
    every prompt position must be computed (prompt logprobs, mean pooling).
    """

    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params",
                 "eos_token_ids", "max_tokens", "arrival_time", "priority", "status",
                 "num_computed_tokens", "stop_reason", "num_preemptions", "admit_seq",
                 "cache_salt", "block_hashes", "num_cached_tokens", "fork_children",
                 "grammar", "pooling_params", "reads_prefix_cache", "lora_name",
                 "num_found_cached_tokens", "passed_by_shorter")

    def __init__(self, req_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None, eos_token_ids: frozenset[int],
                 max_tokens: int, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None,
                 fork_children: tuple[tuple[str, SamplingParams], ...] = (),
                 grammar: RequestGrammar | None = None, *,
                 pooling_params: PoolingParams | None = None,
                 reads_prefix_cache: bool | None = None,
                 lora_name: str | None = None) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.admit_seq = -1  # order of (latest) admission into the running set
        self.cache_salt = cache_salt
        self.block_hashes: list[int] = []  # of every full block of all_token_ids
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        # the prefix-cache hit the scheduler found on its arrival: the part of its prompt that
        # the load report does not count as queued work while it waits
        self.num_found_cached_tokens = 0
        # it waited a step while shorter prompts behind it ran (Scheduler.short_prompts_first)
        self.passed_by_shorter = False
        # n > 1: the other samples, created by forking this request once its prompt is done
        self.fork_children = fork_children
        # structured outputs: the matcher of this sequence's grammar (advanced by the scheduler)
        self.grammar = grammar
        self.pooling_params = pooling_params
        if reads_prefix_cache is None:  # prompt logprobs need every prompt position computed
            reads_prefix_cache = (sampling_params is None
                                  or sampling_params.prompt_logprobs is None)
        self.reads_prefix_cache = reads_prefix_cache
        self.lora_name = lora_name  # the LoRA adapter it runs under (None: the base model)

    def fork(self, req_id: str, params: SamplingParams) -> Request:
        """A sibling sample sharing this request's computed prompt (and, in the cache, its
        blocks), taken before the first sampled token is appended."""
        child = Request(req_id, self.prompt_token_ids, params, self.eos_token_ids,
                        self.max_tokens, self.arrival_time, self.priority, self.cache_salt,
                        grammar=None if self.grammar is None else self.grammar.fork(),
                        lora_name=self.lora_name)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_cached_tokens = self.num_cached_tokens
        child.num_found_cached_tokens = self.num_found_cached_tokens
        child.status = self.status
        return child

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status implied by the last token, or None if it goes on. Under a
        structured output, the grammar's matcher is advanced past the token here: the request
        stops when the grammar is complete."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.grammar is not None and (not self.grammar.accept(last)
                                         or self.grammar.is_terminated):
            # the grammar is complete (or, never expected, refused what its mask allowed)
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
