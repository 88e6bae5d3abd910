"""The types of one engine step, shared by the scheduler, the model runner and the engine.

The scheduler emits a ``SchedulerOutput``; the runner returns a ``ModelRunnerOutput``; the
scheduler turns that into one ``EngineCoreOutput`` per request that progressed. Both packages
import this module and neither imports the other.

What the scheduler sends are diffs, not state: a request is described in full once
(``NewRequestData``); afterwards only what changed is sent (``CachedRequestData``), the samples
an n > 1 request forks into (``ForkedRequestData``), and the ids of finished requests so the
runner can drop their state. Everything here is plain Python data, never tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_worker.pooling_params import PoolingParams
from engine_worker.request import RequestStatus
from engine_worker.sampling_params import SamplingParams
from engine_worker.spec_decode.stats import SpecDecodingStats
from quire.errors import FieldError

if TYPE_CHECKING:
    from engine_worker.grammar import GrammarBitmask

# a sampled id meaning "no token may come next": the request's constraints together allowed
# none (a grammar and its bad_words or allowed_token_ids); the scheduler ends the request
# with an error naming them
NO_TOKEN = -1


# ------------------------------------------------------------------ scheduler -> runner
@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen before: it samples (``sampling_params``) or, a
    pooling request, pools its prompt (``pooling_params``, with ``normalize`` resolved)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams | None
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    lora_name: str | None = None  # the adapter it runs under (None: the base model)


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A request the runner already holds. When ``replace_block_table`` (resumed after
    preemption, or a block copied on write) ``block_ids`` is its whole new block table;
    otherwise they are appended to it."""

    req_id: str
    replace_block_table: bool
    block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class ForkedRequestData:
    """n > 1: sample ``req_id`` forks from ``parent_req_id`` in this step, whose prompt the
    step completes. The child starts as a copy of the parent after the step's tokens (same
    block table, same token ids) and its first token is sampled from the parent's logits."""

    parent_req_id: str
    req_id: str
    sampling_params: SamplingParams


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One engine step's batch. ``num_scheduled_tokens[req_id]`` new tokens run per request."""

    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]
    # copy-on-write: copy every layer's K/V of block src into block dst before the step
    block_copies: tuple[tuple[int, int], ...] = ()
    # n > 1 forks, in sampling order: each parent's children follow one another
    forks: tuple[ForkedRequestData, ...] = ()
    # structured outputs: allowed tokens of the sequences that sample under a grammar
    # (a fork samples its first token under its parent's row)
    grammar_bitmask: GrammarBitmask | None = None
    # speculative decoding: draft tokens verified after each listed request's last token; they
    # are counted in its ``num_scheduled_tokens`` (1 + len(drafts) for a decoding request)
    spec_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # multi-step: every listed request decodes (one token each) and the runner runs up to this
    # many forward passes, sampling each and feeding the sample to the next; each request has
    # cache slots for all of them. The runner may stop early (every row stopped, or the engine
    # has new work); each request's sampled tokens say how many ran.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def forks_by_parent(self) -> dict[str, list[ForkedRequestData]]:
        """Each forking parent's forks, in order (a new dict each call)."""
        grouped: dict[str, list[ForkedRequestData]] = {}
        for fork in self.forks:
            grouped.setdefault(fork.parent_req_id, []).append(fork)
        return grouped


# ------------------------------------------------------------------ runner -> scheduler
@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """Log probabilities at one or more positions.

    For position ``p``: ``token_ids[p][0]`` is the chosen (sampled or prompt) token, followed by
    the top-k tokens; ``logprobs[p]`` matches them; ``ranks[p]`` is the chosen token's 1-based rank.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Per request id: tokens sampled this step (empty mid-prefill; with drafts, the accepted
    drafts then one more) and optional logprobs (one position per sampled token);
    ``pooled``: the vector of each pooling request whose prompt this step completed."""

    sampled_token_ids: Mapping[str, tuple[int, ...]]
    logprobs: Mapping[str, SampledLogprobs]
    prompt_logprobs: Mapping[str, SampledLogprobs]
    pooled: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


# ------------------------------------------------------------------ scheduler -> engine
@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finish_status: RequestStatus | None = None
    stop_reason: int | str | None = None
    new_logprobs: tuple[SampledLogprobs, ...] = ()
    new_prompt_logprobs: SampledLogprobs | None = None
    num_cached_tokens: int = 0
    pooled: tuple[float, ...] | None = None  # a pooling request's vector, on its last output
    error: FieldError | None = None  # why it ended aborted, when its own input was the cause


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's counts after a step; ``num_preemptions`` is a running total."""

    num_running: int
    num_waiting: int
    num_queued_tokens: int  # tokens of unfinished requests not yet computed
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None  # totals; None when speculation is off
    # the last step left requests waiting for batch room (max_num_seqs, KV blocks, a
    # preemption), not only for its token budget or a LoRA slot (LoadReport.batch_full)
    batch_full: bool = False
    # long prompts that waited a step for shorter ones (short_prompts_first), a running total
    num_prompts_passed: int = 0
