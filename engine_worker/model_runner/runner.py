"""Runs one scheduled step on the model: builds flat inputs, runs forward, samples.

The runner keeps its own per-request state (token ids, block table, generator), updated from the
scheduler's diffs; it shares no mutable object with the scheduler and decides nothing the
scheduler has not sent (an n > 1 request forks exactly when ``SchedulerOutput.forks`` says).

A step queues its device work (forward, logits, sampling, logprobs) without reading the device,
then copies what the host needs (the sampled ids, logprobs where asked for) in one
``platform.to_host``: one wait per step, whatever the batch. With a ``CudaGraphDecoder``,
decode-only steps up to its largest size replay a captured graph instead of the eager forward.

Speculative decoding: a request with draft tokens (``SchedulerOutput.spec_token_ids``) runs its
last token and the drafts as one query (a prefill chunk over its cached context, which every
attention backend computes exactly as the decodes it replaces); each of those positions is
sampled as its own row, under the sampling state it would have without speculation (the
drafts before it counted as output), and ``spec_decode.rejection_sampler`` keeps the accepted
prefix plus one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine_worker.backends.base import SamplingKernels
from engine_worker.grammar import GrammarBitmask
from engine_worker.lora.manager import LoRAManager
from engine_worker.model_runner.graphs import CudaGraphDecoder
from engine_worker.model_runner.inputs import DecodeInputs, build_step_inputs
from engine_worker.model_runner.sampling_inputs import (build_sampling_metadata,
                                                         changes_with_tokens)
from engine_worker.platform import to_device, to_host
from engine_worker.pooler import Pooler
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampler import (LogprobTensors, SamplingMetadata, draw_uniforms,
                                   logprob_tensors, sample_tokens)
from engine_worker.sampling_params import SamplingParams
from engine_worker.spec_decode.rejection_sampler import accepted_tokens
from engine_worker.step_types import (NO_TOKEN, ForkedRequestData, ModelRunnerOutput,
                                      SampledLogprobs, SchedulerOutput)


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
    lora_name: str | None = None  # the adapter it runs under (None: the base model)


@dataclass(frozen=True, slots=True)
class _VerifiedPosition:
    """What the sampler reads of a request at one verified position: its tokens up to there
    (the drafts before it included), so penalties and min_tokens see what they would see had
    the drafts been sampled one step at a time."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True, slots=True)
class _DeviceSamples:
    """One step's samples, still on the device: ``states[j]`` owns rows ``row_starts[j]`` to
    ``row_starts[j + 1]`` of ``token_ids`` (one row, or one per verified position)."""

    states: list[RunnerRequestState]
    row_starts: list[int]
    drafts: list[tuple[int, ...]]  # per state: the drafts its rows verify (empty: none)
    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobTensors | None
    # seeded requests with drafts: their generator's state before the step's draws, and the
    # uniforms one position draws (see ModelRunner._rewind)
    rewinds: dict[int, tuple[torch.Generator, torch.Tensor, int]]


class ModelRunner:
    """Owns the model and the KV cache tensors of one engine."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, vocab_size: int, eos_token_ids: frozenset[int],
                 seed: int, graphs: CudaGraphDecoder | None = None,
                 pooler: Pooler | None = None, lora: LoRAManager | None = None,
                 sampling_kernels: SamplingKernels = SamplingKernels()) -> None:
        """``graphs``: decode-only steps replayed from its captured graphs (captured over
        ``kv_caches``); None runs every step eagerly. ``pooler``: how pooling requests'
        hidden states become their vectors (needed once one is sent). ``lora``: the adapters
        requests may run under (None: LoRA is off). ``sampling_kernels``: the backend's
        (``Backend.sampling``)."""
        self.sampling_kernels = sampling_kernels
        self.model = model
        self.lora = lora
        self.pooler = pooler
        self.graphs = graphs
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, RunnerRequestState] = {}
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        # the last step's sampling rows and their metadata, while it can be reused
        self._last_sampling: tuple[list, SamplingMetadata] | None = None
        # a decode-only step's inputs, filled in place (on the CPU, where nothing reads a
        # step's inputs after it: a GPU's copies are queued, so there they are made anew)
        self._decode_inputs = DecodeInputs() if device.type == "cpu" else None
        self._inference_mode = torch.inference_mode()
        # multi-step decodes stop before a pass when this says True (a server's new request
        # or abort waits no longer than one pass); None: they run every pass scheduled
        self.interrupt: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ state updates
    def _apply_diffs(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_requests:
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids), params=new.sampling_params,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=self._generator(new.sampling_params), pooling=new.pooling_params,
                lora_name=new.lora_name)
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
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled tokens through the model and sample where a request is complete."""
        # one inference_mode kept by the runner (a runner steps on one thread): the decorator
        # makes a new one a call, its Python about 20 us a step on cold caches (Zen 4)
        with self._inference_mode:
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(out)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if out.is_empty:
            return ModelRunnerOutput({}, {}, {})
        if out.num_steps > 1:
            return self._execute_steps(out)
        for req_id, draft in out.spec_token_ids.items():  # run as tokens of the request
            self.requests[req_id].token_ids.extend(draft)
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
            samples = self._sample(states, counts, query_starts, sample_rows, hidden, forks,
                                   out.spec_token_ids, out.grammar_bitmask)
        assert not forks, f"forks of requests that sample nothing this step: {sorted(forks)}"
        for state, n in zip(states, counts):
            state.num_computed_tokens += n
        sampled, logprobs, prompt_logprobs, pooled = self._to_host(samples, prompt_logprobs,
                                                                   pooled)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, pooled)

    def _execute_steps(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """A multi-step decode: up to ``out.num_steps`` passes over the same requests, each
        sampling one token a request that the next one computes, as that many one-token steps
        would (a seeded request draws the same stream; penalties and min_tokens see each new
        token, its sampling rows being rebuilt when they change with tokens). It stops early
        once every request has sampled a stop token (EOS unless ignored, a stop token id; the
        scheduler's stop rules cut what follows), one sampled no token, or ``interrupt()``
        says the engine has new work."""
        states = [self.requests[r] for r in out.num_scheduled_tokens]
        counts = [1] * len(states)
        rows = list(range(len(states)))
        tokens: dict[str, list[int]] = {s.req_id: [] for s in states}
        logprobs: dict[str, list[SampledLogprobs]] = {}
        stops = [self._stop_token_ids(s) for s in states]
        stopped = [False] * len(states)
        for step in range(out.num_steps):
            if step and self.interrupt is not None and self.interrupt():
                break
            hidden, query_starts = self._forward(states, counts)
            samples = self._sample(states, counts, query_starts, rows, hidden, {}, {}, None)
            for state in states:
                state.num_computed_tokens += 1
            sampled, step_logprobs, _, _ = self._to_host(samples, {}, {})
            no_token = False
            for j, state in enumerate(states):
                (token,) = sampled[state.req_id]
                tokens[state.req_id].append(token)
                no_token |= token == NO_TOKEN
                stopped[j] |= token in stops[j] and \
                    len(state.token_ids) - state.num_prompt_tokens >= state.params.min_tokens
            for req_id, lp in step_logprobs.items():
                logprobs.setdefault(req_id, []).append(lp)
            if no_token or all(stopped):
                break
        return ModelRunnerOutput(
            {r: tuple(t) for r, t in tokens.items()},
            {r: SampledLogprobs(token_ids=sum((p.token_ids for p in lps), ()),
                                logprobs=sum((p.logprobs for p in lps), ()),
                                ranks=sum((p.ranks for p in lps), ()))
             for r, lps in logprobs.items()}, {})

    def _stop_token_ids(self, state: RunnerRequestState) -> frozenset[int]:
        params = state.params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids) if params.stop_token_ids else eos

    def _forward(self, states, counts) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of the step's tokens [num_tokens, hidden_size] and each request's
        first row: from a graph for a decode-only step that fits one, else eagerly."""
        token_slots = None if self.lora is None else \
            self.lora.step_slots([s.lora_name for s in states], counts)
        step = None
        if self.graphs is not None and (token_slots is None or self.graphs.takes_lora):
            step = self.graphs.prepare(states, counts, token_slots)
        if step is not None:
            return self.graphs.run(step), list(range(len(states)))
        lora = None if token_slots is None else self.lora.batch(token_slots)
        if self._decode_inputs is not None and all(n == 1 for n in counts):
            input_ids, positions, meta, query_starts = self._decode_inputs.build(
                states, self.block_size)
        else:
            input_ids, positions, meta, query_starts = build_step_inputs(
                states, counts, self.block_size, self.device)
        if lora is None:
            return self.model(input_ids, positions, self.kv_caches, meta), query_starts
        return self.model(input_ids, positions, self.kv_caches, meta, lora), query_starts

    def _sample(self, states, counts, query_starts, rows, hidden, forks, spec_token_ids,
                grammar_bitmask: GrammarBitmask | None) -> _DeviceSamples:
        """``forks`` (parent -> its forks) is consumed: each parent's forks are applied.
        A request with drafts samples every position from its last token on."""
        picked, row_views, hidden_rows, logit_rows, row_starts, drafts = [], [], [], [], [], []
        mask_keys: list[str | None] = []  # each row's grammar row (None: unconstrained)
        for i in rows:
            state = states[i]
            draft = spec_token_ids.get(state.req_id, ())
            end = query_starts[i] + counts[i]
            first_row = len(hidden_rows)
            hidden_rows.extend(range(end - 1 - len(draft), end))
            for children_of in [state] + self._fork(state, counts[i],
                                                    forks.pop(state.req_id, ())):
                picked.append(children_of)
                drafts.append(draft)
                row_starts.append(len(row_views))
                if draft:  # requests under a grammar get no drafts (Scheduler._propose)
                    row_views.extend(self._verified_positions(children_of, draft))
                    mask_keys.extend([None] * (len(draft) + 1))
                else:
                    row_views.append(children_of)
                    mask_keys.append(state.req_id)  # a fork's first mask is its parent's
                # the samples of one prompt share its logits
                logit_rows.extend(range(first_row, first_row + len(draft) + 1))
        row_starts.append(len(row_views))
        if hidden_rows != list(range(hidden.shape[0])):  # (a decode step samples every row)
            hidden = hidden[self._index(hidden_rows)]
        logits = self.model.compute_logits(hidden)
        if len(logit_rows) != len(hidden_rows):
            logits = logits[self._index(logit_rows)]
        bitmask = None
        if grammar_bitmask is not None:
            bitmask = grammar_bitmask.rows_for(mask_keys)
        meta = self._sampling_metadata(row_views, bitmask)
        rewinds = {j: (s.generator, s.generator.get_state(), meta.rounds.num_uniforms)
                   for j, (s, d) in enumerate(zip(picked, drafts))
                   if d and s.generator is not None and not s.params.is_greedy}
        uniforms = draw_uniforms(logits, meta, self.default_generator)
        token_ids, logprobs = sample_tokens(logits, meta, uniforms, self.sampling_kernels)
        return _DeviceSamples(picked, row_starts, drafts, token_ids, logprobs, rewinds)

    def _sampling_metadata(self, rows: list, bitmask: np.ndarray | None) -> SamplingMetadata:
        """The sampler's tensors for ``rows``. A step of the same rows as the last one, none
        of whose sampling changes with its tokens (no penalties, bad words, min_tokens ban or
        grammar), reuses the last step's, as vLLM's persistent batch keeps them: a decode step
        then builds none (where the streamed weights leave every cache cold, building them
        costs 80-100 us a step)."""
        last = self._last_sampling
        if bitmask is None and last is not None and len(last[0]) == len(rows) \
                and all(a is b for a, b in zip(last[0], rows)):
            return last[1]
        meta = build_sampling_metadata(rows, self.vocab_size, self.eos_token_ids, self.device,
                                       token_bitmask=bitmask)
        # (the rows are held, so that no other object can take one's place at its address)
        keep = bitmask is None and not any(map(changes_with_tokens, rows))
        self._last_sampling = (rows, meta) if keep else None
        return meta

    def _rewind(self, generator: torch.Generator, state: torch.Tensor, num_uniforms: int,
                num_tokens: int) -> None:
        """A seeded request's stream after a verified step: as if only the positions of the
        ``num_tokens`` emitted tokens had drawn, which is what a step per token would have
        drawn. Position i then always takes the i-th draw of the stream, with or without
        drafts, so a seeded request's tokens do not depend on what was proposed or accepted
        (nor on the batch, which decides whether drafts run)."""
        generator.set_state(state)
        for _ in range(num_tokens):  # as draw_uniforms draws a row
            torch.empty(num_uniforms, dtype=torch.float64, device=self.device
                        ).uniform_(generator=generator)

    @staticmethod
    def _verified_positions(state: RunnerRequestState, draft: tuple[int, ...]
                            ) -> list[_VerifiedPosition]:
        # state.token_ids ends with the drafts; position p follows the drafts before it
        base = len(state.token_ids) - len(draft)
        return [_VerifiedPosition(state.token_ids[:base + p], state.num_prompt_tokens,
                                  state.params, state.generator)
                for p in range(len(draft) + 1)]

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
            for j, (state, draft) in enumerate(zip(samples.states, samples.drafts)):
                start = samples.row_starts[j]
                tokens = token_ids[start:samples.row_starts[j + 1]]
                if draft:
                    tokens = accepted_tokens(draft, tokens)
                    self._settle_drafts(state, draft, len(tokens))
                    if j in samples.rewinds:
                        self._rewind(*samples.rewinds[j], len(tokens))
                state.token_ids.extend(tokens)
                sampled[state.req_id] = tuple(tokens)
                if samples.logprobs is not None and state.params.logprobs is not None:
                    k = state.params.logprobs + 1  # the sampled token, then its top k
                    rows = range(start, start + len(tokens))
                    logprobs[state.req_id] = SampledLogprobs(
                        token_ids=tuple(tuple(top_ids[r][:k]) for r in rows),
                        logprobs=tuple(tuple(top_lps[r][:k]) for r in rows),
                        ranks=tuple(ranks[r] for r in rows))
        prompt = {req_id: LogprobTensors(next(host), next(host), next(host)).to_python()
                  for req_id in prompt_logprobs}
        vectors = {req_id: tuple(next(host).tolist()) for req_id in pooled}
        return sampled, logprobs, prompt, vectors

    @staticmethod
    def _settle_drafts(state: RunnerRequestState, draft: tuple[int, ...],
                       num_tokens: int) -> None:
        """Drop the drafts from the request's tokens (the accepted ones come back as sampled
        tokens) and count only the cache slots that hold its tokens: the last one and the
        accepted drafts. The scheduler gives the rejected slots' blocks back and sends the
        table anew."""
        del state.token_ids[len(state.token_ids) - len(draft):]
        state.num_computed_tokens -= len(draft) + 1 - num_tokens

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
                prompt_logprobs_from=parent.num_prompt_tokens, lora_name=parent.lora_name)
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
