"""What the scheduler hands the model runner each step: diffs, not state.

A request is described in full once (``NewRequestData``); afterwards only what changed is sent
(``CachedRequestData``), plus the ids of finished requests so the runner can drop their state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine_worker.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen before."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    # n > 1: (child req_id, params) of the other samples; the runner samples their first
    # tokens from this request's first logits and forks its state for them
    fork_children: tuple[tuple[str, SamplingParams], ...] = ()


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

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
