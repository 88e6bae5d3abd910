"""Runs one scheduled step on the model: builds flat inputs, runs forward, samples.

The runner keeps its own per-request state (token ids, block table, generator), updated from the
scheduler's diffs; it shares no mutable object with the scheduler and decides nothing the
scheduler has not sent (an n > 1 request forks exactly when ``SchedulerOutput.forks`` says).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.model_runner.sampling_inputs import build_sampling_metadata
from engine_worker.sampler import gather_logprobs, sample
from engine_worker.sampling_params import SamplingParams
from engine_worker.step_types import (ForkedRequestData, ModelRunnerOutput, SampledLogprobs,
                                      SchedulerOutput)


@dataclass(slots=True)
class RunnerRequestState:
    req_id: str
    token_ids: list[int]  # prompt then every sampled token
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    prompt_logprobs_from: int = 0  # prompt positions before this already have logprobs


class ModelRunner:
    """Owns the model and the KV cache tensors of one engine."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, vocab_size: int, eos_token_ids: frozenset[int],
                 seed: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, RunnerRequestState] = {}
        self.default_generator = torch.Generator(device=device).manual_seed(seed)

    # ------------------------------------------------------------------ state updates
    def _apply_diffs(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_requests:
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids), params=new.sampling_params,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=self._generator(new.sampling_params))
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            if cached.replace_block_table:
                state.block_ids = list(cached.block_ids)
            else:
                state.block_ids.extend(cached.block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed)

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: every layer's K/V of each src block into its dst block. All sources
        are read before any destination is written, so a freed source reused as a later
        destination in the same step is still copied correctly."""
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for kv_cache in self.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
            kv_cache[:, dst] = kv_cache[:, src]

    # ------------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled tokens through the model and sample where a request is complete."""
        self._apply_diffs(out)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if out.is_empty:
            return ModelRunnerOutput({}, {}, {})
        # decodes (one new token) first, then prefill chunks; see attention.metadata
        order = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        counts = [out.num_scheduled_tokens[r] for r in order]
        input_ids, positions, meta, query_starts = build_step_inputs(states, counts,
                                                                     self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        sample_rows = [i for i, (s, n) in enumerate(zip(states, counts))
                       if s.num_computed_tokens + n >= len(s.token_ids)]
        prompt_logprobs = self._prompt_logprobs(states, counts, query_starts, hidden)
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, SampledLogprobs] = {}
        forks = out.forks_by_parent()
        if sample_rows:
            sampled, logprobs = self._sample(states, counts, query_starts, sample_rows, hidden,
                                             forks)
        assert not forks, f"forks of requests that sample nothing this step: {sorted(forks)}"
        for state, n in zip(states, counts):
            state.num_computed_tokens += n
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _sample(self, states, counts, query_starts, rows, hidden, forks):
        """``forks`` (parent -> its forks) is consumed: each parent's forks are applied."""
        picked, logit_rows = [], []
        for j, i in enumerate(rows):
            picked.append(states[i])
            logit_rows.append(j)
            for child in self._fork(states[i], counts[i], forks.pop(states[i].req_id, ())):
                picked.append(child)
                logit_rows.append(j)  # the samples of one prompt share its logits
        last = torch.tensor([query_starts[i] + counts[i] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        if len(logit_rows) != len(rows):
            logits = logits[torch.tensor(logit_rows, device=self.device)]
        meta = build_sampling_metadata(picked, self.vocab_size, self.eos_token_ids, self.device)
        tokens, logprobs = sample(logits, meta, self.default_generator)
        sampled, per_req_logprobs = {}, {}
        for j, (state, token) in enumerate(zip(picked, tokens.tolist())):
            state.token_ids.append(token)
            sampled[state.req_id] = (token,)
            if logprobs is not None and state.params.logprobs is not None:
                k = state.params.logprobs + 1
                per_req_logprobs[state.req_id] = SampledLogprobs(
                    token_ids=(logprobs.token_ids[j][:k],), logprobs=(logprobs.logprobs[j][:k],),
                    ranks=(logprobs.ranks[j],))
        return sampled, per_req_logprobs

    def _fork(self, parent: RunnerRequestState, num_scheduled: int,
              forks: list[ForkedRequestData]) -> list[RunnerRequestState]:
        """n > 1: the forked samples' states, copied from the parent after its prompt."""
        children = []
        for fork in forks:
            child = RunnerRequestState(
                req_id=fork.req_id, token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens, params=fork.sampling_params,
                block_ids=list(parent.block_ids),
                num_computed_tokens=parent.num_computed_tokens + num_scheduled,
                generator=self._generator(fork.sampling_params),
                prompt_logprobs_from=parent.num_prompt_tokens)
            self.requests[fork.req_id] = child
            children.append(child)
        return children

    def _prompt_logprobs(self, states, counts, query_starts, hidden):
        result: dict[str, SampledLogprobs] = {}
        for state, n, start in zip(states, counts, query_starts):
            k = state.params.prompt_logprobs
            first = max(state.num_computed_tokens, state.prompt_logprobs_from)
            # position p predicts prompt token p + 1
            last = min(state.num_computed_tokens + n, state.num_prompt_tokens - 1)
            if k is None or first >= last:
                continue
            rows = torch.arange(start + first - state.num_computed_tokens,
                                start + last - state.num_computed_tokens, device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            targets = torch.tensor(state.token_ids[first + 1:last + 1], device=self.device)
            result[state.req_id] = gather_logprobs(logprobs, targets, k)
            state.prompt_logprobs_from = last
        return result
