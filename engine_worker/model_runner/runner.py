"""Runs one scheduled step on the model: builds flat inputs, runs forward, samples.

The runner keeps its own per-request state (token ids, block table, generator), updated from the
scheduler's diffs; it shares no mutable object with the scheduler and decides nothing the
scheduler has not sent (an n > 1 request forks exactly when ``SchedulerOutput.forks`` says).

A step queues its device work (forward, logits, sampling, logprobs) without reading the device,
then copies what the host needs (the sampled ids, logprobs where asked for) in one
``platform.to_host``: one wait per step, whatever the batch. With a ``CudaGraphDecoder``,
decode-only steps up to its largest size replay a captured graph instead of the eager forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.model_runner.graphs import CudaGraphDecoder
from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.model_runner.sampling_inputs import build_sampling_metadata
from engine_worker.platform import to_device, to_host
from engine_worker.pooler import Pooler
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampler import LogprobTensors, draw_uniforms, logprob_tensors, sample_tokens
from engine_worker.sampling_params import SamplingParams
from engine_worker.step_types import (ForkedRequestData, ModelRunnerOutput, SampledLogprobs,
                                      SchedulerOutput)


@dataclass(slots=True)
class RunnerRequestState:
    req_id: str
    token_ids: list[int]  # prompt then every sampled token
    num_prompt_tokens: int
    params: SamplingParams | None  # None: a pooling request
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    prompt_logprobs_from: int = 0  # prompt positions before this already have logprobs
    pooling: PoolingParams | None = None
    pooled: torch.Tensor | None = None  # the pooling method's running state, [hidden] fp32


@dataclass(frozen=True, slots=True)
class _DeviceSamples:
    """One step's samples, still on the device: row j of ``token_ids`` is ``states[j]``'s."""

    states: list[RunnerRequestState]
    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobTensors | None


class ModelRunner:
    """Owns the model and the KV cache tensors of one engine."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, vocab_size: int, eos_token_ids: frozenset[int],
                 seed: int, graphs: CudaGraphDecoder | None = None,
                 pooler: Pooler | None = None) -> None:
        """``graphs``: decode-only steps replayed from its captured graphs (captured over
        ``kv_caches``); None runs every step eagerly. ``pooler``: how pooling requests'
        hidden states become their vectors (needed once one is sent)."""
        self.model = model
        self.pooler = pooler
        self.graphs = graphs
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
                generator=self._generator(new.sampling_params), pooling=new.pooling_params)
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            if cached.replace_block_table:
                state.block_ids = list(cached.block_ids)
            else:
                state.block_ids.extend(cached.block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _generator(self, params: SamplingParams | None) -> torch.Generator | None:
        if params is None or params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed)

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: every layer's K/V of each src block into its dst block. All sources
        are read before any destination is written, so a freed source reused as a later
        destination in the same step is still copied correctly."""
        src = to_device(torch.tensor([c[0] for c in copies]), self.device)
        dst = to_device(torch.tensor([c[1] for c in copies]), self.device)
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
        hidden, query_starts = self._forward(states, counts)

        sample_rows = [i for i, (s, n) in enumerate(zip(states, counts))
                       if s.num_computed_tokens + n >= len(s.token_ids) and s.pooling is None]
        pooled = self._pool(states, counts, query_starts, hidden)
        prompt_logprobs = self._prompt_logprobs(states, counts, query_starts, hidden)
        forks = out.forks_by_parent()
        samples = None
        if sample_rows:
            samples = self._sample(states, counts, query_starts, sample_rows, hidden, forks)
        assert not forks, f"forks of requests that sample nothing this step: {sorted(forks)}"
        sampled, logprobs, prompt_logprobs, pooled = self._to_host(samples, prompt_logprobs,
                                                                   pooled)
        for state, n in zip(states, counts):
            state.num_computed_tokens += n
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, pooled)

    def _forward(self, states, counts) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of the step's tokens [num_tokens, hidden_size] and each request's
        first row: from a graph for a decode-only step that fits one, else eagerly."""
        step = self.graphs.prepare(states, counts) if self.graphs is not None else None
        if step is not None:
            return self.graphs.run(step), list(range(len(states)))
        input_ids, positions, meta, query_starts = build_step_inputs(states, counts,
                                                                     self.block_size, self.device)
        return self.model(input_ids, positions, self.kv_caches, meta), query_starts

    def _sample(self, states, counts, query_starts, rows, hidden, forks) -> _DeviceSamples:
        """``forks`` (parent -> its forks) is consumed: each parent's forks are applied."""
        picked, logit_rows = [], []
        for j, i in enumerate(rows):
            picked.append(states[i])
            logit_rows.append(j)
            for child in self._fork(states[i], counts[i], forks.pop(states[i].req_id, ())):
                picked.append(child)
                logit_rows.append(j)  # the samples of one prompt share its logits
        last = self._index([query_starts[i] + counts[i] - 1 for i in rows])
        logits = self.model.compute_logits(hidden[last])
        if len(logit_rows) != len(rows):
            logits = logits[self._index(logit_rows)]
        meta = build_sampling_metadata(picked, self.vocab_size, self.eos_token_ids, self.device)
        uniforms = draw_uniforms(logits, meta, self.default_generator)
        token_ids, logprobs = sample_tokens(logits, meta, uniforms)
        return _DeviceSamples(picked, token_ids, logprobs)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device)

    def _pool(self, states, counts, query_starts, hidden) -> dict[str, torch.Tensor]:
        """Advance every pooling request's pooling over its rows of this step; the vectors
        (on the device) of those whose prompt this step completes."""
        finished: dict[str, torch.Tensor] = {}
        for state, n, start in zip(states, counts, query_starts):
            if state.pooling is None:
                continue
            first = state.num_computed_tokens
            if first == 0:
                state.pooled = None  # (re)started from the first position, e.g. after preemption
            completes = first + n >= state.num_prompt_tokens
            state.pooled = self.pooler.method.update(state.pooled, hidden[start:start + n],
                                                     first, completes)
            if completes:
                finished[state.req_id] = self.pooler.finish(
                    state.pooled, state.num_prompt_tokens, bool(state.pooling.normalize))
                state.pooled = None
        return finished

    def _to_host(self, samples: _DeviceSamples | None,
                 prompt_logprobs: dict[str, LogprobTensors],
                 pooled: dict[str, torch.Tensor]):
        """The one device read of a step: sampled ids, their logprobs, prompt logprobs and
        pooled vectors."""
        device_tensors: list[torch.Tensor] = []
        if samples is not None:
            device_tensors.append(samples.token_ids)
            if samples.logprobs is not None:
                device_tensors.extend(samples.logprobs)
        for tensors in prompt_logprobs.values():
            device_tensors.extend(tensors)
        device_tensors.extend(pooled.values())
        host = iter(to_host(device_tensors))
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, SampledLogprobs] = {}
        if samples is not None:
            token_ids = next(host).tolist()
            if samples.logprobs is not None:
                top_ids, top_lps, ranks = (next(host).tolist() for _ in range(3))
            for j, (state, token) in enumerate(zip(samples.states, token_ids)):
                state.token_ids.append(token)
                sampled[state.req_id] = (token,)
                if samples.logprobs is not None and state.params.logprobs is not None:
                    k = state.params.logprobs + 1  # the sampled token, then its top k
                    logprobs[state.req_id] = SampledLogprobs(
                        token_ids=(tuple(top_ids[j][:k]),), logprobs=(tuple(top_lps[j][:k]),),
                        ranks=(ranks[j],))
        prompt = {req_id: LogprobTensors(next(host), next(host), next(host)).to_python()
                  for req_id in prompt_logprobs}
        vectors = {req_id: tuple(next(host).tolist()) for req_id in pooled}
        return sampled, logprobs, prompt, vectors

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

    def _prompt_logprobs(self, states, counts, query_starts, hidden
                         ) -> dict[str, LogprobTensors]:
        """Per request asking for them: the step's prompt logprobs, on the device."""
        result: dict[str, LogprobTensors] = {}
        for state, n, start in zip(states, counts, query_starts):
            if state.params is None:
                continue
            k = state.params.prompt_logprobs
            first = max(state.num_computed_tokens, state.prompt_logprobs_from)
            # position p predicts prompt token p + 1
            last = min(state.num_computed_tokens + n, state.num_prompt_tokens - 1)
            if k is None or first >= last:
                continue
            rows = torch.arange(start + first - state.num_computed_tokens,
                                start + last - state.num_computed_tokens, device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            targets = self._index(state.token_ids[first + 1:last + 1])
            result[state.req_id] = logprob_tensors(logprobs, targets, k)
            state.prompt_logprobs_from = last
        return result
