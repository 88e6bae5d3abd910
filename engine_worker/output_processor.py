"""From the engine core's token deltas to user-facing RequestOutputs.

Detokenizes incrementally, applies stop strings, turns logprob tensors' plain data into
``Logprob`` entries, and gathers the ``n`` child sequences of a request into one output.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from engine_worker.outputs import (CompletionOutput, Logprob, LogprobsDict, PoolingOutput,
                                   PoolingRequestOutput, RequestMetrics, RequestOutput)
from engine_worker.request import RequestStatus
from engine_worker.sampling_params import RequestOutputKind, SamplingParams
from engine_worker.step_types import EngineCoreOutput, SampledLogprobs
from engine_worker.tokenizer import IncrementalDetokenizer, Tokenizer
from quire.errors import FieldError


@dataclass(slots=True)
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0
    sent_num_tokens: int = 0


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, _Sequence]  # child req_id -> sequence
    metrics: RequestMetrics
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    num_sent_prompt_logprobs: int = 0  # DELTA: entries already handed out
    error: FieldError | None = None  # a sample ended for its own input (RequestOutput.error)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


class OutputProcessor:
    """Owns every live request's output-side state; the engine loop calls it after each step."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._pooling: dict[str, list[int]] = {}  # pooling request id -> its prompt's ids

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float) -> None:
        sequences = {}
        for index, child_id in enumerate(child_ids):
            detok = None
            if params.detokenize:
                detok = self.tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens,
                                                   params.stop, params.include_stop_str_in_output,
                                                   params.min_tokens)
            sequences[child_id] = _Sequence(
                index=index, detokenizer=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self._child_to_parent[child_id] = request_id
        self._requests[request_id] = _RequestState(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            params=params, sequences=sequences, metrics=RequestMetrics(arrival_time=arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """A pooling request: one output, when its vector comes."""
        self._pooling[request_id] = prompt_token_ids

    def child_ids(self, request_id: str) -> list[str]:
        if request_id in self._pooling:
            return [request_id]
        state = self._requests.get(request_id)
        return list(state.sequences) if state else []

    def has(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._pooling

    def is_live_sample(self, sample_id: str) -> bool:
        return sample_id in self._child_to_parent or sample_id in self._requests \
            or sample_id in self._pooling

    def mark_scheduled(self, child_ids, now: float) -> None:
        for child_id in child_ids:
            parent = self._requests.get(self._child_to_parent.get(child_id, ""))
            if parent is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now

    def mark_preempted(self, child_ids, now: float) -> None:
        """Preemptions are rare: a tuple append each keeps their times for tracing."""
        for child_id in child_ids:
            parent = self._requests.get(self._child_to_parent.get(child_id, ""))
            if parent is not None:
                parent.metrics.preempted_times += (now,)

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the outputs to hand out and the child ids that a stop string just ended
        (the caller must finish those in the scheduler)."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        changed: set[str] = set()  # sample ids with news (DELTA sends only those)
        stopped_by_string: list[str] = []
        pooled: list[PoolingRequestOutput] = []
        for out in core_outputs:
            if out.req_id in self._pooling:
                pooled.append(PoolingRequestOutput(
                    request_id=out.req_id, outputs=PoolingOutput(list(out.pooled)),
                    prompt_token_ids=self._pooling.pop(out.req_id),
                    num_cached_tokens=max(out.num_cached_tokens, 0)))
                continue
            state = self._requests[self._child_to_parent[out.req_id]]
            seq = state.sequences[out.req_id]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._to_dicts(out.new_prompt_logprobs))
            if out.new_token_ids:
                self._append_tokens(state, seq, out, now)
                if out.finish_status is None and seq.finish_reason == "stop":
                    stopped_by_string.append(out.req_id)
            if out.finish_status is not None and seq.finish_reason is None:
                seq.finish_reason = out.finish_status.finish_reason
                seq.stop_reason = out.stop_reason
            if out.error is not None and state.error is None:
                state.error = out.error
            touched[state.request_id] = state
            changed.add(out.req_id)
        return pooled + self._emit(touched.values(), now, changed), stopped_by_string

    def abort(self, request_id: str) -> list[RequestOutput | PoolingRequestOutput]:
        """Mark every unfinished sequence aborted; returns the final output to hand out."""
        if request_id in self._pooling:
            return [PoolingRequestOutput(request_id=request_id, outputs=None,
                                         prompt_token_ids=self._pooling.pop(request_id))]
        state = self._requests.get(request_id)
        if state is None:
            return []
        changed = set()
        for sample_id, seq in state.sequences.items():
            if seq.finish_reason is None:
                seq.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
                changed.add(sample_id)
        return self._emit([state], time.monotonic(), changed)

    # ---------------------------------------------------------------------- internals
    def _append_tokens(self, state: _RequestState, seq: _Sequence, out: EngineCoreOutput,
                       now: float) -> None:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        seq.token_ids.extend(out.new_token_ids)
        for entry in out.new_logprobs:
            if seq.logprobs is not None:
                dicts = self._to_dicts(entry)
                seq.logprobs.extend(dicts)
                seq.cumulative_logprob += sum(lp[0] for lp in entry.logprobs)
        if seq.detokenizer is not None and seq.finish_reason is None:
            taken = seq.detokenizer.num_tokens
            stop = seq.detokenizer.update(out.new_token_ids)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                # several tokens in one step (speculative decoding): drop those after the stop
                self._drop_last(seq, len(out.new_token_ids)
                                - (seq.detokenizer.num_tokens - taken))

    @staticmethod
    def _drop_last(seq: _Sequence, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        del seq.token_ids[-num_tokens:]
        if seq.logprobs is not None:
            dropped = seq.logprobs[-num_tokens:]
            del seq.logprobs[-num_tokens:]
            seq.cumulative_logprob -= sum(next(iter(d.values())).logprob for d in dropped)

    def _to_dicts(self, entry: SampledLogprobs) -> list[LogprobsDict]:
        dicts = []
        for ids, lps, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            d: LogprobsDict = {}
            for position, (token_id, lp) in enumerate(zip(ids, lps)):
                if token_id in d:
                    continue
                d[token_id] = Logprob(logprob=lp, rank=rank if position == 0 else position,
                                      decoded_token=self.tokenizer.token_text(token_id))
            dicts.append(d)
        return dicts

    def _emit(self, states, now: float, changed: set[str]) -> list[RequestOutput]:
        outputs = []
        for state in states:
            finished = state.finished
            kind = state.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            delta = kind == RequestOutputKind.DELTA
            completions = [self._completion(seq, finished or seq.finish_reason is not None, delta)
                           for sample_id, seq in state.sequences.items()
                           if not delta or sample_id in changed]
            prompt_logprobs = state.prompt_logprobs
            if prompt_logprobs is not None:
                start = state.num_sent_prompt_logprobs if delta else 0
                prompt_logprobs = prompt_logprobs[start:]
                state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
            if finished:
                state.metrics.finished_time = now
                self._forget(state)
            outputs.append(RequestOutput(
                request_id=state.request_id, prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
                metrics=dataclasses.replace(state.metrics), error=state.error))
        return outputs

    @staticmethod
    def _completion(seq: _Sequence, finished: bool, delta: bool) -> CompletionOutput:
        text = seq.detokenizer.text(finished) if seq.detokenizer is not None else ""
        token_ids, logprobs = seq.token_ids, seq.logprobs
        if delta:
            token_ids = token_ids[seq.sent_num_tokens:]
            logprobs = logprobs[seq.sent_num_tokens:] if logprobs is not None else None
            text = text[seq.sent_text_len:]
        seq.sent_text_len += len(text) if delta else len(text) - seq.sent_text_len
        seq.sent_num_tokens = len(seq.token_ids)
        return CompletionOutput(index=seq.index, text=text, token_ids=list(token_ids),
                                cumulative_logprob=seq.cumulative_logprob,
                                logprobs=None if logprobs is None else list(logprobs),
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request_id]
        for child_id in state.sequences:
            self._child_to_parent.pop(child_id, None)
